"""Read what verl and r3operator logged for one run each and set them side by side in one table.

verl 0.9.1 logs one dict per step (`Tracking.log`): to the console as ``step:N - key:value - …``
(`verl/utils/logger/aggregate_logger.py:concat_dict_to_str`) and, with `trainer.logger` holding `file`, as JSONL
lines ``{"step": N, "data": {…}}`` (`FileLogger`, path `VERL_FILE_LOGGER_PATH`). The keys read here:
`timing_s/{gen,old_log_prob,update_actor,update_weights,step}` (seconds), `response_length/mean` (tokens per
sample), `perf/max_memory_allocated_gb` (the trainer's torch peak, GiB), `critic/score/mean` (reward),
`training/rollout_probs_diff_{mean,max}` (|Δp| in probability space) and `peer/logprob_abs_diff_{mean,max}`,
`peer/kl_k3` (|Δlogprob| and k3 KL, added by verl_hook/sitecustomize.py).

r3operator writes `metrics.csv` (r3operator/runtime/step_record.py COLUMNS), one row per step.

Every figure is computed the same way for both: the first step (engine and kernel warm-up) is left out when there
are more; per-GPU figures divide by the GPUs of the machine, whatever each framework uses of them.
"""

from __future__ import annotations

import csv
import json
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PHASES = ("rollout", "old_logprob", "update", "weight_sync", "pause", "other")
"""`pause`: the asynchronous mode's wait for the rollout segment in flight before a weight sync (r3operator's
`t_pause`); synchronous runs have none."""
VERL_PHASES = {
    "rollout": "timing_s/gen",
    "old_logprob": "timing_s/old_log_prob",
    "update": "timing_s/update_actor",
    "weight_sync": "timing_s/update_weights",
}
R3_PHASES = {
    "rollout": "t_rollout",
    "old_logprob": "t_old_logprob",
    "update": "t_update",
    "weight_sync": "t_weight_sync",
}
_CONSOLE = re.compile(r"^step:(\d+)\s+-\s+(.*)$")


class MetricsError(ValueError):
    """A log that cannot be read as a run's metrics; the message names the file and what is missing."""


@dataclass
class RunSummary:
    framework: str
    replay: str
    gpus: int
    steps: int  # steps logged
    measured_steps: int  # steps the means are over (the first is left out when there are more)
    generated_tokens_per_s_per_gpu: float
    trained_tokens_per_s_per_gpu: float
    step_seconds: float
    split: dict[str, float]
    trainer_peak_gib: float | None
    gpu_peak_gib: list[float] | None
    logprob_abs_diff_mean: float | None
    logprob_abs_diff_max: float | None
    kl_k3: float | None
    routing_agreement: float | None
    reward: list[float] = field(default_factory=list)
    extra: dict[str, float] = field(default_factory=dict)
    logprob_abs_diff_by_step: dict[int, float] = field(default_factory=dict)  # every logged step, step 1 too

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# ---- readers ----------------------------------------------------------------------------------------------------


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _cell(text: str) -> float | str:
    value = _number(text)
    return text if value is None else value


def read_verl_log(path: Path) -> dict[int, dict[str, float]]:
    """Step -> metrics from verl's JSONL file logger, or from its console log when the path is not JSONL. Later
    lines for a step update earlier ones (verl logs a step once; a restarted run logs it again)."""
    if not path.is_file():
        raise MetricsError(f"{path}: no such file")
    steps: dict[int, dict[str, float]] = {}
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
        line = line.strip()
        if line.startswith("{"):
            try:
                record = json.loads(line)
                step, data = int(record["step"]), record["data"]
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                raise MetricsError(f"{path}:{number}: not a verl metrics line (expected {{'step', 'data'}})") from None
            values = {k: float(v) for k, v in data.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        else:
            match = _CONSOLE.match(line)
            if match is None:
                continue  # the console log holds everything else the run printed
            step = int(match.group(1))
            values = {}
            for item in match.group(2).split(" - "):
                key, sep, raw = item.rpartition(":")
                value = _number(raw)
                if sep and value is not None:
                    values[key] = value
        steps.setdefault(step, {}).update(values)
    if not steps:
        raise MetricsError(f"{path}: no step metrics (neither JSONL lines nor 'step:N - key:value' lines)")
    return steps


def read_r3_metrics(path: Path) -> list[dict[str, float | str]]:
    if not path.is_file():
        raise MetricsError(f"{path}: no such file")
    with path.open(newline="") as fh:
        reader = csv.DictReader(fh)
        missing = {"step", "tokens", "step_seconds", *R3_PHASES.values()} - set(reader.fieldnames or ())
        if missing:
            raise MetricsError(f"{path}: not an r3operator metrics.csv (no column {', '.join(sorted(missing))})")
        rows: list[dict[str, float | str]] = []
        for row in reader:
            rows.append({k: _cell(v) for k, v in row.items()})
    if not rows:
        raise MetricsError(f"{path}: no steps")
    return rows


def read_gpu_peaks(path: Path) -> list[float] | None:
    """The runner's nvidia-smi samples (`gpu,used_mib` lines): the largest per GPU, in GiB; None without a file."""
    if not path.is_file():
        return None
    peaks: dict[int, float] = {}
    for line in path.read_text().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 2 or _number(parts[0]) is None or _number(parts[1]) is None:
            continue
        gpu, used = int(float(parts[0])), float(parts[1]) / 1024
        peaks[gpu] = max(peaks.get(gpu, 0.0), used)
    return [round(peaks[g], 2) for g in sorted(peaks)] or None


# ---- summaries --------------------------------------------------------------------------------------------------


def _measured(steps: Sequence[int]) -> list[int]:
    ordered = sorted(steps)
    return ordered[1:] if len(ordered) > 1 else ordered


def _mean(values: Iterable[float | None]) -> float | None:
    kept = [v for v in values if v is not None and not math.isnan(v)]
    return sum(kept) / len(kept) if kept else None


def _max(values: Iterable[float | None]) -> float | None:
    kept = [v for v in values if v is not None and not math.isnan(v)]
    return max(kept) if kept else None


def summarize_verl(
    path: Path, *, replay: str, gpus: int, samples_per_step: int, gpu_peaks: list[float] | None = None
) -> RunSummary:
    """`samples_per_step`: prompts × n (verl logs the mean response length, not the sum)."""
    steps = read_verl_log(path)
    needed = [*VERL_PHASES.values(), "timing_s/step", "response_length/mean"]
    for step, values in steps.items():
        missing = [k for k in needed if k not in values]
        if missing:
            raise MetricsError(f"{path}: step {step} lacks {', '.join(missing)}")
    measured = _measured(list(steps))
    tokens = sum(steps[s]["response_length/mean"] * samples_per_step for s in measured)
    rollout_s = sum(steps[s]["timing_s/gen"] for s in measured)
    step_s = sum(steps[s]["timing_s/step"] for s in measured)
    split = {phase: sum(steps[s][key] for s in measured) / len(measured) for phase, key in VERL_PHASES.items()}
    split["other"] = step_s / len(measured) - sum(split.values())
    extra = {}
    for key, label in (
        ("training/rollout_probs_diff_mean", "prob_abs_diff_mean"),
        ("training/rollout_probs_diff_max", "prob_abs_diff_max"),
    ):
        value = (
            _mean(steps[s].get(key) for s in measured)
            if label.endswith("mean")
            else _max(steps[s].get(key) for s in measured)
        )
        if value is not None:
            extra[label] = value
    return RunSummary(
        framework="verl",
        replay=replay,
        gpus=gpus,
        steps=len(steps),
        measured_steps=len(measured),
        generated_tokens_per_s_per_gpu=tokens / max(rollout_s, 1e-9) / gpus,
        trained_tokens_per_s_per_gpu=tokens / max(step_s, 1e-9) / gpus,
        step_seconds=step_s / len(measured),
        split=split,
        trainer_peak_gib=_max(steps[s].get("perf/max_memory_allocated_gb") for s in steps),
        gpu_peak_gib=gpu_peaks,
        logprob_abs_diff_mean=_mean(steps[s].get("peer/logprob_abs_diff_mean") for s in measured),
        logprob_abs_diff_max=_max(steps[s].get("peer/logprob_abs_diff_max") for s in measured),
        kl_k3=_mean(steps[s].get("peer/kl_k3") for s in measured),
        routing_agreement=None,  # verl 0.9.1 logs no agreement between rollout and trainer routes
        reward=[steps[s].get("critic/score/mean", math.nan) for s in sorted(steps)],
        extra=extra,
        logprob_abs_diff_by_step={
            s: v
            for s in sorted(steps)
            if (v := steps[s].get("peer/logprob_abs_diff_mean")) is not None and not math.isnan(v)
        },
    )


def summarize_r3(path: Path, *, replay: str, gpus: int, gpu_peaks: list[float] | None = None) -> RunSummary:
    """Skipped steps (no usable sample) carry no update and are left out. The checkpoint a run writes after its
    last step is left out of the step time (verl runs with checkpoints off) and kept in `extra`."""
    rows = [r for r in read_r3_metrics(path) if r.get("skipped") != 1.0]
    if not rows:
        raise MetricsError(f"{path}: every step was skipped")
    by_step = {int(float(r["step"])): r for r in rows}
    measured = _measured(list(by_step))

    def col(step: int, name: str) -> float:
        value = by_step[step].get(name)
        return float(value) if isinstance(value, float) else 0.0

    def opt(step: int, name: str) -> float | None:
        value = by_step[step].get(name)
        return value if isinstance(value, float) else None

    step_times = {s: col(s, "step_seconds") - col(s, "t_checkpoint") for s in measured}
    tokens = sum(col(s, "tokens") for s in measured)
    step_s = sum(step_times.values())
    phases = dict(R3_PHASES)
    # The asynchronous mode generates while the trainer trains: its `rollout` phase is only the trainer's wait
    # for finished groups, so the engine's rate is what it delivers per step, not per rollout phase.
    asynchronous = any(opt(s, "t_pause") is not None for s in measured)
    if asynchronous:
        phases["pause"] = "t_pause"
    generating_s = step_s if asynchronous else sum(col(s, "t_rollout") for s in measured)
    split = {phase: sum(col(s, key) for s in measured) / len(measured) for phase, key in phases.items()}
    split["other"] = step_s / len(measured) - sum(split.values())
    checkpoint = sum(col(s, "t_checkpoint") for s in by_step)
    return RunSummary(
        framework="r3operator",
        replay=replay,
        gpus=gpus,
        steps=len(by_step),
        measured_steps=len(measured),
        generated_tokens_per_s_per_gpu=tokens / max(generating_s, 1e-9) / gpus,
        trained_tokens_per_s_per_gpu=tokens / max(step_s, 1e-9) / gpus,
        step_seconds=step_s / len(measured),
        split=split,
        trainer_peak_gib=_max(opt(s, "trainer_peak_memory_gib") for s in by_step),
        gpu_peak_gib=gpu_peaks,
        logprob_abs_diff_mean=_mean(opt(s, "logprob_abs_diff_mean") for s in measured),
        logprob_abs_diff_max=_max(opt(s, "logprob_abs_diff_max") for s in measured),
        kl_k3=_mean(opt(s, "kl_k3") for s in measured),
        routing_agreement=_mean(opt(s, "routing_natural_agreement") for s in measured),
        reward=[col(s, "reward_mean") for s in sorted(by_step)],
        extra={"checkpoint_seconds_total": checkpoint} if checkpoint else {},
        logprob_abs_diff_by_step={
            s: v for s in sorted(by_step) if (v := opt(s, "logprob_abs_diff_mean")) is not None and not math.isnan(v)
        },
    )


# ---- the table --------------------------------------------------------------------------------------------------


def _fmt(value: float | None, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return f"{value:.{digits}g}" if abs(value) < 1e4 else f"{value:,.0f}"


def _reward_cell(reward: Sequence[float]) -> str:
    if not reward:
        return "—"
    k = max(1, min(3, len(reward) // 3))
    first, last = _mean(reward[:k]), _mean(reward[-k:])
    return f"{_fmt(first)} → {_fmt(last)} (first/last {k})"


def initial_weights_steps(runs: Sequence[RunSummary | None]) -> list[int]:
    """The steps every run rolled out from the shared initial weights, step 1 left out as elsewhere.

    A step's rollout comes before its update, and GRPO's advantages are all 0 while every reward of a step is 0,
    so no run's policy moves (but for AdamW's weight decay, ~1e-7 of a weight a step) before the update of its
    first step with a reward. Up to that step in every run, both frameworks score the same prompts with the
    same weights, and |Δlogprob| compares their engine-vs-trainer numerics alone; after it, each run's policy
    has gone its own way (a policy that collapses to certain tokens has |Δlogprob| near 0 whatever its
    numerics). Runs with |Δlogprob| logged after step 1 only (the asynchronous mode logs it at step 1 alone); [] when
    there are none."""
    ends = []
    for run in runs:
        if run is None or not any(step > 1 for step in run.logprob_abs_diff_by_step):
            continue
        rewarded = [i + 1 for i, r in enumerate(run.reward) if not math.isnan(r) and r > 0]
        ends.append(rewarded[0] if rewarded else len(run.reward))
    if not ends:
        return []
    end = min(ends)
    return list(range(2, end + 1)) if end > 1 else [1]


def table(runs: Sequence[RunSummary | None], labels: Sequence[str]) -> str:
    """One markdown table: a column per run (None: not run), a row per figure."""
    if len(runs) != len(labels):
        raise ValueError("one label per run")
    initial = initial_weights_steps(runs)
    span = f"{initial[0]}–{initial[-1]}" if len(initial) > 1 else (str(initial[0]) if initial else "")
    rows: list[tuple[str, Any]] = [
        ("steps (measured)", lambda r: f"{r.steps} ({r.measured_steps})"),
        ("generated tokens/s/GPU", lambda r: _fmt(r.generated_tokens_per_s_per_gpu)),
        ("trained tokens/s/GPU", lambda r: _fmt(r.trained_tokens_per_s_per_gpu)),
        ("step time (s)", lambda r: _fmt(r.step_seconds)),
        *[(f"  {phase} (s)", lambda r, p=phase: _fmt(r.split.get(p))) for phase in PHASES],
        ("trainer peak memory (GiB, torch)", lambda r: _fmt(r.trainer_peak_gib)),
        (
            "GPU peak memory per GPU (GiB, nvidia-smi)",
            lambda r: " / ".join(_fmt(g) for g in r.gpu_peak_gib) if r.gpu_peak_gib else "—",
        ),
        ("mean \\|Δlogprob\\| rollout vs trainer", lambda r: _fmt(r.logprob_abs_diff_mean)),
        ("max \\|Δlogprob\\|", lambda r: _fmt(r.logprob_abs_diff_max)),
        *(
            [
                (
                    f"mean \\|Δlogprob\\|, steps {span} (every run still on the shared initial weights)",
                    lambda r: _fmt(_mean(r.logprob_abs_diff_by_step.get(s) for s in initial)),
                )
            ]
            if initial
            else []
        ),
        ("k3 KL rollout vs trainer", lambda r: _fmt(r.kl_k3)),
        ("routing agreement (trainer's own routes vs rollout's)", lambda r: _fmt(r.routing_agreement)),
        (
            "mean / max \\|Δp\\| (verl's training/rollout_probs_diff)",
            lambda r: (
                f"{_fmt(r.extra.get('prob_abs_diff_mean'))} / {_fmt(r.extra.get('prob_abs_diff_max'))}"
                if "prob_abs_diff_mean" in r.extra
                else "—"
            ),
        ),
        ("reward", lambda r: _reward_cell(r.reward)),
    ]
    lines = ["| | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    for name, cell in rows:
        lines.append(f"| {name} | " + " | ".join("not run" if r is None else cell(r) for r in runs) + " |")
    return "\n".join(lines)


def ratio_line(ours: RunSummary | None, theirs: RunSummary | None, *, who: str = "r3operator") -> str:
    """r3operator's trained tokens/s/GPU over verl's, R3 on both (the issue's target: ≥ 1.0×)."""
    if ours is None or theirs is None or theirs.trained_tokens_per_s_per_gpu <= 0:
        return f"{who} / verl trained tokens/s/GPU with R3: not measured (a run is missing)"
    ratio = ours.trained_tokens_per_s_per_gpu / theirs.trained_tokens_per_s_per_gpu
    return f"{who} / verl trained tokens/s/GPU with R3: {ratio:.2f}× (target ≥ 1.0×, moonshot ≥ 1.2×)"


def reward_table(runs: Sequence[RunSummary | None], labels: Sequence[str], every: int = 5) -> str:
    """Reward at step 1 and every `every` steps after, one column per run."""
    longest = max((len(r.reward) for r in runs if r is not None), default=0)
    marks = sorted({1, *range(every, longest + 1, every), longest}) if longest else []
    lines = ["| step | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    for step in marks:
        cells = ["—" if r is None or step > len(r.reward) else _fmt(r.reward[step - 1]) for r in runs]
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
