"""`trainer.fsdp.gradientCheckpointing` reaches the HF/FSDP trainer, and an R3 update with it is the update
without it (the reference: the same one-process trainer, checkpointing off)."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from tiny_moe import r3_batch  # noqa: E402

from r3operator.api.enums import ReplayMode  # noqa: E402
from r3operator.api.load import load_rljob  # noqa: E402
from r3operator.trainer.hf_policy import PolicyTrainer  # noqa: E402

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def checkpointing(model: torch.nn.Module) -> bool:
    """What transformers' own `is_activation_checkpointing` reads: a layer flagged to recompute."""
    return any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def _r3_update(trainer: PolicyTrainer) -> tuple[float, float, dict[str, torch.Tensor]]:
    batch = r3_batch()
    old = trainer.old_logprobs(batch, ReplayMode.R3)
    stats = trainer.update(batch, old, mini_batches=2, clip_low=0.2, clip_high=0.28)
    state = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return stats.loss, stats.grad_norm, state


def test_the_spec_field_turns_checkpointing_on_and_the_r3_update_is_unchanged(tiny_moe_dir: Path) -> None:
    from r3operator.trainer.factory import build_trainer

    spec = load_rljob(EXAMPLES / "qwen3-30b-a3b-r3-fsdp.yaml").spec
    assert spec.trainer.fsdp is not None and spec.trainer.fsdp.gradient_checkpointing
    spec.trainer.fsdp.param_dtype = "float32"  # exact comparison: no bf16 autocast on either side
    checkpointed = build_trainer(spec, tiny_moe_dir, device="cpu")
    assert isinstance(checkpointed, PolicyTrainer)
    assert checkpointing(checkpointed.model)
    plain = PolicyTrainer(
        tiny_moe_dir, device="cpu", learning_rate=spec.algorithm.learning_rate, seed=spec.seed, compute_dtype="float32"
    )
    assert not checkpointing(plain.model)

    loss, norm, state = _r3_update(checkpointed)
    ref_loss, ref_norm, ref_state = _r3_update(plain)
    assert loss == pytest.approx(ref_loss, rel=1e-6, abs=1e-7)
    assert norm == pytest.approx(ref_norm, rel=1e-6)
    assert all(torch.allclose(state[k], ref_state[k], rtol=0, atol=1e-7) for k in ref_state)
