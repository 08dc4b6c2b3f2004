"""A trained step's routing figures (runtime/step_rows.py `with_training`) on routes written out by hand: the
(token, layer) agreement and the share of tokens whose routers differ from the engine in at least one MoE layer,
compared as expert SETS over the routed rows only, in metrics.csv's row and in the Prometheus gauge."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

JOB = 'namespace="ns",rljob="j"'


def _record() -> Any:
    from r3operator.runtime.step_record import StepRecord

    return StepRecord(
        step=1,
        policy_version=1,
        replay_mode="Disabled",
        reward_mean=0.5,
        reward_std=0.5,
        samples=2,
        samples_dropped=0,
        tokens=4,
        tokens_per_second=1.0,
    )


def _trained(engine_routes: Any, natural: Any, route_pad: Any) -> tuple[Any, Any]:
    from r3operator.api.enums import ReplayMode
    from r3operator.runtime.metrics import RuntimeMetrics
    from r3operator.runtime.step_rows import with_training
    from r3operator.trainer.base import UpdateStats, old_pass_for
    from r3operator.trainer.batch import TrainBatch

    batch_size, seq = 2, 3
    response = torch.ones(batch_size, seq - 1, dtype=torch.bool)
    batch = TrainBatch(
        input_ids=torch.zeros(batch_size, seq, dtype=torch.int64),
        attention_mask=torch.ones(batch_size, seq, dtype=torch.int64),
        response_mask=response,
        rollout_logprobs=torch.full((batch_size, seq - 1), -1.0),
        advantages=torch.zeros(batch_size),
        engine_routes=engine_routes,
        route_pad=route_pad,
        sample_ids=["a", "b"],
    )
    old = old_pass_for(ReplayMode.DISABLED, batch, torch.full((batch_size, seq - 1), -1.0), natural, natural)
    stats = UpdateStats(loss=0.0, clip_fraction=0.0, approx_kl=0.0, grad_norm=1.0, tokens=4)
    sync = SimpleNamespace(near_ties=0, phases=SimpleNamespace(seconds={}))
    metrics = RuntimeMetrics("j", namespace="ns")
    record = with_training(
        _record(),
        [],
        batch,
        old,
        stats,
        masks=(response, None),
        sync=sync,  # type: ignore[arg-type]  # the two fields with_training reads of a WeightSyncSession
        canary_ok=True,
        multi_turn=False,
        metrics=metrics,
    )
    return record, metrics


def test_tokens_with_any_differing_layer_are_counted_over_routed_rows_as_sets() -> None:
    # [B=2, S=3, L=2, K=2]; every engine row routed to experts {1, 2}.
    engine = torch.tensor([[[[1, 2], [1, 2]]] * 3] * 2)
    natural = engine.clone()
    natural[0, 0, 0] = torch.tensor([2, 1])  # the same set in another order: agrees
    natural[0, 1, 1] = torch.tensor([1, 3])  # token (0, 1): one layer differs
    natural[1, 0] = torch.tensor([[3, 4], [1, 4]])  # token (1, 0): both layers differ
    natural[1, 2, 0] = torch.tensor([5, 6])  # token (1, 2) differs, but it has no captured route: not counted
    route_pad = torch.zeros(2, 3, dtype=torch.bool)
    route_pad[1, 2] = True
    engine[1, 2] = 0  # vLLM's zero row where no route was captured
    record, metrics = _trained(engine, natural, route_pad)
    # 5 routed tokens, 2 with a differing layer; 10 routed (token, layer) pairs, 3 differing.
    assert record.routing_tokens_any_diff == pytest.approx(2 / 5)
    assert record.routing_natural_agreement == pytest.approx(7 / 10)
    assert record.row()["routing_tokens_any_diff"] == pytest.approx(0.4)
    assert f"r3operator_routing_tokens_any_diff_ratio{{{JOB}}} 0.4" in metrics.exposition()


def test_a_step_without_engine_routes_has_no_routing_figure() -> None:
    natural = torch.ones(2, 3, 2, 2, dtype=torch.int64)
    record, _ = _trained(None, natural, None)
    assert record.routing_tokens_any_diff != record.routing_tokens_any_diff  # NaN: nothing was compared
    assert record.row()["routing_tokens_any_diff"] != record.row()["routing_tokens_any_diff"]
