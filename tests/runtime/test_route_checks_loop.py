"""The step loop's route checks on CPU: the real trainer (tiny model) against the in-process fake engine, for
the failures a fake engine or a broken batch builder injects more directly than a real engine can."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fake_engine import FakeEngine
from runtime_test_helpers import settings_for, write_job


def _run(tmp_path: Path, engine: FakeEngine, policy: str | None = None) -> Any:
    from r3operator.rollout.engines import EngineGroup
    from r3operator.runtime.loop import GRPORun

    spec: dict[str, Any] = {"weightSync": {"canary": False}, "algorithm": {"steps": 1}}
    if policy is not None:
        spec["routingReplay"] = {"onRouteCheckFailure": policy}
    job = write_job(tmp_path, **spec)
    run = GRPORun(settings_for(job, tmp_path / "runs", steps=1), engines=EngineGroup([engine]))
    run.setup()
    return run


def _weights(run: Any) -> dict[str, Any]:
    return {name: p.detach().clone() for name, p in run.trainer.model.named_parameters()}


def _unchanged(before: dict[str, Any], run: Any) -> bool:
    import torch

    return all(torch.equal(before[name], p) for name, p in run.trainer.model.named_parameters())


class ConstantLayerEngine(FakeEngine):
    """Captures one expert set for every token of layer 2 (the other layers vary with the token)."""

    def route_row(self, position: int, token: int, tag: str | None = None) -> np.ndarray:
        row = super().route_row(position, token, tag)
        row[2] = np.arange(self.top_k)
        return row


def test_an_engine_without_capture_stops_the_job_by_default(tmp_path: Path) -> None:
    """Replay on the trainer's side only: the engine sends no routes. The default policy (Fail) stops the job at
    the first sample instead of dropping every sample, every step."""
    from r3operator.runtime.route_checks import RouteCheckError

    run = _run(tmp_path, FakeEngine(routes=False))
    before = _weights(run)
    with pytest.raises(
        RouteCheckError, match=r"route check routes-missing failed \(sample p0-c0\): engine returned no"
    ):
        run.train_step(1)
    assert _unchanged(before, run)


def test_a_constant_layer_stops_the_job_after_the_old_logprob_pass(tmp_path: Path) -> None:
    from r3operator.runtime.route_checks import RouteCheckError

    run = _run(tmp_path, ConstantLayerEngine())
    before, version = _weights(run), run.policy_version
    with pytest.raises(
        RouteCheckError, match=r"constant-layer failed \(sample p0-c0, layer 2\): all \d+ replayed rows"
    ):
        run.train_step(1)
    assert _unchanged(before, run) and run.policy_version == version


def test_skip_sample_drops_constant_layer_samples_and_counts_them(tmp_path: Path) -> None:
    run = _run(tmp_path, ConstantLayerEngine(), policy="SkipSample")
    before = _weights(run)
    row = run.train_step(1)
    assert row.skipped == 1 and row.route_check_failures == row.samples_dropped == 16
    assert row.replayed_fraction == 0.0 and _unchanged(before, run)
    exposition = run.metrics.exposition()
    assert (
        'r3operator_route_check_failures_total{namespace="default",rljob="tiny-count-r3",rule="constant-layer"} 16.0'
        in exposition
    )
    assert 'r3operator_replayed_rows_ratio{namespace="default",rljob="tiny-count-r3"} 0.0' in exposition


def test_a_batch_that_replays_its_pad_stops_the_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch builder that zero-pads routes and forgets the no-route mask: every pad column, and each sample's
    last token, would replay expert 0 (NVIDIA-NeMo/RL#3208's review). The check stops it before the forward,
    naming the sample and the position."""
    from r3operator.runtime.route_checks import RouteCheckError
    from r3operator.trainer import batch as batch_module

    real = batch_module.place_routes

    def forgets_the_mask(*args: Any, **kwargs: Any) -> tuple[np.ndarray, np.ndarray]:
        ids, no_route = real(*args, **kwargs)
        return ids, np.zeros_like(no_route)

    monkeypatch.setattr(batch_module, "place_routes", forgets_the_mask)
    run = _run(tmp_path, FakeEngine())
    before = _weights(run)
    with pytest.raises(RouteCheckError, match=r"pad-replayed failed \(sample p0-c0\): position \d+ \(its last token\)"):
        run.train_step(1)
    assert _unchanged(before, run)


def test_a_healthy_step_replays_every_row_and_times_its_checks(tmp_path: Path) -> None:
    run = _run(tmp_path, FakeEngine())
    row = run.train_step(1)
    assert row.skipped == 0 and row.route_check_failures == 0 and row.route_check_message is None
    assert row.replayed_fraction == 1.0 and row.fallback_fraction == 0.0
    assert "route_checks" in row.phase_seconds
    from r3operator.runtime.metrics import progress_patch

    # What the driver pushes into status.progress after the step, where the operator reads ReplayHealthy from.
    body = progress_patch(row, total_steps=1, last_checkpoint_step=None)["status"]["progress"]
    assert body["replayedFraction"] == 1.0 and body["fallbackFraction"] == 0.0 and body["routeCheckFailures"] == 0


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("moe", [(0, 1, 2), (0, 1, 2, 3)])
def test_the_device_screen_flags_every_row_the_constant_layer_rule_fails(seed: int, moe: tuple[int, ...]) -> None:
    """`constant_layer_suspects` (torch, where the routes are) against routing/checks.py's numpy rule, on random
    routes with constant engine layers planted in some rows (and in rows whose trainer routing is constant too,
    which the rule lets pass), one of them in a different order on every row, and rows whose sets all have one sum
    but differ (the screen's candidates, not failures): the screen must miss no failing row, and flag no other."""
    import numpy as np
    import torch

    from r3operator.routing.checks import check_constant_layers
    from r3operator.runtime.route_checks import constant_layer_suspects

    rng = np.random.default_rng(seed)
    b, s, layers, k, experts = 12, 9, 4, 2, 8
    engine = rng.integers(0, experts, size=(b, s, layers, k))
    natural = rng.integers(0, experts, size=(b, s, layers, k))
    replayed = rng.random((b, s)) < 0.8
    replayed[0] = False  # nothing replayed
    replayed[1, 1:] = False  # one row: never constant by the rule
    for row in (2, 5, 7):
        engine[row, :, 1] = [3, 6]  # a planted constant capture
    engine[9, :, 2] = [1, 4]
    engine[5, ::2, 1] = [6, 3]  # the same set in another order
    natural[9, :, 2] = [4, 1]  # the trainer's routing is that one set too: not a failure
    engine[10, :, 3] = [2, 5]  # a failure only where layer 3 is an MoE layer
    engine[11, :, 0] = [1, 6]
    engine[11, ::2, 0] = [3, 4]  # one sum (7) on every row, two sets: no failure
    ids = [f"s{i}" for i in range(b)]
    expected = {int(f.sample_id[1:]) for f in check_constant_layers(ids, engine, natural, replayed, moe)}
    got = constant_layer_suspects(torch.as_tensor(engine), torch.as_tensor(natural), torch.as_tensor(replayed), moe)
    assert set(got) == expected
    assert expected >= {2, 5, 7} and not expected & {0, 1, 9, 11}
    assert (10 in expected) == (3 in moe)
