"""The operator benchmark's apply → every child, read from an audit log written here: every child counts, also
those that share a name with another kind (the engine Service, StatefulSet and NetworkPolicy; the trainer's
ServiceAccount, Role, RoleBinding and RayJob), and the end of an RLJob is split at the operator's end record."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from benchmarks.bench_operator import NS, _children_latency, _timeline

T0 = datetime(2026, 11, 27, 7, 0, tzinfo=UTC)


def _event(
    at: float,
    verb: str,
    resource: str,
    name: str,
    agent: str,
    *,
    code: int = 201,
    subresource: str | None = None,
    took: float = 0.1,
) -> dict[str, Any]:
    ref = {"resource": resource, "namespace": NS, "name": name, **({"subresource": subresource} if subresource else {})}

    def stamp(seconds: float) -> str:
        return (T0 + timedelta(seconds=seconds)).isoformat().replace("+00:00", "Z")

    return {
        "verb": verb,
        "objectRef": ref,
        "userAgent": agent,
        "responseStatus": {"code": code},
        "requestReceivedTimestamp": stamp(at - took),
        "stageTimestamp": stamp(at),
    }


def _plane(tmp_path: Path, events: list[dict[str, Any]]) -> Any:
    log = tmp_path / "audit.log"
    log.write_text("".join(json.dumps(e, separators=(",", ":")) + "\n" for e in events))
    return SimpleNamespace(audit_log=log)


CHILDREN = (
    ("configmaps", "job-000-config"),
    ("services", "job-000-engine"),
    ("serviceaccounts", "job-000-trainer"),
    ("statefulsets", "job-000-engine"),  # after the Service of the same name
    ("rayjobs", "job-000-trainer"),  # after the ServiceAccount of the same name
)


def test_every_child_counts_also_one_that_shares_its_name_with_a_child_created_before_it(tmp_path: Path) -> None:
    events = [_event(0.0, "create", "rljobs", "job-000", "Python-urllib/3.12")]
    events += [
        _event(0.2 + 0.3 * i, "patch", resource, name, "r3operator/0.1") for i, (resource, name) in enumerate(CHILDREN)
    ]
    latencies, _, by_name = _children_latency(_plane(tmp_path, events), ["job-000"])
    assert latencies == [pytest.approx(0.2 + 0.3 * 4)]  # the RayJob, the last child written
    assert by_name == [pytest.approx(0.2 + 0.3 * 2)]  # the old reading: the ServiceAccount, first under its name


def test_the_rljobs_end_is_split_at_the_end_record_and_the_status_write_after_it(tmp_path: Path) -> None:
    start = T0.timestamp()
    events = [
        _event(0.0, "create", "rljobs", "job-000", "Python-urllib/3.12"),
        _event(5.0, "patch", "rljobs", "job-000", "r3operator/0.1", code=200, subresource="status"),  # before the end
        _event(10.5, "patch", "rljobs", "job-000", "r3operator/0.1", code=200, took=0.3),  # the end record
        _event(11.0, "patch", "rljobs", "job-000", "r3operator/0.1", code=200, subresource="status", took=0.2),
    ]
    ends = {"job-000": (start + 10.0, start + 11.4)}
    timeline = _timeline(_plane(tmp_path, events), ["job-000"], tmp_path / "no-operator.log", None, ends)
    record = timeline["RayJob Failed (the benchmark's watch) → the operator's end record received (audit)"]
    status = timeline["end record received → the next status write answered (audit)"]
    watch = timeline["that status write answered → the benchmark's watch saw Failed"]
    assert record["p50_s"] == pytest.approx(0.2, abs=1e-3)  # received at 10.2 s, the RayJob failed at 10.0 s
    assert status["p50_s"] == pytest.approx(0.8, abs=1e-3)  # 10.2 → 11.0, not the status write at 5.0 s
    assert watch["p50_s"] == pytest.approx(0.4, abs=1e-3)
