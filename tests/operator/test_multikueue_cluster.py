"""MultiKueue on two real control planes: the session's (the manager) and one of this module's own (the worker), each
with its own kube-apiserver, controllers, kwok GPU nodes, KubeRay, Kueue v0.15 and r3operator operator process. The
manager's Kueue runs MultiKueue's generic adapter for RLJobs (`multiKueue.externalFrameworks`, tests/kubecluster) and
reaches the worker with a kubeconfig Secret, as a real MultiKueue setup does.

An RLJob applied on the manager with `spec.managedBy: kueue.x-k8s.io/multikueue` gets its Workload there and nothing
else; Kueue dispatches it, the worker runs it (engines, RayJob) on the Workload MultiKueue made, the worker's status
is mirrored into the manager's RLJob by Kueue, and the end travels back: Succeeded on the manager, the worker's copy
and its Workload removed."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubecluster.controlplane import ControlPlane, Fleet, binaries_dir, gpu_resource_flavor
from operator_harness import REPO, Cluster, OperatorProcess, condition, example, get_columns, paths, wait_for

from r3operator.operator.managed_by import MULTIKUEUE_ORIGIN_LABEL, PREBUILT_WORKLOAD_LABEL

NS = "rl-multikueue"
QUEUE = "mk-dispatch"
GPU = "nvidia.com/gpu"
KUEUE = "/apis/kueue.x-k8s.io/v1beta1"
MULTIKUEUE = "kueue.x-k8s.io/multikueue"
DISPATCH_S = 120.0
"""Two control planes' worth of controllers on a 2-core box: generous, a working chain takes seconds."""


def _cluster_queue(checks: list[str]) -> dict[str, Any]:
    quota = [{"name": GPU, "nominalQuota": 16}]
    spec: dict[str, Any] = {
        "namespaceSelector": {},
        "resourceGroups": [{"coveredResources": [GPU], "flavors": [{"name": "h100", "resources": quota}]}],
    }
    if checks:
        spec["admissionChecks"] = checks
    return {"apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "ClusterQueue", "metadata": {"name": QUEUE}, "spec": spec}


def _queues(cluster: Cluster, checks: list[str]) -> None:
    cluster.namespace(NS)
    cluster.apply(gpu_resource_flavor())
    cluster.apply(_cluster_queue(checks))
    local_queue = {"name": QUEUE, "namespace": NS}
    cluster.apply(
        {
            "apiVersion": "kueue.x-k8s.io/v1beta1",
            "kind": "LocalQueue",
            "metadata": local_queue,
            "spec": {"clusterQueue": QUEUE},
        }
    )


def _worker_kubeconfig(worker: ControlPlane) -> str:
    """What MultiKueue accepts: the server, the CA as data (no file paths) and a token (no token files, no exec)."""
    ca = base64.b64encode(Path(worker.ca).read_bytes()).decode()
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "worker", "cluster": {"server": worker.url, "certificate-authority-data": ca}}],
        "users": [{"name": "kueue", "user": {"token": worker.admin_token}}],
        "contexts": [{"name": "worker", "context": {"cluster": "worker", "user": "kueue"}}],
        "current-context": "worker",
    }
    return yaml.safe_dump(config)


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    plane = ControlPlane(
        tmp_path_factory.mktemp("worker-plane"), binaries_dir(), fleet=Fleet(nodes=2, cpu_nodes=1), with_kuberay=True
    )
    plane.start()
    try:
        cluster = Cluster(plane)
        cluster.kubectl("apply", "--server-side", "-f", str(REPO / "crds"))
        plane.wait_established("rljobs.r3operator.io")
        plane.start_kueue()
        _queues(cluster, checks=[])
        yield cluster
    finally:
        plane.stop()


@pytest.fixture(scope="module")
def manager(cluster: Cluster, worker: Cluster) -> Cluster:
    cluster.api.start_kueue()
    cluster.apply(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "mk-worker-kubeconfig", "namespace": "kueue-system"},
            "stringData": {"kubeconfig": _worker_kubeconfig(worker.api)},
        }
    )
    cluster.apply(
        {
            "apiVersion": "kueue.x-k8s.io/v1beta1",
            "kind": "MultiKueueCluster",
            "metadata": {"name": "mk-worker"},
            "spec": {"kubeConfig": {"locationType": "Secret", "location": "mk-worker-kubeconfig"}},
        }
    )
    mk_config = {"name": "mk-dispatch"}
    cluster.apply(
        {
            "apiVersion": "kueue.x-k8s.io/v1beta1",
            "kind": "MultiKueueConfig",
            "metadata": mk_config,
            "spec": {"clusters": ["mk-worker"]},
        }
    )
    parameters = {"apiGroup": "kueue.x-k8s.io", "kind": "MultiKueueConfig", "name": "mk-dispatch"}
    cluster.apply(
        {
            "apiVersion": "kueue.x-k8s.io/v1beta1",
            "kind": "AdmissionCheck",
            "metadata": {"name": "mk-dispatch"},
            "spec": {"controllerName": MULTIKUEUE, "parameters": parameters},
        }
    )
    _queues(cluster, checks=["mk-dispatch"])
    wait_for(
        lambda: condition(cluster.get("/apis/kueue.x-k8s.io/v1beta1/multikueueclusters/mk-worker"), "Active"),
        timeout=DISPATCH_S,
        what="the manager's Kueue connected to the worker",
    )
    return cluster


@pytest.fixture(scope="module")
def operators(manager: Cluster, worker: Cluster) -> Iterator[tuple[OperatorProcess, OperatorProcess]]:
    env = {"R3OPERATOR_RESYNC_SECONDS": "5", "R3OPERATOR_CANARY": "false"}
    on_manager = OperatorProcess(manager, NS, "--liveness", "", env=env)
    on_worker = OperatorProcess(worker, NS, "--liveness", "", env=env)
    yield on_manager, on_worker
    for op in (on_manager, on_worker):
        op.stop()
        assert "Traceback" not in op.log(), op.log()


def _is(cluster: Cluster, job: str, ctype: str, status: str) -> bool:
    found = condition(cluster.get(paths(NS, job)["rljob"]), ctype)
    return found is not None and found["status"] == status


def _statuses_agree(manager: Cluster, worker: Cluster, job: str) -> dict[str, Any] | None:
    mine = (manager.get(paths(NS, job)["rljob"]) or {}).get("status")
    theirs = (worker.get(paths(NS, job)["rljob"]) or {}).get("status")
    return mine if mine and mine == theirs else None


def test_multikueue_dispatches_an_rljob_to_the_worker_and_mirrors_its_status_back(
    manager: Cluster, worker: Cluster, operators: tuple[OperatorProcess, OperatorProcess]
) -> None:
    on_manager, on_worker = operators
    job = "dispatched"
    edits = {
        "queueName": QUEUE,
        "managedBy": MULTIKUEUE,
        "inference.replicas": 1,
        "inference.resources": {},
        "trainer.nodes": 1,
        "trainer.gpusPerNode": 4,
    }
    manager.apply(example(job, NS, **edits))

    # The manager: its Workload, controlled by the RLJob, reserves quota and MultiKueue's check turns Ready.
    workload_path = f"{KUEUE}/namespaces/{NS}/workloads/{job}-workload"
    local = wait_for(
        lambda: (w := manager.get(workload_path)) and condition(w, "Admitted") and w,
        timeout=DISPATCH_S,
        what=f"the manager's Workload admitted\n{on_manager.log(20)}",
    )
    [check] = local["status"]["admissionChecks"]
    assert (check["name"], check["state"]) == ("mk-dispatch", "Ready") and "mk-worker" in check["message"]
    [owner] = local["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["controller"]) == ("RLJob", job, True)

    # The worker: a copy without managedBy, on the Workload MultiKueue made, runs as any RLJob does.
    copy = wait_for(lambda: worker.get(paths(NS, job)["rljob"]), timeout=DISPATCH_S, what="the worker's copy")
    assert "managedBy" not in copy["spec"]
    assert copy["metadata"]["labels"][PREBUILT_WORKLOAD_LABEL] == f"{job}-workload"
    assert copy["metadata"]["labels"][MULTIKUEUE_ORIGIN_LABEL]
    wait_for(
        lambda: _is(worker, job, "TrainerReady", "True"),
        timeout=DISPATCH_S,
        what=f"the worker's trainer running\n{on_worker.log(30)}",
    )
    admitted = condition(worker.get(paths(NS, job)["rljob"]), "Admitted")
    assert admitted is not None and (admitted["status"], admitted["reason"]) == ("True", "Admitted")
    workloads = (worker.get(f"{KUEUE}/namespaces/{NS}/workloads") or {}).get("items") or []
    assert [w["metadata"]["name"] for w in workloads] == [f"{job}-workload"]  # MultiKueue's; none of the operator's
    assert worker.get(paths(NS, job)["sts"]) is not None and worker.get(paths(NS, job)["rayjob"]) is not None

    # Back on the manager: Kueue copies the worker's status whole; the manager's operator made nothing but the Workload.
    mirrored = wait_for(
        lambda: _statuses_agree(manager, worker, job), timeout=DISPATCH_S, what="the worker's status on the manager"
    )
    assert _is(manager, job, "TrainerReady", "True")
    for key in ("sts", "rayjob", "cm", "pvc", "sa"):
        assert manager.get(paths(NS, job)[key]) is None, key
    assert get_columns(manager, NS, job)["ENGINES"] == mirrored["enginesReady"]  # kubectl get shows the worker's job
    rljob_status = f"/apis/r3operator.io/v1alpha1/namespaces/{NS}/rljobs/{job}/status"
    ours = [r for r in manager.requests() if r.path == rljob_status and r.user_agent.startswith("r3operator/")]
    assert ours == []  # the status is Kueue's copy of the worker's, never the manager's operator's

    # The end: the worker's trainer finishes (KubeRay paused, the test writes what it writes), the worker's operator
    # marks the Workload Finished, MultiKueue carries the end and the last status back and removes the worker's copy.
    with worker.api.paused("kuberay-operator"):
        worker.patch_status(paths(NS, job)["rayjob"], {"jobStatus": "SUCCEEDED", "jobDeploymentStatus": "Complete"})
        wait_for(
            lambda: _is(manager, job, "Succeeded", "True"),
            timeout=DISPATCH_S,
            what=f"Succeeded on the manager\n{on_worker.log(20)}",
        )
    wait_for(lambda: condition(manager.get(workload_path), "Finished"), timeout=DISPATCH_S, what="manager Finished")
    wait_for(lambda: worker.get(paths(NS, job)["rljob"]) is None, timeout=DISPATCH_S, what="the worker's copy removed")
    assert manager.get(paths(NS, job)["rljob"])["spec"]["managedBy"] == MULTIKUEUE  # the manager's stays as applied
