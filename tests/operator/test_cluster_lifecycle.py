"""Job lifecycles that need the real controllers: KubeRay running our RayJob to failure, the garbage
collector removing an RLJob's children, an apiserver restart under a running operator."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubecluster import __main__ as kubecluster_cli
from kubecluster.controlplane import KEEP_TRAINING_NAMESPACE, SUBMITTER_CONTAINER, kwok_stages
from operator_harness import Cluster, condition, example, paths, running_operator, wait_for

FAIL_NS = "kwok-fail-jobs"  # kwok fails every Job-owned pod here (tests/kubecluster/kwok-stages.yaml)
KUBERAY_SUBMITTER_GRACE_S = 30
"""KubeRay (v1.6) fails a RayJob this long after its submitter finished when no Ray dashboard reported the job."""


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


def _plain_job(name: str, namespace: str, container: str) -> dict[str, Any]:
    pod = {"restartPolicy": "Never", "containers": [{"name": container, "image": "busybox", "command": ["true"]}]}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"backoffLimit": 0, "template": {"spec": pod}},
    }


def _pod_of_job(cluster: Cluster, ns: str, job: str, phase: str) -> dict[str, Any] | None:
    pods = cluster.get(f"/api/v1/namespaces/{ns}/pods?labelSelector=job-name={job}")["items"]
    return pods[0] if pods and pods[0]["status"].get("phase") == phase else None


def test_on_kwok_the_trainer_keeps_running_only_where_a_test_opts_in(cluster: Cluster) -> None:
    # KubeRay fails a RayJob 30 s after its submitter finished if no Ray dashboard reported the job terminal;
    # kwok runs no dashboard, so a submitter that exits (kwok completes Job pods) fails the job ~2.5 min in.
    # In the opt-in namespace kwok keeps the submitter running, as `ray job submit` does while a job trains.
    ns, job = KEEP_TRAINING_NAMESPACE, "keeps-training"
    other = "default-submitters"
    cluster.namespace(other)
    with running_operator(cluster, ns):
        try:
            cluster.apply(small(job, ns, **{"model.uri": "file:///models/Qwen3-30B-A3B", "model.revision": None}))
            # Off (the session's default) elsewhere: a submitter container there completes at once, and in the
            # opt-in namespace every other Job pod completes too.
            cluster.apply(_plain_job("submitter-elsewhere", other, SUBMITTER_CONTAINER))
            cluster.apply(_plain_job("worker-here", ns, "worker"))
            _cond(cluster, ns, job, "TrainerReady", "True", timeout=90)
            pod = wait_for(
                lambda: _pod_of_job(cluster, ns, f"{job}-trainer", "Running"),
                timeout=60,
                what="KubeRay's submitter pod running",
            )
            assert pod["spec"]["containers"][0]["name"] == SUBMITTER_CONTAINER
            wait_for(
                lambda: _pod_of_job(cluster, other, "submitter-elsewhere", "Succeeded"),
                timeout=60,
                what="a submitter outside the opt-in namespace completed",
            )
            wait_for(
                lambda: _pod_of_job(cluster, ns, "worker-here", "Succeeded"),
                timeout=60,
                what="another Job's pod in the opt-in namespace completed",
            )
            # Past the point where a completed submitter would have failed the RayJob, all still runs.
            time.sleep(KUBERAY_SUBMITTER_GRACE_S + 5)
            assert _pod_of_job(cluster, ns, f"{job}-trainer", "Running") is not None
            submitter_job = cluster.get(f"/apis/batch/v1/namespaces/{ns}/jobs/{job}-trainer")
            assert not (submitter_job.get("status") or {}).get("completionTime")
            assert cluster.get(paths(ns, job)["rayjob"])["status"]["jobDeploymentStatus"] == "Running"
            rljob = cluster.get(paths(ns, job)["rljob"])
            assert condition(rljob, "TrainerReady")["status"] == "True"
            assert condition(rljob, "Failed") is None or condition(rljob, "Failed")["status"] != "True"
        finally:
            # A job that never ends holds its fake GPUs: give them back to the session's fleet.
            cluster.kubectl("delete", "rlj", job, "-n", ns, "--wait=false", check=False)


def _completes(stages: str, pod: dict[str, Any]) -> bool:
    """Whether the pod-complete stage's selector (In/NotIn on a namespace or the first container's name, the
    only expressions it uses on those) lets kwok complete this Job pod."""
    complete = next(s for s in yaml.safe_load_all(stages) if s["metadata"]["name"] == "pod-complete")
    values = {".metadata.namespace": pod["namespace"], ".spec.containers.[0].name": pod["container"]}
    for expression in complete["spec"]["selector"]["matchExpressions"]:
        if expression["key"] in values:
            inside = values[expression["key"]] in expression["values"]
            if inside != (expression["operator"] == "In"):
                return False
    return True


def test_a_persons_cluster_keeps_every_submitter_running_and_the_sessions_does_not(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    submitter = {"namespace": "rl", "container": SUBMITTER_CONTAINER}
    worker = {"namespace": "rl", "container": "fetch-model"}
    assert _completes(kwok_stages(keep_submitters_running=False), submitter)
    assert not _completes(kwok_stages(keep_submitters_running=True), submitter)
    assert _completes(kwok_stages(keep_submitters_running=True), worker)
    # `make cluster-up` (kubecluster up) turns it on; --complete-submitters gives the session's behaviour.
    seen: list[bool] = []
    monkeypatch.setattr(kubecluster_cli, "up", lambda *args: seen.append(args[-1]) or 0)
    assert kubecluster_cli.main(["up", "--dir", str(tmp_path)]) == 0
    assert kubecluster_cli.main(["up", "--dir", str(tmp_path), "--complete-submitters"]) == 0
    assert seen == [True, False]


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
            lambda: (
                (c := condition(cluster.get(paths(ns, job)["rljob"]), "EnginesReady"))
                and c["reason"] == "Unschedulable"
                and "Insufficient nvidia.com/gpu" in c["message"]  # first the volume may not be bound yet
                and c
            ),
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
    bare = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "bare", "namespace": ns},
        "spec": {"containers": [{"name": "c", "image": "busybox"}]},
    }
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
