"""The non-finite guard through the step loop, with a NaN injected mid-run (R3OPERATOR_FAULT_NONFINITE_STEPS):
the engine keeps the pre-step weights (no sync), no checkpoint is written for the step, the trainer's weights
stay those of the step before, the step is counted (metrics.csv, Prometheus, status.progress), and
`algorithm.maxNonFiniteSteps` such steps in a row fail the run naming them. One process, then 2 trainer ranks
(FSDP2, Megatron's pipeline) against the same in-process recording engine."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest
from fake_engine import RecordingEngine
from runtime_test_helpers import settings_for, write_job

JOB = 'namespace="default",rljob="tiny-count-r3"'


def _run(tmp_path: Path, engine: RecordingEngine, *, steps: int, ranks: int | None = None, **spec: Any) -> Any:
    from r3operator.rollout.engines import EngineGroup
    from r3operator.runtime.loop import GRPORun

    algorithm = {"steps": steps, **spec.pop("algorithm", {})}
    job = write_job(tmp_path, weightSync={"canary": False}, algorithm=algorithm, **spec)
    settings = settings_for(job, tmp_path / "runs", steps=steps, trainer_ranks=ranks)
    return GRPORun(settings, engines=EngineGroup([engine]))


def _weights(run: Any) -> dict[str, Any]:
    """The trainer's weights as the engine receives them (checkpoint names, fp32 on CPU)."""
    import torch

    from r3operator.wire.weights import checkpoint_tensors

    return dict(checkpoint_tensors(run.trainer.model_state_dict(), dtype=torch.float32))


def _equal_and_finite(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) and bool(torch.isfinite(a[n]).all()) for n in a)


def _checkpoint_weights(run: Any, step: int) -> dict[str, Any]:
    """What a fresh one-process trainer reads back from the committed checkpoint of `step`."""
    import torch

    from r3operator.trainer.hf_policy import PolicyTrainer
    from r3operator.trainer.sharded_checkpoint import read_full_state
    from r3operator.wire.weights import checkpoint_tensors

    policy = run.ckpt_root / f"step-{step:06d}" / "policy"
    if run.spec.trainer.backend.value == "Megatron":
        return dict(checkpoint_tensors(read_full_state(policy)["model"], dtype=torch.float32))
    single = PolicyTrainer(run.model_dir, device="cpu", learning_rate=1e-6, seed=0)
    single.load_checkpoint(policy)
    return dict(checkpoint_tensors(single.model_state_dict(), dtype=torch.float32))


def _csv(run: Any) -> list[dict[str, str]]:
    with (run.run_dir / "metrics.csv").open() as fh:
        return list(csv.DictReader(fh))


def test_a_nan_step_is_not_applied_synced_or_checkpointed_and_is_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("R3OPERATOR_FAULT_NONFINITE_STEPS", "2")
    engine = RecordingEngine()
    run = _run(tmp_path, engine, steps=3)
    pushed: list[dict[str, Any]] = []
    run.setup()
    try:
        monkeypatch.setattr(run.status, "push", pushed.append)
        run.train_step(1)
        version, syncs, before = run.policy_version, engine.counts["finish"], engine.weights
        assert _equal_and_finite(_weights(run), before)
        optim = {
            (i, k): v.clone() for i, state in enumerate(run.trainer.optimizer.state.values()) for k, v in state.items()
        }

        row = run.train_step(2)
        assert row.nonfinite_updates == 1 and row.canary_ok == 0 and row.policy_version == version
        assert engine.counts["finish"] == syncs and engine.weights is before  # nothing was sent to the engine
        assert _equal_and_finite(_weights(run), before)  # the trainer kept the step-1 weights
        after = {(i, k): v for i, state in enumerate(run.trainer.optimizer.state.values()) for k, v in state.items()}
        assert optim.keys() == after.keys() and all(
            bool((optim[k] == after[k]).all()) for k in optim
        )  # AdamW as it was
        assert f"r3operator_nonfinite_steps_total{{{JOB}}} 1.0" in run.metrics.exposition()
        progress = pushed[-1]["status"]["progress"]
        assert (progress["step"], progress["nonFiniteSteps"], progress["lastNonFiniteStep"]) == (2, 1, 2)
        run.finish_checkpoint()
        assert run.last_checkpoint_step == 1  # step 2 wrote none
        assert _equal_and_finite(_checkpoint_weights(run, 1), before)

        row = run.train_step(3)  # the next step trains and syncs as usual
        assert row.nonfinite_updates == 0 and row.policy_version == version + 1
        assert engine.weights is not before and _equal_and_finite(_weights(run), engine.weights)
        assert pushed[-1]["status"]["progress"]["nonFiniteSteps"] == 1
    finally:
        run.trainer.close()
    assert [r["nonfinite_updates"] for r in _csv(run)] == ["0", "1", "0"]


def test_max_non_finite_steps_in_a_row_fail_the_run_naming_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from r3operator.runtime.nonfinite import NonFiniteStepsError

    monkeypatch.setenv("R3OPERATOR_FAULT_NONFINITE_STEPS", "2,3")
    engine = RecordingEngine()
    run = _run(tmp_path, engine, steps=5, algorithm={"maxNonFiniteSteps": 2})
    with pytest.raises(NonFiniteStepsError, match=r"steps 2, 3: 2 steps in a row .*maxNonFiniteSteps 2"):
        run.run()
    assert [r["step"] for r in _csv(run)] == ["1", "2", "3"]
    assert run.last_checkpoint_step == 1 and run.policy_version == 2  # the setup sync, then step 1's
    assert _equal_and_finite(_checkpoint_weights(run, 1), engine.weights)


@pytest.mark.slow
@pytest.mark.parametrize(
    "trainer",
    [{}, {"backend": "Megatron", "megatron": {"pipelineParallelSize": 2}}],
    ids=["fsdp-2-ranks", "megatron-pp2"],
)
def test_the_guard_holds_on_two_trainer_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, trainer: Any) -> None:
    """The NaN sample goes to one rank (FSDP: rank 0's rows; Megatron pp2: the last stage computes the loss):
    every rank skips the step, the engine and the checkpoint keep step 1's weights, two in a row fail."""
    if trainer:
        pytest.importorskip("megatron.core", reason="megatron-core not installed (pip extra `megatron`)")
    from r3operator.runtime.nonfinite import NonFiniteStepsError
    from r3operator.trainer.distributed import DistributedTrainer

    monkeypatch.setenv("R3OPERATOR_FAULT_NONFINITE_STEPS", "2,3")
    engine = RecordingEngine()
    run = _run(tmp_path, engine, steps=3, ranks=2, algorithm={"maxNonFiniteSteps": 2}, trainer=trainer)
    run.setup()
    try:
        assert isinstance(run.trainer, DistributedTrainer) and run.trainer.world_size == 2
        run.train_step(1)
        before = engine.weights
        row = run.train_step(2)
        assert row.nonfinite_updates == 1 and engine.weights is before
        assert _equal_and_finite(_weights(run), before)
        with pytest.raises(NonFiniteStepsError, match=r"steps 2, 3"):
            run.train_step(3)
        assert _equal_and_finite(_weights(run), before)
        run.finish_checkpoint()
        assert run.last_checkpoint_step == 1
        assert _equal_and_finite(_checkpoint_weights(run, 1), before)
    finally:
        run.trainer.close()
