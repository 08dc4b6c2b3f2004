"""The reconcile pass against an in-memory client: what it writes, deletes and reports when the API
server refuses, when the RLJob does not parse, and whose status it trusts. No server, no kopf."""

from __future__ import annotations

import asyncio
import copy
import datetime as dt
import json
from pathlib import Path
from typing import Any

import pytest
from operator_harness import example

from r3operator.operator.kube import KINDS, Kind, KubeError
from r3operator.operator.reconcile import API_ERROR_PASSES, Reconciler

REPO = Path(__file__).resolve().parents[2]
NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


class FakeClient:
    """Objects by (plural, namespace, name); every write is recorded; ``refuse`` makes writes fail."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str | None, str], dict[str, Any]] = {}
        self.writes: list[tuple[str, str, str]] = []
        self.refuse: KubeError | None = None
        self._rv = 0

    def put(self, obj: dict[str, Any]) -> dict[str, Any]:
        obj = copy.deepcopy(obj)
        self._rv += 1
        meta = obj.setdefault("metadata", {})
        meta.setdefault("uid", f"uid-{obj['kind']}-{meta['name']}")
        meta["resourceVersion"] = str(self._rv)
        self.objects[(KINDS[obj["kind"]].plural, meta.get("namespace"), meta["name"])] = obj
        return obj

    async def get(self, kind: Kind, namespace: str | None, name: str) -> dict[str, Any] | None:
        found = self.objects.get((kind.plural, namespace, name))
        return copy.deepcopy(found) if found is not None else None

    async def list(self, kind: Kind, namespace: str | None, *, label_selector: str) -> list[dict[str, Any]]:
        wanted = dict(pair.split("=", 1) for pair in label_selector.split(","))

        def matches(obj: dict[str, Any]) -> bool:
            return wanted.items() <= (obj["metadata"].get("labels") or {}).items()

        return [
            copy.deepcopy(o)
            for (p, ns, _), o in self.objects.items()
            if (p, ns) == (kind.plural, namespace) and matches(o)
        ]

    def precondition(self, obj: dict[str, Any]) -> dict[str, Any]:
        """As the API server treats an apply's ``metadata.resourceVersion``: a precondition (409 Conflict when
        an object is there at another version), never stored."""
        key = (KINDS[obj["kind"]].plural, obj["metadata"].get("namespace"), obj["metadata"]["name"])
        version = obj["metadata"].get("resourceVersion")
        if version is None:
            return obj
        have = self.objects.get(key)
        if have is not None and have["metadata"]["resourceVersion"] != version:
            raise KubeError(409, "the object has been modified", "Conflict")
        return {**obj, "metadata": {k: v for k, v in obj["metadata"].items() if k != "resourceVersion"}}

    async def apply(self, obj: dict[str, Any], *, force: bool, field_manager: str = "r3operator") -> dict[str, Any]:
        self.writes.append(("apply", obj["kind"], obj["metadata"]["name"]))
        if self.refuse is not None:
            raise self.refuse
        obj = self.precondition(obj)
        key = (KINDS[obj["kind"]].plural, obj["metadata"].get("namespace"), obj["metadata"]["name"])
        merged = copy.deepcopy(self.objects.get(key) or {})
        merged.update(copy.deepcopy(obj))
        return self.put(merged)

    async def merge_patch(
        self, kind: Kind, namespace: str | None, name: str, patch: dict[str, Any], *, subresource: str | None = None
    ) -> dict[str, Any]:
        self.writes.append(("patch" + (f"/{subresource}" if subresource else ""), kind.plural, name))
        obj = self.objects[(kind.plural, namespace, name)]
        obj.setdefault("status", {}).update(patch.get("status") or {})
        return copy.deepcopy(obj)

    async def delete(self, kind: Kind, namespace: str | None, name: str, *, uid: str | None = None) -> bool:
        self.writes.append(("delete", kind.plural, name))
        return self.objects.pop((kind.plural, namespace, name), None) is not None

    async def serves(self, group_version: str, plural: str) -> bool:
        return plural == "rayjobs"


def _rljob(**spec_edits: Any) -> dict[str, Any]:
    doc = example("job", "rl", **spec_edits)
    doc["metadata"].update(uid="job-uid", generation=1)
    return doc


def _reconcile(client: FakeClient, body: dict[str, Any]) -> Any:
    reconciler = Reconciler(client, clock=lambda: NOW)  # type: ignore[arg-type]
    return reconciler, asyncio.run(reconciler.reconcile(body))


def _status(client: FakeClient) -> dict[str, Any]:
    return client.objects[("rljobs", "rl", "job")].get("status") or {}


def _condition(client: FakeClient, ctype: str) -> dict[str, Any]:
    return next(c for c in _status(client)["conditions"] if c["type"] == ctype)


def test_an_rljob_that_does_not_parse_gets_valid_false_and_one_event_once():
    client = FakeClient()
    body = client.put({**_rljob(), "spec": {**_rljob()["spec"], "notAField": 1}})
    reconciler = Reconciler(client, clock=lambda: NOW)  # type: ignore[arg-type]
    first = asyncio.run(reconciler.reconcile(body))
    assert [e.reason for e in first.events] == ["ParseError"] and first.events[0].type == "Warning"
    valid = _condition(client, "Valid")
    assert (valid["status"], valid["reason"]) == ("False", "ParseError") and "notAField" in valid["message"]
    again = asyncio.run(reconciler.reconcile(body))
    assert again.events == [] and not again.status_written
    assert [w for w in client.writes if w[0] != "patch/status"] == []  # nothing but its own status


def test_a_foreign_rayjob_under_the_trainer_name_is_not_believed_and_not_touched():
    client = FakeClient()
    body = client.put(_rljob(**{"runPolicy.ttlSecondsAfterFinished": 0, "storage.retainPolicy": "Delete"}))
    client.put(
        {
            "apiVersion": "ray.io/v1",
            "kind": "RayJob",
            "metadata": {"name": "job-trainer", "namespace": "rl"},
            "status": {"jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED", "endTime": "2020-01-01T00:00:00Z"},
        }
    )
    _, outcome = _reconcile(client, body)
    assert not [w for w in client.writes if w[0] != "patch/status"], client.writes
    assert (_condition(client, "Valid")["reason"], _condition(client, "Succeeded")["status"]) == (
        "NameConflict",
        "False",
    )
    assert "RayJob/job-trainer" in _condition(client, "Valid")["message"]
    assert [e.reason for e in outcome.events if e.type == "Warning"] == ["NameConflict"]


def _expire(client: FakeClient) -> list[str]:
    """The RayJob ends (long ago) and the next pass runs past ttlSecondsAfterFinished: the kinds it deleted."""
    ray = client.objects[("rayjobs", "rl", "job-trainer")]
    ray["status"] = {"jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED", "endTime": "2025-12-31T23:00:00Z"}
    client.writes.clear()
    _reconcile(client, client.objects[("rljobs", "rl", "job")])
    return [w[1] for w in client.writes if w[0] == "delete"]


def test_the_ttl_keeps_the_model_cache_by_default():
    client = FakeClient()
    body = client.put(_rljob(**{"runPolicy.ttlSecondsAfterFinished": 0, "storage.retainPolicy": "Delete"}))
    _reconcile(client, body)
    deletes = _expire(client)
    assert deletes.count("persistentvolumeclaims") == 1  # the routing claim; the model copy stays
    kept = [k for k in client.objects if k[0] == "persistentvolumeclaims" and k[2].startswith("model-cache-")]
    assert len(kept) == 1  # shared by source and revision: deleted by no job's TTL


def test_after_the_rayjob_ends_and_the_ttl_passes_children_are_deleted_rayjob_last():
    client = FakeClient()
    body = client.put(
        _rljob(
            **{
                "runPolicy.ttlSecondsAfterFinished": 0,
                "storage.retainPolicy": "Delete",
                "model.cache": {"retainPolicy": "Delete"},
            }
        )
    )
    _reconcile(client, body)
    ray = client.objects[("rayjobs", "rl", "job-trainer")]
    ray["status"] = {"jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED", "endTime": "2025-12-31T23:00:00Z"}
    client.writes.clear()
    _reconcile(client, client.objects[("rljobs", "rl", "job")])
    deletes = [w[1] for w in client.writes if w[0] == "delete"]
    assert deletes[-1] == "rayjobs" and "persistentvolumeclaims" in deletes
    # The example's hf:// model also has a model-fetch Job and a model cache claim.
    assert set(deletes) == {
        "rolebindings",
        "roles",
        "serviceaccounts",
        "statefulsets",
        "networkpolicies",
        "services",
        "configmaps",
        "persistentvolumeclaims",
        "jobs",
        "rayjobs",
    }
    assert deletes.count("persistentvolumeclaims") == 2
    assert _condition(client, "Succeeded")["status"] == "True"
    # The RayJob is gone; the recorded end keeps the operator from training again.
    client.writes.clear()
    _reconcile(client, client.objects[("rljobs", "rl", "job")])
    assert [w for w in client.writes if w[0] != "patch/status"] == []
    assert _condition(client, "Progressing")["reason"] == "WorkloadsDeleted"


def test_a_namespace_being_deleted_is_reported_without_retrying_as_an_error():
    client = FakeClient()
    body = client.put(_rljob())
    client.refuse = KubeError(
        403,
        "unable to create new content in namespace rl because it is being terminated",
        "Forbidden",
        ("NamespaceTerminating",),
    )
    _, outcome = _reconcile(client, body)
    assert outcome.error is client.refuse and outcome.error.namespace_terminating
    assert (_condition(client, "Progressing")["reason"], _condition(client, "Ready")["reason"]) == (
        "NamespaceTerminating",
        "NamespaceTerminating",
    )


@pytest.mark.parametrize(
    ("error", "passes_until_reported"),
    [
        (KubeError(422, "spec.template: Invalid value", "Invalid"), 1),
        (KubeError(500, "etcdserver: request timed out", "InternalError"), API_ERROR_PASSES),
    ],
)
def test_a_refused_write_is_in_status_once_it_persists(error: KubeError, passes_until_reported: int):
    client = FakeClient()
    client.put(_rljob())
    client.refuse = error
    reconciler = Reconciler(client, clock=lambda: NOW)  # type: ignore[arg-type]
    events: list[str] = []
    for n in range(1, passes_until_reported + 1):
        outcome = asyncio.run(reconciler.reconcile(client.objects[("rljobs", "rl", "job")]))
        events += [e.reason for e in outcome.events]
        reported = _condition(client, "Progressing")["reason"] == "APIError"
        assert reported == (n == passes_until_reported), n
    message = _condition(client, "Progressing")["message"]
    assert error.message in message and str(error.status) in message
    assert _condition(client, "Ready")["reason"] == "APIError"
    assert events.count("APIError") == 1
    # The write goes through again: the error leaves the status.
    client.refuse = None
    asyncio.run(reconciler.reconcile(client.objects[("rljobs", "rl", "job")]))
    assert _condition(client, "Progressing")["reason"] != "APIError"


# A replica of 16 GPUs on 8-GPU nodes: two pods, a LeaderWorkerSet group (api/engine_layout.py).
TWO_NODE_REPLICAS = {"inference.tensorParallelSize": 4, "inference.dataParallelSize": 4, "inference.gpusPerNode": 8}


class LeaderWorkerSetClient(FakeClient):
    async def serves(self, group_version: str, plural: str) -> bool:
        return plural in ("rayjobs", "leaderworkersets")


def test_a_multi_node_replica_without_the_lws_crd_is_refused_naming_the_rule_and_nothing_is_created():
    client = FakeClient()  # serves RayJobs only
    body = client.put(_rljob(**TWO_NODE_REPLICAS))
    _, outcome = _reconcile(client, body)
    valid = _condition(client, "Valid")
    assert (valid["status"], valid["reason"]) == ("False", "IncompatibleSettings")
    assert valid["message"].startswith("ENGINE-LWS: ") and "install LeaderWorkerSet" in valid["message"]
    assert [w for w in client.writes if w[0] != "patch/status"] == []
    assert not outcome.valid


def test_a_multi_node_replica_with_the_lws_crd_gets_a_leader_worker_set_and_its_groups_make_it_ready():
    client = LeaderWorkerSetClient()
    body = client.put(
        _rljob(**TWO_NODE_REPLICAS, **{"inference.replicas": 2, "model.uri": "file:///models/Qwen3-30B-A3B"})
    )
    _reconcile(client, body)
    created = {w[1] for w in client.writes if w[0] == "apply"}
    assert "LeaderWorkerSet" in created and "StatefulSet" not in created
    assert _condition(client, "Valid")["status"] == "True"
    lws = client.objects[("leaderworkersets", "rl", "job-engine")]
    assert lws["spec"]["replicas"] == 2
    lws["status"] = {"replicas": 2, "readyReplicas": 1, "updatedReplicas": 2}
    _reconcile(client, client.objects[("rljobs", "rl", "job")])
    engines = _condition(client, "EnginesReady")
    assert (engines["status"], engines["message"]) == ("False", "1/2 engine replicas ready")
    lws["status"]["readyReplicas"] = 2  # groups, not pods: each group is a leader and a worker
    _reconcile(client, client.objects[("rljobs", "rl", "job")])
    assert _condition(client, "EnginesReady")["message"] == "2/2 engine replicas ready"


def test_a_rise_in_the_trainers_non_finite_steps_posts_one_warning_naming_the_step():
    """The trainer reports `nonFiniteSteps` in its progress; each rise is one Warning event naming the last such
    step. After an operator restart only a non-finite latest step is news (an older count is not repeated)."""
    client = FakeClient()
    client.put(_rljob())
    job = client.objects[("rljobs", "rl", "job")]

    def pass_with(reconciler: Reconciler, **progress: int) -> list[tuple[str, str, str]]:
        if progress:  # what the driver's report writes into the ConfigMap the first pass created
            report = client.objects[("configmaps", "rl", "job-progress")]
            report["data"] = {"progress": json.dumps(progress)}
        outcome = asyncio.run(reconciler.reconcile(copy.deepcopy(job)))
        return [(e.type, e.reason, e.message) for e in outcome.events if e.reason == "NonFiniteStep"]

    operator = Reconciler(client, clock=lambda: NOW)  # type: ignore[arg-type]
    assert pass_with(operator) == []
    assert pass_with(operator, step=3, nonFiniteSteps=0) == []
    ((kind, _, message),) = pass_with(operator, step=4, nonFiniteSteps=1, lastNonFiniteStep=4)
    assert kind == "Warning" and message.startswith("step 4: an update had a non-finite loss or gradient")
    assert "1 such step(s) so far, spec.algorithm.maxNonFiniteSteps 3 in a row fail the job" in message
    assert pass_with(operator, step=5, nonFiniteSteps=1, lastNonFiniteStep=4) == []

    restarted = Reconciler(client, clock=lambda: NOW)  # type: ignore[arg-type]
    assert pass_with(restarted, step=6, nonFiniteSteps=1, lastNonFiniteStep=4) == []
    ((_, _, message),) = pass_with(restarted, step=8, nonFiniteSteps=3, lastNonFiniteStep=8)
    assert message.startswith("step 8:") and "3 such step(s) so far" in message
    fresh = Reconciler(client, clock=lambda: NOW)  # type: ignore[arg-type]
    assert len(pass_with(fresh, step=8, nonFiniteSteps=3, lastNonFiniteStep=8)) == 1  # the latest step is the one


def test_a_status_writes_own_echo_arriving_before_its_answer_is_not_someone_elses():
    """The watch event of a status write can reach the operator before the write's response (the event loop runs
    the event handler while the write is awaited): that echo is the operator's own, not a foreign status to write
    back; a status no write of the operator's made still is."""
    seen: list[bool] = []

    class EchoFirst(FakeClient):
        reconciler: Reconciler | None = None

        async def merge_patch(self, kind: Kind, namespace: str | None, name: str, patch: dict[str, Any], **kw: Any):
            result = await super().merge_patch(kind, namespace, name, patch, **kw)
            self._rv += 1
            result["metadata"]["resourceVersion"] = str(self._rv)
            if kind.plural == "rljobs" and kw.get("subresource") == "status" and self.reconciler is not None:
                seen.append(self.reconciler.foreign_status(copy.deepcopy(result)))  # the echo, before the answer
            return result

    client = EchoFirst()
    client.put(_rljob())
    operator = Reconciler(client, clock=lambda: NOW)  # type: ignore[arg-type]
    client.reconciler = operator
    asyncio.run(operator.reconcile(copy.deepcopy(client.objects[("rljobs", "rl", "job")])))
    sts = client.objects[("statefulsets", "rl", "job-engine")]
    sts["status"] = {"replicas": 4, "readyReplicas": 4, "updatedReplicas": 4}  # the next status differs
    asyncio.run(operator.reconcile(copy.deepcopy(client.objects[("rljobs", "rl", "job")])))
    assert len(seen) == 2 and not any(seen)  # two writes, each echo the operator's own
    forged = copy.deepcopy(client.objects[("rljobs", "rl", "job")])
    forged["metadata"]["resourceVersion"] = str(client._rv + 1)
    forged["status"]["startTime"] = "2000-01-01T00:00:00Z"
    assert operator.foreign_status(forged)
