"""R3 routes cross the process boundary once (in the engine's answer) and train from memory; the routing
volume keeps a record written in the background. A stand-in engine group returns fixed samples (no vLLM)."""

from __future__ import annotations

import errno
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from runtime_test_helpers import settings_for, write_job

from r3operator.routing.codec import decode, encode
from r3operator.routing.sample import RolloutSample

pytestmark = pytest.mark.slow  # the batch builder needs torch
E, L, K = 8, 2, 2


class Engines:
    def __init__(self, samples: list[RolloutSample]) -> None:
        self.samples = samples

    def generate(self, prompts: Any, **kwargs: Any) -> list[RolloutSample]:
        return self.samples


def make_samples() -> list[RolloutSample]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(2):
        rows = rng.random((5, L, E)).argsort(-1)[..., :K]  # prompt 3 + 3 generated - 1
        out.append(
            RolloutSample(
                sample_id=f"p{i}-c0",
                prompt_index=i,
                choice_index=0,
                prompt_token_ids=(5, 6, 7),
                token_ids=(8, 9, 10),
                logprobs=np.zeros(3, dtype=np.float32),
                routes=encode(rows, num_experts=E),
            )
        )
    return out


def make_run(tmp_path: Path, *, mode: str = "R3", retention: int = 4) -> Any:
    from r3operator.runtime.loop import GRPORun
    from r3operator.tasks.source import BuiltinTask

    job = write_job(tmp_path, routingReplay={"mode": mode}, storage={"retentionSteps": retention})
    run = GRPORun(settings_for(job, tmp_path / "runs"))
    # what setup() would build (runtime/setup.py), as far as rollout and load_routes read it
    run.engines = Engines(make_samples())
    run.trainer = SimpleNamespace(pad_id=0, batch_device="cpu")  # all that load_routes reads of it
    run.supervisor = SimpleNamespace(on_policy=lambda call, what: call())  # no engine faults in these tests
    run.num_experts = E
    run.task = BuiltinTask("count", vocab_size=512, reward="exact-match", seed=0)
    run.routes.dropped = []
    run._start_recorder()  # what setup() does once the model's expert count is known
    return run


def test_batch_routes_come_from_the_engine_answer_not_the_volume(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    samples, _ = run.rollout(1)
    run.recorder.flush()
    for path in (run.run_dir / "routes").rglob("*.r3r"):
        path.write_bytes(b"garbage")  # whatever happens to the record, training reads memory
    batch = run.load_routes(1, samples, np.zeros(len(samples)))
    assert batch.sample_ids == ["p0-c0", "p1-c0"] and run.routes.dropped == []
    np.testing.assert_array_equal(batch.engine_routes[1, :5].numpy(), decode(samples[1].routes))


def test_the_record_holds_every_sample_and_keeps_only_the_retained_steps(tmp_path: Path) -> None:
    run = make_run(tmp_path, retention=2)
    for step in (1, 2, 3):
        samples, _ = run.rollout(step)
    run.recorder.close()
    assert run.store.steps() == [2, 3]
    for sample in samples:
        record = run.store.get(step=3, sample_id=sample.sample_id)  # checksummed read
        np.testing.assert_array_equal(decode(record.routes), decode(sample.routes))
        assert record.header.policy_version == run.policy_version


def test_a_failing_volume_is_counted_and_training_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = make_run(tmp_path)

    def put_fails(**kwargs: Any) -> Path:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(run.store, "put", put_fails)
    samples, _ = run.rollout(1)
    run.recorder.flush()
    batch = run.load_routes(1, samples, np.zeros(len(samples)))
    assert batch.size == 2 and run.routes.dropped == []
    failures = 'r3operator_route_record_failures_total{namespace="default",operation="write",rljob="tiny-count-r3"}'
    assert f"{failures} 1.0" in run.metrics.exposition()


def test_modes_without_replay_keep_no_record(tmp_path: Path) -> None:
    run = make_run(tmp_path, mode="Disabled")
    run.rollout(1)
    assert run.recorder is None and not list((run.run_dir / "routes").rglob("*.r3r"))
