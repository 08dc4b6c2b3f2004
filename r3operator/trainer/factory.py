"""Pick the trainer backend named by `spec.trainer.backend`, on how many ranks."""

from __future__ import annotations

from pathlib import Path

from r3operator.api.v1alpha1 import RLJobSpec
from r3operator.trainer.base import Trainer


def world_size(spec: RLJobSpec, *, device: str, override: int | None = None) -> int:
    """Trainer ranks: `override` (`r3operator run --trainer-ranks`) if given; on GPU one per GPU of the
    RayJob (`trainer.nodes × trainer.gpusPerNode`); on CPU one."""
    if override is not None:
        if override < 1:
            raise ValueError(f"trainer ranks: expected at least 1, got {override}")
        return override
    if device.startswith("cuda"):
        return int(spec.trainer.nodes) * int(spec.trainer.gpus_per_node)
    return 1


def build_trainer(spec: RLJobSpec, model_dir: Path, *, device: str, ranks: int = 1) -> Trainer:
    """The trainer for `spec.trainer.backend`, in this process for one rank, else
    `distributed.DistributedTrainer` over `ranks` Ray actors: FSDP (`hf_policy`, FSDP2 over the ranks) or
    Megatron (the adapter; TP/EP/SP groups and data parallel over the ranks, `megatron/ranks.py`)."""
    from r3operator.api.enums import TrainerBackend

    fsdp = spec.trainer.fsdp
    compute_dtype = fsdp.param_dtype if fsdp is not None else "bfloat16"
    reshard = fsdp.reshard_after_forward if fsdp is not None else True
    checkpointing = fsdp.gradient_checkpointing if fsdp is not None else False
    micro_tokens = fsdp.micro_batch_tokens if fsdp is not None else None
    if spec.trainer.backend is TrainerBackend.MEGATRON:
        from r3operator.trainer.megatron.adapter import build_megatron_policy_trainer, require_megatron
        from r3operator.trainer.megatron.parallel import ParallelSizes, check_world

        check_world(ParallelSizes.from_spec(spec.trainer.megatron), ranks)  # before any rank starts
        require_megatron()
        if ranks == 1:
            return build_megatron_policy_trainer(spec, model_dir, device=device)
        from r3operator.trainer.distributed import DistributedTrainer
        from r3operator.trainer.megatron.ranks import MegatronOptions

        block = spec.trainer.megatron
        megatron = MegatronOptions(
            block,
            learning_rate=spec.algorithm.learning_rate,
            seed=spec.seed,
            micro_batch_size=None if block is None else block.micro_batch_size,
        )
        return DistributedTrainer(model_dir, world_size=ranks, device=device, options=megatron)
    if ranks > 1:
        from r3operator.trainer.distributed import DistributedTrainer, PolicyOptions

        options = PolicyOptions(
            learning_rate=spec.algorithm.learning_rate,
            seed=spec.seed,
            compute_dtype=compute_dtype,
            reshard_after_forward=reshard,
            gradient_checkpointing=checkpointing,
            micro_batch_tokens=micro_tokens,
        )
        return DistributedTrainer(model_dir, world_size=ranks, device=device, options=options)
    from r3operator.trainer.hf_policy import PolicyTrainer

    return PolicyTrainer(
        model_dir,
        device=device,
        learning_rate=spec.algorithm.learning_rate,
        seed=spec.seed,
        use_fsdp=device.startswith("cuda"),
        compute_dtype=compute_dtype,
        fsdp_options={"reshard_after_forward": reshard} if fsdp is not None else None,
        gradient_checkpointing=checkpointing,
        micro_batch_tokens=micro_tokens,
    )
