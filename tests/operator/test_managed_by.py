"""spec.managedBy against the in-memory client (operator/managed_by.py): MultiKueue's manager side gets its Workload
and nothing else, no status write; another controller's job gets nothing; a worker's copy runs on the Workload
MultiKueue made for it, which it does not own, and hands it Finished at the end."""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

from test_reconcile import FakeClient, _rljob

from r3operator.operator.reconcile import Reconciler

NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
MULTIKUEUE = "kueue.x-k8s.io/multikueue"


class KueueClient(FakeClient):
    async def serves(self, group_version: str, plural: str) -> bool:
        return plural in ("rayjobs", "workloads")


def _pass(reconciler: Reconciler, client: FakeClient) -> Any:
    client.writes.clear()
    return asyncio.run(reconciler.reconcile(client.objects[("rljobs", "rl", "job")]))


def test_the_manager_side_gets_its_workload_and_nothing_else() -> None:
    client = KueueClient()
    client.put(_rljob(managedBy=MULTIKUEUE, queueName="gpu"))
    reconciler = Reconciler(client, clock=lambda: NOW)  # type: ignore[arg-type]
    outcome = _pass(reconciler, client)
    assert client.writes == [("apply", "Workload", "job-workload")]
    workload = client.objects[("workloads", "rl", "job-workload")]
    [owner] = workload["metadata"]["ownerReferences"]
    # What MultiKueue's adapter looks the job up by: the Workload's controller.
    assert (owner["apiVersion"], owner["kind"], owner["name"], owner["controller"]) == (
        "r3operator.io/v1alpha1",
        "RLJob",
        "job",
        True,
    )
    assert workload["spec"]["queueName"] == "gpu" and workload["spec"]["podSets"]
    assert outcome.events == [] and "status" not in client.objects[("rljobs", "rl", "job")]
    assert _pass(reconciler, client).events == [] and client.writes == []  # at rest: nothing


def test_a_job_another_controller_manages_is_left_alone() -> None:
    client = KueueClient()
    client.put(_rljob(managedBy="example.com/batch-controller", queueName="gpu"))
    outcome = _pass(Reconciler(client, clock=lambda: NOW), client)  # type: ignore[arg-type]
    assert client.writes == [] and outcome.events == []


def test_a_manager_side_job_that_breaks_a_rule_gets_no_workload_and_one_warning() -> None:
    client = KueueClient()
    client.put(_rljob(managedBy=MULTIKUEUE, queueName="gpu", **{"inference.image": "vllm/vllm-openai:v0.13.0"}))
    reconciler = Reconciler(client, clock=lambda: NOW)  # type: ignore[arg-type]
    outcome = _pass(reconciler, client)
    assert client.writes == []
    [event] = outcome.events
    assert (event.type, event.reason) == ("Warning", "IncompatibleSettings") and "R3-VLLM-MIN-VERSION" in event.message
    assert _pass(reconciler, client).events == []  # said once


def _prebuilt(name: str, *, admitted: bool) -> dict[str, Any]:
    conditions = []
    if admitted:
        stamp = "2026-01-01T00:00:00Z"
        conditions = [
            {"type": t, "status": "True", "reason": t, "message": "", "lastTransitionTime": stamp}
            for t in ("QuotaReserved", "Admitted")
        ]
    return {
        "apiVersion": "kueue.x-k8s.io/v1beta1",
        "kind": "Workload",
        "metadata": {"name": name, "namespace": "rl", "labels": {"kueue.x-k8s.io/multikueue-origin": "manager"}},
        "spec": {"queueName": "gpu", "podSets": []},
        "status": {"conditions": conditions, "admission": {"clusterQueue": "worker-cq"} if admitted else None},
    }


def test_the_workers_copy_runs_on_the_workload_multikueue_made_and_finishes_it() -> None:
    client = KueueClient()
    job = _rljob(queueName="gpu", **{"model.uri": "pvc://models/qwen3"})  # nothing to fetch first
    job["metadata"]["labels"] = {"kueue.x-k8s.io/prebuilt-workload-name": "job-workload-dispatched"}
    client.put(job)
    client.put({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "models", "namespace": "rl"}})
    client.put(_prebuilt("job-workload-dispatched", admitted=True))
    reconciler = Reconciler(client, clock=lambda: NOW)  # type: ignore[arg-type]
    _pass(reconciler, client)
    written = {(w[1], w[2]) for w in client.writes if w[0] == "apply"}
    assert ("StatefulSet", "job-engine") in written and ("RayJob", "job-trainer") in written
    assert not [w for w in written if w[0] == "Workload"]  # no Workload of its own
    assert ("workloads", "rl", "job-workload") not in client.objects
    admitted = next(
        c for c in client.objects[("rljobs", "rl", "job")]["status"]["conditions"] if c["type"] == "Admitted"
    )
    assert (admitted["status"], admitted["reason"]) == ("True", "Admitted") and "worker-cq" in admitted["message"]
    ray = client.objects[("rayjobs", "rl", "job-trainer")]
    assert ray["spec"]["suspend"] is False

    ray["status"] = {"jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED", "endTime": "2025-12-31T23:00:00Z"}
    _pass(reconciler, client)
    assert ("patch/status", "workloads", "job-workload-dispatched") in client.writes
    finished = client.objects[("workloads", "rl", "job-workload-dispatched")]["status"]["conditions"]
    assert any(c["type"] == "Finished" and c["status"] == "True" for c in finished)  # what MultiKueue carries back
    assert ("workloads", "rl", "job-workload-dispatched") in client.objects  # never deleted: not the job's own


def test_a_workers_copy_waits_while_its_workload_is_not_admitted() -> None:
    client = KueueClient()
    job = _rljob(queueName="gpu")
    job["metadata"]["labels"] = {"kueue.x-k8s.io/prebuilt-workload-name": "job-workload"}
    client.put(job)
    client.put(_prebuilt("job-workload", admitted=False))
    _pass(Reconciler(client, clock=lambda: NOW), client)  # type: ignore[arg-type]
    assert client.objects[("rayjobs", "rl", "job-trainer")]["spec"]["suspend"] is True
    assert not [w for w in client.writes if w[1] == "Workload"]
