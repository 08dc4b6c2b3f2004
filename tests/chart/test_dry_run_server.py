"""`kubectl apply --dry-run=server` of the rendered chart on the session's real kube-apiserver.

The control plane does not serve the Prometheus Operator kinds (monitoring.coreos.com), and installing
their CRDs would make the operator tests of the same session create PodMonitors; so the chart is rendered
with PodMonitor/ServiceMonitor/PrometheusRule off here. tests/chart/test_chart.py renders those and
tests/observability check their content.
"""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from kubecluster.clients import apply_crd, create_namespace, kubectl

from tests.chart.conftest import REPO, helm_template

EXAMPLE = REPO / "examples" / "qwen3-30b-a3b-r3-fsdp.yaml"


@pytest.mark.parametrize("mode", ["cluster", "namespaced"])
def test_rendered_chart_is_accepted_by_server_dry_run(helm: str, control_plane: Any, namespace: str, mode: str) -> None:
    watched = create_namespace(control_plane, f"{namespace}-jobs")
    namespaced = ("watch.mode=namespaced", f"watch.namespaces={{{watched}}}")
    sets = namespaced if mode == "namespaced" else ("watch.mode=cluster",)
    proc = helm_template(helm, *sets, namespace=namespace)
    assert proc.returncode == 0, proc.stderr
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]

    dry = kubectl(control_plane, "apply", "--dry-run=server", "-f", "-", stdin=proc.stdout)
    assert dry.returncode == 0, dry.stderr
    # Every rendered object went through the apiserver's admission and validation, none was written.
    for doc in docs:
        group = doc["apiVersion"].split("/")[0] if "/" in doc["apiVersion"] else ""
        kind = f"{doc['kind'].lower()}.{group}" if group else doc["kind"].lower()
        assert f"{kind}/{doc['metadata']['name']} " in dry.stdout, (kind, dry.stdout)
    assert dry.stdout.count("(server dry run)") == len(docs)
    deployments = control_plane.request("GET", f"/apis/apps/v1/namespaces/{namespace}/deployments")
    assert deployments["items"] == []
    # The CRD the chart ships serves RLJobs: an example passes it (the CRD is applied for real here).
    [crd] = [d for d in docs if d["kind"] == "CustomResourceDefinition"]
    apply_crd(control_plane, crd)
    job = yaml.safe_load(EXAMPLE.read_text())
    job["metadata"]["namespace"] = watched
    applied = kubectl(control_plane, "apply", "--dry-run=server", "-f", "-", stdin=yaml.safe_dump(job))
    assert applied.returncode == 0, applied.stderr
    assert f"rljob.r3operator.io/{job['metadata']['name']} created (server dry run)" in applied.stdout
