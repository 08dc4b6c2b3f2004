"""A finished run's metrics.csv as the driver's Prometheus series: the dashboards over a run nobody scraped.

A run with no Prometheus beside it (`r3operator run` on a workstation, a lent GPU, a benchmark) still leaves its
metrics.csv, one row per step (runtime/step_record.py). Each row is played again through the driver's own exporter
(`RuntimeMetrics`, a registry of its own per run), in the order the driver sets them after a step (runtime/step_rows.py
`StepRows`: the fidelity figures, then `publish`'s `observe_step`; the evaluation's `observe_eval`, the canary's
verdict), and the registry is read after every row: one sample of every series at the step's end, so each series
holds the value a scrape would have read then, a series the driver removed (`clear_fidelity`) has no sample. The
samples are written as OpenMetrics with their timestamps; `promtool tsdb create-blocks-from openmetrics` makes them
blocks a real Prometheus serves (observability/prom.py), and the dashboards' own queries draw them
(`r3operator dashboard-preview --run`).

The timeline: metrics.csv keeps no wall clock, so step k ends at the runs' common start plus the sum of the run's
`step_seconds` through k; runs given together are taken to have started together (the learning benchmark starts its
modes side by side). What no column keeps is not made up: the per-layer routing agreement and the tokens with any
routing difference (only their mean is a column), the |Δlogprob| std and min, route bytes, the weight sync's own
seconds (its step phase, `t_weight_sync`, is there), staleness histograms and drop counters; their panels say "no
data". Held-out evaluations hold their last value between them, as the driver's gauge does.
"""

from __future__ import annotations

import csv
import math
import subprocess
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from r3operator.runtime.metrics import RuntimeMetrics
from r3operator.runtime.step_record import StepRecord

FIDELITY_COLUMNS: Mapping[str, str] = {
    "logprob_abs_diff_mean": "r3operator_logprob_abs_diff_mean",
    "logprob_abs_diff_max": "r3operator_logprob_abs_diff_max",
    "kl_k3": "r3operator_kl_k3",
    "extreme_token_fraction": "r3operator_extreme_token_ratio",
}
"""metrics.csv's fidelity columns and the gauges `R3Metrics.observe_logprobs` sets from the same figures."""
STEP_COLUMNS = ("step", "policy_version", "reward_mean", "tokens_per_second", "step_seconds")
"""What `RuntimeMetrics.observe_step` exports of a row (with its phases, the `t_<phase>` columns)."""
ROUTING_COLUMNS: Mapping[str, str] = {"routing_tokens_any_diff": "r3operator_routing_tokens_any_diff_ratio"}
"""The routing figures a row keeps whole, and their gauges (`R3Metrics.observe_routing`; the per-layer agreement a row
keeps only as a mean, so that is not played). Absent from the files of runs before them."""
BACKFILLED = frozenset(
    {
        *FIDELITY_COLUMNS.values(),
        *ROUTING_COLUMNS.values(),
        *(f"r3operator_{column}" for column in STEP_COLUMNS),
        "r3operator_step_phase_seconds",
        "r3operator_eval_reward",
        "r3operator_eval_step",
        "r3operator_weight_sync_canary_ok",
        "r3operator_replay_active",
    }
)
"""The series a row gives back exactly. The exporter makes the others at 0 when it starts (so a live counter reads 0
before its first event); played from a file they would read as a measured 0, so they are left out."""


class BackfillError(ValueError):
    """A metrics.csv that cannot be played again (the message names the file, and the row or column)."""


@dataclass(frozen=True)
class RunRows:
    """One run's metrics.csv rows, the `rljob` label its series get, and its evaluation before training (eval.csv's
    step 0, which no step row carries), if it had one."""

    rljob: str
    path: Path
    rows: list[dict[str, str]]
    eval_before: float | None = None

    @property
    def seconds(self) -> float:
        """The run's length: the sum of its steps' `step_seconds`."""
        return sum(_number(self.path, row, "step_seconds") or 0.0 for row in self.rows)


@dataclass(frozen=True)
class Sample:
    """One series' value at one time: what a scrape of the driver would have read then."""

    name: str
    labels: tuple[tuple[str, str], ...]
    value: float
    timestamp: float


def read_run(path: Path, rljob: str | None = None) -> RunRows:
    """A run's rows from `path`: its metrics.csv, or a run directory holding one. `rljob` defaults to the directory's
    name (a `<name>-metrics.csv` file: `<name>`)."""
    csv_path = path / "metrics.csv" if path.is_dir() else path
    if not csv_path.is_file():
        raise BackfillError(f"{csv_path}: no metrics.csv there (give a run directory or its metrics.csv)")
    with csv_path.open(newline="") as fh:
        reader = csv.DictReader(fh)
        missing = [c for c in (*STEP_COLUMNS, "replay_mode") if c not in (reader.fieldnames or [])]
        if missing:
            raise BackfillError(f"{csv_path}: not a run's metrics.csv, it has no column {missing[0]!r}")
        rows = list(reader)
    if not rows:
        raise BackfillError(f"{csv_path}: no step recorded yet")
    by_step: dict[int, dict[str, str]] = {}
    for row in rows:  # a resumed run may repeat a step that was not checkpointed: its last row is the one that held
        by_step[int(_number(csv_path, row, "step") or 0)] = row
    named = csv_path.name != "metrics.csv"  # the learning benchmark's `<mode>-metrics.csv` beside `<mode>-eval.csv`
    if rljob is None:
        rljob = csv_path.stem.removesuffix("-metrics") if named else csv_path.parent.name
    evals = csv_path.with_name(csv_path.name.replace("metrics.csv", "eval.csv"))
    return RunRows(rljob, csv_path, [by_step[step] for step in sorted(by_step)], _eval_before(evals))


def _eval_before(path: Path) -> float | None:
    """The held-out reward of the evaluation before training (step 0 of eval.csv, runtime/report.py), if any."""
    if not path.is_file():
        return None
    with path.open(newline="") as fh:
        for row in csv.DictReader(fh):
            if (row.get("step") or "").strip() == "0":
                return _number(path, row, "eval_reward_mean")
    return None


def _number(path: Path, row: Mapping[str, str], column: str) -> float | None:
    """The cell as a number; None when it is empty (the step had no such figure)."""
    text = (row.get(column) or "").strip()
    if not text:
        return None
    try:
        return float(text)
    except ValueError:
        raise BackfillError(f"{path}: step {row.get('step')!r}, column {column!r} is {text!r}, not a number") from None


def _record(run: RunRows, row: Mapping[str, str]) -> StepRecord:
    """What `observe_step` reads of the row (the other fields are not exported)."""

    def number(column: str) -> float:
        value = _number(run.path, row, column)
        if value is None:
            raise BackfillError(f"{run.path}: step {row.get('step')!r} has no {column}")
        return value

    return StepRecord(
        step=int(number("step")),
        policy_version=int(number("policy_version")),
        replay_mode=row["replay_mode"],
        reward_mean=number("reward_mean"),
        reward_std=0.0,
        samples=0,
        samples_dropped=0,
        tokens=0,
        tokens_per_second=number("tokens_per_second"),
        step_seconds=number("step_seconds"),
    )


def play(run: RunRows, start: float, *, namespace: str = "default") -> Iterator[Sample]:
    """Every series of the driver's exporter after each of `run`'s steps, the step ending at `start` plus the run's
    seconds through it (see the module doc)."""
    metrics = RuntimeMetrics(run.rljob, namespace=namespace)
    metrics.r3.set_replay_active(run.rows[0]["replay_mode"] == "R3")  # a property of the job (runtime/loop.py setup)
    if run.eval_before is not None:  # set up, then evaluated before step 1
        metrics.observe_eval(0, run.eval_before)
    yield from _snapshot(metrics, start)
    at = start
    for row in run.rows:
        figures = {column: _number(run.path, row, column) for column in FIDELITY_COLUMNS}
        if any(value is None or math.isnan(value) for value in figures.values()):
            metrics.r3.clear_fidelity()  # a step with no token measured: the driver removes the series
        else:
            for column, name in FIDELITY_COLUMNS.items():
                metrics.r3.set(name, float(figures[column] or 0.0))
            for column, name in ROUTING_COLUMNS.items():
                value = _number(run.path, row, column)
                if value is None or math.isnan(value):
                    metrics.r3.clear_fidelity(routing_only=True)  # no routes compared (or an older file): no series
                else:
                    metrics.r3.set(name, value)
        phases = {
            column.removeprefix("t_"): seconds
            for column in row
            if column.startswith("t_") and (seconds := _number(run.path, row, column)) is not None
        }
        record = _record(run, row)
        metrics.observe_step(record, phases)
        if (reward := _number(run.path, row, "eval_reward")) is not None:
            metrics.observe_eval(record.step, reward)
        if (_number(run.path, row, "canary_ok") or 0.0) > 0:  # the canary ran and passed (else the run stopped)
            metrics.set("r3operator_weight_sync_canary_ok", 1.0)
        at += record.step_seconds
        yield from _snapshot(metrics, at)


def _snapshot(metrics: RuntimeMetrics, at: float) -> Iterator[Sample]:
    """The registry's `BACKFILLED` series as a scrape reads them at `at`."""
    for family in metrics.registry.collect():
        if family.name not in BACKFILLED:
            continue
        for sample in family.samples:
            yield Sample(sample.name, tuple(sorted(sample.labels.items())), float(sample.value), at)


def openmetrics(samples: Iterable[Sample]) -> str:
    """`samples` (gauges: every `BACKFILLED` series is one) as an OpenMetrics text with timestamps, what promtool
    backfills: each family's samples together, each series in time order."""
    families: dict[str, list[Sample]] = {}
    for sample in samples:
        families.setdefault(sample.name, []).append(sample)
    lines: list[str] = []
    for family, members in sorted(families.items()):
        lines.append(f"# TYPE {family} gauge")
        for s in sorted(members, key=lambda s: (s.name, s.labels, s.timestamp)):
            labels = ",".join(f'{k}="{_escaped(v)}"' for k, v in s.labels)
            lines.append(f"{s.name}{{{labels}}} {s.value!r} {s.timestamp:.3f}")
    lines.append("# EOF")
    return "\n".join(lines) + "\n"


def _escaped(value: str) -> str:
    """A label value as OpenMetrics writes it: backslash, double quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def backfill(runs: Sequence[RunRows], start: float, out: Path, *, promtool: str) -> Path:
    """`runs`' series from `start` into TSDB blocks under `out` (promtool); returns `out`."""
    samples = [sample for run in runs for sample in play(run, start)]
    out.mkdir(parents=True, exist_ok=True)
    text = out.parent / f"{out.name}.om"
    text.write_text(openmetrics(samples))
    done = subprocess.run(
        [promtool, "tsdb", "create-blocks-from", "openmetrics", str(text), str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise BackfillError(f"promtool could not make blocks of {text}: {(done.stderr or done.stdout).strip()[-600:]}")
    return out
