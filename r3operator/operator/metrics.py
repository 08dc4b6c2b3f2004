"""Operator metrics (prometheus-client). kopf ships none; the server starts from a startup handler.

``METRICS`` is the table docs/operator.md and dashboards are written from.
"""

from __future__ import annotations

import contextlib
import datetime as dt
from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    start_http_server,
)

from r3operator.api.plan import plan
from r3operator.api.v1alpha1 import RLJob, RLJobStatus
from r3operator.operator.status import CONDITION_ORDER


@dataclass(frozen=True, slots=True)
class MetricDef:
    name: str
    type: str
    labels: tuple[str, ...]
    help: str


METRICS: tuple[MetricDef, ...] = (
    MetricDef("r3operator_reconcile_total", "counter", ("result",), "Reconcile passes by result (ok, invalid, error)."),
    MetricDef("r3operator_reconcile_errors_total", "counter", ("reason",), "Reconcile passes that raised, by reason."),
    MetricDef("r3operator_reconcile_duration_seconds", "histogram", (), "Wall time of one reconcile pass."),
    MetricDef(
        "r3operator_rljob_info",
        "gauge",
        ("namespace", "rljob", "replay_mode", "trainer_backend", "vllm_version"),
        "Always 1; labels describe the RLJob.",
    ),
    MetricDef(
        "r3operator_rljob_condition",
        "gauge",
        ("namespace", "rljob", "type", "status"),
        "1 for the condition's current status, 0 for the other two.",
    ),
    MetricDef("r3operator_rljob_step", "gauge", ("namespace", "rljob"), "status.progress.step (the driver's report)."),
    MetricDef(
        "r3operator_upgrade_phase",
        "gauge",
        ("namespace", "rljob", "phase"),
        "1 for the engine image upgrade's current phase (Canary, Rolling, Complete, Blocked, Cancelled), 0 otherwise.",
    ),
    MetricDef(
        "r3operator_upgrade_canary_natural_mismatch_ratio",
        "gauge",
        ("namespace", "rljob", "engine"),
        "Upgrade canary: token-layers where the trainer's router differs from the engine (engine=old|new).",
    ),
    MetricDef(
        "r3operator_upgrade_canary_logprob_abs_diff",
        "gauge",
        ("namespace", "rljob", "engine", "replay"),
        "Upgrade canary: mean |rollout - trainer logprob| per engine (old|new), replay off or R3.",
    ),
    MetricDef(
        "r3operator_leader",
        "gauge",
        (),
        "1 on the replica that holds the leader-election Lease and reconciles, 0 on a standby.",
    ),
    MetricDef(
        "r3operator_rljob_last_progress_timestamp_seconds",
        "gauge",
        ("namespace", "rljob"),
        "Unix time of the later of the last completed step (status.progress.updatedAt) and the Ready "
        "condition turning True.",
    ),
    MetricDef(
        "r3operator_rljob_no_progress_threshold_seconds",
        "gauge",
        ("namespace", "rljob"),
        "spec.monitoring.noProgressSeconds: RLJobNoProgress fires when a Ready job has made no step for longer.",
    ),
)

# No `*_created` series next to each counter and histogram: nothing reads them.
disable_created_metrics()  # type: ignore[no-untyped-call]
REGISTRY = CollectorRegistry(auto_describe=True)
_BY_NAME = {m.name: m for m in METRICS}


def _labels(name: str) -> tuple[str, ...]:
    return _BY_NAME[name].labels


def _counter(name: str) -> Counter:
    return Counter(name.removesuffix("_total"), _BY_NAME[name].help, _labels(name), registry=REGISTRY)


def _gauge(name: str) -> Gauge:
    return Gauge(name, _BY_NAME[name].help, _labels(name), registry=REGISTRY)


RECONCILE_TOTAL = _counter("r3operator_reconcile_total")
RECONCILE_ERRORS = _counter("r3operator_reconcile_errors_total")
RECONCILE_DURATION = Histogram(
    "r3operator_reconcile_duration_seconds",
    _BY_NAME["r3operator_reconcile_duration_seconds"].help,
    registry=REGISTRY,
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
RLJOB_INFO = _gauge("r3operator_rljob_info")
RLJOB_CONDITION = _gauge("r3operator_rljob_condition")
RLJOB_STEP = _gauge("r3operator_rljob_step")
UPGRADE_PHASE = _gauge("r3operator_upgrade_phase")
CANARY_MISMATCH = _gauge("r3operator_upgrade_canary_natural_mismatch_ratio")
CANARY_LOGPROB = _gauge("r3operator_upgrade_canary_logprob_abs_diff")
UPGRADE_PHASES = ("Canary", "Rolling", "Complete", "Blocked", "Cancelled")
LEADER = _gauge("r3operator_leader")
RLJOB_LAST_PROGRESS = _gauge("r3operator_rljob_last_progress_timestamp_seconds")
RLJOB_NO_PROGRESS_THRESHOLD = _gauge("r3operator_rljob_no_progress_threshold_seconds")
_PER_JOB = (RLJOB_STEP, RLJOB_LAST_PROGRESS, RLJOB_NO_PROGRESS_THRESHOLD)

_info_labels: dict[tuple[str, str], tuple[str, ...]] = {}


def observe_job(job: RLJob, status: RLJobStatus | None) -> None:
    key = (job.metadata.namespace or "", job.metadata.name)
    version = str(plan(job).engine_version)
    info = (*key, job.spec.routing_replay.mode.value, job.spec.trainer.backend.value, version)
    old = _info_labels.get(key)
    if old is not None and old != info:
        RLJOB_INFO.remove(*old)
    _info_labels[key] = info
    RLJOB_INFO.labels(*info).set(1)
    RLJOB_NO_PROGRESS_THRESHOLD.labels(*key).set(job.spec.monitoring.no_progress_seconds)
    if status is None:
        return
    current = {c.type: c.status.value for c in status.conditions}
    for ctype in CONDITION_ORDER:
        for value in ("True", "False", "Unknown"):
            RLJOB_CONDITION.labels(*key, ctype.value, value).set(1 if current.get(ctype.value) == value else 0)
    if status.progress is not None:
        RLJOB_STEP.labels(*key).set(status.progress.step)
    if status.upgrade is not None:
        _observe_upgrade(key, status)
    last = last_progress_time(status)
    if last is not None:
        RLJOB_LAST_PROGRESS.labels(*key).set(last)


def _observe_upgrade(key: tuple[str, str], status: RLJobStatus) -> None:
    upgrade = status.upgrade
    assert upgrade is not None
    for phase in UPGRADE_PHASES:
        UPGRADE_PHASE.labels(*key, phase).set(1 if upgrade.phase == phase else 0)
    canary = upgrade.canary
    for engine, figures in (("old", canary.old if canary else None), ("new", canary.new if canary else None)):
        if figures is None or not figures.routes_valid:
            continue
        if figures.natural_mismatch is not None:
            CANARY_MISMATCH.labels(*key, engine).set(figures.natural_mismatch)
        for replay, value in (("off", figures.logprob_abs_diff_off), ("r3", figures.logprob_abs_diff_r3)):
            if value is not None:
                CANARY_LOGPROB.labels(*key, engine, replay).set(value)


def _unix(stamp: str | None) -> float | None:
    if not stamp:
        return None
    try:
        return dt.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def last_progress_time(status: RLJobStatus) -> float | None:
    """The later of the last step and Ready turning True: a job that never steps after becoming Ready
    (or after a resume) counts from then, not from a step of an earlier run."""
    ready = next((c for c in status.conditions if c.type == "Ready" and c.status.value == "True"), None)
    stamps = [
        _unix(status.progress.updated_at if status.progress else None),
        _unix(ready.last_transition_time if ready else None),
    ]
    known = [s for s in stamps if s is not None]
    return max(known) if known else None


def forget_job(namespace: str, name: str) -> None:
    """Drop every series of a deleted RLJob (no stale 1s in dashboards)."""
    info = _info_labels.pop((namespace, name), None)
    if info is not None:
        RLJOB_INFO.remove(*info)
    for ctype in CONDITION_ORDER:
        for value in ("True", "False", "Unknown"):
            with contextlib.suppress(KeyError):
                RLJOB_CONDITION.remove(namespace, name, ctype.value, value)
    for gauge in _PER_JOB:
        with contextlib.suppress(KeyError):
            gauge.remove(namespace, name)
    for phase in UPGRADE_PHASES:
        with contextlib.suppress(KeyError):
            UPGRADE_PHASE.remove(namespace, name, phase)
    for engine in ("old", "new"):
        with contextlib.suppress(KeyError):
            CANARY_MISMATCH.remove(namespace, name, engine)
        for replay in ("off", "r3"):
            with contextlib.suppress(KeyError):
                CANARY_LOGPROB.remove(namespace, name, engine, replay)


_serving: set[int] = set()


def serve(port: int, addr: str = "0.0.0.0") -> None:
    """Start the exporter once per port: with leader election it starts before kopf (a standby is scraped
    too), and kopf's startup handler then finds it running."""
    if port in _serving:
        return
    start_http_server(port, addr=addr, registry=REGISTRY)
    _serving.add(port)
