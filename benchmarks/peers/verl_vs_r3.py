"""verl 0.9.1 and r3operator on the same GPUs, model, prompts, lengths, batch and replay mode: one table.

On the GPU machine, after scripts/gpu-setup.sh (r3operator, vLLM 0.22.1 into /tmp/site) and
benchmarks/peers/verl-setup.sh (verl into /tmp/verl-site), from the repository root:

    python3 -m benchmarks.peers.verl_vs_r3 --gpus 2 --steps 30 --out DIR                 # everything
    python3 -m benchmarks.peers.verl_vs_r3 --gpus 2 --steps 30 --out DIR --parts verl-R3  # one part per call
    python3 -m benchmarks.peers.verl_vs_r3 --gpus 2 --out DIR --parts table               # the table again
    python3 -m benchmarks.peers.verl_vs_r3 --gpus 2 --steps 50 --out DIR --warm-start-steps 50  # a warmed-up start

Parts: `prepare` (the a3b model in the HF layout + the arith parquet, benchmarks/peers/verl_inputs.py; with
`--warm-start-steps N`, the model then warmed by N steps of r3operator's SFT warm-up, benchmarks/peers/warm_start.py,
which every later part must be given too), `r3`
(benchmarks/jobs/a3b-verl-peer.yaml, replay off then R3, same seed: on 2 or more GPUs through `r3operator up`, the
engine on GPU 0 and the trainer on the others with NCCL weight sync; on 1 GPU or the CPU `r3operator run
--compare-replay`, engine beside the trainer), `verl-R3`,
`verl-disabled` (benchmarks/peers/verl_config.py), `table` (benchmarks/peers/compare.py). Each run's console goes
to DIR/<part>/console.log, nvidia-smi's memory samples to DIR/<part>/gpu_memory.csv; the table to DIR/table.md
and DIR/summary.json. A part that fails or times out is reported, and the table shows it as not run.

The learning workload (issue 44's warm start, `arith-chain` task, held-out eval; 64×8 samples of ≤ 512 tokens) has a
runner of its own beside this one: benchmarks/peers/verl_learning.py.

Each verl part first runs benchmarks/peers/te_preflight.py on one of its GPUs (seconds; DIR/<part>/preflight.log):
Transformer Engine's attention with verl's inputs and attention backend. When TE has no backend for them, verl is
not started (it would reach the same failure after ~5 minutes) and the part fails with TE's reasons.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.gpu_memory import nvidia_smi_memory_query
from benchmarks.peers.compare import MetricsError, RunSummary, ratio_line, reward_table, summarize_r3, summarize_verl
from benchmarks.peers.compare import table as make_table
from benchmarks.peers.te_preflight import MARKER as PREFLIGHT_MARKER
from benchmarks.peers.verl_config import ATTENTION_BACKEND, Workload, verl_command, verl_overrides
from benchmarks.peers.warm_start import (
    DEFAULT_LEARNING_RATE,
    WARM_START_FILE,
    WarmStartError,
    check_start,
    read_warm_start,
)

REPO = Path(__file__).resolve().parents[2]
PEERS = Path(__file__).resolve().parent
JOB = REPO / "benchmarks" / "jobs" / "a3b-verl-peer.yaml"
JOB_NAME = "a3b-verl-peer"
PARTS = ("prepare", "r3", "verl-R3", "verl-disabled", "table")
FAST = "r3-fast"
"""r3operator's own fast settings beside the like-for-like runs: R3 with the kernel-format weight sync and the
asynchronous mode (rollouts of the next step while the trainer updates, one policy version of staleness)."""
FAST_LABEL = "r3operator R3, kernel sync, async"
# Kept set for every program on the lent multi-GPU hosts (NVLink multicast can take the host's GPUs down).
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
COMMON_ENV = {
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "PYTHONUNBUFFERED": "1",
    **SAFE_ENV,
}


class GpuMemorySampler:
    """nvidia-smi's used memory per GPU once a second into `path` (`gpu,used_mib`): the same measure for both
    frameworks, engine and trainer together, whichever process holds the memory."""

    def __init__(self, path: Path, period_s: float = 1.0) -> None:
        self.path, self.period_s = path, period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> GpuMemorySampler:
        if shutil.which("nvidia-smi"):
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        with self.path.open("a") as fh:
            while not self._stop.wait(self.period_s):
                out = subprocess.run(
                    nvidia_smi_memory_query(os.environ),
                    capture_output=True,
                    text=True,
                    check=False,
                ).stdout
                fh.write(out)
                fh.flush()


def run_logged(name: str, cmd: list[str], env: dict[str, str], out: Path, timeout_s: int) -> int:
    out.mkdir(parents=True, exist_ok=True)
    print(f"== {name}: {' '.join(cmd[:6])} … (log {out / 'console.log'})", flush=True)
    begin = time.perf_counter()
    with (out / "console.log").open("w") as log, GpuMemorySampler(out / "gpu_memory.csv"):
        try:
            proc = subprocess.run(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s, cwd=REPO, check=False
            )
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = 124
    print(f"   rc={rc} in {time.perf_counter() - begin:.0f} s", flush=True)
    return rc


PREFLIGHT_TIMEOUT_S = 300
NOT_STARTED = "not-started.txt"
"""Written in a verl part's folder when its preflight stopped it: the table says why the column is empty."""


@dataclass(frozen=True)
class Preflight:
    ok: bool
    message: str


def preflight_command(python: str, model_dir: Path, backend: str = ATTENTION_BACKEND) -> list[str]:
    return [python, "-m", "benchmarks.peers.te_preflight", "--model", str(model_dir), "--attention-backend", backend]


def read_preflight(output: str, rc: int) -> Preflight:
    """The probe's last `TE_PREFLIGHT {json}` line, trusted only with exit status 0; anything else is a failure
    whose message carries TE's reasons, or the output's last line when the probe died before its verdict."""
    verdict: dict[str, object] | None = None
    for line in output.splitlines():
        if line.startswith(PREFLIGHT_MARKER):
            try:
                parsed = json.loads(line.removeprefix(PREFLIGHT_MARKER))
            except json.JSONDecodeError:
                continue
            verdict = parsed if isinstance(parsed, dict) else None
    if verdict is None:
        last = next((line.strip() for line in reversed(output.splitlines()) if line.strip()), "no output")
        return Preflight(False, f"no verdict (exit status {rc}): {last}")
    passes = verdict.get("passes")
    chosen = "; ".join(f"{k}: {v or 'no backend'}" for k, v in passes.items()) if isinstance(passes, dict) else ""
    setting = f"attention_backend={verdict.get('attention_backend')} {verdict.get('switches')}"
    if rc == 0 and verdict.get("ok") is True:
        return Preflight(True, f"{chosen} ({setting})")
    te_log = verdict.get("te_log")
    why = " | ".join(str(x) for x in te_log) if isinstance(te_log, list) and te_log else "TE logged no reason"
    return Preflight(False, f"{verdict.get('reason') or f'exit status {rc}'} ({setting}); TE: {why}")


def run_preflight(env: Mapping[str, str], run_dir: Path, model_dir: Path, python: str = sys.executable) -> Preflight:
    """The probe on the first of the run's GPUs, its output in run_dir/preflight.log."""
    pre_env = dict(env)
    visible = [g.strip() for g in pre_env.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    if visible:
        pre_env["CUDA_VISIBLE_DEVICES"] = visible[0]
    try:
        proc = subprocess.run(
            preflight_command(python, model_dir),
            env=pre_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=PREFLIGHT_TIMEOUT_S,
            cwd=REPO,
            check=False,
        )
        output, rc = proc.stdout, proc.returncode
    except subprocess.TimeoutExpired as exc:
        partial_out = exc.stdout
        output = partial_out.decode(errors="replace") if isinstance(partial_out, bytes) else (partial_out or "")
        output += f"\ntimed out after {PREFLIGHT_TIMEOUT_S} s\n"
        rc = 124
    (run_dir / "preflight.log").write_text(output)
    return read_preflight(output, rc)


def environment(pythonpath: list[str]) -> dict[str, str]:
    env = dict(os.environ)
    env.update(COMMON_ENV)
    env["PYTHONPATH"] = os.pathsep.join([*pythonpath, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def prepare(args: argparse.Namespace) -> int:
    """The random-init export and the parquet; with --warm-start-steps N, the export then warmed in a process of its
    own (the trainer's GPU memory and process group end with it, before any later part in this call starts)."""
    from benchmarks.peers.verl_inputs import ARITH, convert_arith, export_model

    inputs = args.out / "inputs"
    (inputs / WARM_START_FILE).unlink(missing_ok=True)  # an earlier warm start must not outlive its weights
    export_model(args.model, inputs / "model")
    convert_arith(ARITH, inputs / "data")
    print(f"== prepare: {inputs}", flush=True)
    if not args.warm_start_steps:
        return 0
    return run_logged(
        f"warm start ({args.warm_start_steps} SFT steps, {args.device})",
        warm_start_command(args),
        environment([args.site, str(REPO)]),
        args.out / "warm-start",
        args.timeout_s,
    )


def warm_start_command(args: argparse.Namespace) -> list[str]:
    return [
        sys.executable,
        "-m",
        "benchmarks.peers.warm_start",
        "--model-dir",
        str(args.out / "inputs" / "model"),
        "--steps",
        str(args.warm_start_steps),
        "--lr",
        repr(args.warm_start_lr),
        "--device",
        args.device,
    ]


def place_dataset() -> None:
    """The RLJob's datasetPath, where a trainer pod finds its mounted volume."""
    from benchmarks.peers.verl_inputs import ARITH

    pvc = Path("/tmp/pvc/datasets")
    pvc.mkdir(parents=True, exist_ok=True)
    shutil.copy(ARITH, pvc / "arith.jsonl")


def r3_command(args: argparse.Namespace) -> list[str]:
    """One process, engine beside the trainer: the CPU smoke test and 1-GPU machines (the `a3b` trainer and engine
    do not fit one 80 GB GPU at 16×8 samples of 64 tokens: 2026-11-27, out of memory at 0.3 and at 0.15 of it)."""
    job = JOB
    if args.warm_start_steps:  # the RLJob as committed (R3; --compare-replay runs replay off first) on the warm model
        job = r3_job_variant(JOB, args.out / "r3" / "jobs" / "warm.yaml", sub="r3", replay="R3", gpus=0, args=args)
    cmd = [
        sys.executable,
        "-m",
        "r3operator",
        "run",
        str(job),
        "--device",
        args.device,
        "--no-resume",
        "--compare-replay",
        "--steps",
        str(args.steps),
        "--out-dir",
        str(args.out / "r3"),
        "--quiet",
    ]
    if args.model != "a3b" and not args.warm_start_steps:  # a smoke test on a smaller reference model
        cmd += ["--model", args.model]
    return cmd


def uses_up(args: argparse.Namespace) -> bool:
    return args.device != "cpu" and args.gpus >= 2


def r3_job_variant(
    base: Path, dest: Path, *, sub: str, replay: str, gpus: int, args: argparse.Namespace | None = None
) -> Path:
    """The RLJob with its replay mode set, its own name, `args.r3_engines` engine replicas (None: the committed count)
    and every other GPU given to the trainer (`gpus` 0: the committed count, one process); the `FAST` variant also
    syncs in the kernel layout and runs asynchronously.
    With a warm start (`args.warm_start_steps`), the model is the warmed directory verl reads."""
    import yaml

    doc = yaml.safe_load(base.read_text())
    doc["metadata"]["name"] = f"{JOB_NAME}-{sub}"
    doc["spec"]["routingReplay"]["mode"] = replay
    if args is not None and args.r3_engines:
        doc["spec"]["inference"]["replicas"] = args.r3_engines
    if gpus:
        doc["spec"]["trainer"]["gpusPerNode"] = gpus - int(doc["spec"]["inference"]["replicas"])
    if args is not None and args.warm_start_steps:
        doc["spec"]["model"] = warm_model_block(doc["spec"]["model"], args.out / "inputs" / "model")
        doc["spec"]["algorithm"]["sftWarmupSteps"] = 0  # warmed once, in `prepare`, for both frameworks
    if sub == FAST:
        doc["spec"]["weightSync"]["layout"] = "kernel"
        doc["spec"]["algorithm"]["mode"] = "async"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(yaml.safe_dump(doc, sort_keys=False))
    return dest


def warm_model_block(block: dict[str, Any], model_dir: Path) -> dict[str, Any]:
    """`spec.model` for the warmed directory: a file:// URI (the API's form for a directory already on the machine:
    `up` hands it to `vllm serve` as it is, the driver loads it from there), and the architecture read from its
    config as the runtime reads it (models/architecture.py), so that the driver's check compares against the model
    actually loaded (the `tiny` smoke test)."""
    from transformers import AutoConfig

    from r3operator.models.architecture import architecture

    stated = {**(block.get("architecture") or {}), **architecture(AutoConfig.from_pretrained(model_dir))}
    return {**block, "uri": model_dir.resolve().as_uri(), "architecture": stated}


def r3_up_commands(args: argparse.Namespace) -> list[tuple[str, list[str], Path]]:
    """(run, argv, its metrics.csv's place for the table): R3 first, then the fast column, then replay off, so a
    reservation that ends early has measured the columns the issue's target compares first."""
    runs: list[tuple[str, list[str], Path]] = []
    variants = [
        ("r3", "R3"),
        *([(FAST, "R3")] if args.r3_fast else []),
        *([] if args.skip_r3_disabled else [("disabled", "Disabled")]),
    ]
    for sub, replay in variants:
        job = r3_job_variant(
            JOB, args.out / "r3" / "jobs" / f"{sub}.yaml", sub=sub, replay=replay, gpus=args.gpus, args=args
        )
        cmd = [
            "r3operator",
            "up",
            str(job),
            "--gpus",
            ",".join(str(g) for g in range(args.gpus)),
            "--steps",
            str(args.steps),
            "--out-dir",
            str(args.out / "r3" / f"up-{sub}"),
        ]
        runs.append((sub, cmd, args.out / "r3" / JOB_NAME / sub / "metrics.csv"))
    return runs


def run_r3_up(args: argparse.Namespace, env: dict[str, str]) -> int:
    rc = 0
    for sub, cmd, metrics in r3_up_commands(args):
        code = run_logged(f"r3operator up ({sub})", cmd, env, args.out / "r3" / f"log-{sub}", args.timeout_s)
        found = sorted((args.out / "r3" / f"up-{sub}").rglob("metrics.csv"))
        if found:  # where the table reads it, whatever up named its run folder
            metrics.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(found[0], metrics)
        for checkpoints in (args.out / "r3" / f"up-{sub}").rglob("checkpoints"):
            shutil.rmtree(checkpoints, ignore_errors=True)
        rc = rc or code
    return rc


def run_part(part: str, args: argparse.Namespace) -> int:
    if part == "prepare":
        return prepare(args)
    # verl always reads the inputs' model; r3operator only with a warm start (else the reference model, as the
    # committed RLJob names it, which may run before `prepare` has finished)
    if part.startswith("verl-") or (part == "r3" and args.warm_start_steps):
        try:
            check_start(args.out / "inputs", args.warm_start_steps)
        except WarmStartError as exc:
            print(f"== {part}: {exc}", flush=True)
            return 2
    if part == "r3":
        place_dataset()
        env = environment([args.site, str(REPO)])
        env["PATH"] = os.pathsep.join([str(Path(args.site) / "bin"), env.get("PATH", "")])  # `up` runs `vllm`
        if uses_up(args):
            return run_r3_up(args, env)
        rc = run_logged("r3operator (off, then R3)", r3_command(args), env, args.out / "r3", args.timeout_s)
        shutil.rmtree(args.out / "r3" / JOB_NAME / "disabled" / "checkpoints", ignore_errors=True)
        shutil.rmtree(args.out / "r3" / JOB_NAME / "r3" / "checkpoints", ignore_errors=True)
        return rc
    if part.startswith("verl-"):
        replay = part.removeprefix("verl-")
        run_dir = args.out / part
        inputs = args.out / "inputs"
        for needed in (inputs / "model" / "config.json", inputs / "data" / "train.parquet"):
            if not needed.is_file():
                print(f"== {part}: {needed} is missing; run --parts prepare first", flush=True)
                return 2
        overrides = verl_overrides(
            model_dir=inputs / "model",
            data_dir=inputs / "data",
            reward_file=PEERS / "verl_reward.py",
            gpus=args.gpus,
            steps=args.steps,
            replay=replay,
            log_file=run_dir / "metrics.jsonl",
        )
        return launch_verl(
            part,
            run_dir,
            overrides,
            inputs / "model",
            verl_site=args.verl_site,
            site=args.site,
            timeout_s=args.timeout_s,
        )
    if part == "table":
        text, summary = build_table(args.out, gpus=args.gpus)
        (args.out / "table.md").write_text(text + "\n")
        (args.out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
        print(text, flush=True)
        return 0
    raise ValueError(f"--parts: unknown part {part!r}; choose from {', '.join(PARTS)}")


def verl_environment(run_dir: Path, *, verl_site: str, site: str) -> dict[str, str]:
    """verl's processes: the metrics hook first on the path, verl's site dir before r3operator's."""
    env = environment([str(PEERS / "verl_hook"), verl_site, site, str(REPO)])
    env["VERL_FILE_LOGGER_PATH"] = str(run_dir / "metrics.jsonl")
    env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"  # Megatron's overlap of communication and compute
    return env


def launch_verl(
    part: str, run_dir: Path, overrides: list[str], model_dir: Path, *, verl_site: str, site: str, timeout_s: int
) -> int:
    """One verl run in `run_dir` (overrides.txt, preflight.log, console.log, metrics.jsonl): Transformer Engine's
    preflight first, verl only when it passed (else NOT_STARTED says why, and 3)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("metrics.jsonl", "console.log", NOT_STARTED):
        (run_dir / stale).unlink(missing_ok=True)
    (run_dir / "overrides.txt").write_text("\n".join(overrides) + "\n")
    env = verl_environment(run_dir, verl_site=verl_site, site=site)
    check = run_preflight(env, run_dir, model_dir)
    print(f"== {part}: Transformer Engine preflight: {check.message}", flush=True)
    if not check.ok:
        (run_dir / NOT_STARTED).write_text(f"Transformer Engine preflight failed: {check.message}\n")
        print(f"== {part}: verl not started (see {run_dir / 'preflight.log'})", flush=True)
        return 3
    rc = run_logged(f"verl ({part})", verl_command(sys.executable, overrides), env, run_dir, timeout_s)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return rc


def _verl_log(run_dir: Path) -> Path:
    jsonl = run_dir / "metrics.jsonl"
    return jsonl if jsonl.is_file() and jsonl.stat().st_size else run_dir / "console.log"


def r3_layout_line(job: Path) -> list[str]:
    """How r3operator split its GPUs, from the RLJob its R3 run used (none: no line)."""
    import yaml

    if not job.is_file():
        return []
    spec = yaml.safe_load(job.read_text())["spec"]
    engines, ranks = int(spec["inference"]["replicas"]), int(spec["trainer"]["gpusPerNode"])
    return [f"r3operator's GPUs: {engines} engine replica(s), a GPU each; the trainer over {ranks} rank(s).", ""]


def build_table(out: Path, *, gpus: int, work: Workload = Workload()) -> tuple[str, dict[str, object]]:
    """The table from whatever runs under `out` finished; a missing or unreadable run is a 'not run' column and a
    line saying why."""
    from benchmarks.peers.compare import read_gpu_peaks

    problems: list[str] = []
    runs: dict[str, RunSummary | None] = {}

    def attempt(label: str, make: Callable[[], RunSummary]) -> None:
        try:
            runs[label] = make()
        except MetricsError as exc:
            runs[label] = None
            problems.append(f"{label}: {exc}")

    def verl_run(run_dir: Path, replay: str) -> RunSummary:  # read inside attempt(): a MetricsError is a problem
        if (run_dir / NOT_STARTED).is_file():
            raise MetricsError(f"not started: {(run_dir / NOT_STARTED).read_text().strip()}")
        return summarize_verl(
            _verl_log(run_dir),
            replay=replay,
            gpus=gpus,
            samples_per_step=work.samples_per_step,
            gpu_peaks=read_gpu_peaks(run_dir / "gpu_memory.csv"),
        )

    for replay in ("R3", "disabled"):
        attempt(f"verl {replay}", partial(verl_run, out / f"verl-{replay}", replay))
    r3_runs = [("r3operator R3", "R3", "r3"), ("r3operator disabled", "disabled", "disabled")]
    if (out / "r3" / f"log-{FAST}").is_dir() or (out / "r3" / JOB_NAME / FAST / "metrics.csv").is_file():
        r3_runs.append((FAST_LABEL, "R3", FAST))
    for label, replay, sub in r3_runs:
        path = out / "r3" / JOB_NAME / sub / "metrics.csv"
        # `up` runs each mode on its own, with its own nvidia-smi log; --compare-replay shares one engine and one log
        # between its two runs, so there the peak covers both.
        own = out / "r3" / f"log-{sub}" / "gpu_memory.csv"
        peaks = read_gpu_peaks(own if own.is_file() else out / "r3" / "gpu_memory.csv")
        attempt(label, partial(summarize_r3, path, replay=replay, gpus=gpus, gpu_peaks=peaks))
    labels = ["verl R3", "r3operator R3", "verl disabled", "r3operator disabled"]
    labels += [FAST_LABEL] if FAST_LABEL in runs else []
    ordered = [runs[label] for label in labels]
    try:
        warm = read_warm_start(out / "inputs")
        start = "random init" if warm is None else warm.label()
    except WarmStartError as exc:
        warm, start = None, "start unknown"
        problems.append(f"start: {exc}")
    header = [
        f"## verl 0.9.1 vs r3operator, {gpus} GPU(s), a3b, {start}, arith, {work.prompts_per_step}×{work.group_size} "
        f"samples of ≤ {work.max_response_tokens} tokens",
        "",
        *r3_layout_line(out / "r3" / "jobs" / "r3.yaml"),
    ]
    lines = [
        *header,
        make_table(ordered, labels),
        "",
        ratio_line(runs["r3operator R3"], runs["verl R3"]),
        *(["", ratio_line(runs[FAST_LABEL], runs["verl R3"], who=FAST_LABEL)] if FAST_LABEL in runs else []),
        "",
        "### Reward per step",
        "",
        reward_table(ordered, labels),
    ]
    if problems:
        lines += ["", "### Not in the table", "", *(f"- {p}" for p in problems)]
    text = "\n".join(lines)
    summary: dict[str, object] = {label: (None if r is None else r.to_json()) for label, r in runs.items()}
    summary["problems"] = problems
    summary["start"] = None if warm is None else asdict(warm)
    return text, summary


def build_parser() -> argparse.ArgumentParser:
    """The command line; tests read their options through it too, so none of them misses an option."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, required=True, help="GPUs both frameworks use (2, or 4 where lent)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, in order: {', '.join(PARTS)}")
    parser.add_argument("--model", default="a3b", help="reference model (a3b; tiny for a smoke test)")
    parser.add_argument("--device", default="cuda", help="r3operator's device (cpu: a smoke test of the r3 part)")
    parser.add_argument("--site", default="/tmp/site", help="r3operator's GPU packages (scripts/gpu-setup.sh)")
    parser.add_argument("--verl-site", default="/tmp/verl-site", help="verl's packages (verl-setup.sh)")
    parser.add_argument("--timeout-s", type=int, default=540, help="limit for each framework's run")
    parser.add_argument(
        "--r3-fast",
        action="store_true",
        help="the r3 part also runs R3 with the kernel-format weight sync and the asynchronous mode (2+ GPUs)",
    )
    parser.add_argument(
        "--r3-engines",
        type=int,
        default=None,
        help="r3operator's engine replicas, one GPU each (default: the committed RLJob's, 1); the trainer's ranks "
        "take the other GPUs",
    )
    parser.add_argument(
        "--skip-r3-disabled",
        action="store_true",
        help="the r3 part runs no replay-off column (a reservation short of time: the target compares R3)",
    )
    parser.add_argument(
        "--warm-start-steps",
        type=int,
        default=0,
        help="prepare: warm the model by N steps of r3operator's SFT warm-up for both frameworks; every other part: "
        "the start the inputs must hold (0: the random-init model)",
    )
    parser.add_argument(
        "--warm-start-lr", type=float, default=DEFAULT_LEARNING_RATE, help="the warm-up's learning rate (prepare)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.r3_engines is not None and not 1 <= args.r3_engines < args.gpus:
        parser.error(f"--r3-engines {args.r3_engines}: between 1 and {args.gpus - 1} (the trainer needs a GPU)")
    if args.gpus < 1 or args.steps < 1:
        parser.error("--gpus and --steps must be at least 1")
    if args.warm_start_steps < 0:
        parser.error(f"--warm-start-steps: expected 0 or more, got {args.warm_start_steps}")
    if not args.warm_start_lr > 0:
        parser.error(f"--warm-start-lr: expected a positive learning rate, got {args.warm_start_lr}")
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"--parts: unknown {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    failed = [part for part in parts if run_part(part, args) != 0]
    if failed:
        print(f"failed: {', '.join(failed)} (see DIR/<part>/console.log)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
