"""ReplayHealthy on the real control plane: the trainer's progress (reported as the trainer's ServiceAccount, through
RBAC, into the `<job>-progress` ConfigMap the operator copies from) becomes the condition with its reason, and
`kubectl get rlj` shows it under HEALTHY."""

from __future__ import annotations

import json
from typing import Any

import pytest
from kopf.testing import KopfRunner
from operator_harness import Cluster, example, running_operator, wait_condition

NS = "replay-health"


@pytest.fixture(scope="module")
def operator(cluster: Cluster) -> Any:
    with running_operator(cluster, NS) as runner:
        yield runner


def _push_progress(cluster: Cluster, job: str, progress: dict[str, Any]) -> None:
    cluster.kubectl(
        "-n",
        NS,
        "patch",
        "configmap",
        f"{job}-progress",
        "--type=merge",
        f"--as=system:serviceaccount:{NS}:{job}-trainer",
        "-p",
        json.dumps({"data": {"progress": json.dumps(progress)}}),
    )


def _healthy_column(cluster: Cluster, job: str) -> str:
    out = cluster.kubectl("-n", NS, "get", "rlj", job).stdout.splitlines()
    header, row = out[0].split(), out[1].split()
    return row[header.index("HEALTHY")]


def test_the_trainers_route_checks_become_replay_healthy_and_its_column(cluster: Cluster, operator: KopfRunner) -> None:
    job = "health"
    cluster.apply(example(job, NS))
    wait_condition(cluster, NS, job, "ReplayHealthy", "Unknown", "NoStepYet")
    healthy = {"step": 1, "replayedFraction": 1.0, "fallbackFraction": 0.0, "routeCheckFailures": 0}
    _push_progress(cluster, job, healthy)
    wait_condition(cluster, NS, job, "ReplayHealthy", "True", "RoutesReplayed")
    assert _healthy_column(cluster, job) == "True"
    failed = "route check zero-route failed (sample p3-c1, layer 5): 40 of 40 captured rows hold one expert 8 times"
    _push_progress(cluster, job, {"step": 2, "routeCheckFailures": 4, "routeCheckMessage": failed})
    cond = wait_condition(cluster, NS, job, "ReplayHealthy", "False", "RouteCheckFailed")
    assert "sample p3-c1, layer 5" in cond["message"] and "4 sample(s)" in cond["message"]
    assert _healthy_column(cluster, job) == "False"
