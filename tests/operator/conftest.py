"""Fixtures for the operator tests (helpers live in operator_harness.py: this directory is not a package,
because a package named `operator` would shadow the standard library)."""

from __future__ import annotations

from typing import Any

import pytest
from operator_harness import REPO, Cluster, kubectl_path


@pytest.fixture(scope="module")
def cluster(control_plane: Any) -> Cluster:
    if kubectl_path() is None:
        pytest.fail("kubectl not found: run `make tools` (puts the pinned kubectl in .tools/bin)")
    c = Cluster(control_plane)
    c.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))  # helm may hold it (chart tests)
    control_plane.wait_established("rljobs.r3operator.io")
    return c


@pytest.fixture
def kopf_env(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> Cluster:
    """KopfRunner runs in this process: kopf's kubeconfig login reads $KUBECONFIG."""
    monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))
    return cluster
