"""A burst of child changes is one RLJob status write, on the real control plane.

A StatefulSet's controller moves its status one field per write (ready, then available, one pod at a time), and
each write is a watch event that wakes the RLJob's pass. Every status write is a ~9 KB event the API server's
RLJob watch cache decodes and sends to every RLJob watcher (docs/benchmarks.md, "Fewer status writes"): the
operator waits ``R3OPERATOR_SETTLE_SECONDS`` after a child's event so that the rest of the burst goes into the
same pass. Here the test plays the StatefulSet controller (kube-controller-manager and KubeRay paused, so nobody
else writes a child's status), and counts the operator's status PATCHes in the API server's audit log.
"""

from __future__ import annotations

import time
from typing import Any

from operator_harness import Cluster, OperatorProcess, condition, example, paths, wait_condition, wait_for

NS = "kwok-keep-training"
"""kwok keeps KubeRay's submitter running here: the RayJob does not end (and scale the engines down) mid-test."""
SETTLE_S = 2.0
"""Longer than the production default (0.5 s) so that a burst of back-to-back writes fits in it on a loaded
2-core CI box; the mechanism is the same."""


def _status_writes(cluster: Cluster, rljob: str, since: int = 0) -> list[Any]:
    return [
        r
        for r in cluster.requests()[since:]
        if r.verb in ("patch", "update")
        and r.path == rljob + "/status"
        and r.user_agent.startswith(("r3operator/", "kopf/"))
    ]


def _quiet(cluster: Cluster, rljob: str, seconds: float) -> bool:
    before = len(_status_writes(cluster, rljob))
    time.sleep(seconds)
    return len(_status_writes(cluster, rljob)) == before


def _engines(cluster: Cluster, path: str, ready: int, *, down: bool) -> None:
    """What the StatefulSet controller writes as a pod becomes (un)ready: one field per write (the API server
    holds availableReplicas ≤ readyReplicas)."""
    fields = ["readyReplicas", "availableReplicas"]
    for name in reversed(fields) if down else fields:
        cluster.patch_status(path, {name: ready})


def _engines_say(cluster: Cluster, rljob: str, status: str, message: str) -> None:
    def check() -> bool:
        cond = condition(cluster.get(rljob), "EnginesReady") or {}
        return (cond.get("status"), cond.get("message")) == (status, message)

    wait_for(check, timeout=30, what=f"EnginesReady={status} {message!r}")


def test_a_burst_of_engine_status_changes_is_one_status_write_and_status_ends_as_the_children_say(
    cluster: Cluster,
) -> None:
    cluster.namespace(NS)
    job = "status-burst"
    p = paths(NS, job)
    env = {"R3OPERATOR_RESYNC_SECONDS": "600", "R3OPERATOR_SETTLE_SECONDS": str(SETTLE_S), "R3OPERATOR_CANARY": "0"}
    op = OperatorProcess(cluster, NS, "--liveness", "", env=env)
    try:
        cluster.apply(example(job, NS))
        wait_condition(cluster, NS, job, "EnginesReady", "True", timeout=90)
        replicas = int(cluster.get(p["sts"])["spec"]["replicas"])
        assert replicas > 1, "the burst needs several engine replicas"
        with cluster.api.paused("kube-controller-manager"), cluster.api.paused("kuberay-operator"):
            wait_for(lambda: _quiet(cluster, p["rljob"], SETTLE_S + 1.0), timeout=60, what="no status write")
            mark = len(cluster.requests())
            # The engines go down one pod at a time, then come back one at a time: two bursts, each of
            # 2 × replicas writes, each write a watch event; a status a user reads between the bursts.
            for ready in range(replicas - 1, -1, -1):
                _engines(cluster, p["sts"], ready, down=True)
            _engines_say(cluster, p["rljob"], "False", f"0/{replicas} engine replicas ready")
            for ready in range(1, replicas + 1):
                _engines(cluster, p["sts"], ready, down=False)
            _engines_say(cluster, p["rljob"], "True", f"{replicas}/{replicas} engine replicas ready")
            time.sleep(SETTLE_S + 1.0)  # a late write would show here
            writes = _status_writes(cluster, p["rljob"], mark)
            rljob = cluster.get(p["rljob"])
            sts = cluster.get(p["sts"])
        # The user-visible states the script passes through: all down (0/N), all up again (N/N). Before the
        # settle delay each pass in a burst wrote its own intermediate count (3/N, 2/N, ...).
        assert len(writes) <= 2, [(r.verb, r.path) for r in writes]
        status = rljob["status"]
        assert status["engines"]["readyReplicas"] == sts["status"]["readyReplicas"] == replicas
        assert status["enginesReady"] == f"{replicas}/{replicas}"
        ready = condition(rljob, "Ready")
        assert ready is not None and ready["reason"] != "PodsNotReady", ready
    finally:
        # Deleted while the operator runs: it removes its finalizer, and the RLJob does not outlive the test.
        cluster.kubectl("delete", "rljob", job, "-n", NS, "--timeout=60s", check=False)
        op.stop()
        assert "Traceback" not in op.log(), op.log(80)
