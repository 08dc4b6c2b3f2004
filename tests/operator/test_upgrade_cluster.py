"""Engine image upgrades on the real control plane: the real kopf operator, the real StatefulSet and Job
controllers, kwok nodes. The canary Job's pod keeps running under kwok (tests/kubecluster/kwok-stages.yaml)
until the test plays its end: it annotates the pod with the verdict (`api.canary_verdict.termination_message`)
and kwok, as the kubelet would from /dev/termination-log, ends the container with it as the termination
message. Scoring real engines is in test_upgrade_canary_vllm.py; forged status in test_status_is_output_cluster.py.

- pass: one surge replica on the new image behind a partition, the canary Job; a passing verdict rolls
  every pod to the new image, `Complete`, the Job is deleted;
- fail + operator restart: a failing verdict written while the operator is down is found on restart; the
  engines go back to the old image, `UpgradeBlocked=True CanaryFailed` with the figures, one Event;
- a second image change supersedes the blocked attempt: a new attempt, the old verdict gone, a new Job;
- a surge replica that cannot be scheduled (no free GPU on its node): UpgradeBlocked=True CanaryUnschedulable
  at once, rolled back after upgradePolicy.startTimeoutSeconds, the surge pod and the canary Job gone.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

from canary_ending import canary_verdict, end_canary
from operator_harness import Cluster, condition, example, paths, running_operator, wait_condition, wait_for

NS = "upgrades"
OWN_NODE_TAINT = "r3operator.io/test-node"
OLD, NEW, BAD, NEWER = (f"ghcr.io/r3operator/engine:0.{i}.0-vllm0.22.1" for i in (1, 2, 3, 4))


def _job(name: str) -> dict[str, Any]:
    return example(
        name, NS, **{"inference.image": OLD, "inference.replicas": 2, "upgradePolicy": {"timeoutSeconds": 600}}
    )


def _pod_images(cluster: Cluster, job: str) -> dict[str, str]:
    pods = cluster.get(f"/api/v1/namespaces/{NS}/pods?labelSelector=r3operator.io/job={job},r3operator.io/role=engine")
    return {p["metadata"]["name"]: p["spec"]["containers"][0]["image"] for p in (pods or {}).get("items", [])}


def _upgrade(cluster: Cluster, job: str) -> dict[str, Any]:
    return ((cluster.get(paths(NS, job)["rljob"]) or {}).get("status") or {}).get("upgrade") or {}


def _wait_phase(cluster: Cluster, job: str, phase: str, timeout: float = 60.0) -> dict[str, Any]:
    return wait_for(
        lambda: (u := _upgrade(cluster, job)).get("phase") == phase and u,
        timeout=timeout,
        what=f"{job} upgrade phase {phase}",
    )


def _canary_job(cluster: Cluster, job: str) -> dict[str, Any] | None:
    return cluster.get(f"/apis/batch/v1/namespaces/{NS}/jobs/{job}-upgrade-canary")


def _set_image(cluster: Cluster, job: str, image: str) -> None:
    cluster.kubectl(
        "-n", NS, "patch", "rlj", job, "--type=merge", "-p", f'{{"spec":{{"inference":{{"image":"{image}"}}}}}}'
    )


def test_a_passing_canary_rolls_every_replica(cluster: Cluster) -> None:
    with running_operator(cluster, NS):
        cluster.apply(_job("up-pass"))
        wait_condition(cluster, NS, "up-pass", "EnginesReady", "True")
        _set_image(cluster, "up-pass", NEW)
        upgrade = _wait_phase(cluster, "up-pass", "Canary")
        assert (upgrade["from"], upgrade["to"]) == (OLD, NEW)
        sts = cluster.get(paths(NS, "up-pass")["sts"])
        assert sts["spec"]["replicas"] == 3 and sts["spec"]["updateStrategy"]["rollingUpdate"]["partition"] == 2
        images = wait_for(lambda: (i := _pod_images(cluster, "up-pass")) and len(i) == 3 and i, what="surge pod")
        assert images == {"up-pass-engine-0": OLD, "up-pass-engine-1": OLD, "up-pass-engine-2": NEW}
        job = wait_for(lambda: _canary_job(cluster, "up-pass"), what="canary Job")
        args = job["spec"]["template"]["spec"]["containers"][0]["args"]
        assert "up-pass-engine-2.up-pass-engine.upgrades.svc" in args[args.index("--new") + 1]
        assert job["spec"]["template"]["spec"]["serviceAccountName"] == "up-pass-trainer"
        wait_condition(cluster, NS, "up-pass", "EnginesReady", "True")  # the partition holds them on purpose

        ran = wait_for(lambda: _upgrade(cluster, "up-pass").get("canaryStartedAt"), what="the canary's clock")
        assert ran >= upgrade["startedAt"]
        end_canary(cluster, NS, "up-pass", canary_verdict(upgrade["attempt"], OLD, NEW))
        done = _wait_phase(cluster, "up-pass", "Complete", timeout=120)
        assert done["replicasUpdated"] == 2 and done["canary"]["passed"] is True
        assert wait_for(
            lambda: _pod_images(cluster, "up-pass") == {"up-pass-engine-0": NEW, "up-pass-engine-1": NEW},
            timeout=60,
            what="every engine pod on the new image",
        )
        wait_for(lambda: _canary_job(cluster, "up-pass") is None, what="canary Job deleted")
        blocked = condition(cluster.get(paths(NS, "up-pass")["rljob"]), "UpgradeBlocked")
        assert blocked is not None and (blocked["status"], blocked["reason"]) == ("False", "UpgradeComplete")
        printed = cluster.kubectl("-n", NS, "get", "rlj", "up-pass").stdout
        assert "UPGRADE" in printed and "Complete" in printed


def test_a_failing_canary_rolls_back_across_an_operator_restart_and_a_new_image_supersedes_it(cluster: Cluster) -> None:
    with running_operator(cluster, NS):
        cluster.apply(_job("up-fail"))
        wait_condition(cluster, NS, "up-fail", "EnginesReady", "True")
        _set_image(cluster, "up-fail", BAD)
        upgrade = _wait_phase(cluster, "up-fail", "Canary")
        wait_for(lambda: _canary_job(cluster, "up-fail"), what="canary Job")
    # The operator is down when the verdict arrives; the next one reads it from the pod, the upgrade's
    # state from the engine StatefulSet.
    end_canary(cluster, NS, "up-fail", canary_verdict(upgrade["attempt"], OLD, NEW, passed=False))
    with running_operator(cluster, NS):
        blocked = _wait_phase(cluster, "up-fail", "Blocked")
        assert OLD in blocked["message"] and "natural mismatch 0.09" in blocked["message"]
        cond = wait_condition(cluster, NS, "up-fail", "UpgradeBlocked", "True", "CanaryFailed")
        assert "r3operator.io/upgrade=force" in cond["message"]
        sts = cluster.get(paths(NS, "up-fail")["sts"])
        assert sts["spec"]["template"]["spec"]["containers"][0]["image"] == OLD and sts["spec"]["replicas"] == 2
        assert wait_for(
            lambda: _pod_images(cluster, "up-fail") == {"up-fail-engine-0": OLD, "up-fail-engine-1": OLD},
            what="surge pod gone, the others untouched",
        )
        assert cluster.get(paths(NS, "up-fail")["rljob"])["spec"]["inference"]["image"] == BAD  # the user's to change
        events = cluster.get(f"/api/v1/namespaces/{NS}/events")["items"]
        blocked = [
            e
            for e in events
            if e["involvedObject"]["name"] == "up-fail" and e["message"].startswith("UpgradeBlocked=True")
        ]
        assert [(e["type"], e["reason"]) for e in blocked] == [("Warning", "CanaryFailed")]

        _set_image(cluster, "up-fail", NEWER)
        retry = wait_for(
            lambda: (u := _upgrade(cluster, "up-fail")).get("to") == NEWER and u.get("phase") == "Canary" and u,
            what="a new attempt",
        )
        assert retry["from"] == OLD and retry["attempt"] != upgrade["attempt"] and "canary" not in retry
        job = wait_for(
            lambda: (
                (j := _canary_job(cluster, "up-fail"))
                and j["metadata"]["labels"]["r3operator.io/upgrade-attempt"] == retry["attempt"]
                and j
            ),
            what="the new attempt's canary Job",
        )
        assert BAD not in job["spec"]["template"]["spec"]["containers"][0]["args"]


@contextlib.contextmanager
def _own_gpu_node(cluster: Cluster, name: str) -> Iterator[str]:
    """An 8-GPU node of this test's own: the session's fleet is shared with earlier tests' pods, so whether
    one of its nodes is still idle depends on test order."""
    from kubecluster.controlplane import Fleet

    node = Fleet(nodes=1, cpu_nodes=0).node(0)
    node["metadata"]["name"] = node["metadata"]["labels"]["kubernetes.io/hostname"] = name
    # Tainted for this test alone: pods earlier tests left Pending (the fleet full) would take a new node at once.
    node["spec"]["taints"].append({"key": OWN_NODE_TAINT, "value": name, "effect": "NoSchedule"})
    cluster.api.add_node_objects([node])
    try:
        yield name
    finally:
        cluster.http("DELETE", f"/api/v1/nodes/{name}")


def test_a_surge_replica_without_a_free_gpu_is_reported_at_once_and_rolled_back(cluster: Cluster) -> None:
    # Both regular replicas (4 GPUs each) fill the one 8-GPU node the engines may use: the surge cannot fit.
    with _own_gpu_node(cluster, "gpu-node-up-nogpu") as node:
        _surge_without_a_free_gpu(cluster, node)


def _surge_without_a_free_gpu(cluster: Cluster, node: str) -> None:
    job = {**_job("up-nogpu")}
    job["spec"] = {
        **job["spec"],
        "upgradePolicy": {"timeoutSeconds": 600, "startTimeoutSeconds": 15},
        "inference": {
            **job["spec"]["inference"],
            "podTemplate": {
                "nodeSelector": {"kubernetes.io/hostname": node},
                "tolerations": [{"key": OWN_NODE_TAINT, "operator": "Equal", "value": node, "effect": "NoSchedule"}],
            },
        },
    }
    with running_operator(cluster, NS):
        cluster.apply(job)
        # The pods land on a node made a moment ago: under the suite's load its first pods take longer.
        wait_condition(cluster, NS, "up-nogpu", "EnginesReady", "True", timeout=60)
        _set_image(cluster, "up-nogpu", NEW)
        upgrade = _wait_phase(cluster, "up-nogpu", "Canary")
        cond = wait_condition(cluster, NS, "up-nogpu", "UpgradeBlocked", "True", "CanaryUnschedulable")
        assert "up-nogpu-engine-2 cannot be scheduled" in cond["message"] and "nvidia.com/gpu" in cond["message"]
        assert "canaryStartedAt" not in _upgrade(cluster, "up-nogpu")  # the clock has not started
        blocked = _wait_phase(cluster, "up-nogpu", "Blocked", timeout=60)
        assert blocked["attempt"] == upgrade["attempt"] and "did not start within 15 s" in blocked["message"]
        sts = wait_for(
            lambda: (s := cluster.get(paths(NS, "up-nogpu")["sts"]))["spec"]["replicas"] == 2 and s,
            what="the surge replica removed",
        )
        assert sts["spec"]["template"]["spec"]["containers"][0]["image"] == OLD
        wait_for(lambda: _canary_job(cluster, "up-nogpu") is None, what="the canary Job deleted (its GPU released)")
        assert wait_for(
            lambda: set(_pod_images(cluster, "up-nogpu")) == {"up-nogpu-engine-0", "up-nogpu-engine-1"},
            what="the surge pod gone",
        )
        wait_condition(cluster, NS, "up-nogpu", "UpgradeBlocked", "True", "CanaryFailed")
        record = json.loads(sts["metadata"]["annotations"]["r3operator.io/upgrade-state"])
        assert record["phase"] == "Blocked"


def test_a_trainer_image_change_keeps_the_trainer_until_its_canary_passes(cluster: Cluster) -> None:
    t_old, t_new = "ghcr.io/r3operator/trainer:0.1.0", "ghcr.io/r3operator/trainer:0.2.0"
    rayjob_path = f"/apis/ray.io/v1/namespaces/{NS}/rayjobs/up-trainer-trainer"

    def head_image() -> str:
        rayjob = cluster.get(rayjob_path) or {}
        return rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["image"]

    with running_operator(cluster, NS):
        cluster.apply(
            {
                **_job("up-trainer"),
                "spec": {
                    **_job("up-trainer")["spec"],
                    "trainer": {**_job("up-trainer")["spec"]["trainer"], "image": t_old},
                },
            }
        )
        # A running trainer: the model cache is filled and the RayJob no longer suspended (a trainer image
        # changed while nothing runs yet just replaces the suspended RayJob: nothing to canary against).
        first = wait_for(
            lambda: (r := cluster.get(rayjob_path)) and not r["spec"].get("suspend") and r,
            timeout=60,
            what="a running RayJob",
        )
        cluster.kubectl(
            "-n",
            NS,
            "patch",
            "rlj",
            "up-trainer",
            "--type=merge",
            "-p",
            f'{{"spec":{{"trainer":{{"image":"{t_new}"}}}}}}',
        )
        upgrade = _wait_phase(cluster, "up-trainer", "Canary")
        assert (upgrade["component"], upgrade["from"], upgrade["to"]) == ("trainer", t_old, t_new)
        job = wait_for(lambda: _canary_job(cluster, "up-trainer"), what="canary Job")
        pod = job["spec"]["template"]["spec"]
        assert [c["image"] for c in pod["initContainers"]][-1] == t_old and pod["containers"][0]["image"] == t_new
        assert head_image() == t_old
        assert cluster.get(rayjob_path)["metadata"]["uid"] == first["metadata"]["uid"]  # not replaced meanwhile

        end_canary(cluster, NS, "up-trainer", canary_verdict(upgrade["attempt"], OLD, NEW))
        _wait_phase(cluster, "up-trainer", "Complete", timeout=120)
        assert head_image() == t_new and cluster.get(rayjob_path)["metadata"]["uid"] != first["metadata"]["uid"]
