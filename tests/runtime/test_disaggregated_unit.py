"""A disaggregated engine group under the weight-sync supervisor: both roles are synced, canaried and checked for the
current policy; a prefill engine a version behind its decode engine is re-synced and canaried before a rollout; a
prefill engine is paired only with decode engines of its own build."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from fake_engine import FakeEngine

from r3operator.rollout.disaggregated import DisaggregatedGroup
from r3operator.weightsync.faults import EngineSupervisor
from r3operator.wire.retry import Backoff, EngineUnavailableError


@dataclass
class BuiltEngine(FakeEngine):
    build: str = "vllm 0.30.0 image engine:a"

    def engine_build(self) -> str:
        return self.build


def _chunks() -> list[Any]:
    import torch

    from r3operator.wire.weights import pack_chunk

    return [pack_chunk([("layer.weight", torch.ones(2, 2))])]


def _supervised(prefill: FakeEngine, decode: FakeEngine, canaried: list[list[str]]) -> EngineSupervisor:
    group = DisaggregatedGroup([prefill], [decode])  # type: ignore[list-item]  # the fakes stand in for HTTPEngine

    def canary(engines: Any) -> None:
        canaried.append([e.name for e in engines])

    backoff = Backoff(attempts=2, base_s=0.0, jitter=0.0, sleep=lambda s: None)
    return EngineSupervisor(group, chunks=_chunks, canary=canary, backoff=backoff, nonce="run1")


def test_a_sync_reaches_both_roles_and_a_prefill_engine_a_version_behind_is_resynced_before_a_rollout() -> None:
    prefill, decode = BuiltEngine(name="prefill-0"), BuiltEngine(name="engine-0")
    canaried: list[list[str]] = []
    supervisor = _supervised(prefill, decode, canaried)
    supervisor.sync(1)
    supervisor.sync(2)
    assert prefill.tag == decode.tag == "run1:2"
    assert prefill.calls.count("finish") == decode.calls.count("finish") == 2  # one bracket each per sync

    prefill.tag = "run1:1"  # the prefill engine serves the previous policy (its last sync did not hold)
    served: list[str | None] = []
    supervisor.on_policy(lambda: served.append(prefill.tag), what="rollout")
    assert served == ["run1:2"]  # re-synced before the rollout ran, never after
    assert canaried == [["prefill-0"]]  # and canaried alone: the decode engine was current

    prefill.tag = "run1:1"
    from r3operator.rollout.base import StaleEngineError

    with pytest.raises(StaleEngineError):  # the asynchronous producer's calls refuse instead of re-syncing
        supervisor.current_only(lambda: None, what="segment")


def test_a_prefill_engine_serves_only_with_a_decode_engine_of_its_build() -> None:
    old_p, new_p = BuiltEngine(name="prefill-0"), BuiltEngine(name="prefill-1", build="vllm 0.30.1 image engine:b")
    old_d, new_d = BuiltEngine(name="engine-0"), BuiltEngine(name="engine-1", build="vllm 0.30.1 image engine:b")
    group = DisaggregatedGroup([old_p, new_p], [old_d, new_d])  # type: ignore[list-item]
    assert [(p.name, d.name) for p, d in group.pairs()] == [("prefill-0", "engine-0"), ("prefill-1", "engine-1")]

    new_p.build = old_p.build  # the prefill role rolled back, the decode engine 1 did not: it gets no request
    assert [(p.name, d.name) for p, d in group.pairs()] == [("prefill-0", "engine-0")]

    old_d.build = new_d.build  # every decode engine on b, every prefill engine on a: nothing may serve
    with pytest.raises(EngineUnavailableError, match="no prefill engine shares a build with a decode engine"):
        group.pairs()


def test_a_group_needs_both_roles() -> None:
    with pytest.raises(ValueError, match="needs both roles, got 0 prefill, 1 decode"):
        DisaggregatedGroup([], [BuiltEngine()])  # type: ignore[list-item]
