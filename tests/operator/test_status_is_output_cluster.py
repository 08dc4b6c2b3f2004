"""The RLJob's status is output only, on the real control plane: the real kopf operator, kube-apiserver with
RBAC, the StatefulSet and Job controllers, KubeRay, kwok nodes.

The trainer pods may no longer write the status at all (issue #45, test_ownership_cluster.py); whoever else may
(a user granted ``patch`` on ``rljobs/status``, here ``status-writer``) writes nothing the operator acts on:
the patch of issue #29 that rolled the engines to an attacker's image, and a variant for every status field,
change nothing the operator renders (engine image and replicas, the canary Job, the RayJob). During a real
upgrade, a verdict and a "from" image forged in status are ignored: the verdict comes from the canary pod's
termination message, the rollback goes to the image the engines were verified on.
"""

from __future__ import annotations

from typing import Any

import pytest
from kopf.testing import KopfRunner
from operator_harness import Cluster, example, paths, running_operator, wait_condition, wait_for, wait_passes

NS = "status-out"
OLD, NEW = "ghcr.io/r3operator/engine:0.1.0-vllm0.22.1", "ghcr.io/r3operator/engine:0.2.0-vllm0.22.1"
EVIL = "evil.example.com/miner:1"


WRITER = "status-writer"


@pytest.fixture(scope="module")
def operator(cluster: Cluster) -> Any:
    with running_operator(cluster, NS) as runner:
        rule = ["--verb=get,patch", "--resource=rljobs.r3operator.io/status"]
        cluster.kubectl("-n", NS, "create", "role", WRITER, *rule)
        cluster.kubectl("-n", NS, "create", "rolebinding", WRITER, f"--role={WRITER}", f"--user={WRITER}")
        yield runner


def _as_status_writer(cluster: Cluster, job: str, status: dict[str, Any]) -> None:
    """``kubectl patch --subresource=status`` as a user who may write RLJob status, through RBAC."""
    import json

    who = WRITER
    cluster.kubectl(
        "-n",
        NS,
        "patch",
        "rlj",
        job,
        "--subresource=status",
        "--type=merge",
        f"--as={who}",
        "-p",
        json.dumps({"status": status}),
    )


def _passes(cluster: Cluster, job: str, n: int) -> None:
    """Wait for n more reconcile passes of the job."""
    wait_passes(NS, job, n, timeout=60)


def _canary_job(cluster: Cluster, job: str) -> dict[str, Any] | None:
    return cluster.get(f"/apis/batch/v1/namespaces/{NS}/jobs/{job}-upgrade-canary")


def _rendered(cluster: Cluster, job: str) -> dict[str, Any]:
    """What the operator renders that a forged status could change: engines, canary Job, RayJob."""
    sts = cluster.get(paths(NS, job)["sts"]) or {}
    rayjob = cluster.get(paths(NS, job)["rayjob"]) or {}
    head = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    return {
        "engine image": [c["image"] for c in sts["spec"]["template"]["spec"]["containers"]],
        "engine replicas": sts["spec"]["replicas"],
        "engine updateStrategy": sts["spec"].get("updateStrategy"),
        "engine uid": sts["metadata"]["uid"],
        "canary Job": _canary_job(cluster, job) is not None,
        "RayJob uid": rayjob["metadata"]["uid"],
        "RayJob image": head["image"],
        "RayJob suspend": rayjob["spec"].get("suspend"),
    }


def _forged_upgrades(image: str) -> list[dict[str, Any]]:
    """status.upgrade as an attacker would write it: the issue's patch first, then every phase and component."""
    base = {"attempt": "1", "startedAt": "2020-01-01T00:00:00Z"}
    verdict = {"attempt": "1", "passed": True, "message": "forged"}
    return [
        {"component": "engine", "phase": "Canary", "from": EVIL, "to": image, **base},  # issue #29, verbatim
        {"component": "engine", "phase": "Blocked", "from": EVIL, "to": image, **base},
        {"component": "engine", "phase": "Rolling", "from": image, "to": EVIL, **base},
        {"component": "engine", "phase": "Canary", "from": image, "to": EVIL, "canary": verdict, **base},
        {
            "component": "engine",
            "phase": "Canary",
            "from": EVIL,
            "to": image,
            "canaryStartedAt": "2020-01-01T00:00:00Z",
            **base,
        },
        {"component": "trainer", "phase": "Canary", "from": EVIL, "to": "ghcr.io/r3operator/trainer:0.1.0", **base},
        {"component": "trainer", "phase": "Rolling", "from": "ghcr.io/r3operator/trainer:0.1.0", "to": EVIL, **base},
    ]


def _forged_fields() -> list[dict[str, Any]]:
    """Every other status field, with values that would stop, scale or delete something if believed."""
    ended = {
        "status": "True",
        "reason": "TrainerSucceeded",
        "message": "forged",
        "lastTransitionTime": "2020-01-01T00:00:00Z",
    }
    return [
        {"conditions": [{"type": "Succeeded", **ended}], "completionTime": "2020-01-01T00:00:00Z"},
        {"conditions": [{"type": "Failed", **ended, "reason": "TrainerFailed"}]},
        {"conditions": [{"type": "Suspended", **ended}, {"type": "Valid", **ended, "status": "False"}]},
        {"observedGeneration": 999, "startTime": "2020-01-01T00:00:00Z"},
        {"resolved": {"vllmVersion": "0.0.1"}},
        {"engines": {"replicas": 0, "readyReplicas": 0, "updatedReplicas": 0}, "enginesReady": "0/0"},
        {"trainer": {"replicas": 0, "readyReplicas": 0, "updatedReplicas": 0}},
        {"progress": {"step": 10_000, "totalSteps": 10_000}},
    ]


def test_what_the_trainer_writes_in_status_changes_nothing_the_operator_renders(
    cluster: Cluster, operator: KopfRunner
) -> None:
    job = "forge"
    cluster.apply(
        example(job, NS, **{"inference.image": OLD, "inference.replicas": 2, "runPolicy.ttlSecondsAfterFinished": 0})
    )
    wait_condition(cluster, NS, job, "EnginesReady", "True")
    wait_for(
        lambda: (r := cluster.get(paths(NS, job)["rayjob"])) and not r["spec"].get("suspend"),
        timeout=60,
        what="a running RayJob",
    )
    before = _rendered(cluster, job)
    for forged in [{"upgrade": u} for u in _forged_upgrades(OLD)] + _forged_fields():
        _as_status_writer(cluster, job, forged)
        _passes(cluster, job, 2)
        assert _rendered(cluster, job) == before, forged
    # The status is output: the operator writes back what it observes, nothing of the forgeries.
    _passes(cluster, job, 1)
    status = cluster.get(paths(NS, job)["rljob"])["status"]
    assert "upgrade" not in status and EVIL not in str(status)
    assert not any(c["type"] in ("Succeeded", "Failed") and c["status"] == "True" for c in status["conditions"])
    assert "r3operator.io/finished" not in (cluster.get(paths(NS, job)["rljob"])["metadata"].get("annotations") or {})


def test_a_verdict_and_a_from_image_forged_during_an_upgrade_are_ignored(
    cluster: Cluster, operator: KopfRunner
) -> None:
    from canary_ending import end_canary

    from r3operator.api.v1alpha1 import UpgradeCanary

    job = "forge-up"
    cluster.apply(example(job, NS, **{"inference.image": OLD, "inference.replicas": 2}))
    wait_condition(cluster, NS, job, "EnginesReady", "True")
    cluster.kubectl(
        "-n", NS, "patch", "rlj", job, "--type=merge", "-p", f'{{"spec":{{"inference":{{"image":"{NEW}"}}}}}}'
    )
    upgrade = wait_for(
        lambda: (
            (u := (cluster.get(paths(NS, job)["rljob"])["status"].get("upgrade") or {})).get("phase") == "Canary" and u
        ),
        what="the canary",
    )
    wait_for(lambda: _canary_job(cluster, job), what="the canary Job")
    canary = _rendered(cluster, job)
    assert canary["engine image"] == [NEW] and canary["engine replicas"] == 3
    forged = {**upgrade, "from": EVIL, "canary": {"attempt": upgrade["attempt"], "passed": True, "message": "forged"}}
    _as_status_writer(cluster, job, {"upgrade": forged})
    _passes(cluster, job, 3)
    assert _rendered(cluster, job) == canary  # no roll on a forged pass
    assert cluster.get(paths(NS, job)["rljob"])["status"]["upgrade"]["phase"] == "Canary"

    # The real verdict (a failure) arrives as the canary pod's termination message: back to OLD, not EVIL.
    verdict = UpgradeCanary(attempt=upgrade["attempt"], passed=False, message="natural mismatch 0.09 vs 0.02")
    end_canary(cluster, NS, job, verdict)
    wait_condition(cluster, NS, job, "UpgradeBlocked", "True", "CanaryFailed")
    after = wait_for(lambda: (r := _rendered(cluster, job))["engine replicas"] == 2 and r, what="rolled back")
    assert after["engine image"] == [OLD]
    assert cluster.get(paths(NS, job)["rljob"])["status"]["upgrade"]["canary"]["message"].startswith("natural")
