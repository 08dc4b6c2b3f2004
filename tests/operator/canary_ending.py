"""How the tests on the kwok cluster play the upgrade canary's end (not a test module).

The canary Job's pod keeps running under kwok until the test annotates it with the verdict; kwok then ends
the container with that text as its termination message (tests/kubecluster/kwok-stages.yaml, stage
pod-canary-verdict), as the kubelet does from /dev/termination-log. The operator reads it from there.
"""

from __future__ import annotations

from typing import Any

from operator_harness import Cluster, wait_for

from r3operator.api.canary_verdict import termination_message
from r3operator.api.v1alpha1 import EngineFidelity, UpgradeCanary

MESSAGE_ANNOTATION = "kwok.r3operator.io/termination-message"


def running_canary_pod(cluster: Cluster, namespace: str, job: str) -> dict[str, Any]:
    selector = f"r3operator.io/job={job},r3operator.io/role=upgrade-canary"

    def find() -> dict[str, Any] | None:
        pods = (cluster.get(f"/api/v1/namespaces/{namespace}/pods?labelSelector={selector}") or {}).get("items", [])
        return next((p for p in pods if p["status"].get("phase") == "Running"), None)

    return wait_for(find, timeout=60, what=f"a running canary pod of {job}")


def end_canary(cluster: Cluster, namespace: str, job: str, verdict: UpgradeCanary) -> None:
    """The canary container of ``job`` ends with ``verdict`` as its termination message."""
    pod = running_canary_pod(cluster, namespace, job)
    patch = {"metadata": {"annotations": {MESSAGE_ANNOTATION: termination_message(verdict)}}}
    cluster.http(
        "PATCH", f"/api/v1/namespaces/{namespace}/pods/{pod['metadata']['name']}", patch, "application/merge-patch+json"
    )


def canary_verdict(attempt: str, old: str, new: str, *, passed: bool = True) -> UpgradeCanary:
    """A canary's verdict on moving the engines from image `old` to `new`: the new engine's natural-routing
    mismatch 0.02 (as the old one's: passed) or 0.09 (failed)."""

    def engine(image: str, mismatch: float) -> EngineFidelity:
        return EngineFidelity(
            image=image,
            routes_valid=True,
            replay_agreement=1.0,
            natural_mismatch=mismatch,
            logprob_abs_diff_off=0.005,
            logprob_abs_diff_r3=0.004,
        )

    new_mismatch = 0.02 if passed else 0.09
    return UpgradeCanary(
        attempt=attempt,
        passed=passed,
        message=f"natural mismatch {new_mismatch} vs 0.02",
        old=engine(old, 0.02),
        new=engine(new, new_mismatch),
    )
