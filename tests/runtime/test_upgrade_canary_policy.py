"""The upgrade canary scores with the run's latest sharded checkpoint, read into one process."""

from __future__ import annotations

from pathlib import Path

import pytest
from runtime_test_helpers import settings_for, write_job

pytestmark = pytest.mark.slow


def test_the_canary_policy_is_the_latest_checkpoint(tmp_path: Path) -> None:
    import torch

    from r3operator.models import ensure_reference_model
    from r3operator.runtime import checkpoint as ckpt
    from r3operator.runtime.upgrade_canary import load_policy
    from r3operator.trainer.factory import build_trainer

    settings = settings_for(write_job(tmp_path), tmp_path / "runs")
    model_dir = ensure_reference_model("tiny")
    trainer = build_trainer(settings.job.spec, model_dir, device="cpu")
    trainer.sft_step([[5, 6, 7]], [[8, 9]])  # weights the model directory does not have
    saver = ckpt.AsyncCheckpoints(settings.run_dir / "checkpoints", trainer, keep_last=1)
    saver.start(step=3, policy_version=4)
    assert saver.finish() is not None
    want = trainer.model_state_dict()

    policy, info = load_policy(settings, model_dir)
    got = policy.model_state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert info is not None and (info.step, info.policy_version) == (3, 4)  # what the verdict names
    fresh = build_trainer(settings.job.spec, model_dir, device="cpu").model_state_dict()
    assert any(not torch.equal(fresh[k], want[k]) for k in want)
