"""megatron-core trainer backend (`trainer.backend: Megatron`)."""

from r3operator.trainer.megatron.trainer import LogprobOutput, MegatronTrainer, build_megatron_trainer

__all__ = ["LogprobOutput", "MegatronTrainer", "build_megatron_trainer"]
