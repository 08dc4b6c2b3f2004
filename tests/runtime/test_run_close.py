"""A run lets go of its weight sync when it ends, whether it finished or failed: over IPC the trainer maps the
engines' parameters, and an engine that exits while they are still mapped leaves PyTorch warning that shared CUDA
tensors were not released. A failure to let go is logged and never hides the run's own outcome."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fake_engine import RecordingEngine
from runtime_test_helpers import settings_for, write_job


class _Install:
    """Stands for the native transfer's install (vLLM's sender needs CUDA): records the close, or fails it."""

    def __init__(self, closed: list[str], fails: bool) -> None:
        self.closed, self.fails = closed, fails

    def close(self) -> None:
        self.closed.append("closed")
        if self.fails:
            raise OSError("the mapping was already gone")


def _run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, closed: list[str], *, close_fails: bool) -> Any:
    from r3operator.rollout.engines import EngineGroup
    from r3operator.runtime.loop import GRPORun

    job = write_job(tmp_path, weightSync={"canary": False}, algorithm={"steps": 1})
    run = GRPORun(settings_for(job, tmp_path / "runs", steps=1), engines=EngineGroup([RecordingEngine()]))
    setup = run.setup

    def setup_then_install() -> None:
        setup()
        assert run.weight_sync.install is None  # CPU engines sync packed chunks: no install of their own
        run.weight_sync.install = _Install(closed, close_fails)  # type: ignore[assignment]  # syncs stay packed

    monkeypatch.setattr(run, "setup", setup_then_install)
    return run


def test_a_finished_run_closes_its_weight_sync_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    closed: list[str] = []
    run = _run(tmp_path, monkeypatch, closed, close_fails=False)
    rows = run.run()
    assert [row.step for row in rows] == [1] and closed == ["closed"]


def test_a_failed_step_still_closes_it_and_a_failed_close_does_not_hide_the_steps_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    closed: list[str] = []
    run = _run(tmp_path, monkeypatch, closed, close_fails=True)

    def failing_step(step: int) -> Any:
        raise RuntimeError(f"step {step}: the engine went away")

    monkeypatch.setattr(run, "train_step", failing_step)
    with caplog.at_level("WARNING", logger="r3operator.runtime"), pytest.raises(RuntimeError, match="step 1: the"):
        run.run()
    assert closed == ["closed"]
    assert "the weight sync did not close cleanly: OSError: the mapping was already gone" in caplog.text


def test_a_failed_close_after_a_finished_run_is_logged_not_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    closed: list[str] = []
    run = _run(tmp_path, monkeypatch, closed, close_fails=True)
    with caplog.at_level("WARNING", logger="r3operator.runtime"):
        rows = run.run()
    assert [row.step for row in rows] == [1] and closed == ["closed"]
    assert "did not close cleanly" in caplog.text
