"""Where the driver takes R3 routes from: in memory from a Ray-actor engine (no disk round trip), through
the routing store from engines over HTTP. A stand-in engine group returns fixed samples (no vLLM)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from runtime_test_helpers import settings_for, write_job

from r3operator.engine.rollout import RolloutSample
from r3operator.routing.codec import decode, encode

pytestmark = pytest.mark.slow  # the batch builder needs torch
E, L, K = 8, 2, 2


class Engines:
    def __init__(self, samples: list[RolloutSample], *, over_http: bool) -> None:
        self.samples, self.over_http = samples, over_http

    def generate(self, prompts: Any, **kwargs: Any) -> list[RolloutSample]:
        return self.samples


def make_samples() -> list[RolloutSample]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(2):
        rows = rng.random((5, L, E)).argsort(-1)[..., :K]  # prompt 3 + 3 generated - 1
        out.append(RolloutSample(
            sample_id=f"p{i}-c0", prompt_index=i, choice_index=0, prompt_token_ids=(5, 6, 7), token_ids=(8, 9, 10),
            logprobs=np.zeros(3, dtype=np.float32), routes=encode(rows, num_experts=E),
        ))  # fmt: skip
    return out


def make_run(tmp_path: Path, *, over_http: bool) -> Any:
    from r3operator.runtime.loop import GRPORun
    from r3operator.trainer.grpo import tasks

    engines = Engines(make_samples(), over_http=over_http)
    run = GRPORun(settings_for(write_job(tmp_path), tmp_path / "runs"), engines=engines)  # type: ignore[arg-type]
    run.routes_on_volume = run.engines.over_http  # what setup() derives, without starting a trainer
    run.trainer = SimpleNamespace(pad_id=0)  # load_routes reads only the pad id
    run.supervisor = SimpleNamespace(on_policy=lambda call, what: call())  # no engine faults in these tests
    run.num_experts = E
    run.pool = tasks.problems("count", vocab_size=512)
    run.dropped = []
    return run


def test_ray_engine_routes_stay_in_memory(tmp_path: Path) -> None:
    run = make_run(tmp_path, over_http=False)
    samples, _ = run.rollout(1)
    assert not list((run.run_dir / "routes").rglob("*.r3r"))
    batch = run.load_routes(1, samples, np.zeros(len(samples)))
    assert batch.engine_routes is not None and run.dropped == []
    np.testing.assert_array_equal(batch.engine_routes[1, :5].numpy(), decode(samples[1].routes))


def test_http_engine_routes_go_through_the_store(tmp_path: Path) -> None:
    run = make_run(tmp_path, over_http=True)
    samples, _ = run.rollout(1)
    files = sorted((run.run_dir / "routes").rglob("*.r3r"))
    assert [f.stem for f in files] == ["p0-c0", "p1-c0"]
    files[0].unlink()  # what the trainer reads is the file, not the sample in memory
    batch = run.load_routes(1, samples, np.zeros(len(samples)))
    assert batch.sample_ids == ["p1-c0"] and run.dropped == [("p0-c0", "routing_file")]


def test_engine_groups_know_when_routes_cross_the_volume() -> None:
    from r3operator.runtime.engines import EngineGroup, HTTPEngine, RayEngine

    ray_engine, http_engine = RayEngine.__new__(RayEngine), HTTPEngine.__new__(HTTPEngine)  # no actor, no server
    assert not EngineGroup([ray_engine]).over_http
    assert EngineGroup([ray_engine, http_engine]).over_http
