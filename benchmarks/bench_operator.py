"""Operator scale benchmark on the real control plane (tests/kubecluster: kube-apiserver, controllers,
scheduler, kwok fake GPU nodes, KubeRay).

The operator runs as its own process (``kopf run -m r3operator.operator.handlers --standalone``) with its
production defaults (10 s resync, 5 s idle). For each fleet size it measures, over N RLJobs created one
after another at a fixed rate:

- apply → every child exists (p50/p95/max), from the RLJob's create to the last child's create;
- time until every engine pod is Running (real StatefulSet controller + scheduler + kwok);
- API requests per RLJob made by the operator (the apiserver's audit log, by user agent), while
  converging, and writes per minute in the steady state (target 0: nothing changes, nothing is written);
- operator RSS and CPU seconds.

    python -m benchmarks.bench_operator [--jobs 50 200 500] [--nodes 256]

Targets: p50 ≤ 1 s, p95 ≤ 3 s, RSS ≤ 250 MB, zero steady-state writes.
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
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from kubecluster.controlplane import ControlPlane, Fleet, control_plane  # noqa: E402

NS = "bench"
OPERATOR_AGENTS = ("r3operator/", "kopf/")
WRITES = ("create", "update", "patch", "delete")
RESYNC_S = 10.0


def small_job(name: str) -> dict[str, Any]:
    """The Qwen3 example at the smallest footprint (one 1-GPU engine, a 1-GPU trainer), so that hundreds
    of jobs fit the fake fleet and every engine pod can run."""
    doc = copy.deepcopy(yaml.safe_load((REPO / "examples" / "qwen3-30b-a3b-r3-fsdp.yaml").read_text()))
    doc["metadata"] = {"name": name, "namespace": NS}
    inf = doc["spec"]["inference"]
    inf.update(replicas=1, tensorParallelSize=1, dataParallelSize=1, enableExpertParallel=False)
    inf.pop("dataParallelSizeLocal", None)
    doc["spec"]["trainer"].update(nodes=1, gpusPerNode=1)
    return doc


def _created_at(obj: dict[str, Any]) -> float:
    return datetime.fromisoformat(obj["metadata"]["creationTimestamp"].replace("Z", "+00:00")).timestamp()


def _children_latency(plane: ControlPlane, jobs: list[str]) -> list[float]:
    """Per RLJob: last child's creationTimestamp - the RLJob's (whole seconds on the apiserver's clock),
    refined with the audit log's sub-second stage timestamps."""
    created: dict[str, float] = {}
    last_child: dict[str, float] = {}
    with open(plane.audit_log) as log:
        for line in log:
            event = json.loads(line)
            # The operator creates children with server-side apply: a patch answered 201 Created.
            if event.get("verb") not in ("create", "patch") or event.get("responseStatus", {}).get("code") != 201:
                continue
            ref = event.get("objectRef", {})
            if ref.get("namespace") != NS:
                continue
            at = datetime.fromisoformat(event["stageTimestamp"].replace("Z", "+00:00")).timestamp()
            name = ref.get("name") or ""
            if ref.get("resource") == "rljobs":
                created[name] = at
            elif ref.get("resource") in ("statefulsets", "services", "configmaps", "persistentvolumeclaims", "rayjobs"):
                job = name.rsplit("-", 1)[0]
                last_child[job] = max(last_child.get(job, 0.0), at)
    return [last_child[j] - created[j] for j in jobs if j in created and j in last_child]


def _count_children(plane: ControlPlane) -> Counter[str]:
    counts: Counter[str] = Counter()
    for plural, group in (("statefulsets", "/apis/apps/v1"), ("rayjobs", "/apis/ray.io/v1"), ("services", "/api/v1")):
        for item in plane.request("GET", f"{group}/namespaces/{NS}/{plural}")["items"]:
            counts[item["metadata"]["name"].rsplit("-", 1)[0]] += 1
    return counts


def _engine_pods_running(plane: ControlPlane) -> tuple[int, int]:
    pods = plane.request("GET", f"/api/v1/namespaces/{NS}/pods?labelSelector=r3operator.io/role=engine")["items"]
    return sum(1 for p in pods if p["status"].get("phase") == "Running"), len(pods)


def _operator_requests(plane: ControlPlane, since: int) -> list[Any]:
    return [r for r in plane.requests()[since:] if r.user_agent.startswith(OPERATOR_AGENTS)]


def run_size(jobs: int, nodes: int, rate_per_s: float) -> dict[str, Any]:
    fleet = Fleet(nodes=nodes, gpus_per_node=8, cpu_nodes=2)
    with control_plane(fleet=fleet) as plane:
        plane.request("POST", "/api/v1/namespaces", {"metadata": {"name": NS}})
        subprocess.run(
            [str(REPO / ".tools" / "bin" / "kubectl"), "apply", "--server-side", "-f", str(REPO / "crds")],
            env={**os.environ, "KUBECONFIG": str(plane.kubeconfig)}, check=True, capture_output=True,
        )  # fmt: skip
        plane.wait_established("rljobs.r3operator.io")
        env = {**os.environ, "KUBECONFIG": str(plane.kubeconfig), "R3OPERATOR_METRICS_PORT": "0"}
        cmd = [sys.executable, "-m", "kopf", "run", "--standalone", "-n", NS, "-m", "r3operator.operator.handlers"]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        operator = psutil.Process(proc.pid)
        try:
            time.sleep(5)  # start-up (imports, login, first list/watch) is not part of the figures
            mark, cpu0 = len(plane.requests()), sum(operator.cpu_times()[:2])
            names = [f"job-{i:03d}" for i in range(jobs)]
            t0 = time.monotonic()
            path = f"/apis/r3operator.io/v1alpha1/namespaces/{NS}/rljobs"
            for i, name in enumerate(names):
                plane.request("POST", path, small_job(name))
                time.sleep(max(0.0, t0 + (i + 1) / rate_per_s - time.monotonic()))
            deadline = time.monotonic() + 600
            while sum(1 for n, c in _count_children(plane).items() if c >= 3 and n in names) < jobs:
                if time.monotonic() > deadline:
                    raise TimeoutError("children not all created after 600 s")
                time.sleep(1)
            all_children_s = time.monotonic() - t0
            while (running := _engine_pods_running(plane))[0] < jobs:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"engine pods running {running} after 600 s")
                time.sleep(1)
            engines_running_s = time.monotonic() - t0
            converge_requests = _operator_requests(plane, mark)
            cpu_converge = sum(operator.cpu_times()[:2]) - cpu0
            # Steady state: let status settle (engines Ready, conditions), then watch three resync rounds.
            time.sleep(2 * RESYNC_S)
            steady_mark, steady_t0, cpu1 = len(plane.requests()), time.monotonic(), sum(operator.cpu_times()[:2])
            time.sleep(3 * RESYNC_S)
            steady = _operator_requests(plane, steady_mark)
            steady_minutes = (time.monotonic() - steady_t0) / 60
            steady_writes = [r for r in steady if r.verb in WRITES and "/events" not in r.path]
            rss_mb = operator.memory_info().rss / 2**20
            cpu_steady = sum(operator.cpu_times()[:2]) - cpu1
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        latencies = _children_latency(plane, names)
    by_verb = Counter(r.verb for r in converge_requests)
    return {
        "jobs": jobs,
        "nodes": nodes,
        "create_rate_per_s": rate_per_s,
        "apply_to_children_p50_s": round(statistics.median(latencies), 3),
        "apply_to_children_p95_s": round(sorted(latencies)[int(0.95 * (len(latencies) - 1))], 3),
        "apply_to_children_max_s": round(max(latencies), 3),
        "all_children_after_s": round(all_children_s, 1),
        "all_engine_pods_running_after_s": round(engines_running_s, 1),
        "operator_requests_per_rljob_converging": round(len(converge_requests) / jobs, 1),
        "operator_requests_by_verb_converging": dict(by_verb),
        "steady_state_writes_per_min": round(len(steady_writes) / steady_minutes, 2),
        "steady_state_write_paths": sorted({r.path for r in steady_writes})[:10],
        "steady_state_requests_per_min": round(len(steady) / steady_minutes, 1),
        "operator_rss_mb": round(rss_mb, 1),
        "operator_cpu_s_converging": round(cpu_converge, 1),
        "operator_cpu_s_per_min_steady": round(cpu_steady / steady_minutes, 2),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, nargs="+", default=[50])
    parser.add_argument("--nodes", type=int, default=256)
    parser.add_argument("--rate", type=float, default=5.0, help="RLJob creates per second")
    args = parser.parse_args(argv or [])
    sizes = [run_size(n, args.nodes, args.rate) for n in args.jobs]
    result = {"sizes": sizes, "targets": {"p50_s": 1.0, "p95_s": 3.0, "rss_mb": 250, "steady_writes_per_min": 0}}
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
