"""The reconcile pass reading its children from the informer cache (operator/informer.py) over an in-memory
client: a second pass asks the API server for no child, a child changed behind the cache's back (no event
yet) is seen at the next event, and an object someone else put under a child's name, which the labelled
watch cannot hold, is still a NameConflict. No server, no kopf."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator
from typing import Any

from test_reconcile import NOW, FakeClient, _condition, _rljob

from r3operator.operator import meta
from r3operator.operator.informer import ChildCache
from r3operator.operator.kube import KINDS, Kind
from r3operator.operator.lifecycle import observed_finish
from r3operator.operator.reconcile import Reconciler

CHILD_KINDS = (
    "StatefulSet",
    "RayJob",
    "ConfigMap",
    "Service",
    "PersistentVolumeClaim",
    "ServiceAccount",
    "Role",
    "RoleBinding",
    "NetworkPolicy",
    "Job",
)
CHILD_PLURALS = {KINDS[k].plural for k in CHILD_KINDS}


class WatchedClient(FakeClient):
    """FakeClient plus what the informer uses: a labelled LIST with a version and a WATCH fed from the writes."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[tuple[str, str]] = []
        self.queues: list[tuple[str, asyncio.Queue[dict[str, Any]]]] = []

    def put(self, obj: dict[str, Any]) -> dict[str, Any]:
        stored = super().put(obj)
        for plural, queue in self.queues:
            if plural == KINDS[stored["kind"]].plural and meta.LABEL_JOB in (stored["metadata"].get("labels") or {}):
                queue.put_nowait({"type": "MODIFIED", "object": stored})
        return stored

    async def get(self, kind: Kind, namespace: str | None, name: str) -> dict[str, Any] | None:
        self.reads.append((kind.plural, name))
        return await super().get(kind, namespace, name)

    async def list_with_version(
        self, kind: Kind, namespace: str | None, *, label_selector: str, page: int = 500
    ) -> tuple[list[dict[str, Any]], str]:
        def labelled(o: dict[str, Any]) -> bool:
            return label_selector in (o["metadata"].get("labels") or {})

        items = [o for (p, ns, _), o in self.objects.items() if (p, ns) == (kind.plural, namespace) and labelled(o)]
        return items, str(self._rv)

    async def watch(
        self, kind: Kind, namespace: str | None, *, label_selector: str, resource_version: str, timeout_s: int
    ) -> AsyncIterator[dict[str, Any]]:
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.queues.append((kind.plural, queue))
        while True:
            yield await queue.get()


async def _passes(client: WatchedClient, body: dict[str, Any], woken: list[Any]) -> Reconciler:
    cache = ChildCache(client, woken.append)  # type: ignore[arg-type]
    reconciler = Reconciler(client, clock=lambda: NOW, cache=cache)  # type: ignore[arg-type]
    await reconciler.reconcile(body)
    return reconciler


def test_a_pass_reads_its_children_from_the_cache_and_reacts_to_their_events():
    client = WatchedClient()
    body = client.put(_rljob())
    woken: list[Any] = []

    async def scenario() -> None:
        reconciler = await _passes(client, body, woken)  # the first pass: children created
        assert reconciler.cache is not None
        await asyncio.sleep(0.05)  # the apply results reach the watches
        # The events of the pass's own writes wake no second pass: it has seen what it wrote.
        assert woken == []
        client.reads.clear()
        client.writes.clear()
        again = await reconciler.reconcile(body)
        assert again.written == [] and [w for w in client.writes if w[0] != "patch/status"] == []
        # No child is read from the API server: the RLJob itself, and what the operator does not own, only.
        assert not [r for r in client.reads if r[0] in CHILD_PLURALS], client.reads
        # A child's event wakes its RLJob, by the job label.
        woken.clear()
        sts = client.objects[("statefulsets", "rl", "job-engine")]
        client.put({**sts, "status": {"replicas": 1, "readyReplicas": 1}})
        await asyncio.sleep(0.05)
        assert woken == [("rl", "job")]
        cached = reconciler.cache.lookup("StatefulSet", "rl", "job-engine")
        assert isinstance(cached, dict) and cached["status"]["readyReplicas"] == 1
        await reconciler.cache.close()

    asyncio.run(scenario())


def test_an_unlabelled_object_under_a_child_name_is_a_name_conflict_untouched_and_no_child_is_left():
    client = WatchedClient()
    body = client.put(_rljob())
    # Someone else's ConfigMap under the job's config name, without the operator's label: the watch never sees it.
    theirs = client.put(
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "job-config", "namespace": "rl"}, "data": {}}
    )

    async def scenario() -> None:
        reconciler = await _passes(client, body, [])
        assert reconciler.cache is not None
        assert reconciler.cache.lookup("ConfigMap", "rl", "job-config") is None
        first = list(client.writes)
        client.writes.clear()
        client.reads.clear()
        # The next pass reads the names the cache does not hold before writing: it writes nothing at all.
        await reconciler.reconcile(client.objects[("rljobs", "rl", "job")])
        assert client.writes == [], client.writes
        assert ("configmaps", "job-config") in client.reads
        await reconciler.cache.close()
        # The first pass: its creates went out at once (no read before); the ConfigMap's was refused (409), the
        # name then read, and what it had created was deleted again.
        created = {(KINDS[k].plural, n) for verb, k, n in first if verb == "apply" and not n.startswith("model-cache-")}
        deleted = {(p, n) for verb, p, n in first if verb == "delete"}
        assert created - {("configmaps", "job-config")} == deleted, (created, deleted)

    asyncio.run(scenario())
    assert ("configmaps", "job-config") in client.reads
    assert _condition(client, "Valid")["reason"] == "NameConflict"
    assert "ConfigMap/job-config" in _condition(client, "Valid")["message"]
    assert client.objects[("configmaps", "rl", "job-config")] == theirs  # untouched
    # No child of the job is left: only its RLJob, their ConfigMap, and the model cache claim no RLJob controls.
    left = {(p, n) for (p, _, n) in client.objects if (p, n) not in {("rljobs", "job"), ("configmaps", "job-config")}}
    assert {n for _, n in left} == {n for _, n in left if n.startswith("model-cache-")}, left


def test_an_object_of_the_rljobs_the_cache_does_not_hold_is_applied_after_its_refused_create():
    client = WatchedClient()
    body = client.put(_rljob())
    # The job's own ConfigMap (its controller reference), its labels stripped by hand: the watch does not hold it.
    owner = {
        "apiVersion": "r3operator.io/v1alpha1",
        "kind": "RLJob",
        "name": "job",
        "uid": "job-uid",
        "controller": True,
    }
    config = {"name": "job-config", "namespace": "rl", "ownerReferences": [owner]}
    client.put({"apiVersion": "v1", "kind": "ConfigMap", "metadata": config, "data": {"stale": "1"}})

    async def scenario() -> None:
        reconciler = await _passes(client, body, [])
        assert reconciler.cache is not None
        await reconciler.cache.close()

    asyncio.run(scenario())
    applies = [w for w in client.writes if w == ("apply", "ConfigMap", "job-config")]
    assert len(applies) == 2, client.writes  # the create refused, then the apply of what the GET showed
    assert ("configmaps", "job-config") in client.reads
    assert not [w for w in client.writes if w[0] == "delete"], client.writes
    assert _condition(client, "Valid")["status"] == "True"
    held = client.objects[("configmaps", "rl", "job-config")]
    assert held["metadata"]["labels"][meta.LABEL_JOB] == "job" and "config.json" in held["data"], held


class RoundTripClient(WatchedClient):
    """Every request (GET, apply, delete, PATCH) takes a moment; ``rounds`` holds (round, verb, plural, name) of
    each, a round being the requests in flight together, from none in flight to none again."""

    def __init__(self) -> None:
        super().__init__()
        self.in_flight = 0
        self.round = 0
        self.rounds: list[tuple[int, str, str, str]] = []

    async def _trip(self, verb: str, plural: str, name: str, answer: Any) -> Any:
        if self.in_flight == 0:
            self.round += 1
        self.rounds.append((self.round, verb, plural, name))
        self.in_flight += 1
        try:
            await asyncio.sleep(0.01)
            return await answer
        finally:
            self.in_flight -= 1

    async def get(self, kind: Kind, namespace: str | None, name: str) -> dict[str, Any] | None:
        return await self._trip("get", kind.plural, name, super().get(kind, namespace, name))  # type: ignore[no-any-return]

    async def apply(self, obj: dict[str, Any], *, force: bool, field_manager: str = "r3operator") -> dict[str, Any]:
        answer = super().apply(obj, force=force, field_manager=field_manager)
        return await self._trip("apply", KINDS[obj["kind"]].plural, obj["metadata"]["name"], answer)  # type: ignore[no-any-return]

    async def merge_patch(
        self, kind: Kind, namespace: str | None, name: str, patch: dict[str, Any], *, subresource: str | None = None
    ) -> dict[str, Any]:
        answer = super().merge_patch(kind, namespace, name, patch, subresource=subresource)
        return await self._trip("patch" + (f"/{subresource}" if subresource else ""), kind.plural, name, answer)  # type: ignore[no-any-return]


def test_a_new_rljobs_first_pass_reads_no_child_and_creates_them_all_in_one_round_trip_then_its_status():
    client = RoundTripClient()
    body = client.put(_rljob())

    async def scenario() -> None:
        cache = ChildCache(client, lambda key: None)  # type: ignore[arg-type]
        reconciler = Reconciler(client, clock=lambda: NOW, cache=cache)  # type: ignore[arg-type]
        await reconciler.reconcile(copy.deepcopy(body), live=True)  # a daemon's pass: kopf's body, no GET of it
        await cache.close()

    asyncio.run(scenario())
    rounds = client.rounds
    children = [(r, p, n) for r, verb, p, n in rounds if verb == "apply"]
    assert len(children) >= 8, rounds  # the job's children, all created by this first pass
    # No child's name is read: the cache holds none of them, and each create is refused if the name is taken.
    assert not [t for t in rounds if t[1] == "get" and t[2] in CHILD_PLURALS], rounds
    # Every create in the first round trip, the status in the second; nothing else.
    assert {r for r, _, _ in children} == {1}, rounds
    assert [(r, verb) for r, verb, _, _ in rounds if verb != "apply"] == [(2, "patch/status")], rounds
    assert {(p, n) for _, p, n in children} <= {(p, n) for p, _, n in client.objects}  # and they were made


def test_a_held_render_is_the_same_children_as_a_fresh_desired_and_each_pass_gets_its_own_copy():
    from r3operator.api.load import parse_rljob
    from r3operator.operator.desired import Facts, desired

    body = _rljob()
    body["metadata"]["uid"] = "uid-1"
    job = parse_rljob(body, source="test")
    reconciler = Reconciler(WatchedClient(), clock=lambda: NOW)  # type: ignore[arg-type]
    facts = Facts(model_fetched=False)
    reference = desired(job, facts)  # rendered here, not through the reconciler's cache
    assert reconciler._desired(job, facts) == reference
    held = reconciler._desired(job, facts)  # from what the reconciler holds
    assert held == reference
    held[0]["metadata"]["name"] = "changed by a caller"
    assert reconciler._desired(job, facts) == reference
    # Another fact renders again.
    assert reconciler._desired(job, Facts(model_fetched=True)) == desired(job, Facts(model_fetched=True))


def test_the_rljob_held_from_the_operators_own_write_keeps_no_managed_fields():
    reconciler = Reconciler(WatchedClient(), clock=lambda: NOW)  # type: ignore[arg-type]
    returned = {
        "metadata": {"name": "job", "resourceVersion": "7", "managedFields": [{"manager": "r3operator"}]},
        "status": {"phase": "x"},
    }
    reconciler._wrote("uid-1", returned)
    held = reconciler._newest("uid-1", {"metadata": {"name": "job", "resourceVersion": "6"}})  # the live body is older
    assert held == {"metadata": {"name": "job", "resourceVersion": "7"}, "status": {"phase": "x"}}


class VersionedPatchClient(WatchedClient):
    """A status PATCH makes a new resourceVersion, as the API server's does (FakeClient's keeps the old one)."""

    async def merge_patch(
        self, kind: Kind, namespace: str | None, name: str, patch: dict[str, Any], *, subresource: str | None = None
    ) -> dict[str, Any]:
        await super().merge_patch(kind, namespace, name, patch, subresource=subresource)
        obj = self.objects[(kind.plural, namespace, name)]
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)
        return copy.deepcopy(obj)


def test_a_pass_on_a_live_body_older_than_its_own_status_write_reads_that_write_and_writes_nothing_again():
    client = VersionedPatchClient()
    stale = client.put(_rljob())  # kopf's live body, before any status: its watch lags behind the pass's writes
    stale["metadata"]["managedFields"] = [{"manager": "kubectl", "operation": "Update"}]

    async def scenario() -> None:
        cache = ChildCache(client, lambda key: None)  # type: ignore[arg-type]
        reconciler = Reconciler(client, clock=lambda: NOW, cache=cache)  # type: ignore[arg-type]
        first = await reconciler.reconcile(copy.deepcopy(stale), live=True)
        assert first.status_written
        await asyncio.sleep(0.05)
        client.writes.clear()
        again = await reconciler.reconcile(copy.deepcopy(stale), live=True)
        # It parsed the RLJob as its own write returned it (status included), not the stale body: no write.
        assert not again.status_written and client.writes == [], client.writes
        assert again.job is not None and again.job.status is not None
        assert again.job.status.observed_generation == 1
        # Once kopf's body is as new as the write, that body is taken and the held write let go.
        live = copy.deepcopy(client.objects[("rljobs", "rl", "job")])
        await reconciler.reconcile(live, live=True)
        assert reconciler._written == {}
        await cache.close()

    asyncio.run(scenario())


def test_the_rayjob_ending_is_passed_on_as_an_end_once_and_other_child_events_are_not():
    client = WatchedClient()
    changed: list[Any] = []
    ended: list[Any] = []
    labels = {meta.LABEL_JOB: "job"}
    ray_job = client.put(
        {
            "apiVersion": "ray.io/v1",
            "kind": "RayJob",
            "metadata": {"name": "job-trainer", "namespace": "rl", "labels": labels},
        }
    )

    async def scenario() -> None:
        cache = ChildCache(client, changed.append, on_end=ended.append)  # type: ignore[arg-type]
        cache.watch_namespace("rl")
        assert await cache.wait_synced("rl", 5.0)
        running = {"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"}
        failed = {"jobDeploymentStatus": "Failed", "jobStatus": "FAILED", "message": "the submitter exited"}
        for status in (running, failed, {**failed, "endTime": "2026-11-27T03:00:00Z"}):
            client.put({**ray_job, "status": status})
            await asyncio.sleep(0.02)
        sts = {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": "job-engine", "namespace": "rl"}}
        client.put({**sts, "metadata": {**sts["metadata"], "labels": labels}, "status": {"replicas": 0}})
        await asyncio.sleep(0.02)
        await cache.close()

    asyncio.run(scenario())
    assert changed == [("rl", "job")] * 4  # every event wakes the RLJob
    assert ended == [("rl", "job")]  # the RayJob's end once, at its Failed


def test_the_cache_holds_no_managed_fields_nor_the_rayclusters_status_and_the_rayjobs_end_still_reads():
    client = WatchedClient()
    labels = {meta.LABEL_JOB: "job"}
    status = {
        "jobDeploymentStatus": "Failed",
        "jobStatus": "FAILED",
        "message": "the submitter exited",
        "endTime": "2026-11-27T03:00:00Z",
        "rayClusterStatus": {"desiredGPU": "1", "head": {"podName": "h"}, "conditions": [{"type": "HeadPodReady"}]},
    }
    managed = [{"manager": "kuberay-operator", "operation": "Update", "fieldsV1": {"f:status": {}}}]
    client.put(
        {
            "apiVersion": "ray.io/v1",
            "kind": "RayJob",
            "metadata": {"name": "job-trainer", "namespace": "rl", "labels": labels, "managedFields": managed},
            "spec": {"entrypoint": "python -m train"},
            "status": status,
        }
    )

    async def scenario() -> dict[str, Any]:
        cache = ChildCache(client, lambda key: None)  # type: ignore[arg-type]
        cache.watch_namespace("rl")
        assert await cache.wait_synced("rl", 5.0)
        held = cache.lookup("RayJob", "rl", "job-trainer")
        await cache.close()
        assert isinstance(held, dict)
        return held

    held = asyncio.run(scenario())
    assert "managedFields" not in held["metadata"] and "rayClusterStatus" not in held["status"]
    assert held["spec"] == {"entrypoint": "python -m train"}
    # What the pass reads of it (lifecycle.observed_finish: the end and when; status.py: the job's own fields).
    finish = observed_finish(held)
    assert finish is not None and not finish.succeeded and finish.message == "the submitter exited"
    assert finish.ended_at is not None and finish.ended_at.hour == 3
    assert {k: held["status"][k] for k in ("jobDeploymentStatus", "jobStatus", "message")} == {
        k: status[k] for k in ("jobDeploymentStatus", "jobStatus", "message")
    }
