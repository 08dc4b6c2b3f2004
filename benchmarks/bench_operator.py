"""Operator scale benchmark on the real control plane (tests/kubecluster: kube-apiserver, controllers,
scheduler, kwok fake GPU nodes, KubeRay).

Two operator processes run as the chart runs them (``r3operator operator --leader-elect``, production
defaults: 300 s resync, children from watches): one leads, one stands by. For each fleet size, over N
RLJobs created one after another at a fixed rate, it measures:

- apply → every child exists (p50/p95/max), from the RLJob's create to the last child's create, and the
  time until every engine pod is Running (real StatefulSet controller + scheduler + kwok);
- API requests per RLJob made by the operator (the apiserver's audit log, by user agent) while converging;
- convergence, detected: every RLJob has ended (kwok's RayJobs fail a few minutes after they start, once:
  ``backoffLimit`` 0) and then, for ``QUIET_S``, no RLJob changed and the operator wrote nothing;
- at rest, over ``STEADY_S`` after convergence: requests per minute by verb and resource, its watches
  aside (target: 0 writes and ≤ 1 request per minute per RLJob), and the operator's RSS;
- child change → RLJob status, both as a client's watch sees them: the engine StatefulSet ready (the
  controller's status write, when its pod became Ready) → the RLJob's EnginesReady; and the RayJob failed
  (KubeRay's status write: kwok's Ray cluster has no dashboard, so each RayJob fails once, its
  ``backoffLimit`` 0) → the RLJob's Failed;
- leader failover under load: the leader gets SIGTERM, a child is deleted at once; the time until the
  standby has taken the Lease and re-created it.

- with ``--apiserver-metrics``, where a create's watch event waits: kube-apiserver's and etcd's /metrics
  scraped before the creates, after them and once the engine pods run (watch cache events received and
  dispatched, watch events sent, terminated watchers, priority-and-fairness waits, the audit backend, etcd's
  request time, Go's scheduler latency) with each process's CPU and the whole box's busy share, next to each
  create answered → the benchmark's own watch event (one clock); ``--audit-mode batch`` runs the API server
  with its audit log written off the request path, to compare with the default ``blocking``.

    python -m benchmarks.bench_operator [--jobs 100 500] [--nodes 256] [--out benchmarks/results/x.json]

Targets: p50 ≤ 1 s, p95 ≤ 3 s, child change → status p95 ≤ 2 s, RSS ≤ 250 MB at 500, zero writes at rest,
failover ≤ 15 s.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
import yaml

from benchmarks.report_json import emit

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from kubecluster.controlplane import ControlPlane, Fleet, control_plane  # noqa: E402

NS = "bench"
OPERATOR_AGENTS = ("r3operator/", "kopf/")
WRITES = ("create", "update", "patch", "delete")
QUIET_S = 30.0
"""Convergence: this long with no RLJob changed and no operator write."""
STEADY_S = 60.0


def small_job(name: str) -> dict[str, Any]:
    """The Qwen3 example at the smallest footprint (one 1-GPU engine, a 1-GPU trainer), so that hundreds
    of jobs fit the fake fleet and every engine pod can run."""
    doc = copy.deepcopy(yaml.safe_load((REPO / "examples" / "qwen3-30b-a3b-r3-fsdp.yaml").read_text()))
    doc["metadata"] = {"name": name, "namespace": NS}
    inf = doc["spec"]["inference"]
    inf.update(replicas=1, tensorParallelSize=1, dataParallelSize=1, enableExpertParallel=False)
    inf.pop("dataParallelSizeLocal", None)
    doc["spec"]["trainer"].update(nodes=1, gpusPerNode=1)
    # One attempt: kwok's RayJob fails a few minutes after it starts (no Ray dashboard answers KubeRay), and
    # each retry of the example's backoffLimit 3 would put that end minutes later again.
    doc["spec"]["runPolicy"]["backoffLimit"] = 0
    return doc


CHILD_RESOURCES = (
    "statefulsets",
    "services",
    "configmaps",
    "persistentvolumeclaims",
    "rayjobs",
    "jobs",
    "networkpolicies",
    "serviceaccounts",
    "roles",
    "rolebindings",
)
"""Every child the operator creates for the benchmark's RLJob."""


def _children_latency(plane: ControlPlane, jobs: list[str]) -> tuple[list[float], float | None, list[float]]:
    """Per RLJob: its last child's create - its own, from the audit log's sub-second stage timestamps (the
    apiserver's clock); when the last child of all was created (wall clock; None unless every RLJob has one); and
    the first figure as runs before 2026-11-27 07:00 UTC computed it, one create per child *name* (the first
    kind's under a shared name), to compare with them."""
    created: dict[str, float] = {}
    last_child: dict[str, float] = {}
    first_create: dict[tuple[str, str], float] = {}
    first_by_name: dict[str, float] = {}
    last_by_name: dict[str, float] = {}
    with open(plane.audit_log, "rb") as log:
        for line in log:
            if b'"code":201' not in line:  # a create; the others are most of a log of hundreds of MB
                continue
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
            elif ref.get("resource") in CHILD_RESOURCES and _by_operator(event):  # not KubeRay's Job and Services
                job = "-".join(name.split("-")[:2])  # job-NNN-engine, job-NNN-model-cache, ...
                # Each child's first create: the failover below deletes one and the operator creates it again. By
                # resource and name: the engine Service, StatefulSet and NetworkPolicy share a name, as do the
                # trainer's ServiceAccount, Role, RoleBinding and RayJob.
                child = (str(ref.get("resource")), name)
                first_create.setdefault(child, at)
                last_child[job] = max(last_child.get(job, 0.0), first_create[child])
                first_by_name.setdefault(name, at)
                last_by_name[job] = max(last_by_name.get(job, 0.0), first_by_name[name])
    latencies = [last_child[j] - created[j] for j in jobs if j in created and j in last_child]
    by_name = [last_by_name[j] - created[j] for j in jobs if j in created and j in last_by_name]
    return latencies, max(last_child[j] for j in jobs) if all(j in last_child for j in jobs) else None, by_name


TIMELINE_STEPS = ("daemon", "start", "synced", "desired", "read", "written", "status")
"""The operator's first-pass timeline line (handlers.reconcile_loop, Outcome.marks), in the order a pass reaches
them: its daemon spawned (kopf saw the RLJob), the pass began, the caches synced, desired() rendered, every
child read (the writes go out next), the writes answered, the status written."""
TIMELINE_LINE = re.compile(r"\[([^/\]]+)/([^\]]+)\] first pass timeline: (.*)$")


def _first_pass_marks(log_path: Path) -> dict[str, dict[str, float]]:
    """Per RLJob, the first timeline line its operator logged (a standby that takes over logs its own later)."""
    marks: dict[str, dict[str, float]] = {}
    with contextlib.suppress(FileNotFoundError), open(log_path, errors="replace") as log:
        for line in log:
            if (found := TIMELINE_LINE.search(line.rstrip("\n"))) is not None and found[2] not in marks:
                steps = dict(pair.split("=", 1) for pair in found[3].split())
                marks[found[2]] = {step: float(at) for step, at in steps.items() if step in TIMELINE_STEPS}
    return marks


def _timeline(
    plane: ControlPlane,
    jobs: list[str],
    log_path: Path,
    client_saw: dict[str, float] | None = None,
    ends: dict[str, tuple[float, float]] | None = None,
) -> dict[str, Any]:
    """Where an RLJob's apply → children time goes: the audit log's stamps (its create, the operator's requests
    naming the job or its children: when each was received, when answered) lined up with the operator's own
    first-pass marks (same host, same clock). p50/p95 of each segment, over the RLJobs that have all of them.
    ``ends``: per RLJob, when the benchmark's watches saw its RayJob fail and the RLJob's Failed; that way split
    at the operator's end record (its patch of the RLJob's annotations) and the status write after it."""
    created: dict[str, float] = {}
    kopf_first: dict[str, float] = {}
    op_first: dict[str, float] = {}
    first_write: dict[str, float] = {}
    last_write: dict[str, float] = {}
    before_write: Counter[str] = Counter()
    rljob_writes: Counter[str] = Counter()
    write_server: list[float] = []
    read_server: list[float] = []
    end_record: dict[str, float] = {}
    status_answered: dict[str, list[float]] = {}
    wanted = set(jobs)
    for event in _audit(plane, b'"name":"job-'):  # node heartbeats and the rest, most of the log, skipped unparsed
        ref = event.get("objectRef") or {}
        if ref.get("namespace") != NS or event.get("verb") == "watch":
            continue
        name = str(ref.get("name") or "")
        job = "-".join(name.split("-")[:2])
        if job not in wanted:
            continue
        received, answered = _stamp_of(event, "requestReceivedTimestamp"), _stamp(event)
        code = (event.get("responseStatus") or {}).get("code")
        if ref.get("resource") == "rljobs" and event.get("verb") in WRITES:
            # Each write of an RLJob is one more event the API server's RLJob watch cache decodes and sends to
            # every RLJob watcher, in order: a create's event waits behind the writes before it.
            agent = str(event.get("userAgent", "")).split("/", 1)[0]
            rljob_writes[f"{agent} {event.get('verb')} {ref.get('subresource') or ''}".strip()] += 1
            if agent == "r3operator" and event.get("verb") == "patch":
                if ref.get("subresource") == "status":
                    status_answered.setdefault(job, []).append(answered)
                else:  # the end record (reconcile.Reconciler._record_finish): the operator's only RLJob patch
                    end_record.setdefault(job, received)
        if ref.get("resource") == "rljobs" and not ref.get("subresource"):
            if event.get("verb") == "create" and code == 201:
                created[job] = answered
            elif str(event.get("userAgent", "")).startswith("kopf/"):
                kopf_first.setdefault(job, received)
            continue
        if not str(event.get("userAgent", "")).startswith("r3operator/") or ref.get("resource") not in CHILD_RESOURCES:
            continue
        op_first.setdefault(job, received)
        child = f"{ref.get('resource')}/{name}"  # several kinds share a child's name (_children_latency)
        if event.get("verb") in ("create", "patch") and code == 201 and child not in last_write:
            first_write.setdefault(job, received)
            last_write[child] = answered
            last_write[job] = max(last_write.get(job, 0.0), answered)
            write_server.append(answered - received)
        elif event.get("verb") == "get":
            read_server.append(answered - received)
            if job not in first_write:
                before_write[job] += 1
    marks = _first_pass_marks(log_path)

    def segment(start: Any, end: Any) -> dict[str, Any]:
        gaps = [end(j) - start(j) for j in jobs if start(j) is not None and end(j) is not None]
        return _latencies(gaps)

    def mark(step: str) -> Any:
        return lambda j: (marks.get(j) or {}).get(step)

    def status_after_record(job: str) -> float | None:
        if job not in end_record:
            return None
        return min((at for at in status_answered.get(job, []) if at >= end_record[job]), default=None)

    ray_failed = {j: ray for j, (ray, _) in (ends or {}).items()}
    rljob_failed = {j: failed for j, (_, failed) in (ends or {}).items()}

    return {
        "create → kopf's first request on the RLJob (its finalizer)": segment(created.get, kopf_first.get),
        # Another watcher of the same RLJobs (the benchmark's own, in another process): late too, the API server's
        # delivery is slow; on time, the wait is kopf's.
        "create → the benchmark's own RLJob watch got it": segment(created.get, (client_saw or {}).get),
        "create → daemon spawned (kopf saw the RLJob)": segment(created.get, mark("daemon")),
        "daemon spawned → pass began": segment(mark("daemon"), mark("start")),
        "pass began → caches synced": segment(mark("start"), mark("synced")),
        "caches synced → desired() (discovery, references, the reads of every child name)": segment(
            mark("synced"), mark("desired")
        ),
        "desired() → every child read (names the first reads missed, claims)": segment(mark("desired"), mark("read")),
        "every child read → first child write received (audit)": segment(mark("read"), first_write.get),
        "first child write received → last child answered (audit)": segment(first_write.get, last_write.get),
        "writes answered → status written": segment(mark("written"), mark("status")),
        "create → last child answered (audit)": segment(created.get, last_write.get),
        "child write, API server time (received → answered)": _latencies(write_server),
        "child GET, API server time (received → answered)": _latencies(read_server),
        "child GETs before the first write, per RLJob": _latencies([float(before_write[j]) for j in jobs]),
        "RayJob Failed (the benchmark's watch) → the operator's end record received (audit)": segment(
            ray_failed.get, end_record.get
        ),
        "end record received → the next status write answered (audit)": segment(end_record.get, status_after_record),
        "that status write answered → the benchmark's watch saw Failed": segment(status_after_record, rljob_failed.get),
        "rljobs with a first-pass timeline line": len([j for j in jobs if j in marks]),
        "RLJob writes per RLJob over the run, by user agent, verb and subresource": {
            key: round(count / max(len(jobs), 1), 2) for key, count in sorted(rljob_writes.items())
        },
    }


def _stamp_of(event: dict[str, Any], key: str) -> float:
    return datetime.fromisoformat(str(event.get(key) or event["stageTimestamp"]).replace("Z", "+00:00")).timestamp()


def _list(plane: ControlPlane, path: str) -> list[dict[str, Any]]:
    """A LIST the benchmark polls, tried again when the loaded API server does not answer within the client's 30 s
    (a 500-RLJob run died of one): a poll that is late is no failure of what it measures."""
    for attempt in range(5):
        try:
            return list(plane.request("GET", path)["items"])
        except (TimeoutError, OSError):
            if attempt == 4:
                raise
            time.sleep(2)
    raise AssertionError("unreachable")


def _engine_pods_running(plane: ControlPlane) -> tuple[int, int]:
    pods = _list(plane, f"/api/v1/namespaces/{NS}/pods?labelSelector=r3operator.io/role=engine")
    return sum(1 for p in pods if p["status"].get("phase") == "Running"), len(pods)


def _audit(plane: ControlPlane, containing: bytes = b"") -> Iterator[dict[str, Any]]:
    with open(plane.audit_log, "rb") as log:
        for line in log:
            if line.endswith(b"\n") and containing in line:
                yield json.loads(line)


def _stamp(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(event["stageTimestamp"].replace("Z", "+00:00")).timestamp()


def _by_operator(event: dict[str, Any]) -> bool:
    return str(event.get("userAgent", "")).startswith(OPERATOR_AGENTS)


_OPERATOR_SEEN: dict[str, tuple[int, list[dict[str, Any]]]] = {}
"""Per audit log: how far it was read, and the operator's requests in it so far. The log grows to hundreds of MB
at 500 RLJobs: read whole every 5 s (the convergence check), the benchmark itself would load the box."""


def _operator_requests(plane: ControlPlane, since: float, until: float | None = None) -> list[dict[str, Any]]:
    """The operator's completed requests in [since, until) (wall clock), its open watches and its Lease aside."""
    path = str(plane.audit_log)
    offset, seen = _OPERATOR_SEEN.get(path, (0, []))
    with open(path, "rb") as log:
        log.seek(offset)
        for raw in log:
            if not raw.endswith(b"\n"):
                break  # a line still being written: read again next time
            offset += len(raw)
            if b'"userAgent":"r3operator/' not in raw and b'"userAgent":"kopf/' not in raw:
                continue
            e = json.loads(raw)
            if _by_operator(e) and e.get("verb") != "watch" and (e.get("objectRef") or {}).get("resource") != "leases":
                e["_at"] = _stamp(e)
                seen.append(e)
    _OPERATOR_SEEN[path] = (offset, seen)
    end = until if until is not None else float("inf")
    return [e for e in seen if since <= e["_at"] < end]


def _resource(event: dict[str, Any]) -> str:
    ref = event.get("objectRef") or {}
    sub = ref.get("subresource")
    return f"{ref.get('resource', '?')}/{sub}" if sub else str(ref.get("resource", "?"))


def _rljob_versions(plane: ControlPlane) -> tuple[dict[str, str], int]:
    """Each RLJob's resourceVersion, and how many have ended (Failed or Succeeded True)."""
    items = _list(plane, f"/apis/r3operator.io/v1alpha1/namespaces/{NS}/rljobs")
    ended = sum(1 for i in items if _condition_true("Failed")(i) or _condition_true("Succeeded")(i))
    return {i["metadata"]["name"]: i["metadata"]["resourceVersion"] for i in items}, ended


def _wait_converged(plane: ControlPlane, since: float, jobs: int, timeout_s: float) -> float | None:
    """Seconds after ``since`` until every RLJob has ended (each RayJob fails once here) and then QUIET_S passed
    with no RLJob changed and no operator write (events aside): a quiet spell while KubeRay still waits on its
    RayJobs is not rest. None when that did not happen within ``timeout_s`` (the figures after it are then not
    at rest, and say so)."""
    (versions, _), quiet_from = _rljob_versions(plane), time.time()
    while time.time() - since < timeout_s:
        time.sleep(5)
        now_versions, ended = _rljob_versions(plane)
        writes = [
            e for e in _operator_requests(plane, quiet_from) if e.get("verb") in WRITES and _resource(e) != "events"
        ]
        if now_versions != versions or writes or ended < jobs:
            versions, quiet_from = now_versions, time.time()
        elif time.time() - quiet_from >= QUIET_S:
            return quiet_from - since
    return None


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def _pct(values: list[float], q: float) -> float:
    return round(sorted(values)[int(q * (len(values) - 1))], 3) if values else float("nan")


def _latencies(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    return {"n": len(values), "p50_s": _pct(values, 0.5), "p95_s": _pct(values, 0.95), "max_s": round(max(values), 3)}


class Recorder:
    """A watch of one resource in NS from the benchmark's side: (arrival time, object) of every event, to time
    a child's change against the RLJob's status as a client sees both."""

    def __init__(self, plane: ControlPlane, path: str) -> None:
        self.events: list[tuple[float, dict[str, Any]]] = []
        self._url = f"{plane.url}{path}?watch=true&timeoutSeconds=3600"
        self._plane = plane
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        # A refused or broken watch (429 from a loaded apiserver) starts again: its first events re-send every
        # object, which first() skips past only where a condition was first met while it was down.
        request = urllib.request.Request(self._url, headers={"Authorization": f"Bearer {self._plane.admin_token}"})
        while True:
            try:
                with urllib.request.urlopen(request, context=self._plane.ssl_context(), timeout=3700) as stream:
                    for line in stream:
                        event = json.loads(line)
                        self.events.append((time.time(), event.get("object") or {}))
            except (OSError, ValueError):
                time.sleep(1)

    def first(self, name: str, predicate: Any, since: float = 0.0) -> float | None:
        for at, obj in list(self.events):
            if at >= since and obj.get("metadata", {}).get("name") == name and predicate(obj):
                return at
        return None


def _condition_true(ctype: str) -> Any:
    def check(obj: dict[str, Any]) -> bool:
        conditions = (obj.get("status") or {}).get("conditions") or []
        return any(c.get("type") == ctype and c.get("status") == "True" for c in conditions)

    return check


def _sts_ready(obj: dict[str, Any]) -> bool:
    want = int((obj.get("spec") or {}).get("replicas") or 0)
    return want > 0 and int((obj.get("status") or {}).get("readyReplicas") or 0) >= want


def _gaps(pairs: list[tuple[float | None, float | None]]) -> list[float]:
    return [b - a for a, b in pairs if a is not None and b is not None]


def _ray_job_failed(obj: dict[str, Any]) -> bool:
    return (obj.get("status") or {}).get("jobDeploymentStatus") == "Failed"


APISERVER_SERIES = (
    "apiserver_watch_events_total",
    "apiserver_watch_events_sizes",
    "apiserver_watch_cache_",
    "apiserver_terminated_watchers_total",
    "apiserver_registered_watchers",
    "apiserver_longrunning_requests",
    "apiserver_request_duration_seconds",
    "apiserver_request_total",
    "apiserver_flowcontrol_request_wait_duration_seconds",
    "apiserver_flowcontrol_rejected_requests_total",
    "apiserver_flowcontrol_current_inqueue_requests",
    "apiserver_flowcontrol_current_executing_seats",
    "apiserver_current_inflight_requests",
    "apiserver_audit_",
    "apiserver_storage_events_received_total",
    "etcd_request_duration_seconds",
    "etcd_bookmark_counts",
    "process_cpu_seconds_total",
    "go_sched_latencies_seconds",
)
"""kube-apiserver's series on a create's way to a watcher: etcd's watch into the watch cache (events received),
the cache's dispatch to each watcher (dispatched, terminated watchers: a watcher too slow to take its events),
what consistent reads waited for the cache to catch up with etcd (read wait), the request and priority-and-fairness
queues, the audit backend, etcd's request time, the process's CPU, and how long its runnable goroutines waited
for a thread (Go's scheduler latency: what CPU starvation looks like from inside)."""
ETCD_SERIES = (
    "etcd_server_",
    "etcd_mvcc_",
    "etcd_debugging_mvcc_current_revision",
    "etcd_debugging_mvcc_slow_watcher_total",
    "etcd_debugging_mvcc_pending_events_total",
    "etcd_debugging_mvcc_watcher_total",
    "process_cpu_seconds_total",
    "go_sched_latencies_seconds",
)
REQUEST_RESOURCES = ("rljobs", "statefulsets", "configmaps", "pods", "rayjobs", "leases", "jobs", "services")
"""apiserver_request_* are kept for these resources only (every node's heartbeat and lease is the rest)."""


def _scrape(plane: ControlPlane, operators: dict[str, int]) -> dict[str, Any]:
    """Raw /metrics texts and CPU times now; parsed after the run, so the parse costs the measured box nothing."""
    cpu = {}
    pids = {name: proc.popen.pid for name, proc in plane.processes.items()} | operators
    for name, pid in pids.items():
        with contextlib.suppress(psutil.Error):
            cpu[name] = sum(psutil.Process(pid).cpu_times()[:2])
    return {
        "at": time.time(),
        "kube-apiserver": plane.metrics_text("kube-apiserver"),
        "etcd": plane.metrics_text("etcd"),
        "process_cpu_s": cpu,
        "system_cpu": psutil.cpu_times()._asdict(),
        "load_average": list(os.getloadavg()),
    }


def _samples(text: str, prefixes: tuple[str, ...]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.startswith(prefixes):
                continue
            resource = sample.labels.get("resource")
            if sample.name.startswith("apiserver_request_") and resource not in REQUEST_RESOURCES:
                continue
            out[(sample.name, tuple(sorted(sample.labels.items())))] = float(sample.value)
    return out


def _bucket_quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """The upper bound of the bucket holding quantile q of (le, cumulative count) pairs: an upper estimate."""
    buckets = sorted(buckets)
    total = buckets[-1][1] if buckets else 0.0
    for le, count in buckets:
        if total > 0 and count >= q * total:
            return le
    return None


def _bucket_text(le: float | None) -> float | str | None:
    return "+Inf" if le == float("inf") else le  # JSON has no infinity


def _metrics_delta(before: str, after: str, prefixes: tuple[str, ...]) -> dict[str, Any]:
    """What changed between two scrapes: counters and histograms as deltas (a histogram as count, mean and the
    buckets holding its p50/p95), gauges as their value after; unchanged series left out."""
    old, new = _samples(before, prefixes), _samples(after, prefixes)
    histograms: dict[tuple[str, tuple[tuple[str, str], ...]], dict[str, Any]] = {}
    histogram_names = {name.removesuffix("_bucket") for name, _ in new if name.endswith("_bucket")}
    plain: dict[str, Any] = {}
    for (name, labels), value in new.items():
        delta = value - old.get((name, labels), 0.0)
        if name.endswith(("_bucket", "_sum", "_count")) and name.rsplit("_", 1)[0] in histogram_names:
            base, part = name.rsplit("_", 1)
            key = (base, tuple((k, v) for k, v in labels if k != "le"))
            entry = histograms.setdefault(key, {"buckets": []})
            if part == "bucket":
                entry["buckets"].append((float(dict(labels)["le"]), delta))
            else:
                entry[part] = delta
            continue
        label_text = ",".join(f"{k}={v}" for k, v in labels)
        is_counter = name.endswith(("_total", "_seconds_total"))
        if is_counter and delta == 0:
            continue
        plain[f"{name}{{{label_text}}}"] = round(delta if is_counter else value, 3)
    for (base, labels), entry in sorted(histograms.items()):
        count = entry.get("count", 0.0)
        if count <= 0:
            continue
        label_text = ",".join(f"{k}={v}" for k, v in labels)
        plain[f"{base}{{{label_text}}}"] = {
            "count": round(count, 1),
            "mean_s": round(entry.get("sum", 0.0) / count, 4),
            "p50_bucket_le": _bucket_text(_bucket_quantile(entry["buckets"], 0.5)),
            "p95_bucket_le": _bucket_text(_bucket_quantile(entry["buckets"], 0.95)),
        }
    return plain


def _window(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """One window between two scrapes: the API server's and etcd's series, each process's CPU seconds, and how
    busy the whole box was (1.0 = both cores)."""
    seconds = after["at"] - before["at"]
    system = {k: after["system_cpu"][k] - before["system_cpu"][k] for k in after["system_cpu"]}
    idle = system.get("idle", 0.0) + system.get("iowait", 0.0)
    return {
        "seconds": round(seconds, 1),
        "box_cpu_busy_share": round(1 - idle / max(sum(system.values()), 1e-9), 3),
        "load_average_after": [round(x, 2) for x in after["load_average"]],
        "process_cpu_share": {
            name: round((after["process_cpu_s"][name] - before["process_cpu_s"].get(name, 0.0)) / seconds, 3)
            for name in after["process_cpu_s"]
        },
        "kube-apiserver": _metrics_delta(before["kube-apiserver"], after["kube-apiserver"], APISERVER_SERIES),
        "etcd": _metrics_delta(before["etcd"], after["etcd"], ETCD_SERIES),
    }


def _start_operator(
    plane: ControlPlane, name: str, retry_s: float, profile: Path | None, probe: str = "off"
) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "KUBECONFIG": str(plane.kubeconfig),
        "R3OPERATOR_METRICS_PORT": "0",
        "R3OPERATOR_POD_NAME": name,
        "PYTHONPATH": str(REPO),
        "R3_PROBE_OUT": str(_probe_path(plane, name)),
    }
    if probe == "tracemalloc":
        env["R3_PROBE_TRACEMALLOC"] = "1"
    for variable in ("R3OPERATOR_RESYNC_SECONDS", "R3OPERATOR_DISCOVERY_TTL_SECONDS", "R3OPERATOR_SETTLE_SECONDS"):
        env.pop(variable, None)  # production defaults
    # Lease duration and renew deadline 60/40 s rather than the defaults' 15/10: on the shared 2-core box the API
    # server can stall for seconds, and a leader that cannot renew within the deadline exits. The retry period
    # (--lease-retry, the chart's 2 s by default) is how often the standby asks: it bounds the takeover. The
    # failover below is a SIGTERM, which releases the Lease: no wait for the lease duration.
    prefix = [sys.executable] if profile is None else [sys.executable, "-m", "cProfile", "-o", str(profile)]
    main = ["-m", "benchmarks.operator_probe"] if probe != "off" else ["-m", "r3operator"]
    cmd = [
        *prefix,
        *main,
        "operator",
        "-n",
        NS,
        "--liveness",
        "",
        "--leader-elect",
        "--leader-election-namespace",
        NS,
        "--lease-duration",
        "60",
        "--renew-deadline",
        "40",
        "--retry-period",
        str(retry_s),
    ]
    log = open(plane.logs / f"operator-{name}.log", "wb")  # noqa: SIM115 (the process owns it)
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)


def _probe_path(plane: ControlPlane, name: str) -> Path:
    return plane.logs / f"memory-{name}.json"


def _probe(plane: ControlPlane, proc: subprocess.Popen[bytes], name: str) -> dict[str, Any] | None:
    """operator_probe.py's snapshot of a running operator (SIGUSR1), or None when it wrote none within 120 s."""
    path = _probe_path(plane, name)
    path.unlink(missing_ok=True)
    proc.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError, ValueError):
            return dict(json.loads(path.read_text()))
        time.sleep(0.5)
    return None


def _holder(plane: ControlPlane) -> str:
    lease = plane.request("GET", f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases/r3operator-leader") or {}
    return str((lease.get("spec") or {}).get("holderIdentity") or "")


def _wait(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.1)


def _waited(predicate: Any, timeout: float, since: float) -> float | None:
    """Seconds from ``since`` until ``predicate()``; None when it did not hold within ``timeout``."""
    try:
        _wait(predicate, timeout, "")
    except TimeoutError:
        return None
    return time.monotonic() - since


def run_size(
    jobs: int,
    nodes: int,
    rate_per_s: float,
    retry_s: float,
    profile: Path | None,
    converge_timeout_s: float,
    probe: str = "off",
    audit_mode: str = "blocking",
    apiserver_metrics: bool = False,
) -> dict[str, Any]:
    fleet = Fleet(nodes=nodes, gpus_per_node=8, cpu_nodes=2)
    with control_plane(fleet=fleet, audit_mode=audit_mode) as plane:
        plane.request("POST", "/api/v1/namespaces", {"metadata": {"name": NS}})
        subprocess.run(
            [str(REPO / ".tools" / "bin" / "kubectl"), "apply", "--server-side", "-f", str(REPO / "crds")],
            env={**os.environ, "KUBECONFIG": str(plane.kubeconfig)},
            check=True,
            capture_output=True,
        )
        plane.wait_established("rljobs.r3operator.io")
        leader = _start_operator(
            plane, "op-a", retry_s, profile.resolve() / f"op-a-{jobs}.prof" if profile else None, probe
        )
        procs = [leader]
        try:
            _wait(lambda: _holder(plane).startswith("op-a_"), 60, "op-a never took the Lease")
            standby = _start_operator(plane, "op-b", retry_s, None, "gc" if probe != "off" else "off")
            procs.append(standby)
            operator = psutil.Process(leader.pid)
            sts = Recorder(plane, f"/apis/apps/v1/namespaces/{NS}/statefulsets")
            rljobs = Recorder(plane, f"/apis/r3operator.io/v1alpha1/namespaces/{NS}/rljobs")
            rayjobs = Recorder(plane, f"/apis/ray.io/v1/namespaces/{NS}/rayjobs")
            time.sleep(5)  # start-up (imports, login, first list/watch) is not part of the figures
            pids = {"operator-leader": leader.pid, "operator-standby": standby.pid}
            scrapes = [_scrape(plane, pids)] if apiserver_metrics else []
            cpu0, t0_wall = sum(operator.cpu_times()[:2]), time.time()
            names = [f"job-{i:03d}" for i in range(jobs)]
            t0 = time.monotonic()
            path = f"/apis/r3operator.io/v1alpha1/namespaces/{NS}/rljobs"
            # When the benchmark had each create's answer (its own clock, as its watch's arrivals are).
            answered: dict[str, float] = {}
            for i, name in enumerate(names):
                plane.request("POST", path, small_job(name))
                answered[name] = time.time()
                time.sleep(max(0.0, t0 + (i + 1) / rate_per_s - time.monotonic()))
            if apiserver_metrics:
                scrapes.append(_scrape(plane, pids))
            # The operator is one Python thread: a share near 1.0 while the RLJobs arrive means it was CPU-bound,
            # and every step of a first pass waited for the event loop.
            creating_s, cpu_creating = time.monotonic() - t0, sum(operator.cpu_times()[:2]) - cpu0
            # Past a deadline the run goes on and records what it saw: a figure is None, never a crash.
            deadline, running = time.monotonic() + 600, (0, jobs)
            # Polled every 2 s, one labelled LIST: the benchmark's own reads are load on the box it measures.
            engines_running_s: float | None = None

            # Once an RLJob has ended its engines stop: every engine pod running at once can no longer happen.
            def ended() -> bool:
                return any(
                    _condition_true("Failed")(o) or _condition_true("Succeeded")(o) for _, o in list(rljobs.events)
                )

            while engines_running_s is None and time.monotonic() < deadline and not ended():
                if (running := _engine_pods_running(plane))[0] >= jobs:
                    engines_running_s = time.monotonic() - t0
                time.sleep(2)
            if apiserver_metrics:
                scrapes.append(_scrape(plane, pids))
            converged_after_s = _wait_converged(plane, t0_wall, jobs, converge_timeout_s)
            converge_requests = _operator_requests(plane, t0_wall)
            cpu_converge = sum(operator.cpu_times()[:2]) - cpu0
            # At rest.
            steady_t0, cpu1 = time.time(), sum(operator.cpu_times()[:2])
            time.sleep(STEADY_S)
            steady_t1 = time.time()
            steady = _operator_requests(plane, steady_t0, steady_t1)
            steady_minutes = (steady_t1 - steady_t0) / 60
            steady_writes = [e for e in steady if e.get("verb") in WRITES and _resource(e) != "events"]
            rss_mb = operator.memory_info().rss / 2**20
            cpu_steady = sum(operator.cpu_times()[:2]) - cpu1
            memory: dict[str, dict[str, Any] | None] = {}
            if probe != "off":
                memory["leader"] = _probe(plane, leader, "op-a")
            engines_to_status = _gaps(
                [
                    (sts.first(f"{n}-engine", _sts_ready), rljobs.first(n, _condition_true("EnginesReady")))
                    for n in names
                ]
            )
            ends = {
                n: (ray, failed)
                for n in names
                if (ray := rayjobs.first(f"{n}-trainer", _ray_job_failed)) is not None
                and (failed := rljobs.first(n, _condition_true("Failed"))) is not None
            }
            failed_to_status = [failed - ray for ray, failed in ends.values()]
            # Leader failover: SIGTERM (a rolling update), then a child deleted at once.
            victim = f"/api/v1/namespaces/{NS}/configmaps/{names[-1]}-config"
            old_uid = plane.request("GET", victim)["metadata"]["uid"]
            leader_held_until_failover = leader.poll() is None and _holder(plane).startswith("op-a_")
            t_fail = time.monotonic()
            leader.send_signal(signal.SIGTERM)
            plane.request("DELETE", victim)
            lease_after_s = _waited(lambda: _holder(plane).startswith("op-b_"), 120, t_fail)

            def uid() -> str | None:
                return ((plane.request("GET", victim) or {}).get("metadata") or {}).get("uid")

            failover_s = _waited(lambda: uid() not in (None, old_uid), 180, t_fail)
            # The standby's state once it holds what the leader held: a first pass over every RLJob (its own
            # timeline lines), not the moment it took the Lease.
            standby_log = plane.logs / "operator-op-b.log"
            standby_passes_s = _waited(lambda: len(_first_pass_marks(standby_log)) >= jobs, 300, t_fail)
            rss_standby_mb = psutil.Process(standby.pid).memory_info().rss / 2**20
            # Which operator re-created the child: the new leader, or the old one in a pass before it stopped (its
            # log holds the first create too).
            created = f"created ConfigMap/{names[-1]}-config"
            recreated_by = [
                who
                for who, before in (("op-a", 1), ("op-b", 0))
                if (plane.logs / f"operator-{who}.log").read_text(errors="replace").count(created) > before
            ]
            # Where the RLJob whose child went missing came in the new leader's first passes (takeover.py orders
            # them): how many of the others began theirs before it.
            taken = _first_pass_marks(standby_log)
            victim_start = taken.get(names[-1], {}).get("start")
            passes_before_victim = (
                sum(1 for n, m in taken.items() if n != names[-1] and m.get("start", 0.0) < victim_start)
                if victim_start is not None
                else None
            )
            if probe != "off":
                memory["standby_after_taking_over"] = _probe(plane, standby, "op-b")
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.terminate()
                    try:
                        proc.wait(timeout=60)
                    except subprocess.TimeoutExpired:
                        proc.kill()
        latencies, last_child_at, latencies_by_name = _children_latency(plane, names)
        client_saw = {n: at for n in names if (at := rljobs.first(n, lambda _: True)) is not None}
        # Both stamps are the benchmark's: no clock but its own between the answer and the event.
        own_watch_delay = {n: client_saw[n] - answered[n] for n in names if n in client_saw}
        timeline = _timeline(plane, names, plane.logs / "operator-op-a.log", client_saw, ends)
    by_verb = Counter(e["verb"] for e in converge_requests)
    by_resource = Counter(f"{e['verb']} {_resource(e)}" for e in steady)
    return {
        "jobs": jobs,
        "nodes": nodes,
        "lease_retry_period_s": retry_s,
        "create_rate_per_s": rate_per_s,
        "apply_to_children": _latencies(latencies),
        "apply_to_children_one_create_per_name": _latencies(latencies_by_name),
        "apply_to_children_timeline": timeline,
        "create_answered_to_own_watch_event": _latencies(list(own_watch_delay.values())),
        # In creation order, a tenth of the RLJobs each: a delay that grows with the load the run has built.
        "create_answered_to_own_watch_event_p50_by_tenth": [
            _pct(part, 0.5)
            for k in range(10)
            if (
                part := [
                    own_watch_delay[n] for n in names[k * jobs // 10 : (k + 1) * jobs // 10] if n in own_watch_delay
                ]
            )
        ],
        "audit_log_mode": audit_mode,
        "apiserver_metrics": {
            "while creating": _window(scrapes[0], scrapes[1]),
            "creates done → engine pods running or an RLJob ended": _window(scrapes[1], scrapes[2]),
        }
        if len(scrapes) == 3
        else {},
        "all_children_after_s": _round(last_child_at - t0_wall if last_child_at is not None else None),
        "all_engine_pods_running_after_s": _round(engines_running_s),
        "converged_after_s": _round(converged_after_s),
        "engine_pods_running_at_the_end": list(running),
        "operator_requests_per_rljob_converging": round(len(converge_requests) / jobs, 1),
        "operator_requests_by_verb_converging": dict(by_verb),
        "steady_window_s": STEADY_S,
        "steady_state_writes_per_min": round(len(steady_writes) / steady_minutes, 2),
        "steady_state_write_paths": sorted({e.get("requestURI", "") for e in steady_writes})[:10],
        "steady_state_requests_per_min": round(len(steady) / steady_minutes, 1),
        "steady_state_requests_per_min_per_rljob": round(len(steady) / steady_minutes / jobs, 3),
        "steady_state_requests_by_verb_resource": dict(by_resource),
        "engine_ready_to_status": _latencies(engines_to_status),
        "rayjob_failed_to_status": _latencies(failed_to_status),
        "leader_held_the_lease_until_the_failover": leader_held_until_failover,
        "failover_lease_taken_after_s": _round(lease_after_s),
        "failover_child_recreated_after_s": _round(failover_s),
        "operator_rss_mb": round(rss_mb, 1),
        "standby_first_passes_after_failover_s": _round(standby_passes_s),
        "failover_first_passes_before_the_one_with_the_deleted_child": passes_before_victim,
        "failover_child_recreated_by": recreated_by,
        "standby_rss_mb_after_its_first_passes": round(rss_standby_mb, 1),
        "operator_cpu_share_while_creating": round(cpu_creating / creating_s, 2),
        "operator_cpu_s_converging": round(cpu_converge, 1),
        "operator_cpu_s_per_min_steady": round(cpu_steady / steady_minutes, 2),
        "memory_probe": memory,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, nargs="+", default=[50])
    parser.add_argument("--nodes", type=int, default=256)
    parser.add_argument("--rate", type=float, default=5.0, help="RLJob creates per second")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    parser.add_argument("--converge-timeout", type=float, default=900.0, help="s after the first create")
    parser.add_argument("--lease-retry", type=float, default=2.0, help="the operators' --retry-period (s)")
    parser.add_argument("--profile", type=Path, help="run the leader under cProfile, its stats in this folder")
    parser.add_argument(
        "--memory-probe",
        choices=("off", "gc", "tracemalloc"),
        default="off",
        help="snapshot both operators' memory (benchmarks/operator_probe.py); tracemalloc: the "
        "leader's heap by line too (slow)",
    )
    parser.add_argument(
        "--audit-mode",
        choices=("blocking", "batch"),
        default="blocking",
        help="kube-apiserver's --audit-log-mode (the timelines read the log either way)",
    )
    parser.add_argument(
        "--apiserver-metrics",
        action="store_true",
        help="scrape kube-apiserver's and etcd's /metrics before and after the creates: the watch path's series",
    )
    args = parser.parse_args(argv or [])
    # A SIGTERM stops the run through its finally blocks: the operators and the control plane go with it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    load_before = os.getloadavg()
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    sizes = [
        run_size(
            n,
            args.nodes,
            args.rate,
            args.lease_retry,
            args.profile,
            args.converge_timeout,
            args.memory_probe,
            args.audit_mode,
            args.apiserver_metrics,
        )
        for n in args.jobs
    ]
    result = {
        "date": datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": f"{platform.node()}: {os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB",
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "sizes": sizes,
        "targets": {
            "p50_s": 1.0,
            "p95_s": 3.0,
            "change_to_status_p95_s": 2.0,
            "rss_mb": 250,
            "steady_writes_per_min": 0,
            "steady_requests_per_min_per_rljob": 1,
            "failover_s": 15,
        },
    }
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
