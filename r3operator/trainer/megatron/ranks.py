"""The Megatron backend on `distributed.DistributedTrainer`'s Ray-actor ranks.

Each rank joins the process group (`fsdp.init_rank`: rank 0's address and port), then
`build_megatron_trainer` sets megatron's parallel state over it: TP, EP, (SP) groups as
`trainer.megatron` says, data parallel over the rest (world / (TP × PP × CP) replicas). A TP × PP group is
one data-parallel replica: its ranks get the same micro-batch rows and routes, and the TP rank 0 of its
last pipeline stage answers for it (the last stage computes the logprobs and the loss). Rows, share
weights and the gradient reductions that make the update equal the one-process update are
`trainer/shards.py` and `megatron/grads.py`; the pipeline schedule is `megatron/pipeline.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from r3operator.trainer.distributed import RankRole


@dataclass(frozen=True)
class MegatronOptions:
    """What every rank builds its `MegatronPolicyTrainer` with (a `distributed.RankBuilder`)."""

    megatron: Any  # the RLJob's trainer.megatron block (MegatronSpec) or None: all sizes 1
    learning_rate: float
    seed: int
    compute_dtype: str = "bfloat16"
    micro_batch_size: int | None = None  # rows per micro-batch of a share; None: one micro-batch per share

    def build(self, model_dir: Path, device: str, *, rank: int, world_size: int) -> tuple[Any, RankRole]:
        from megatron.core import parallel_state as ps

        from r3operator.trainer.megatron.adapter import MegatronPolicyTrainer
        from r3operator.trainer.megatron.trainer import build_megatron_trainer

        trainer = build_megatron_trainer(
            self.megatron,
            model_dir,
            device,
            learning_rate=self.learning_rate,
            seed=self.seed,
            micro_batch_size=self.micro_batch_size,
        )
        answers = (
            ps.get_tensor_model_parallel_rank() == 0
            and ps.get_context_parallel_rank() == 0
            and ps.is_pipeline_last_stage()
        )
        role = RankRole(dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size(), answers=answers)
        return MegatronPolicyTrainer(trainer, compute_dtype=self.compute_dtype), role
