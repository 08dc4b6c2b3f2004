"""Two operator processes against the real control plane: only the Lease holder reconciles, a rolling
update (SIGTERM to the leader) hands over without two active reconcilers, and a leader that loses its
Lease exits.

Each process is `r3operator operator --leader-elect` as the chart runs it, with short Lease timings.
kopf prefixes every log line about an object with its timestamp and `[namespace/name]`; those lines are
how the test sees which process reconciled what, and when.
"""

from __future__ import annotations

import datetime as dt
import os
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubecluster.controlplane import ApiError
from operator_harness import REPO, Cluster, OperatorProcess, all_children, example, free_port, wait_for

NS = "rl-ha"
LEASE = f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases/r3operator-leader"


class Replica(OperatorProcess):
    """One operator replica with leader election, and the endpoints it serves."""

    def __init__(self, cluster: Cluster, name: str, health: str, metrics_port: int, *args: str) -> None:
        env = {"R3OPERATOR_POD_NAME": name, "R3OPERATOR_METRICS_PORT": str(metrics_port)}
        super().__init__(cluster, NS, *args, "--liveness", health, env=env)
        self.name, self.health, self.metrics = name, health, f"http://127.0.0.1:{metrics_port}/metrics"

    def reconciled(self, job: str) -> list[dt.datetime]:
        return self.stamped(rf"\[{NS}/{job}\]")

    def leader_gauge(self) -> float | None:
        """`r3operator_leader` as this replica exports it (a standby is scraped too)."""
        try:
            with urllib.request.urlopen(self.metrics, timeout=2) as r:
                text = r.read().decode()
        except (urllib.error.URLError, OSError):
            return None
        m = re.search(r"^r3operator_leader (\S+)$", text, re.M)
        return float(m.group(1)) if m else None

    def ready(self) -> str | None:
        try:
            with urllib.request.urlopen(self.health.replace("/healthz", "/readyz"), timeout=2) as r:
                return r.read().decode().strip() if r.status == 200 else None
        except (urllib.error.URLError, OSError):
            return None


@pytest.fixture
def replicas(cluster: Cluster) -> Iterator[list[Replica]]:
    cluster.namespace(NS)
    started: list[Replica] = []
    yield started
    for replica in started:
        replica.stop(graceful=False)


def _start(cluster: Cluster, replicas: list[Replica], name: str) -> Replica:
    port, metrics_port = free_port(), free_port()
    replica = Replica(
        cluster,
        name,
        f"http://127.0.0.1:{port}/healthz",
        metrics_port,
        "--leader-elect",
        "--leader-election-namespace",
        NS,
        "--lease-duration",
        "4",
        "--renew-deadline",
        "3",
        "--retry-period",
        "0.5",
    )
    replicas.append(replica)
    return replica


def _holder(cluster: Cluster) -> str:
    lease = cluster.get(LEASE) or {}
    return str((lease.get("spec") or {}).get("holderIdentity") or "")


def test_only_the_lease_holder_reconciles_and_a_rolling_update_hands_over_without_overlap(
    cluster: Cluster, replicas: list[Replica]
) -> None:
    a = _start(cluster, replicas, "replica-a")
    wait_for(lambda: a.stamped("acquired lease"), timeout=60, what=f"replica-a leads\n{a.log()}")
    b = _start(cluster, replicas, "replica-b")
    assert wait_for(lambda: b.ready() == "standby", timeout=60, what=f"replica-b standby\n{b.log()}")
    with urllib.request.urlopen(b.health, timeout=2) as live:  # a standby passes its liveness probe
        assert live.status == 200
    assert a.ready() == "leader" and _holder(cluster).startswith("replica-a_")
    assert (a.leader_gauge(), b.leader_gauge()) == (1.0, 0.0)

    cluster.apply(example("ha-one", NS))
    all_children(cluster, NS, "ha-one")
    wait_for(lambda: a.reconciled("ha-one"), what="replica-a logs its reconcile")
    assert b.reconciled("ha-one") == [], b.log()

    # A rolling update: the old pod gets SIGTERM while the new one stands by.
    a.proc.send_signal(signal.SIGTERM)
    assert a.proc.wait(timeout=60) == 0, a.log()
    wait_for(lambda: b.stamped("acquired lease"), timeout=30, what=f"replica-b takes over\n{b.log()}")
    [released] = a.stamped("released lease")
    [acquired] = b.stamped("acquired lease")
    assert max(a.reconciled("ha-one")) <= released <= acquired, (a.log(), b.log())
    assert _holder(cluster).startswith("replica-b_") and b.ready() == "leader" and b.leader_gauge() == 1.0

    cluster.apply(example("ha-two", NS))
    all_children(cluster, NS, "ha-two")
    wait_for(lambda: b.reconciled("ha-two"), what="replica-b reconciles after the hand-over")
    assert min(b.reconciled("ha-one") + b.reconciled("ha-two")) >= acquired

    # A leader whose Lease is taken (a partition, a manual edit) stops at once instead of reconciling on.
    _take_lease(cluster, "intruder")
    assert b.proc.wait(timeout=30) == 1, b.log()
    assert b.stamped("lost lease"), b.log()


def _take_lease(cluster: Cluster, holder: str) -> None:
    """Write another holder into the Lease; the leader renews it meanwhile, so a conflicting write is retried
    on the fresh object (as `kubectl edit` would have to)."""
    for _ in range(20):
        lease = cluster.get(LEASE)
        assert lease is not None
        lease["spec"]["holderIdentity"] = holder
        try:
            cluster.http("PUT", LEASE, lease)
            return
        except ApiError as exc:
            if exc.code != 409:
                raise
    raise AssertionError("the Lease changed under every one of 20 writes")


def test_leader_election_flags_are_checked(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "r3operator",
            "operator",
            "-n",
            NS,
            "--leader-elect",
            "--leader-election-namespace",
            NS,
            "--lease-duration",
            "2",
            "--renew-deadline",
            "5",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 2 and "renew deadline < lease duration" in proc.stderr
