"""Job lifecycles that need the real controllers: KubeRay running our RayJob to failure, the garbage
collector removing an RLJob's children, an apiserver restart under a running operator."""

from __future__ import annotations

from typing import Any

from operator_harness import Cluster, condition, example, paths, running_operator, wait_for

FAIL_NS = "kwok-fail-jobs"  # kwok fails every Job-owned pod here (tests/kubecluster/kwok-stages.yaml)


def small(name: str, namespace: str, **edits: Any) -> dict[str, Any]:
    """The Qwen3 example at 1 engine GPU + 1 trainer GPU, so many fit the fake fleet."""
    return example(
        name,
        namespace,
        **{
            "inference.replicas": 1,
            "inference.tensorParallelSize": 1,
            "inference.dataParallelSize": 1,
            "inference.dataParallelSizeLocal": 1,
            "inference.enableExpertParallel": False,
            "trainer.nodes": 1,
            "trainer.gpusPerNode": 1,
            **edits,
        },
    )


def _cond(cluster: Cluster, ns: str, job: str, ctype: str, status: str, timeout: float = 30.0) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        cond = condition(cluster.get(paths(ns, job)["rljob"]), ctype)
        return cond if cond and cond["status"] == status else None

    return wait_for(check, timeout=timeout, what=f"{job} {ctype}={status}")


def test_kuberay_runs_the_trainer_and_its_failure_fails_the_rljob(cluster: Cluster) -> None:
    job = "fails"
    with running_operator(cluster, FAIL_NS):
        # A model in the image: kwok would fail the model-fetch Job's pod here too, and the trainer would wait.
        in_image = {"model.uri": "file:///models/Qwen3-30B-A3B", "model.revision": None}
        cluster.apply(small(job, FAIL_NS, **{"runPolicy.backoffLimit": 0}, **in_image))
        # KubeRay turns our RayJob into a RayCluster whose head pod kwok runs on a GPU node.
        def ray_cluster_seen() -> str | None:
            rayjob = cluster.get(paths(FAIL_NS, job)["rayjob"]) or {}
            status = rayjob.get("status", {})
            name = status.get("rayClusterName")
            if not name:
                return None
            if cluster.get(f"/apis/ray.io/v1/namespaces/{FAIL_NS}/rayclusters/{name}") is not None:
                return str(name)
            # On a busy machine the job can fail before this look: KubeRay then deletes the finished job's
            # RayCluster (shutdownAfterJobFinishes), and a failed deployment shows that it had one.
            return str(name) if status.get("jobDeploymentStatus") == "Failed" else None

        wait_for(ray_cluster_seen, timeout=60, what="KubeRay's RayCluster for the RayJob")
        # The submitter Job's pods exit 1 (kwok, this namespace): KubeRay fails the RayJob, we fail the RLJob.
        failed = _cond(cluster, FAIL_NS, job, "Failed", "True", timeout=180)
        assert failed["reason"] == "TrainerFailed"
        rayjob = cluster.get(paths(FAIL_NS, job)["rayjob"])
        assert rayjob["status"]["jobDeploymentStatus"] == "Failed"
        assert condition(cluster.get(paths(FAIL_NS, job)["rljob"]), "Succeeded")["status"] == "False"


def test_deleting_an_rljob_lets_the_garbage_collector_remove_its_children(cluster: Cluster) -> None:
    ns, job = "gc", "collected"
    with running_operator(cluster, ns):
        cluster.apply(small(job, ns, **{"storage.retainPolicy": "Delete"}))
        owned = {key: path for key, path in paths(ns, job).items() if key != "rljob"}
        wait_for(lambda: all(cluster.get(p) for p in owned.values()), timeout=60, what="children")
        wait_for(lambda: _engine_pods(cluster, ns, job), timeout=60, what="engine pod")
        cluster.kubectl("delete", "rlj", job, "-n", ns, "--wait=false")
        # Background propagation: the real garbage collector deletes every owned child, then the pods.
        wait_for(lambda: not any(cluster.get(p) for p in owned.values()), timeout=90, what="children collected")
        wait_for(lambda: not _engine_pods(cluster, ns, job), timeout=60, what="engine pods collected")


def test_operator_rides_out_an_apiserver_restart(cluster: Cluster) -> None:
    ns = "restart"
    with running_operator(cluster, ns):
        cluster.apply(small("before", ns))
        wait_for(lambda: cluster.get(paths(ns, "before")["sts"]), timeout=60, what="children before the restart")
        # Every watch breaks and every request fails until the apiserver is back; the operator reconnects.
        cluster.api.restart_apiserver()
        cluster.apply(small("after", ns))
        kids = {key: p for key, p in paths(ns, "after").items() if key != "rljob"}
        wait_for(lambda: all(cluster.get(p) for p in kids.values()), timeout=120, what="children after the restart")
        _cond(cluster, ns, "after", "Valid", "True", timeout=60)


def _engine_pods(cluster: Cluster, ns: str, job: str) -> list[dict[str, Any]]:
    selector = f"r3operator.io/job={job},r3operator.io/role=engine"
    return cluster.get(f"/api/v1/namespaces/{ns}/pods?labelSelector={selector}")["items"]


def test_a_job_larger_than_the_fleet_stays_pending_and_says_why(cluster: Cluster) -> None:
    ns, job = "too-big", "greedy"
    # 16 GPUs per engine pod (TP 8 × DP 2 on one node, declared as a 16-GPU node): the fleet's nodes have 8.
    edits = {
        "inference.tensorParallelSize": 8,
        "inference.dataParallelSize": 2,
        "inference.dataParallelSizeLocal": 2,
        "inference.gpusPerNode": 16,
        "inference.replicas": 1,
    }
    with running_operator(cluster, ns):
        cluster.apply(example(job, ns, **edits))
        cond = wait_for(
            lambda: (c := condition(cluster.get(paths(ns, job)["rljob"]), "EnginesReady"))
            and c["reason"] == "Unschedulable"
            and "Insufficient nvidia.com/gpu" in c["message"]  # first the volume may not be bound yet
            and c,
            timeout=90,
            what="EnginesReady=False Unschedulable for want of GPUs",
        )
        assert cond["message"].startswith("engine pods cannot be scheduled: 1 pod: 0/")
        ready = condition(cluster.get(paths(ns, job)["rljob"]), "Ready")
        assert ready["status"] == "False"


def test_engine_and_trainer_pods_are_admitted_under_the_restricted_pod_security_level(cluster: Cluster) -> None:
    ns, job = "restricted", "locked-down"
    cluster.namespace(ns)
    cluster.kubectl("label", "namespace", ns, "pod-security.kubernetes.io/enforce=restricted", "--overwrite")
    bare = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "bare", "namespace": ns},
            "spec": {"containers": [{"name": "c", "image": "busybox"}]}}  # fmt: skip
    refused = cluster.apply(bare, check=False)
    assert refused.returncode != 0 and "violates PodSecurity" in refused.stderr  # enforcement is on
    with running_operator(cluster, ns):
        cluster.apply(small(job, ns))
        # The admission plugin refuses a non-compliant pod outright: pods that exist were admitted.
        wait_for(lambda: _engine_pods(cluster, ns, job), timeout=60, what="engine pod admitted")
        selector = f"r3operator.io/job={job},r3operator.io/role=trainer"
        wait_for(
            lambda: cluster.get(f"/api/v1/namespaces/{ns}/pods?labelSelector={selector}")["items"],
            timeout=90,
            what="KubeRay's trainer head pod admitted",
        )
