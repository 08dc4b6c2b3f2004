"""The REAL kubectl (pinned, from .tools/bin, see scripts/install-tools.sh) against the emulator."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from r3operator.testing.apiserver import KubeAPIEmulator

from .conftest import SAMPLE_CRD

KUBECTL = Path(__file__).resolve().parents[2] / ".tools" / "bin" / "kubectl"
pytestmark = pytest.mark.skipif(
    not KUBECTL.exists(), reason=f"{KUBECTL} missing: run `make tools` (bash scripts/install-tools.sh .tools)"
)

CR = """\
apiVersion: example.r3.dev/v1
kind: TrainJob
metadata:
  name: demo
spec:
  model: tiny
  replicas: {replicas}
  replay:
    mode: R3
"""

Kubectl = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture(scope="module")
def kubectl(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kubectl]:
    home = tmp_path_factory.mktemp("kubectl-home")
    with KubeAPIEmulator(kubeconfig_dir=home) as api:
        # A per-session HOME and discovery cache: kubectl's cache would otherwise outlive the emulator.
        env = {**os.environ, "HOME": str(home), "KUBECONFIG": str(api.kubeconfig_path)}

        def run(*args: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
            command = [str(KUBECTL), "--cache-dir", str(home / "cache"), *args]
            result = subprocess.run(command, env=env, input=stdin, capture_output=True, text=True, timeout=60)
            if check and result.returncode != 0:
                raise AssertionError(f"kubectl {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
            return result

        run("apply", "-f", str(SAMPLE_CRD))
        yield run


def test_apply_crd_and_cr_then_get_shows_printer_columns_via_short_name(kubectl: Kubectl) -> None:
    assert "created" in kubectl("apply", "-f", "-", stdin=CR.format(replicas=2)).stdout
    header, row = kubectl("get", "tj").stdout.splitlines()
    assert header.split() == ["NAME", "MODE", "REPLICAS", "READY", "PHASE", "AGE"]
    assert row.split()[:3] == ["demo", "R3", "2"]


def test_reapply_is_a_merge_patch(kubectl: Kubectl) -> None:
    kubectl("apply", "-f", "-", stdin=CR.format(replicas=2))
    assert "configured" in kubectl("apply", "-f", "-", stdin=CR.format(replicas=3)).stdout
    assert kubectl("get", "trainjob", "demo", "-o", "jsonpath={.spec.replicas}").stdout == "3"


def test_invalid_cr_is_refused_with_the_cel_message(kubectl: Kubectl) -> None:
    kubectl("apply", "-f", "-", stdin=CR.format(replicas=3))
    bad = CR.format(replicas=3).replace("  replay:", "  kvCacheOffload: true\n  replay:")
    result = kubectl("apply", "-f", "-", stdin=bad, check=False)
    assert result.returncode != 0
    assert 'The TrainJob "demo" is invalid' in result.stderr
    assert "R3 replay cannot be combined with kvCacheOffload" in result.stderr


def test_unknown_field_is_refused_by_strict_validation(kubectl: Kubectl) -> None:
    bad = CR.format(replicas=3).replace("  model: tiny", "  model: tiny\n  modle: typo")
    result = kubectl("apply", "-f", "-", stdin=bad, check=False)
    assert result.returncode != 0 and 'unknown field "spec.modle"' in result.stderr


def test_server_dry_run_validates_without_storing(kubectl: Kubectl) -> None:
    other = CR.format(replicas=1).replace("name: demo", "name: dry")
    assert "server dry run" in kubectl("apply", "--dry-run=server", "-f", "-", stdin=other).stdout
    missing = kubectl("get", "tj", "dry", check=False)
    assert missing.returncode != 0 and "NotFound" in missing.stderr


def test_status_patch_wait_and_columns(kubectl: Kubectl) -> None:
    kubectl("apply", "-f", "-", stdin=CR.format(replicas=3))
    status = {"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}
    kubectl("patch", "tj", "demo", "--subresource=status", "--type=merge", "-p", json.dumps(status))
    kubectl("wait", "--for=jsonpath={.status.phase}=Running", "tj/demo", "--timeout=10s")
    row = kubectl("get", "tj", "demo", "--no-headers").stdout.split()
    assert row[3:5] == ["True", "Running"]


def test_explain_reads_the_crd_schema(kubectl: Kubectl) -> None:
    out = kubectl("explain", "trainjobs.spec").stdout
    assert "Desired state of the training job." in out
    assert "model" in out and "-required-" in out


def test_delete_with_finalizer_then_wait_for_delete(kubectl: Kubectl) -> None:
    other = CR.format(replicas=1).replace("name: demo", "name: fin\n  finalizers: [r3.dev/hold]")
    kubectl("apply", "-f", "-", stdin=other)
    kubectl("delete", "tj", "fin", "--wait=false")
    assert kubectl("get", "tj", "fin", "-o", "jsonpath={.metadata.deletionTimestamp}").stdout
    kubectl("patch", "tj", "fin", "--type=json", "-p", '[{"op": "remove", "path": "/metadata/finalizers"}]')
    kubectl("wait", "--for=delete", "tj/fin", "--timeout=10s")
    kubectl("delete", "-f", "-", stdin=CR.format(replicas=3))
    assert "No resources found" in kubectl("get", "tj").stderr
