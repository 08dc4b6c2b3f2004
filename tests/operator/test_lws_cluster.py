"""Multi-node engine replicas on the real control plane: LeaderWorkerSet v0.7 (built from its Go module, with
its webhooks), Kueue, kwok's fake 8-GPU nodes (tainted nvidia.com/gpu) and the real kopf operator.

The engine replica is 16 GPUs (TP 4 x DP 4) on 8-GPU nodes: a LeaderWorkerSet group of a leader and one
``--headless`` worker, 8 GPUs each. The first test runs before the LWS CRD is installed in the session's control
plane (tests run in file order; no other module installs it).
"""

from __future__ import annotations

from typing import Any

from canary_ending import canary_verdict, end_canary
from kubecluster.controlplane import gpu_resource_flavor
from operator_harness import Cluster, condition, example, paths, running_operator, wait_condition, wait_for

LWS_CRD = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/leaderworkersets.leaderworkerset.x-k8s.io"
KUEUE = "/apis/kueue.x-k8s.io/v1beta1"
GPU = "nvidia.com/gpu"
UPGRADE_NS = "lws-upgrade"
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
    flavor = gpu_resource_flavor()
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
    cluster.apply(
        {
            "apiVersion": "kueue.x-k8s.io/v1beta1",
            "kind": "LocalQueue",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"clusterQueue": name},
        }
    )


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
        workload = wait_for(
            lambda: cluster.get(f"{KUEUE}/namespaces/{ns}/workloads/{job}-workload"), what="the Workload"
        )
        # Gang admission covers the whole group: the leader and the worker are pod sets of the job's Workload.
        counts = {(p["name"], p["count"]) for p in workload["spec"]["podSets"]}
        assert counts == {("engine-leaders", 1), ("engine-workers", 1), ("trainer-head", 1)}, admitted
        lws = wait_for(lambda: cluster.get(_lws_path(ns, job)), what="the LeaderWorkerSet")
        assert lws["spec"]["replicas"] == 0 and lws["spec"]["leaderWorkerTemplate"]["size"] == 2
        assert not _engine_pods(cluster, ns, job)

        _queue(cluster, ns, queue, gpus=24)
        _cond(cluster, ns, job, "Admitted", "True", timeout=60)
        pods = wait_for(
            lambda: (
                (found := [p for p in _engine_pods(cluster, ns, job) if p["spec"].get("nodeName")])
                and len(found) == 2
                and found
            ),
            timeout=90,
            what="the LWS controller's leader and worker pods, scheduled",
        )
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
        assert "--headless" in worker["spec"]["containers"][0]["args"]
        assert "--headless" not in leader["spec"]["containers"][0]["args"]
        ready = _cond(cluster, ns, job, "EnginesReady", "True", timeout=90)
        assert ready["message"] == "1/1 engine replicas ready"
        assert condition(cluster.get(paths(ns, job)["rljob"]), "Valid")["status"] == "True"


def _pod_images(cluster: Cluster, ns: str, job: str) -> dict[str, str]:
    return {p["metadata"]["name"]: p["spec"]["containers"][0]["image"] for p in _engine_pods(cluster, ns, job)}


def _upgrade_phase(cluster: Cluster, ns: str, job: str, phase: str, timeout: float) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        upgrade = ((cluster.get(paths(ns, job)["rljob"]) or {}).get("status") or {}).get("upgrade") or {}
        return upgrade if upgrade.get("phase") == phase else None

    return wait_for(check, timeout=timeout, what=f"{job} upgrade phase {phase}")


def test_an_engine_upgrade_canaries_one_lws_group_behind_the_partition_then_rolls_every_group(cluster: Cluster) -> None:
    cluster.api.start_lws()
    ns, job = UPGRADE_NS, "wide-up"
    old, new = (f"ghcr.io/r3operator/engine:0.{i}.0-vllm0.22.1" for i in (1, 2))
    edits = {
        **TWO_NODE_REPLICA,
        "inference.replicas": 2,
        "inference.image": old,
        "upgradePolicy": {"timeoutSeconds": 600},
    }
    with running_operator(cluster, ns):
        cluster.apply(example(job, ns, **edits))
        _cond(cluster, ns, job, "EnginesReady", "True", timeout=120)
        cluster.kubectl(
            "-n", ns, "patch", "rlj", job, "--type=merge", "-p", f'{{"spec":{{"inference":{{"image":"{new}"}}}}}}'
        )
        upgrade = _upgrade_phase(cluster, ns, job, "Canary", timeout=60)
        lws = cluster.get(_lws_path(ns, job))
        assert lws["spec"]["replicas"] == 3
        assert lws["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"]["partition"] == 2
        # The LWS controller puts the surge group (index 2, leader and worker) on the new image and keeps
        # groups 0 and 1 where they are.
        want = {f"{job}-engine-{g}{w}": (new if g == 2 else old) for g in range(3) for w in ("", "-1")}
        assert wait_for(lambda: _pod_images(cluster, ns, job) == want, timeout=90, what="the canary group")
        canary = wait_for(
            lambda: cluster.get(f"/apis/batch/v1/namespaces/{ns}/jobs/{job}-upgrade-canary"), what="the canary Job"
        )
        args = canary["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--new") + 1].startswith(f"http://{job}-engine-2.{job}-engine.{ns}.svc")

        end_canary(cluster, UPGRADE_NS, job, canary_verdict(upgrade["attempt"], old, new))
        done = _upgrade_phase(cluster, ns, job, "Complete", timeout=180)
        assert done["replicasUpdated"] == 2
        every = {f"{job}-engine-{g}{w}": new for g in range(2) for w in ("", "-1")}
        assert wait_for(lambda: _pod_images(cluster, ns, job) == every, timeout=90, what="every group on the new image")
