"""Operator benchmark: apply → all children created (p50/p95 over 50 RLJobs), RSS with 200 RLJobs.

The API server is the in-process emulator (r3operator.testing.apiserver); the operator runs as a
separate process (``kopf run -m r3operator.operator.handlers --standalone``) with its production
defaults (10 s resync, 5 s idle), so its RSS is measured alone.

    python -m benchmarks.bench_operator [--jobs 50] [--total 200]

Targets (issue 4): p50 ≤ 2 s, RSS ≤ 250 MB.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import yaml

from r3operator.api.crd import render_crd_yaml
from r3operator.testing.apiserver import KubeAPIEmulator

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "qwen3-30b-a3b-r3-fsdp.yaml"
RAYJOB_CRD = REPO / "tests" / "operator" / "fixtures" / "rayjob-crd.yaml"
NS = "bench"
CHILDREN = (
    "/api/v1/namespaces/{ns}/persistentvolumeclaims/{job}-routing",
    "/api/v1/namespaces/{ns}/configmaps/{job}-config",
    "/api/v1/namespaces/{ns}/services/{job}-engine",
    "/apis/apps/v1/namespaces/{ns}/statefulsets/{job}-engine",
    "/apis/ray.io/v1/namespaces/{ns}/rayjobs/{job}-trainer",
)


def _http(base: str, method: str, path: str, body: Any = None) -> Any:
    req = urllib.request.Request(base + path, data=None if body is None else json.dumps(body).encode(), method=method)
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise


def _rljob(name: str) -> dict[str, Any]:
    doc = copy.deepcopy(yaml.safe_load(EXAMPLE.read_text()))
    doc["metadata"] = {"name": name, "namespace": NS}
    return doc


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _wait_children(base: str, job: str, timeout: float = 60.0) -> float:
    start = time.perf_counter()
    pending = [p.format(ns=NS, job=job) for p in CHILDREN]
    while pending:
        if time.perf_counter() - start > timeout:
            raise TimeoutError(f"{job}: children still missing after {timeout}s: {pending}")
        pending = [p for p in pending if _http(base, "GET", p) is None]
        if pending:
            time.sleep(0.01)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=50, help="RLJobs timed one after another")
    parser.add_argument("--total", type=int, default=200, help="RLJobs alive when RSS is measured")
    args = parser.parse_args(argv or [])
    with KubeAPIEmulator() as api:
        base = api.url
        for crd in (yaml.safe_load(render_crd_yaml()), yaml.safe_load(RAYJOB_CRD.read_text())):
            _http(base, "POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)
        _http(base, "POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
        env = {**os.environ, "KUBECONFIG": str(api.kubeconfig_path), "R3OPERATOR_METRICS_PORT": "0"}
        cmd = [sys.executable, "-m", "kopf", "run", "--standalone", "-n", NS, "-m", "r3operator.operator.handlers"]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            time.sleep(3)  # operator start-up (imports, login, first watch) is not part of the figure
            path = f"/apis/r3operator.io/v1alpha1/namespaces/{NS}/rljobs"
            latencies = []
            for i in range(args.jobs):
                name = f"job-{i:03d}"
                t0 = time.perf_counter()
                _http(base, "POST", path, _rljob(name))
                _wait_children(base, name)
                latencies.append(time.perf_counter() - t0)
            for i in range(args.jobs, args.total):
                _http(base, "POST", path, _rljob(f"job-{i:03d}"))
            for i in range(args.jobs, args.total):
                _wait_children(base, f"job-{i:03d}", timeout=300)
            time.sleep(15)  # let a full resync round (10 s timer) run over all RLJobs
            rss_mb = psutil.Process(proc.pid).memory_info().rss / 2**20
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    result = {
        "apply_to_children_p50_s": round(statistics.median(latencies), 3),
        "apply_to_children_p95_s": round(_percentile(latencies, 0.95), 3),
        "apply_to_children_max_s": round(max(latencies), 3),
        "jobs_timed": args.jobs,
        "operator_rss_mb_at_total": round(rss_mb, 1),
        "rljobs_total": args.total,
        "targets": {"p50_s": 2.0, "rss_mb": 250},
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
