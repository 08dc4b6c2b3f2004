"""Fixtures for the operator tests (helpers live in operator_harness.py: this directory is not a package,
because a package named `operator` would shadow the standard library)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from operator_harness import REPO, Cluster, kubectl_path


@pytest.fixture(scope="module")
def emulator() -> Iterator[Any]:
    if kubectl_path() is None:
        pytest.skip("kubectl not found: run `bash scripts/install-tools.sh .tools` (puts kubectl in .tools/bin)")
    from r3operator.testing.apiserver import KubeAPIEmulator

    with KubeAPIEmulator() as api:
        yield api


@pytest.fixture(scope="module")
def cluster(emulator: Any) -> Cluster:
    c = Cluster(emulator)
    c.kubectl("apply", "-f", str(REPO / "crds"))
    return c


@pytest.fixture
def kopf_env(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> Cluster:
    """KopfRunner runs in this process: kopf's kubeconfig login reads $KUBECONFIG."""
    monkeypatch.setenv("KUBECONFIG", str(cluster.api.kubeconfig_path))
    return cluster
