"""Gang admission by a real Kueue (v0.15, built from its Go module) on the real control plane.

The real kopf operator, Kueue with its webhooks, the StatefulSet controller, the scheduler, kwok's fake
GPU nodes (tainted nvidia.com/gpu) and KubeRay. Each test has its own ClusterQueue and LocalQueue, so
one test's quota never decides another's; the RLJobs are the Qwen3 example shrunk to 8 GPUs (one 4-GPU
engine replica and a 4-GPU trainer), requesting GPUs only so that the queues need no CPU quota.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from kopf.testing import KopfRunner
from kubecluster.controlplane import gpu_resource_flavor
from operator_harness import Cluster, condition, example, paths, running_operator, wait_condition, wait_for

NS = "rl-kueue"
KUEUE = "/apis/kueue.x-k8s.io/v1beta1"
GPU = "nvidia.com/gpu"


@pytest.fixture(scope="module")
def operator(cluster: Cluster) -> Iterator[KopfRunner]:
    cluster.api.start_kueue()
    flavor = gpu_resource_flavor()
    cluster.apply(flavor)
    for name, value in (("rl-low", 10), ("rl-high", 1000)):
        cluster.apply(
            {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": name}, "value": value}
        )
    with running_operator(cluster, NS) as runner:
        yield runner


def _queue(cluster: Cluster, name: str, gpus: int) -> str:
    """A ClusterQueue of `gpus` GPUs that preempts lower priorities, and a LocalQueue `name` in NS for it."""
    cluster.apply(_cluster_queue(name, gpus))
    cluster.apply(
        {
            "apiVersion": "kueue.x-k8s.io/v1beta1",
            "kind": "LocalQueue",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"clusterQueue": name},
        }
    )
    return name


def _cluster_queue(name: str, gpus: int) -> dict[str, Any]:
    quota = [{"name": GPU, "nominalQuota": gpus}]
    return {
        "apiVersion": "kueue.x-k8s.io/v1beta1",
        "kind": "ClusterQueue",
        "metadata": {"name": name},
        "spec": {
            "namespaceSelector": {},
            "preemption": {"withinClusterQueue": "LowerPriority"},
            "resourceGroups": [{"coveredResources": [GPU], "flavors": [{"name": "h100", "resources": quota}]}],
        },
    }


def _job(name: str, queue: str, **edits: Any) -> dict[str, Any]:
    """8 GPUs: one engine replica of TP2 x DP2 and one 4-GPU trainer node; GPUs are all it requests."""
    return example(
        name,
        NS,
        **{
            "queueName": queue,
            "inference.replicas": 1,
            "inference.resources": {},
            "trainer.nodes": 1,
            "trainer.gpusPerNode": 4,
            **edits,
        },
    )


def _workload(cluster: Cluster, job: str) -> dict[str, Any] | None:
    return cluster.get(f"{KUEUE}/namespaces/{NS}/workloads/{job}-workload")


def _fetch_job(cluster: Cluster, job: str) -> dict[str, Any]:
    found = cluster.get(f"/apis/batch/v1/namespaces/{NS}/jobs/{job}-model-fetch")
    assert found is not None, f"{job}-model-fetch"
    return found


def _cond(cluster: Cluster, job: str, ctype: str, status: str, reason: str | None = None) -> dict[str, Any]:
    return wait_condition(cluster, NS, job, ctype, status, reason)


def _says(cluster: Cluster, job: str, ctype: str, reason: str, text: str) -> dict[str, Any]:
    """Wait until condition `ctype` has `reason` and a message containing `text` (Kueue's verdict arrives later)."""

    def check() -> dict[str, Any] | None:
        cond = condition(cluster.get(paths(NS, job)["rljob"]), ctype)
        return cond if cond and cond["reason"] == reason and text in cond["message"] else None

    return wait_for(check, what=f"{job} {ctype} {reason} saying {text!r}")


def _running(cluster: Cluster, job: str) -> bool:
    sts, ray = cluster.get(paths(NS, job)["sts"]), cluster.get(paths(NS, job)["rayjob"])
    return bool(sts and ray and sts["spec"]["replicas"] == 1 and ray["spec"]["suspend"] is False)


def _held(cluster: Cluster, job: str) -> bool:
    sts, ray = cluster.get(paths(NS, job)["sts"]), cluster.get(paths(NS, job)["rayjob"])
    return bool(sts and ray and sts["spec"]["replicas"] == 0 and ray["spec"]["suspend"] is True)


def test_job_waits_for_quota_suspended_then_runs_when_admitted(cluster: Cluster, operator: KopfRunner):
    queue = _queue(cluster, "q-exhausted", gpus=4)  # the job needs 8
    job = "queued"
    cluster.apply(_job(job, queue))

    admitted = _says(cluster, job, "Admitted", "WaitingForAdmission", "insufficient")
    assert admitted["status"] == "False" and GPU in admitted["message"], admitted["message"]
    assert wait_for(lambda: _held(cluster, job), what="engines at 0 and the RayJob suspended")
    assert _cond(cluster, job, "Suspended", "True", "WaitingForAdmission")
    assert _says(cluster, job, "Ready", "WaitingForAdmission", "insufficient")["status"] == "False"
    workload = _workload(cluster, job)
    assert workload is not None and workload["spec"]["queueName"] == queue
    assert workload["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == queue
    # One unit: the engine pods and the trainer's head are pod sets of one Workload.
    assert {(p["name"], p["count"]) for p in workload["spec"]["podSets"]} == {("engine", 1), ("trainer-head", 1)}
    assert not [
        p
        for p in cluster.get(f"/api/v1/namespaces/{NS}/pods")["items"]
        if p["metadata"]["labels"].get("r3operator.io/job") == job
    ]
    # The model fetch is gated like the rest: its Job waits suspended, no fetch pod runs outside the quota.
    assert _fetch_job(cluster, job)["spec"]["suspend"] is True

    # The queue grows: Kueue admits the whole job and the operator starts engines and trainer together.
    cluster.apply(_cluster_queue(queue, gpus=8))
    _cond(cluster, job, "Admitted", "True", "Admitted")
    assert wait_for(lambda: _running(cluster, job), what="engines and trainer started")
    assert condition(_fetch_job(cluster, job), "Complete")  # the cache filled first, after admission
    _cond(cluster, job, "Suspended", "False", "Active")
    # The engine pods land on the tainted fake GPU nodes (the default toleration, and Kueue's flavor).
    pods = wait_for(
        lambda: [
            p
            for p in cluster.get(f"/api/v1/namespaces/{NS}/pods")["items"]
            if p["metadata"]["labels"].get("r3operator.io/job") == job
            and p["spec"].get("nodeName")
            and p["metadata"]["labels"].get("r3operator.io/role") == "engine"
        ],
        what="scheduled engine pods",
    )
    assert all(p["spec"]["nodeName"].startswith("gpu-node-") for p in pods)


def test_preempted_job_is_suspended_requeued_and_resumed(cluster: Cluster, operator: KopfRunner):
    queue = _queue(cluster, "q-preempt", gpus=8)  # room for one job
    low, high = "low-prio", "high-prio"
    cluster.apply(_job(low, queue, podTemplate={"priorityClassName": "rl-low"}))
    _cond(cluster, low, "Admitted", "True", "Admitted")
    assert wait_for(lambda: _running(cluster, low), what=f"{low} running")
    assert _workload(cluster, low)["spec"]["priority"] == 10

    cluster.apply(_job(high, queue, podTemplate={"priorityClassName": "rl-high"}))
    _says(cluster, low, "Admitted", "Evicted", "Preempted")
    assert wait_for(lambda: _held(cluster, low), what=f"{low} suspended")
    _cond(cluster, low, "Suspended", "True")
    # The operator hands the quota back once nothing of the low job runs: Kueue admits the high one.
    _cond(cluster, high, "Admitted", "True", "Admitted")
    assert wait_for(lambda: _running(cluster, high), what=f"{high} running")
    requeued = condition(_workload(cluster, low), "Requeued")
    assert requeued is not None and requeued["status"] == "True", requeued
    _cond(cluster, low, "Admitted", "False", "WaitingForAdmission")

    # The high job leaves: Kueue re-admits the low one, which resumes.
    cluster.kubectl("delete", "rljob", high, "-n", NS, "--wait=false")
    _cond(cluster, low, "Admitted", "True", "Admitted")
    assert wait_for(lambda: _running(cluster, low), what=f"{low} resumed", timeout=60)
    _cond(cluster, low, "Suspended", "False", "Active")


def test_missing_priority_class_is_valid_false_and_nothing_is_created(cluster: Cluster, operator: KopfRunner):
    queue = _queue(cluster, "q-refs", gpus=8)
    job = "no-prio"
    cluster.apply(_job(job, queue, podTemplate={"priorityClassName": "does-not-exist"}))
    valid = _cond(cluster, job, "Valid", "False", "ReferenceNotFound")
    assert "PriorityClass/does-not-exist" in valid["message"], valid["message"]
    assert _workload(cluster, job) is None
    assert cluster.get(paths(NS, job)["sts"]) is None and cluster.get(paths(NS, job)["rayjob"]) is None


def _fetch_pods(cluster: Cluster, job: str) -> list[dict[str, Any]]:
    selector = f"job-name={job}-model-fetch"
    return cluster.get(f"/api/v1/namespaces/{NS}/pods?labelSelector={selector}")["items"]


def test_an_eviction_during_the_model_fetch_stops_the_fetch_before_the_quota_is_released(
    cluster: Cluster, operator: KopfRunner
):
    queue = _queue(cluster, "q-fetch", gpus=8)  # room for one job
    low, high = "fetch-low", "fetch-high"
    # kwok (the nodes' kubelet) paused: the fetch pod neither completes nor, once deleted, goes away.
    with cluster.api.paused("kwok"):
        cluster.apply(_job(low, queue, podTemplate={"priorityClassName": "rl-low"}))
        _cond(cluster, low, "Admitted", "True", "Admitted")
        wait_for(lambda: _fetch_pods(cluster, low), what=f"{low}'s fetch pod")
        assert _held(cluster, low)  # engines and trainer wait for the cache
        cluster.apply(_job(high, queue, podTemplate={"priorityClassName": "rl-high"}))
        _says(cluster, low, "Admitted", "Evicted", "Preempted")
        wait_for(lambda: _fetch_job(cluster, low)["spec"]["suspend"] is True, what=f"{low}'s fetch suspended")
        wait_for(
            lambda: all(p["metadata"].get("deletionTimestamp") for p in _fetch_pods(cluster, low)),
            what="the fetch pod deleted by the Job controller",
        )
        # Its pod is still there (terminating): the operator keeps the quota, the preemptor waits.
        assert condition(_workload(cluster, low), "QuotaReserved")["status"] == "True"
        assert cluster.get(paths(NS, high)["sts"])["spec"]["replicas"] == 0
    # The pod goes: the quota is released, the preemptor admitted, and the evicted job queued again.
    _cond(cluster, high, "Admitted", "True", "Admitted")
    assert wait_for(lambda: not _fetch_pods(cluster, low), what=f"{low}'s fetch pod gone")
    _cond(cluster, low, "Admitted", "False", "WaitingForAdmission")
    assert _fetch_job(cluster, low)["spec"]["suspend"] is True
