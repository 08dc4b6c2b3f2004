"""The Megatron adapter's sharded asynchronous checkpoint (one rank): staged at save, resumed exactly."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core", reason="megatron-core not installed (pip extra `megatron`)")

from tiny_moe import build_tiny_moe  # noqa: E402

pytestmark = pytest.mark.slow
PROMPTS, ANSWERS = [[5, 6, 7], [8, 9, 10]], [[20, 21], [22, 23]]


def test_megatron_checkpoint_is_staged_at_save_and_resumes_exactly(tmp_path: Path) -> None:
    from r3operator.trainer.megatron import build_megatron_trainer
    from r3operator.trainer.megatron.adapter import MegatronPolicyTrainer

    model_dir = tmp_path / "model"
    build_tiny_moe("qwen3_moe").save_pretrained(model_dir)

    def fresh() -> MegatronPolicyTrainer:
        return MegatronPolicyTrainer(
            build_megatron_trainer(None, model_dir, "cpu", micro_batch_size=2), compute_dtype="float32"
        )

    first = fresh()
    first.sft_step(PROMPTS, ANSWERS)
    first.save_checkpoint_async(tmp_path / "ckpt")
    at_save = {k: v.clone() for k, v in first.model_state_dict().items()}
    first.sft_step(PROMPTS, ANSWERS)  # runs while the checkpoint is written; must not leak into it
    first.wait_checkpoint()
    after_two = {k: v.clone() for k, v in first.model_state_dict().items()}
    assert any(not torch.equal(at_save[k], after_two[k]) for k in at_save)

    resumed = fresh()
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert all(torch.equal(resumed.model_state_dict()[k], at_save[k]) for k in at_save)
    resumed.sft_step(PROMPTS, ANSWERS)  # with the restored AdamW moments: the same second step
    got = resumed.model_state_dict()
    assert all(torch.equal(got[k], after_two[k]) for k in after_two)
