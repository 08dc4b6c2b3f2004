"""A new leader's first passes (operator/takeover.py): the RLJob whose child went missing while no leader ran is
passed over before the untouched ones, over an in-memory client with the informer cache; the order of turns;
the standing children against desired(). No server, no kopf."""

from __future__ import annotations

import asyncio
import copy
import datetime as dt
from typing import Any

import pytest
from operator_harness import example
from test_reconcile import NOW
from test_reconcile_cache import WatchedClient

from r3operator.api.load import parse_rljob
from r3operator.operator.desired import Facts, desired, standing_children
from r3operator.operator.informer import ChildCache
from r3operator.operator.lifecycle import ANNOTATION_FINISHED
from r3operator.operator.reconcile import Reconciler
from r3operator.operator.takeover import FirstPasses, first_turn, missing_child, needs_pass_first

JOBS = 24
LIMIT = 4


def _job(i: int) -> dict[str, Any]:
    doc = example(f"job-{i:02d}", "rl")
    doc["metadata"].update(uid=f"uid-{i:02d}", generation=1)
    return doc


def _first_passes(
    client: WatchedClient, bodies: list[dict[str, Any]], *, late: int = 0, beside: dict[str, int] | None = None
) -> list[str]:
    """A new leader: a fresh cache and reconciler, one daemon-like task per RLJob in list order (kopf spawns them
    so), each taking its turn and then its first pass; the names in the order the passes ran. ``late``: the last
    so many daemons start only once the others have their turns or wait for one. ``beside``: filled with how many
    first passes ran (its own included) when each began."""
    order: list[str] = []

    async def scenario() -> None:
        gate = FirstPasses(LIMIT)
        cache = ChildCache(client, lambda key: gate.hurry(key))  # type: ignore[arg-type]
        reconciler = Reconciler(client, clock=lambda: NOW, cache=cache)  # type: ignore[arg-type]

        async def daemon(body: dict[str, Any]) -> None:
            key = (body["metadata"]["namespace"], body["metadata"]["name"])
            await first_turn(gate, key, body, cache, child_event=lambda: False)
            try:
                order.append(key[1])
                if beside is not None:
                    beside[key[1]] = gate.running
                await reconciler.reconcile(body, live=True)
                # A pass holds its turn a while (its status write, at least, is a round trip): the in-memory client
                # answers at once, and an untouched RLJob's pass makes no request, so it would end in no time.
                await asyncio.sleep(0.01)
            finally:
                gate.done()

        early = [asyncio.create_task(daemon(b)) for b in bodies[: len(bodies) - late]]
        while gate.running + gate.waiting < len(early):
            await asyncio.sleep(0.01)
        await asyncio.gather(*early, *(daemon(b) for b in bodies[len(bodies) - late :]))
        await cache.close()

    asyncio.run(scenario())
    return order


@pytest.mark.parametrize("late", [0, 2])
def test_the_rljob_whose_child_went_missing_during_the_hand_over_is_passed_over_first(late: int):
    client = WatchedClient()
    bodies = [client.put(_job(i)) for i in range(JOBS)]

    async def old_leader() -> None:
        cache = ChildCache(client, lambda key: None)  # type: ignore[arg-type]
        reconciler = Reconciler(client, clock=lambda: NOW, cache=cache)  # type: ignore[arg-type]
        for body in bodies:
            await reconciler.reconcile(body)
        await cache.close()

    asyncio.run(old_leader())
    # No leader: the last RLJob's ConfigMap is deleted, and the last but one's spec edited (generation 2).
    victim = bodies[-1]["metadata"]["name"]
    del client.objects[("configmaps", "rl", f"{victim}-config")]
    edited = bodies[-2]["metadata"]["name"]
    client.objects[("rljobs", "rl", edited)]["metadata"]["generation"] = 2
    live = [client.objects[("rljobs", "rl", b["metadata"]["name"])] for b in bodies]
    assert all(b["status"]["observedGeneration"] == 1 for b in live)  # the old leader's status
    client.writes.clear()

    beside: dict[str, int] = {}
    order = _first_passes(client, live, late=late, beside=beside)

    assert ("apply", "ConfigMap", f"{victim}-config") in client.writes  # re-created
    assert sorted(order) == sorted(b["metadata"]["name"] for b in bodies)
    # The two that need a pass go first; without the order they would come last of JOBS (list order). Asking after
    # the others (kopf spawned their daemons later), they start at once: after at most the LIMIT with turns.
    assert set(order[: 2 + (LIMIT if late else 0)]) >= {victim, edited}, order
    if late:  # beside the LIMIT others that had their turns, not after one of them ended
        assert beside[victim] > LIMIT and beside[edited] > LIMIT, beside


def test_an_untouched_rljob_needs_no_early_pass_and_a_missing_engine_set_is_seen_under_either_kind():
    client = WatchedClient()
    body = client.put(_job(0))

    async def scenario() -> None:
        cache = ChildCache(client, lambda key: None)  # type: ignore[arg-type]
        reconciler = Reconciler(client, clock=lambda: NOW, cache=cache)  # type: ignore[arg-type]
        await reconciler.reconcile(body)
        live = client.objects[("rljobs", "rl", "job-00")]
        await asyncio.sleep(0.05)
        assert needs_pass_first(live, cache, child_event=False) is None
        assert needs_pass_first(live, cache, child_event=True) == "a child changed"
        assert needs_pass_first(live, None, child_event=False) is None
        sts = client.objects.pop(("statefulsets", "rl", "job-00-engine"))
        fresh = ChildCache(client, lambda key: None)  # type: ignore[arg-type]
        fresh.watch_namespace("rl")
        assert await fresh.wait_synced("rl", 5.0)
        assert needs_pass_first(live, fresh, child_event=False) == "StatefulSet/job-00-engine missing"
        # Ended: its children stay until the TTL (the example's 3600 s) has run from the recorded end, then go.
        ended = copy.deepcopy(live)
        ended["metadata"].setdefault("annotations", {})[ANNOTATION_FINISHED] = "Failed 2026-11-27T03:00:00Z"
        at = dt.datetime(2026, 11, 27, 3, 30, tzinfo=dt.UTC)
        assert missing_child(ended, fresh, at) == "StatefulSet/job-00-engine"
        assert missing_child(ended, fresh, at + dt.timedelta(hours=1)) is None
        await fresh.close()
        client.put(sts)
        await cache.close()

    asyncio.run(scenario())


def test_an_urgent_turn_never_waits_the_others_wait_in_order_and_a_cancelled_wait_gives_its_turn_back():
    granted: list[str] = []

    async def scenario() -> None:
        gate = FirstPasses(1)
        await gate.turn(("ns", "running"), urgent=False)  # holds the only turn

        async def wait(name: str, urgent: bool) -> None:
            await gate.turn(("ns", name), urgent=urgent)
            granted.append(name)

        tasks = [asyncio.create_task(wait(n, u)) for n, u in (("a", False), ("b", False), ("c", True), ("d", False))]
        await asyncio.sleep(0)
        assert granted == ["c"] and gate.running == 2  # past the limit
        gate.hurry(("ns", "d"))  # a child's event while it waits
        tasks[1].cancel()  # "b" stopped while waiting
        await asyncio.sleep(0)
        assert granted == ["c", "d"] and gate.waiting == 1
        for _ in range(3):  # "running", "c", "d" end: "a" gets the one turn once fewer than 1 run
            gate.done()
            await asyncio.sleep(0)
            await asyncio.sleep(0)
        assert granted == ["c", "d", "a"]
        gate.done()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert gate.running == 0 and gate.waiting == 0

    asyncio.run(scenario())


def test_at_most_limit_run_and_a_gate_without_waiters_does_not_wait():
    with pytest.raises(ValueError, match="at least 1"):
        FirstPasses(0)

    async def scenario() -> None:
        gate = FirstPasses(2)
        await asyncio.wait_for(gate.turn(("ns", "a"), urgent=False), 0.1)
        await asyncio.wait_for(gate.turn(("ns", "b"), urgent=False), 0.1)
        third = asyncio.create_task(gate.turn(("ns", "c"), urgent=False))
        await asyncio.sleep(0.01)
        assert not third.done() and gate.running == 2
        gate.done()
        await asyncio.wait_for(third, 0.1)
        assert gate.running == 2

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "facts",
    [Facts(), Facts(finished=True), Facts(admitted=False), Facts(model_fetched=False), Facts(pod_monitor_crd=False)],
)
@pytest.mark.parametrize("edits", [{}, {"queueName": "team"}, {"trainer.podTemplate": {"serviceAccountName": "own"}}])
def test_standing_children_are_rendered_by_desired_for_every_unexpired_job(facts: Facts, edits: dict[str, Any]):
    job = parse_rljob(example("job", "rl", **edits), source="test")
    rendered = {(c["kind"], c["metadata"]["name"]) for c in desired(job, facts)}
    for kinds, name in standing_children("job"):
        assert any((kind, name) in rendered for kind in kinds), (kinds, name, sorted(rendered))
    # Once the TTL ran they go (the reason missing_child skips an ended RLJob).
    gone = {(c["kind"], c["metadata"]["name"]) for c in desired(job, Facts(expired=True))}
    assert not any((k, n) in gone for kinds, n in standing_children("job") for k in kinds)
