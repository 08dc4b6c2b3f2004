"""Multi-node engine replicas on the real control plane: LeaderWorkerSet v0.7 (built from its Go module, with
its webhooks), Kueue, kwok's fake 8-GPU nodes (tainted nvidia.com/gpu) and the real kopf operator.

The engine replica is 16 GPUs (TP 4 x DP 4) on 8-GPU nodes: a LeaderWorkerSet group of a leader and one
``--headless`` worker, 8 GPUs each. The first test runs before the LWS CRD is installed in the session's control
plane (tests run in file order; no other module installs it).
"""

from __future__ import annotations

from typing import Any

from operator_harness import Cluster, condition, example, paths, running_operator, wait_condition, wait_for

LWS_CRD = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/leaderworkersets.leaderworkerset.x-k8s.io"
KUEUE = "/apis/kueue.x-k8s.io/v1beta1"
GPU = "nvidia.com/gpu"
TWO_NODE_REPLICA = {
    "inference.replicas": 1,
    "inference.tensorParallelSize": 4,
    "inference.dataParallelSize": 4,
    "inference.gpusPerNode": 8,
    "inference.resources": {},  # GPUs only: the queue needs no CPU quota
    "trainer.nodes": 1,
    "trainer.gpusPerNode": 4,
}


def _lws_path(ns: str, job: str) -> str:
    return f"/apis/leaderworkerset.x-k8s.io/v1/namespaces/{ns}/leaderworkersets/{job}-engine"


def _engine_pods(cluster: Cluster, ns: str, job: str) -> list[dict[str, Any]]:
    selector = f"r3operator.io/job={job},r3operator.io/role=engine"
    return cluster.get(f"/api/v1/namespaces/{ns}/pods?labelSelector={selector}")["items"]


def _cond(cluster: Cluster, ns: str, job: str, ctype: str, status: str, timeout: float) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        cond = condition(cluster.get(paths(ns, job)["rljob"]), ctype)
        return cond if cond and cond["status"] == status else None

    return wait_for(check, timeout=timeout, what=f"{job} {ctype}={status}")


def _env(pod: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in pod["spec"]["containers"][0].get("env") or []}


def test_without_leaderworkerset_a_multi_node_replica_is_valid_false_naming_the_rule(cluster: Cluster) -> None:
    assert cluster.get(LWS_CRD) is None, "LeaderWorkerSet is installed already: this test must run first"
    ns, job = "lws-missing", "wide"
    with running_operator(cluster, ns):
        cluster.apply(example(job, ns, **TWO_NODE_REPLICA))
        valid = wait_condition(cluster, ns, job, "Valid", "False", "IncompatibleSettings")
        assert valid["message"].startswith("ENGINE-LWS: "), valid["message"]
        assert "install LeaderWorkerSet" in valid["message"] and "2 pods" in valid["message"]
        assert cluster.get(paths(ns, job)["sts"]) is None and cluster.get(paths(ns, job)["rayjob"]) is None


def _queue(cluster: Cluster, ns: str, name: str, gpus: int) -> None:
    flavor = {
        "apiVersion": "kueue.x-k8s.io/v1beta1",
        "kind": "ResourceFlavor",
        "metadata": {"name": "h100"},
        "spec": {
            "nodeLabels": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
            "nodeTaints": [{"key": GPU, "value": "present", "effect": "NoSchedule"}],
        },
    }
    quota = [{"name": GPU, "nominalQuota": gpus}]
    cluster_queue = {
        "apiVersion": "kueue.x-k8s.io/v1beta1",
        "kind": "ClusterQueue",
        "metadata": {"name": name},
        "spec": {
            "namespaceSelector": {},
            "resourceGroups": [{"coveredResources": [GPU], "flavors": [{"name": "h100", "resources": quota}]}],
        },
    }
    cluster.apply(flavor)
    cluster.apply(cluster_queue)
    cluster.apply({"apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "LocalQueue",
                   "metadata": {"name": name, "namespace": ns}, "spec": {"clusterQueue": name}})  # fmt: skip


def test_a_multi_node_replica_is_a_leader_worker_set_gang_admitted_by_kueue_on_separate_gpu_nodes(
    cluster: Cluster,
) -> None:
    cluster.api.start_kueue()
    cluster.api.start_lws()
    ns, job, queue = "lws-queued", "wide", "q-lws"
    cluster.namespace(ns)
    _queue(cluster, ns, queue, gpus=16)  # the job needs 20: 2 engine pods x 8 + the 4-GPU trainer
    with running_operator(cluster, ns):
        cluster.apply(example(job, ns, queueName=queue, **TWO_NODE_REPLICA))
        admitted = wait_condition(cluster, ns, job, "Admitted", "False", "WaitingForAdmission")
        workload = wait_for(lambda: cluster.get(f"{KUEUE}/namespaces/{ns}/workloads/{job}-workload"),
                            what="the Workload")  # fmt: skip
        # Gang admission covers the whole group: the leader and the worker are pod sets of the job's Workload.
        counts = {(p["name"], p["count"]) for p in workload["spec"]["podSets"]}
        assert counts == {("engine-leaders", 1), ("engine-workers", 1), ("trainer-head", 1)}, admitted
        lws = wait_for(lambda: cluster.get(_lws_path(ns, job)), what="the LeaderWorkerSet")
        assert lws["spec"]["replicas"] == 0 and lws["spec"]["leaderWorkerTemplate"]["size"] == 2
        assert not _engine_pods(cluster, ns, job)

        _queue(cluster, ns, queue, gpus=24)
        _cond(cluster, ns, job, "Admitted", "True", timeout=60)
        pods = wait_for(
            lambda: (found := [p for p in _engine_pods(cluster, ns, job) if p["spec"].get("nodeName")])
            and len(found) == 2 and found,
            timeout=90,
            what="the LWS controller's leader and worker pods, scheduled",
        )  # fmt: skip
        by_name = {p["metadata"]["name"]: p for p in pods}
        leader, worker = by_name[f"{job}-engine-0"], by_name[f"{job}-engine-0-1"]
        # 8 GPUs each on 8-GPU nodes: one pod a node, both on the tainted fake GPU nodes.
        assert leader["spec"]["nodeName"] != worker["spec"]["nodeName"]
        assert all(p["spec"]["nodeName"].startswith("gpu-node-") for p in pods)
        assert {p["spec"]["containers"][0]["resources"]["limits"][GPU] for p in pods} == {"8"}
        # LWS's webhook gave every pod the leader's address under the job's engine Service and its index.
        address = f"{job}-engine-0.{job}-engine.{ns}"
        assert (_env(leader)["LWS_LEADER_ADDRESS"], _env(leader)["LWS_WORKER_INDEX"]) == (address, "0")
        assert (_env(worker)["LWS_LEADER_ADDRESS"], _env(worker)["LWS_WORKER_INDEX"]) == (address, "1")
        assert leader["spec"]["subdomain"] == f"{job}-engine"
        assert "--headless" in worker["spec"]["containers"][0]["command"][2]
        assert "--headless" not in leader["spec"]["containers"][0]["command"][2]
        ready = _cond(cluster, ns, job, "EnginesReady", "True", timeout=90)
        assert ready["message"] == "1/1 engine replicas ready"
        assert condition(cluster.get(paths(ns, job)["rljob"]), "Valid")["status"] == "True"
