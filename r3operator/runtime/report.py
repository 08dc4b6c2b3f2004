"""Run outputs: metrics.csv (one row per step), report.md and a PNG plot (matplotlib, Agg; optional:
without matplotlib the run still writes metrics.csv and report.md and says why there is no plot). A run with
`spec.evaluation` also has eval.csv (runtime/evaluation.py): the report and the plot show its eval reward."""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from r3operator.runtime.nonfinite import nonfinite_updates
from r3operator.runtime.step_record import COLUMNS
from r3operator.wire.sync_phases import SYNC_PHASES


def append_row(path: Path, row: Mapping[str, Any]) -> None:
    new = not path.exists()
    if not new:
        _upgrade_header(path)
    with path.open("a", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS, extrasaction="ignore")
        if new:
            writer.writeheader()
        writer.writerow({k: row.get(k, "") for k in COLUMNS})


def _upgrade_header(path: Path) -> None:
    """A run resumed by a newer image finds a metrics.csv whose header lacks newer columns: rewrite it under
    today's header (atomically) so that the rows appended next line up with their names."""
    with path.open() as fh:
        header = fh.readline().rstrip("\r\n").split(",")
    if header == list(COLUMNS):
        return
    rows = list(csv.DictReader(path.read_text().splitlines()))
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows({k: r.get(k, "") or "" for k in COLUMNS} for r in rows)
    tmp.replace(path)


def keep_rows_through(path: Path, last_step: int) -> int:
    """Keep only complete rows of steps <= `last_step`: a killed run may have finished steps after its last
    checkpoint (the resumed run does them again) or died mid-append. Rewritten atomically. Returns how
    many rows were dropped."""
    if not path.exists():
        return 0
    text = path.read_text()
    rows = list(csv.DictReader(text.splitlines()))
    kept = [r for r in rows if _complete_row_through(r, last_step)]
    if len(kept) == len(rows) and text.endswith("\n"):
        return 0
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows({k: row.get(k, "") for k in COLUMNS} for row in kept)
    tmp.replace(path)
    return len(rows) - len(kept)


def _complete_row_through(row: Mapping[str, Any], last_step: int) -> bool:
    if None in row.values():  # csv fills the fields missing from a row cut short with None
        return False
    try:
        return int(row["step"]) <= last_step
    except (KeyError, TypeError, ValueError):
        return False


def read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    with path.open() as fh:
        rows = list(csv.DictReader(fh))
    by_step: dict[int, dict[str, Any]] = {}
    for row in rows:  # a resumed run may repeat a step that was not checkpointed: keep the last
        by_step[int(row["step"])] = row
    return [by_step[s] for s in sorted(by_step)]


EVAL_CSV = "eval.csv"
EVAL_COLUMNS = (
    "step",
    "policy_version",
    "eval_reward_mean",
    "eval_reward_std",
    "prompts",
    "samples",
    "response_tokens_mean",
    "seconds",
)
"""eval.csv's header, in order: one row per held-out evaluation (runtime/evaluation.py), step 0 before training."""


def append_eval_row(path: Path, row: Mapping[str, Any]) -> None:
    new = not path.exists()
    with path.open("a", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=EVAL_COLUMNS)
        if new:
            writer.writeheader()
        writer.writerow({column: row[column] for column in EVAL_COLUMNS})


def read_eval_rows(path: Path) -> list[dict[str, Any]]:
    """eval.csv's complete rows by step (a step evaluated again by a resumed run keeps its last row)."""
    if not path.exists():
        return []
    by_step: dict[int, dict[str, Any]] = {}
    with path.open() as fh:
        for row in csv.DictReader(fh):
            if None in row.values() or not row.get("step"):  # a row cut short by a crash mid-append
                continue
            by_step[int(row["step"])] = row
    return [by_step[step] for step in sorted(by_step)]


def keep_eval_rows_through(path: Path, last_step: int) -> None:
    """A resumed run keeps the evaluations through its checkpoint's step (it runs the later steps again);
    rewritten atomically."""
    kept = [row for row in read_eval_rows(path) if int(row["step"]) <= last_step]
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=EVAL_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(kept)
    tmp.replace(path)


def _f(row: Mapping[str, Any], key: str) -> float:
    try:
        return float(row[key])
    except (KeyError, TypeError, ValueError):
        return math.nan


def reward_trend(rows: Sequence[Mapping[str, Any]], window: int = 3) -> tuple[float, float]:
    """Mean reward of the first and last `window` steps."""
    rewards = [_f(r, "reward_mean") for r in rows]
    w = max(1, min(window, len(rewards) // 2 or 1))
    return sum(rewards[:w]) / w, sum(rewards[-w:]) / w


PLOT_MISSING = "plot.png not written: matplotlib is not installed (pip install matplotlib; extra `runtime`)"


def write_plot(
    path: Path,
    runs: Mapping[str, Sequence[Mapping[str, Any]]],
    evals: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
) -> str | None:
    """Draw the plot (`evals`: each run's eval.csv rows, drawn beside its training reward); returns None, or why no
    plot was written (matplotlib missing)."""
    try:
        import matplotlib
    except ImportError:
        return PLOT_MISSING

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plot_figure(runs, evals)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


REWARD_PANEL = "reward (mean)"


def plot_figure(
    runs: Mapping[str, Sequence[Mapping[str, Any]]], evals: Mapping[str, Sequence[Mapping[str, Any]]] | None = None
) -> Any:
    """The plot's matplotlib Figure (matplotlib imported, Agg): reward (with the held-out eval reward, step 0
    included), mean |Δlogprob| and routing agreement per step."""
    import matplotlib.pyplot as plt

    # Each panel: (title, [(column, line label suffix, style)]). The routing panel shows what the trainer's
    # routers would choose by themselves (the alignment signal) and whether replay handed the experts the
    # engine's ids (100 % under R3 whenever the hook fires, aligned or not).
    panels = [
        (REWARD_PANEL, [("reward_mean", "", "-")]),
        ("mean |Δlogprob| rollout vs trainer", [("logprob_abs_diff_mean", "", "-")]),
        (
            "routing agreement with the engine",
            [("routing_natural_agreement", " trainer natural", "-"), ("replay_applied", " replay applied", "--")],
        ),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, (title, lines) in zip(axes, panels, strict=True):
        for label, rows in runs.items():
            for key, suffix, style in lines:
                ax.plot(
                    [int(r["step"]) for r in rows], [_f(r, key) for r in rows], style, marker="o", label=label + suffix
                )
        if title == REWARD_PANEL:
            for label, rows in (evals or {}).items():
                if rows:
                    steps = [int(r["step"]) for r in rows]
                    values = [_f(r, "eval_reward_mean") for r in rows]
                    ax.plot(steps, values, "--", marker="s", label=f"{label} held-out eval")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    return fig


def eval_lines(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The held-out evaluation of a run (its eval.csv rows): the first evaluation against the last, and the best."""
    if not rows:
        return []
    first, last = rows[0], rows[-1]
    start, end = _f(first, "eval_reward_mean"), _f(last, "eval_reward_mean")
    best = max(rows, key=lambda r: _f(r, "eval_reward_mean"))

    def when(row: Mapping[str, Any]) -> str:
        return "before training" if int(row["step"]) == 0 else f"after step {row['step']}"

    samples = int(_f(first, "samples") // max(_f(first, "prompts"), 1))
    return [
        f"- held-out eval reward ({first['prompts']} prompts × {samples}, {len(rows)} evaluations): "
        f"{start:.3f} {when(first)} → {end:.3f} {when(last)} ({end - start:+.3f}); best "
        f"{_f(best, 'eval_reward_mean'):.3f} {when(best)}"
    ]


def _mean(rows: Sequence[Mapping[str, Any]], key: str) -> float:
    vals = [_f(r, key) for r in rows if not math.isnan(_f(r, key))]
    return sum(vals) / len(vals) if vals else math.nan


def compare_section(runs: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[str]:
    """Replay off vs on, side by side: the figures `--compare-replay` exists for."""
    lines = [
        "## Replay off vs on (same seed)",
        "",
        "| run | mean abs Δlogprob | max abs Δlogprob | k3 KL | routing mismatch, trainer natural vs engine "
        "| replay applied (experts got the engine's ids) | reward start → end |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, rows in runs.items():
        if not rows:
            continue
        start, end = reward_trend(rows)
        lines.append(
            f"| {label} | {_mean(rows, 'logprob_abs_diff_mean'):.3g} | "
            f"{max(_f(r, 'logprob_abs_diff_max') for r in rows):.3g} | {_mean(rows, 'kl_k3'):.3g} | "
            f"{100 * (1 - _mean(rows, 'routing_natural_agreement')):.2f}% | "
            f"{100 * _mean(rows, 'replay_applied'):.2f}% | {start:.3f} → {end:.3f} |"
        )
    values = [(label, _mean(rows, "logprob_abs_diff_mean"), rows) for label, rows in runs.items() if rows]
    if len(values) == 2 and values[0][1] > 0:
        (off_label, off, off_rows), (on_label, on, on_rows) = values
        first_off, first_on = _f(off_rows[0], "logprob_abs_diff_mean"), _f(on_rows[0], "logprob_abs_diff_mean")
        lines += [
            "",
            f"- mean abs Δlogprob {on_label} / {off_label}: {on / off:.2f}× over all steps; step 1 (same seed and "
            f"warm-up, so the same rollouts up to the kernels' nondeterminism): {first_on:.3g} vs {first_off:.3g} "
            f"({first_on / first_off:.2f}×)"
            if first_off > 0
            else "",
        ]
    return [*lines, ""]


def _phase_line(rows: Sequence[Mapping[str, Any]]) -> str:
    """Each step phase's mean seconds; a phase no step ran (no evaluation, a synchronous run's pause) is named
    apart instead of showing as nan."""
    means = {c[2:]: _mean(rows, c) for c in COLUMNS if c.startswith("t_")}
    line = "- mean phase seconds: " + ", ".join(f"{p} {v:.2f}" for p, v in means.items() if not math.isnan(v))
    idle = [p for p, v in means.items() if math.isnan(v)]
    return line + (f" (not run: {', '.join(idle)})" if idle else "")


def _sync_phase_line(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    means = {p: _mean(rows, f"sync_{p}") for p in SYNC_PHASES}
    shown = [f"{p} {v:.3f}" for p, v in means.items() if not math.isnan(v)]
    return [f"- weight sync by phase (mean seconds): {', '.join(shown)}"] if shown else []


def _peak_memory_line(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    peaks = [_f(r, "trainer_peak_memory_gib") for r in rows]
    peaks = [p for p in peaks if not math.isnan(p)]
    return [f"- trainer peak GPU memory (largest rank): {max(peaks):.1f} GiB"] if peaks else []


def _by_lag(rows: Sequence[Mapping[str, Any]]) -> dict[int, tuple[int, float]]:
    """lag -> (tokens, mean |Δlogprob|) over every step, token-weighted, from the `*_by_lag` columns."""
    total: dict[int, tuple[int, float]] = {}
    for row in rows:
        diffs, counts = str(row.get("logprob_abs_diff_by_lag") or ""), str(row.get("tokens_by_lag") or "")
        if not diffs or not counts:
            continue
        for lag, (diff, count) in enumerate(zip(diffs.split(";"), counts.split(";"), strict=True)):
            if int(count):
                tokens, weighted = total.get(lag, (0, 0.0))
                total[lag] = (tokens + int(count), weighted + int(count) * float(diff))
    return {lag: (tokens, weighted / tokens) for lag, (tokens, weighted) in sorted(total.items())}


def fidelity_lines(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Engine vs trainer: |Δlogprob| and natural routing agreement over the steps that measured them; in
    the asynchronous mode only tokens of the current policy version count (the same weights on both
    sides), and the gap per staleness lag follows on its own line. A run where no step had such a token
    says so rather than printing NaN."""
    lagged = _by_lag(rows)
    measured = [r for r in rows if not math.isnan(_f(r, "logprob_abs_diff_mean"))]
    applied = f"replay applied (experts got the engine's ids): {_mean(rows, 'replay_applied'):.4f}"
    scope = ""
    if lagged:
        scope = (
            f" (tokens the current policy version sampled in trajectories it sampled alone, {len(measured)} of "
            f"{len(rows)} steps had them; the rest is staleness, by lag below)"
        )
    if measured:
        any_diff = _mean(measured, "routing_tokens_any_diff")  # NaN: no routes compared, or a file from before it
        differing = "" if math.isnan(any_diff) else f" (tokens with a layer routed differently: {100 * any_diff:.1f}%)"
        lines = [
            f"- mean |Δlogprob| rollout vs trainer (mean over steps){scope}: "
            f"{_mean(measured, 'logprob_abs_diff_mean'):.3g}; max over steps: "
            f"{max(_f(r, 'logprob_abs_diff_max') for r in measured):.3g}",
            f"- routing agreement, trainer natural vs engine: {_mean(measured, 'routing_natural_agreement'):.4f}"
            f"{differing}; {applied}",
        ]
    else:
        why = (
            "no step trained a token of the current policy version (the rollout queue ran ahead of the "
            "trainer), so nothing compares engine and trainer under the same weights but the weight-sync "
            "canary"
            if lagged
            else "no step trained a token"
        )
        lines = [f"- mean |Δlogprob| and routing agreement, rollout vs trainer: not measured: {why}; {applied}"]
    if lagged:
        shown = ", ".join(f"lag {lag} {diff:.3g} ({tokens} tokens)" for lag, (tokens, diff) in lagged.items())
        lines.append(
            f"- mean |Δlogprob| by staleness lag (policy updates between sampling and training; lag 0 is "
            f"the mismatch and the resumed trajectories' context, lag ≥ 1 adds the policy's drift, which the "
            f"importance weights correct): {shown}"
        )
    resumed = [r for r in rows if not math.isnan(_f(r, "logprob_abs_diff_mean_resumed"))]
    if resumed:
        lines.append(
            f"- mean |Δlogprob| of resumed trajectories' current-version tokens (partial rollouts: the engine "
            f"re-read their earlier tokens under the new weights, the trainer replays those tokens' old routes; "
            f"not in the figure above), mean over {len(resumed)} steps: "
            f"{_mean(resumed, 'logprob_abs_diff_mean_resumed'):.3g}"
        )
    return lines


def _canary_line(rows: Sequence[Mapping[str, Any]], canary: bool) -> str:
    """How many of the steps' syncs passed the canary; "off" when it never ran (not "0/N ok")."""
    if not canary:
        return "- weight-sync canary: off (spec.weightSync.canary: false)"
    # A skipped step, and one whose update was not applied (non-finite), had no sync: no weight_sync phase.
    synced = [r for r in rows if _synced(r)]
    ok = sum(1 for r in synced if str(r.get("canary_ok")) in ("1", "True"))
    return f"- weight-sync canary: passed after {ok} of {len(synced)} step syncs"


def _synced(row: Mapping[str, Any]) -> bool:
    """A skipped step has no sync, nor has a non-finite one that applied no update (no weight_sync phase)."""
    if str(row.get("skipped")) in ("1", "True"):
        return False
    return not nonfinite_updates(row) or row.get("t_weight_sync") not in (None, "")


def _nonfinite_line(rows: Sequence[Mapping[str, Any]]) -> str:
    """The steps whose update had a non-finite loss or gradient (runtime/nonfinite.py)."""
    steps = [str(r["step"]) for r in rows if nonfinite_updates(r)]
    listed = f" ({'step' if len(steps) == 1 else 'steps'} {', '.join(steps)})" if steps else ""
    return (
        f"- steps with a non-finite loss or gradient (those updates not applied; no sync or checkpoint when "
        f"none was): {len(steps)}{listed}"
    )


def write_report(
    path: Path,
    *,
    job_name: str,
    runs: Mapping[str, Sequence[Mapping[str, Any]]],
    facts: Mapping[str, Any],
    canary: bool = True,
    evals: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
) -> str:
    """report.md: per-run reward start → end and whether it rose, the held-out eval reward (`evals`: each run's
    eval.csv rows), Δlogprob, routing, canary, phase times."""
    lines = [f"# r3operator run report: {job_name}", ""]
    lines += [f"- {k}: {v}" for k, v in facts.items()]
    lines.append("")
    for label, rows in runs.items():
        if not rows:
            continue
        start, end = reward_trend(rows)
        rose = "rose" if end > start else "did NOT rise"
        lines += [
            f"## {label}",
            "",
            f"- steps: {rows[0]['step']}..{rows[-1]['step']}",
            f"- reward: start {start:.3f} (mean of the first steps) → end {end:.3f} (mean of the last steps): "
            f"the reward {rose} ({end - start:+.3f}); per step {_f(rows[0], 'reward_mean'):.3f} → "
            f"{_f(rows[-1], 'reward_mean'):.3f}",
            *eval_lines((evals or {}).get(label, ())),
            *fidelity_lines(rows),
            _canary_line(rows, canary),
            f"- steps skipped (no usable samples): {sum(1 for r in rows if str(r.get('skipped')) in ('1', 'True'))}",
            _nonfinite_line(rows),
            _phase_line(rows),
            *_sync_phase_line(rows),
            *_peak_memory_line(rows),
            "",
        ]
    if len(runs) > 1:
        lines += compare_section(runs)
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text
