"""The step loop through engine faults, unusable samples and a resume, on CPU: the real trainer (tiny model)
against an in-process fake engine with scripted faults (the canary needs a real engine: it is off here)."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest
from fake_engine import FakeEngine
from runtime_test_helpers import settings_for, write_job

from r3operator.wire.retry import Backoff

JOB = 'namespace="default",rljob="tiny-count-r3"'  # the identity labels of every driver series


@pytest.fixture(autouse=True)
def _instant_backoff(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The supervisor's waits go to a list instead of the clock."""
    slept: list[float] = []
    from r3operator.weightsync import faults

    def make(kind: str = "retry", **defaults: Any) -> Backoff:
        return Backoff(attempts=int(defaults.get("attempts", 4)), base_s=1.0, cap_s=8.0, jitter=0.0, sleep=slept.append)

    monkeypatch.setattr(faults.Backoff, "from_env", staticmethod(make))
    return slept


def _run(tmp_path: Path, engine: FakeEngine, *, steps: int = 2, resume: bool = True, **spec: Any) -> Any:
    from r3operator.rollout.engines import EngineGroup
    from r3operator.runtime.loop import GRPORun

    tmp_path.mkdir(parents=True, exist_ok=True)
    job = write_job(tmp_path, weightSync={"canary": False}, algorithm={"steps": steps}, **spec)
    return GRPORun(settings_for(job, tmp_path / "runs", steps=steps, resume=resume), engines=EngineGroup([engine]))


def _csv(run: Any) -> list[dict[str, str]]:
    with (run.run_dir / "metrics.csv").open() as fh:
        return list(csv.DictReader(fh))


def test_engine_dying_mid_sync_and_restarting_mid_rollout_is_ridden_out(tmp_path: Path) -> None:
    engine = FakeEngine(die_on={"load": {2}})  # the setup sync dies on its 2nd chunk
    run = _run(tmp_path, engine)
    run.setup()
    # The failed bracket is aborted, never finished; the sync is then repeated from its first chunk.
    sync = [c for c in engine.calls if c != "vllm_version"]
    chunks = sync.count("load") - 1  # one failed load, then every chunk
    assert sync == [
        "abort",
        "begin",
        "load",
        "load",
        "abort",
        "wait_ready",
        "abort",
        "begin",
        *["load"] * (chunks - 1),
        "finish",
    ]
    assert chunks > 2
    assert engine.tag == run.supervisor.tag == run.supervisor.tag_for(1) and run.policy_version == 1

    engine.calls.clear()
    engine.die_on = {"generate": {1}}  # the step-1 rollout: the engine dies and comes back with no policy
    row = run.train_step(1)
    assert engine.restarts == 2
    rollout_to_rollout = engine.calls[: [i for i, c in enumerate(engine.calls) if c == "generate"][1] + 1]
    assert rollout_to_rollout.count("generate") == 2
    # Re-synced (a full bracket, tagged with the current policy) before the rollout was repeated.
    resync = rollout_to_rollout[rollout_to_rollout.index("generate") + 1 :]
    assert "begin" in resync and "finish" in resync and resync.index("finish") < resync.index("generate")
    assert row.samples == 16 and row.samples_dropped == 0 and row.policy_version == 2
    exposition = run.metrics.exposition()
    assert f'r3operator_engine_faults_total{{kind="weight_sync",{JOB}}} 1.0' in exposition
    assert f'r3operator_engine_faults_total{{kind="engine_call",{JOB}}} 1.0' in exposition
    assert f'r3operator_engine_faults_total{{kind="stale_engine",{JOB}}} 1.0' in exposition


def test_sync_that_never_succeeds_ends_with_a_clear_error(tmp_path: Path, _instant_backoff: list[float]) -> None:
    from r3operator.wire.retry import EngineUnavailableError

    engine = FakeEngine(die_on={"load": set(range(1, 100))})
    run = _run(tmp_path, engine)
    with pytest.raises(
        EngineUnavailableError,
        match=r"weight sync of policy \w+:1 to fake engine failed 4 times; "
        r"each attempt was aborted without finalising",
    ):
        run.setup()
    assert "finish" not in engine.calls and engine.calls.count("begin") == 4
    assert engine.calls.count("abort") == 8  # each attempt: one before its bracket, one after its failure
    assert _instant_backoff == [1.0, 2.0, 4.0]  # exponential, between the 4 attempts


def test_step_with_no_usable_samples_is_skipped_and_counted(tmp_path: Path) -> None:
    engine = FakeEngine(routes=False)  # every sample comes back without routes: R3 drops them all
    run = _run(tmp_path, engine, steps=1, routingReplay={"onRouteCheckFailure": "SkipSample"})
    run.setup()
    engine.calls.clear()
    row = run.train_step(1)
    assert row.skipped == 1 and row.samples_dropped == row.samples == 16
    assert "begin" not in engine.calls  # no update, so no sync: the engines keep the current policy
    assert run.policy_version == 1 and row.policy_version == 1
    run.finish_checkpoint()  # its checkpoint was written in the background; committed now
    assert run.last_checkpoint_step == 1  # a resume does not redo it
    skipped = 'r3operator_steps_skipped_total{namespace="default",reason="no_usable_samples",rljob="tiny-count-r3"}'
    assert f"{skipped} 1.0" in run.metrics.exposition()
    (written,) = _csv(run)
    assert written["skipped"] == "1" and written["step"] == "1"
    from r3operator.runtime.progress import step_line

    assert "SKIPPED: no usable samples (16 of 16 dropped)" in step_line(row, total_steps=1)


def test_resume_keeps_policy_version_and_writes_each_step_once(tmp_path: Path) -> None:
    engine = FakeEngine()
    straight = _run(tmp_path / "straight", engine, steps=3)
    straight.run()
    versions = [int(r["policy_version"]) for r in _csv(straight)]
    assert versions == [2, 3, 4]  # step k's row: the policy after its sync (the setup sync made version 1)

    # A driver killed after step 3 whose last checkpoint is step 2 (intervalSteps 2; step 3 was the
    # last step of that run, so it checkpointed too: remove it to stand for the kill before it).
    run = _run(tmp_path / "resumed", engine, steps=3, checkpoint={"intervalSteps": 2})
    run.run()
    import shutil

    shutil.rmtree(run.ckpt_root / "step-000003")
    (run.ckpt_root / "latest").write_text("step-000002\n")
    resumed = _run(tmp_path / "resumed", engine, steps=3, checkpoint={"intervalSteps": 2})
    resumed.setup()
    assert resumed.start_step == 3 and resumed.policy_version == 3  # the checkpoint's, not one more
    assert [r["step"] for r in _csv(resumed)] == ["1", "2"]  # step 3 runs again: its old row is gone
    resumed.train_step(3)
    rows = _csv(resumed)
    assert [r["step"] for r in rows] == ["1", "2", "3"]
    assert [int(r["policy_version"]) for r in rows] == versions
