"""Pick the trainer backend named by `spec.trainer.backend`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from r3operator.trainer.base import Trainer


def build_trainer(spec: Any, model_dir: Path, *, device: str) -> Trainer:
    """The trainer for `spec.trainer.backend`: FSDP (`hf_policy`) or Megatron (the adapter)."""
    from r3operator.api.enums import TrainerBackend

    if spec.trainer.backend is TrainerBackend.MEGATRON:
        from r3operator.trainer.megatron.adapter import build_megatron_policy_trainer

        return build_megatron_policy_trainer(spec, model_dir, device=device)
    from r3operator.trainer.hf_policy import PolicyTrainer

    fsdp = spec.trainer.fsdp
    return PolicyTrainer(
        model_dir,
        device=device,
        learning_rate=spec.algorithm.learning_rate,
        seed=spec.seed,
        use_fsdp=device.startswith("cuda"),
        compute_dtype=fsdp.param_dtype if fsdp is not None else "bfloat16",
        fsdp_options={"reshard_after_forward": fsdp.reshard_after_forward} if fsdp is not None else None,
    )
