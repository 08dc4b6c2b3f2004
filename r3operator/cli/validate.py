"""`r3operator validate`: schema + rules over files, with stable JSON rows."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from r3operator.api import RLJobLoadError, Severity, evaluate, load_rljobs
from r3operator.api.load import source_name
from r3operator.api.rules import errors
from r3operator.cli.cluster_facts import rule_context


@dataclass(frozen=True, slots=True)
class Row:
    file: str
    rule: str
    severity: str
    field: str
    message: str

    def as_json(self) -> dict[str, str]:
        return {
            "file": self.file,
            "rule": self.rule,
            "severity": self.severity,
            "field": self.field,
            "message": self.message,
        }


@dataclass(slots=True)
class ValidationResults:
    rows: list[Row] = field(default_factory=list)
    files_ok: list[str] = field(default_factory=list)
    load_failed: bool = False

    @property
    def exit_code(self) -> int:
        if self.load_failed:
            return 2
        return 1 if any(r.severity == Severity.ERROR for r in self.rows) else 0


def validate_files(files: list[Path], *, leader_worker_set: bool | None = None) -> ValidationResults:
    """``leader_worker_set``: whether the cluster serves LeaderWorkerSet (None: not known, cli/cluster_facts.py)."""
    results = ValidationResults()
    for path in files:
        try:
            jobs = load_rljobs(path)
        except RLJobLoadError as exc:
            results.load_failed = True
            for p in exc.problems:
                results.rows.append(Row(exc.source, "schema", Severity.ERROR.value, p.field, p.message))
            continue
        findings = [f for job in jobs for f in evaluate(job.spec, context=rule_context(job.spec, leader_worker_set))]
        results.rows += [Row(source_name(path), f.rule, f.severity.value, f.field, f.message) for f in findings]
        if not errors(findings):
            results.files_ok.append(source_name(path))
    return results
