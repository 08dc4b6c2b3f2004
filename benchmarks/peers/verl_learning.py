"""verl 0.9.1 beside r3operator at the learning workload (issue 44 item 6, issue 51): the warm start, task, held-out
split and workload of benchmarks/learning.py, replay Disabled and R3 in each framework, on 1 or 4 GPUs.

On the GPU machine, after scripts/gpu-setup.sh and benchmarks/peers/verl-setup.sh, from the repository root
(benchmarks/peers/verl-learning.sh chains them detached and collects the results):

    python3 -m benchmarks.learning --out L --parts data,warm --device cuda               # the start both load
    python3 -m benchmarks.peers.verl_learning --learning-dir L --gpus 1 --steps 50 --out O   # every part
    python3 -m benchmarks.peers.verl_learning --learning-dir L --gpus 4 --steps 50 --out O --dry-run  # print only

Parts (`--parts`, run in the order given; each reads what earlier ones left in O):
- `prepare`: checks that L holds the warm start (L/warm/model, a Hugging Face directory with its tokenizer and chat
  template, and L/warm/warm.json) and writes L/data/{train,eval}.jsonl as verl's parquet,
  O/inputs/data/{train,val}.parquet (benchmarks/peers/verl_inputs.py).
- `verl-R3`, `verl-Disabled`: verl in its recommended layout for the GPU count, its hybrid engine: a vLLM replica on
  every GPU that sleeps while the Megatron actor trains on the same GPUs, experts split over all of them
  (benchmarks/peers/verl_config.py). Megatron on one GPU too: verl 0.9.1's router replay exists only on its
  Megatron and VeOmni engines (`router_replay` is a field of their engine configs, none of its FSDP engine's), so an
  FSDP column could not run R3 and would set two engines beside each other instead of two replay modes.
- `r3`: r3operator, R3 then replay off, each run alone on the GPUs: on 1 GPU the learning benchmark's own runs
  (`r3operator run`, the engine in the trainer's process on the same GPU, weights over IPC in the kernel layout); on
  more, `r3operator up` with the same RLJob, its engine on GPU 0 (`--r3-engines`) and the FSDP trainer on the rest.
- `summary` (on the GPU machine, or here on what `verl-learning.sh collect` brought back, unpacked into O):
  O/verl-peer-<date>-<machine>/ with summary.json (per framework and mode: `gpus`, `max_response_tokens`,
  `samples_per_step`, `trained_tokens_per_s_per_gpu`, `kl_k3`, `extreme_token_fraction`, `eval_reward_first`,
  `eval_reward_last`, and the rest of benchmarks/learning.py's per-mode figures), table.md, one PNG per run and one of
  all four (benchmarks/learning.py's plots), and each run's per-step figures in the learning benchmark's CSV columns.

Every figure of both frameworks goes through benchmarks/learning.py's `mode_summary`, from per-step rows in its
columns: verl's logged metrics (`VERL_COLUMNS`) are renamed, r3operator's metrics.csv is taken as it is but for its
step time, which leaves out the held-out evaluation and the checkpoint as verl's `timing_s/step` does.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import math
import os
import shlex
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from benchmarks import learning
from benchmarks.peers import verl_vs_r3
from benchmarks.peers.compare import MetricsError, read_gpu_peaks, read_verl_log
from benchmarks.peers.verl_config import ENGINE_CHOICE, Workload, verl_command, verl_overrides
from benchmarks.peers.verl_inputs import CHAIN_SOURCE

PEERS = Path(__file__).resolve().parent
REPO = PEERS.parents[1]
MODES = ("R3", "Disabled")
"""Run order: the columns the targets compare first, so that a session cut short has them."""
VERL_REPLAY = {"R3": "R3", "Disabled": "disabled"}  # verl's spelling of each mode (router_replay.mode)
FRAMEWORKS = ("r3operator", "verl")
PARTS = ("prepare", "verl-R3", "r3", "verl-Disabled", "summary")
ENGINE_MEMORY_FRACTION = 0.5
"""verl's vLLM share of each GPU: verl's own default (`rollout.gpu_memory_utilization`), which its hybrid engine frees
while the actor trains; r3operator's engine keeps the learning RLJob's fixed 4 GiB KV cache."""
RUN_FILE = "run.json"  # O/run.json: the date and machine of the run, written by the first part on the GPU machine
RATIO_TARGET, RATIO_MOONSHOT = 1.5, 2.0  # r3operator's trained tokens/s/GPU over verl's, R3 on both (issue 44)

VERL_COLUMNS = {
    # benchmarks/learning.py's metrics.csv column: verl 0.9.1's metric (the v1 trainer's names)
    "reward_mean": "critic/score/mean",
    "step_seconds": "timing_s/step",  # validation and checkpoints are timed outside it
    "t_rollout": "timing_s/gen",
    "t_old_logprob": "timing_s/old_log_prob",
    "t_update": "timing_s/update_actor",
    "t_weight_sync": "timing_s/update_weights",
    "kl_k3": "rollout_corr/k3_kl",  # E[r - 1 - log r], r = p_trainer / p_rollout: r3operator's kl_k3
    "extreme_token_fraction": "peer/extreme_token_fraction",  # verl_hook: verl has none without rollout_is / rs
    "logprob_abs_diff_mean": "peer/logprob_abs_diff_mean",
    "logprob_abs_diff_max": "peer/logprob_abs_diff_max",
    "entropy_mean": "actor/entropy",
    "grad_norm": "actor/grad_norm",
    "clip_fraction": "actor/pg_clipfrac",
    "dual_clip_fraction": "actor/pg_clipfrac_lower",
}
VERL_TOKENS = {"tokens": "response_length/mean", "prompt_tokens": "prompt_length/mean"}  # means over the samples
VERL_THROUGHPUT = "perf/throughput"  # (prompt + response tokens) / step seconds / GPUs: checks ours


def eval_key(samples_per_prompt: int) -> str:
    """verl's held-out reward (v1 trainer `_val_metrics_update`: the mean reward of the n answers per prompt)."""
    return f"val-core/{CHAIN_SOURCE}/reward/mean@{samples_per_prompt}"


class LearningPeerError(ValueError):
    """Inputs or runs the comparison cannot use; the message names the file and how to make it."""


# ------------------------------------------------------------------------------------------------ setup


@dataclass(frozen=True)
class Setup:
    learning_dir: Path
    out: Path
    gpus: int
    steps: int
    engine_memory_fraction: float = ENGINE_MEMORY_FRACTION
    r3_engines: int = 1
    site: str = "/tmp/site"
    verl_site: str = "/tmp/verl-site"
    timeout_s: int = 3600
    r3_modes: tuple[str, ...] = MODES
    """The modes the `r3` part runs (a session short of device time: R3 alone); the summary reads every mode's."""

    @property
    def plan(self) -> learning.Plan:
        """The learning benchmark's plan of these runs: its defaults, these steps, the modes one after another."""
        return learning.Plan(steps=self.steps, modes=self.r3_modes, concurrent=False)

    @property
    def model_dir(self) -> Path:
        return self.learning_dir / "warm" / "model"

    @property
    def data_dir(self) -> Path:
        return self.out / "inputs" / "data"


def check_learning_dir(learning_dir: Path) -> None:
    """The files benchmarks.learning's `data` and `warm` parts leave, each named when missing."""
    needed = [
        learning_dir / "data" / "train.jsonl",
        learning_dir / "data" / "eval.jsonl",
        learning_dir / "warm" / "model" / "config.json",
        learning_dir / "warm" / "warm.json",
    ]
    missing = [str(p) for p in needed if not p.is_file()]
    if missing:
        raise LearningPeerError(
            f"--learning-dir {learning_dir}: missing {', '.join(missing)}; make them with "
            f"`python3 -m benchmarks.learning --out {learning_dir} --parts data,warm --device cuda`"
        )


@contextmanager
def model_config_dir(setup: Setup) -> Iterator[Path]:
    """A directory with the warm model's config.json: the warm start itself, or (a dry run before it exists) the
    config of the reference model it is warmed from, which the warm start keeps (benchmarks/learning.py)."""
    if (setup.model_dir / "config.json").is_file():
        yield setup.model_dir
        return
    from r3operator.models.reference import get_spec

    with tempfile.TemporaryDirectory(prefix="r3-verl-learning-") as tmp:
        get_spec(setup.plan.model).hf_config().save_pretrained(tmp)
        yield Path(tmp)


def job_document(setup: Setup, mode: str, config_dir: Path) -> dict[str, Any]:
    """The learning RLJob of `mode` (benchmarks/learning.py), on the warm model; for more than one GPU, its
    engine replicas on GPUs of their own and the trainer on the others (`r3operator up`)."""
    doc = learning.job_document(
        setup.plan, mode=mode, model_dir=config_dir, data=setup.learning_dir / "data", name=learning.run_name(mode)
    )
    doc["spec"]["model"]["uri"] = f"file://{setup.model_dir.resolve()}"
    if setup.gpus > 1:
        doc["spec"]["inference"]["replicas"] = setup.r3_engines
        doc["spec"]["trainer"]["gpusPerNode"] = setup.gpus - setup.r3_engines
    return doc


def parsed_spec(doc: Mapping[str, Any]) -> Any:
    from r3operator.api.load import parse_rljob

    return parse_rljob(dict(doc), source=f"learning RLJob {doc['metadata']['name']}").spec


def flag_value(args: Sequence[str], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(f"{flag}="):
            return arg.split("=", 1)[1]
    return None


def learning_workload(spec: Any, *, engine_memory_fraction: float) -> Workload:
    """verl's side of the workload, read from the RLJob r3operator runs, so that no figure is set twice."""
    evaluation = spec.evaluation
    if evaluation is None or not evaluation.before_training:
        raise LearningPeerError("the learning RLJob must evaluate before training and every intervalSteps steps")
    if spec.task.max_prompt_tokens is None:
        raise LearningPeerError("the learning RLJob must set task.maxPromptTokens (verl's data.max_prompt_length)")
    seqs = flag_value(spec.inference.extra_args, "--max-num-seqs")
    fsdp = spec.trainer.fsdp
    return Workload(
        prompts_per_step=spec.rollout.prompts_per_step,
        group_size=spec.rollout.group_size,
        max_prompt_tokens=spec.task.max_prompt_tokens,
        max_response_tokens=spec.rollout.max_tokens,
        temperature=spec.rollout.temperature,
        learning_rate=spec.algorithm.learning_rate,
        clip_low=spec.algorithm.clip_ratio_low,
        clip_high=spec.algorithm.clip_ratio_high,
        dual_clip_c=spec.algorithm.clip_ratio_c,
        mini_batches=spec.algorithm.mini_batches,
        engine_memory_fraction=engine_memory_fraction,
        seed=spec.seed,
        eval_interval=evaluation.interval_steps,
        eval_temperature=evaluation.temperature,
        eval_samples=evaluation.samples_per_prompt,
        micro_batch_tokens=None if fsdp is None else fsdp.micro_batch_tokens,
        max_num_seqs=None if seqs is None else int(seqs),
        name="learning",
    )


def check_experts(config_dir: Path, gpus: int) -> None:
    config = json.loads((config_dir / "config.json").read_text())
    experts = int(config.get("num_experts", 0))
    if experts % gpus:
        raise LearningPeerError(
            f"{config_dir / 'config.json'}: {experts} experts do not split over {gpus} GPUs "
            "(verl's expert_model_parallel_size is the GPU count)"
        )


def overrides_for(setup: Setup, mode: str, workload: Workload) -> list[str]:
    run_dir = setup.out / f"verl-{mode}"
    return verl_overrides(
        model_dir=setup.model_dir,
        data_dir=setup.data_dir,
        reward_file=PEERS / "verl_reward.py",
        gpus=setup.gpus,
        steps=setup.steps,
        replay=VERL_REPLAY[mode],
        log_file=run_dir / "metrics.jsonl",
        work=workload,
    )


def plan_flags(plan: learning.Plan) -> list[str]:
    """benchmarks.learning's command-line flags for every field of `plan` that is not its default."""
    flags: list[str] = []
    defaults = learning.Plan()
    for field in fields(plan):
        value, default = getattr(plan, field.name), getattr(defaults, field.name)
        if value == default:
            continue
        flag = "--" + field.name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else f"--no-{flag[2:]}")
        elif isinstance(value, tuple):
            flags += [flag, ",".join(value)]
        else:
            flags += [flag, str(value)]
    return flags


def r3_run_command(setup: Setup) -> list[str]:
    """One GPU: the learning benchmark's runs of both modes, one after the other, on its warm start."""
    return [
        sys.executable, "-m", "benchmarks.learning", "--out", str(setup.out / "r3"), "--parts", "runs",
        *plan_flags(setup.plan),
    ]  # fmt: skip


def r3_up_command(setup: Setup, mode: str) -> list[str]:
    return [
        sys.executable, "-m", "r3operator", "up", str(r3_job_path(setup, mode)),
        "--gpus", ",".join(str(g) for g in range(setup.gpus)), "--steps", str(setup.steps),
        "--out-dir", str(setup.out / "r3" / f"up-{mode.lower()}"),
    ]  # fmt: skip


def r3_job_path(setup: Setup, mode: str) -> Path:
    return setup.out / "r3" / "jobs" / f"{mode.lower()}.yaml"


def r3_run_dir(setup: Setup, mode: str) -> Path:
    """Where each mode's metrics.csv and eval.csv end up, whichever command ran it."""
    return setup.out / "r3" / "runs" / learning.run_name(mode)


# ------------------------------------------------------------------------------------------------ parts


def record_run(setup: Setup) -> None:
    """O/run.json: the date and machine the summary's folder is named after (once, by the first GPU part)."""
    path = setup.out / RUN_FILE
    if path.is_file():
        return
    kind = learning.machine()
    machine = kind if setup.gpus == 1 else f"{kind}x{setup.gpus}"
    date = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    path.write_text(json.dumps({"date": date, "machine": machine, "gpus": setup.gpus}) + "\n")


def prepare(setup: Setup) -> int:
    from benchmarks.peers.verl_inputs import convert_learning

    check_learning_dir(setup.learning_dir)
    check_experts(setup.model_dir, setup.gpus)
    train, val = convert_learning(setup.learning_dir / "data", setup.data_dir)
    start = {  # beside the inputs, not in them: `collect` leaves the inputs (parquet, model) on the machine
        "learning_dir": str(setup.learning_dir.resolve()),
        "model": str(setup.model_dir.resolve()),
        "warm": json.loads((setup.learning_dir / "warm" / "warm.json").read_text()),
    }
    (setup.out / "start.json").write_text(json.dumps(start, indent=2) + "\n")
    print(f"== prepare: {train}, {val} (model {setup.model_dir})", flush=True)
    return 0


def run_r3(setup: Setup) -> int:
    check_learning_dir(setup.learning_dir)
    record_run(setup)
    env = verl_vs_r3.environment([setup.site, str(REPO)])
    env["PATH"] = os.pathsep.join([str(Path(setup.site) / "bin"), env.get("PATH", "")])  # engines run `vllm`
    r3 = setup.out / "r3"
    if setup.gpus == 1:
        r3.mkdir(parents=True, exist_ok=True)
        for name in ("data", "warm"):  # benchmarks.learning reads OUT/data and OUT/warm/model
            link = r3 / name
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to((setup.learning_dir / name).resolve(), target_is_directory=True)
        rc = verl_vs_r3.run_logged(
            f"r3operator ({', '.join(setup.r3_modes)})",
            r3_run_command(setup),
            env,
            r3 / "log",
            len(setup.r3_modes) * setup.timeout_s,
        )
        for mode in setup.r3_modes:
            shutil.rmtree(r3_run_dir(setup, mode) / "checkpoints", ignore_errors=True)
        return rc
    rc = 0
    with model_config_dir(setup) as config_dir:
        for mode in setup.r3_modes:
            learning.write_job(job_document(setup, mode, config_dir), r3_job_path(setup, mode))
    for mode in setup.r3_modes:
        up_dir = r3 / f"up-{mode.lower()}"
        code = verl_vs_r3.run_logged(
            f"r3operator up ({mode})", r3_up_command(setup, mode), env, r3 / f"log-{mode.lower()}", setup.timeout_s
        )
        dest = r3_run_dir(setup, mode)
        dest.mkdir(parents=True, exist_ok=True)
        for name in ("metrics.csv", "eval.csv"):  # where the summary reads them, whatever `up` named its run folder
            found = sorted(up_dir.rglob(name))
            if found:
                shutil.copy(found[0], dest / name)
        for checkpoints in up_dir.rglob("checkpoints"):
            shutil.rmtree(checkpoints, ignore_errors=True)
        rc = rc or code
    return rc


def run_verl(setup: Setup, mode: str) -> int:
    check_learning_dir(setup.learning_dir)
    if not (setup.data_dir / "train.parquet").is_file():
        print(f"== verl-{mode}: {setup.data_dir / 'train.parquet'} is missing; run --parts prepare first", flush=True)
        return 2
    record_run(setup)
    with model_config_dir(setup) as config_dir:
        workload = learning_workload(parsed_spec(job_document(setup, mode, config_dir)), **_memory(setup))
    return verl_vs_r3.launch_verl(
        f"verl-{mode}",
        setup.out / f"verl-{mode}",
        overrides_for(setup, mode, workload),
        setup.model_dir,
        verl_site=setup.verl_site,
        site=setup.site,
        timeout_s=setup.timeout_s,
    )


def _memory(setup: Setup) -> dict[str, float]:
    return {"engine_memory_fraction": setup.engine_memory_fraction}


# ------------------------------------------------------------------------------------------------ per-step rows


def _number(value: object) -> float:
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return math.nan


def verl_step_rows(
    log: Path, *, samples: int, eval_samples: int
) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    """verl's logged steps as benchmarks/learning.py's metrics.csv rows and eval.csv rows. The validation before
    training is logged as step 0 on its own; a later one with the step it follows."""
    steps = read_verl_log(log)
    key = eval_key(eval_samples)
    rows: list[dict[str, float]] = []
    evals: list[dict[str, float]] = []
    for step in sorted(steps):
        data = steps[step]
        if key in data:
            evals.append({"step": step, learning.EVAL_COLUMN: data[key]})
        if VERL_COLUMNS["step_seconds"] not in data:
            continue
        row: dict[str, float] = {"step": step, "skipped": 0, "samples": samples}
        row.update({column: data.get(metric, math.nan) for column, metric in VERL_COLUMNS.items()})
        row.update({column: data.get(metric, math.nan) * samples for column, metric in VERL_TOKENS.items()})
        row[VERL_THROUGHPUT] = data.get(VERL_THROUGHPUT, math.nan)
        rows.append(row)
    if not rows:
        raise MetricsError(f"{log}: no trained step (no {VERL_COLUMNS['step_seconds']})")
    return rows, evals


def r3_step_rows(run_dir: Path) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """r3operator's metrics.csv and eval.csv rows, each step's time less its held-out evaluation and checkpoint
    (`t_eval`, `t_checkpoint`), which verl's `timing_s/step` does not hold."""
    metrics = run_dir / "metrics.csv"
    if not metrics.is_file():
        raise MetricsError(f"{metrics}: no such file")
    with metrics.open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    if not rows:
        raise MetricsError(f"{metrics}: no steps")
    for row in rows:
        outside = sum(v for k in ("t_eval", "t_checkpoint") if math.isfinite(v := _number(row.get(k))))
        row["step_seconds"] = repr(_number(row.get("step_seconds")) - outside)
    evals: list[dict[str, str]] = []
    if (run_dir / "eval.csv").is_file():
        with (run_dir / "eval.csv").open(newline="") as fh:
            evals = list(csv.DictReader(fh))
    return rows, evals


def write_rows(path: Path, rows: Sequence[Mapping[str, object]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    columns = list(dict.fromkeys(k for row in rows for k in row))
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


# ------------------------------------------------------------------------------------------------ summary


def memory_log(setup: Setup, framework: str, mode: str) -> Path:
    """The run's nvidia-smi samples (verl_vs_r3.run_logged); one GPU's two r3operator runs share one log."""
    if framework == "verl":
        return setup.out / f"verl-{mode}" / "gpu_memory.csv"
    if setup.gpus == 1:
        return setup.out / "r3" / "log" / "gpu_memory.csv"
    return setup.out / "r3" / f"log-{mode.lower()}" / "gpu_memory.csv"


def label(framework: str, mode: str) -> str:
    return f"{framework}-{mode}"


def run_summary(plan: learning.Plan, run_dir: Path, *, gpus: int) -> dict[str, Any]:
    """benchmarks/learning.py's figures of one run, made per GPU, with issue 51's names beside them."""
    figures = learning.mode_summary(plan, run_dir, gpus_shared_by=1)
    if "error" in figures:
        return figures
    per_run = figures["trained_tokens_per_s_per_gpu"]  # mode_summary's runs hold one GPU each
    figures["trained_tokens_per_s_per_gpu"] = None if per_run is None else per_run / gpus
    figures["gpus"] = gpus
    figures["kl_k3"] = figures["k3_kl_mean"]
    figures["extreme_token_fraction"] = figures["extreme_token_fraction_mean"]
    return figures


def _ratio(a: object, b: object) -> float | None:
    if not isinstance(a, int | float) or not isinstance(b, int | float) or not b or not math.isfinite(a / b):
        return None
    return float(a / b)


def comparisons(runs: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> dict[str, Any]:
    """Issue 44's and 51's targets against verl, each with its figures and whether it is met (None: not measured)."""

    def get(framework: str, mode: str, key: str) -> Any:
        return runs.get(framework, {}).get(mode, {}).get(key)

    speed = _ratio(
        get("r3operator", "R3", "trained_tokens_per_s_per_gpu"), get("verl", "R3", "trained_tokens_per_s_per_gpu")
    )
    kl = _ratio(get("r3operator", "R3", "kl_k3"), get("verl", "R3", "kl_k3"))
    return {
        "trained_tokens_per_s_per_gpu_r3operator_over_verl_R3": {
            "value": speed,
            "target": f">= {RATIO_TARGET} (moonshot {RATIO_MOONSHOT})",
            "met": None if speed is None else speed >= RATIO_TARGET,
        },
        "kl_k3_r3operator_over_verl_R3": {"value": kl, "target": "< 1", "met": None if kl is None else kl < 1},
        **{
            f"kl_k3_R3_over_Disabled_{framework}": _ratio(
                get(framework, "R3", "kl_k3"), get(framework, "Disabled", "kl_k3")
            )
            for framework in FRAMEWORKS
        },
        "collapse": {label(f, m): get(f, m, "collapse") for f in FRAMEWORKS for m in MODES},
    }


def table(runs: Mapping[str, Mapping[str, Mapping[str, Any]]], labels: Sequence[tuple[str, str]]) -> str:
    def cell(figures: Mapping[str, Any] | None, key: str) -> str:
        if figures is None or "error" in figures:
            return "not run"
        value = figures.get(key)
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 1e4 else f"{value:,.0f}"
        return "—" if value is None else str(value)

    def span(figures: Mapping[str, Any] | None, first: str, last: str) -> str:
        return "not run" if figures is None or "error" in figures else f"{cell(figures, first)} → {cell(figures, last)}"

    Figures = Mapping[str, Any] | None
    rows: list[tuple[str, Callable[[Figures], str]]] = [
        ("GPUs", lambda f: cell(f, "gpus")),
        ("steps", lambda f: cell(f, "steps")),
        (
            "samples a step; max response tokens",
            lambda f: f"{cell(f, 'samples_per_step')}; {cell(f, 'max_response_tokens')}",
        ),
        ("trained tokens/s/GPU (prompt + response)", lambda f: cell(f, "trained_tokens_per_s_per_gpu")),
        ("step seconds (no eval, no checkpoint)", lambda f: cell(f, "step_seconds_mean")),
        ("k3 KL(rollout ‖ trainer), mean", lambda f: cell(f, "kl_k3")),
        ("extreme tokens (ratio outside [½, 2]), mean", lambda f: cell(f, "extreme_token_fraction")),
        ("mean \\|Δlogprob\\|", lambda f: cell(f, "logprob_abs_diff_mean")),
        ("held-out reward, first → last", lambda f: span(f, "eval_reward_first", "eval_reward_last")),
        ("train reward, first → last", lambda f: span(f, "reward_first", "reward_last")),
        ("entropy, first → last", lambda f: span(f, "entropy_first", "entropy_last")),
        (
            "grad norm, mean / max",
            lambda f: (
                "not run" if f is None or "error" in f else f"{cell(f, 'grad_norm_mean')} / {cell(f, 'grad_norm_max')}"
            ),
        ),
        ("collapse", lambda f: cell(f, "collapse")),
    ]
    heads = [f"{framework} {mode}" for framework, mode in labels]
    lines = ["| | " + " | ".join(heads) + " |", "|---" * (len(heads) + 1) + "|"]
    for name, make in rows:
        lines.append(f"| {name} | " + " | ".join(make(runs.get(f, {}).get(m)) for f, m in labels) + " |")
    return "\n".join(lines)


def results_dir(setup: Setup, machine: str | None = None) -> Path:
    recorded = json.loads((setup.out / RUN_FILE).read_text()) if (setup.out / RUN_FILE).is_file() else {}
    date = recorded.get("date") or dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    kind = machine or recorded.get("machine") or learning.machine()
    return setup.out / f"verl-peer-{date}-{kind}"


def summarize(setup: Setup, *, machine: str | None = None) -> Path:
    """The folder to commit as benchmarks/results/verl-peer-<date>-<machine>/; its summary.json."""
    out = results_dir(setup, machine)
    plan = replace(setup.plan, modes=MODES)
    eval_samples = 1  # the learning RLJob's evaluation.samplesPerPrompt, verl's val_kwargs.n (learning_workload)
    runs: dict[str, dict[str, dict[str, Any]]] = {framework: {} for framework in FRAMEWORKS}
    problems: list[str] = []
    shown: list[tuple[str, str]] = []
    for framework in FRAMEWORKS:
        for mode in MODES:
            rows: Sequence[Mapping[str, object]]
            evals: Sequence[Mapping[str, object]]
            run_dir = out / "runs" / learning.run_name(label(framework, mode))
            shutil.rmtree(run_dir, ignore_errors=True)
            try:
                if framework == "verl":
                    source = setup.out / f"verl-{mode}"
                    if (source / verl_vs_r3.NOT_STARTED).is_file():
                        raise MetricsError(f"not started: {(source / verl_vs_r3.NOT_STARTED).read_text().strip()}")
                    log = source / "metrics.jsonl"
                    rows, evals = verl_step_rows(
                        log if log.is_file() and log.stat().st_size else source / "console.log",
                        samples=plan.prompts * plan.group,
                        eval_samples=eval_samples,
                    )
                    for name in ("overrides.txt", "metrics.jsonl", "preflight.log"):
                        if (source / name).is_file():
                            shutil.copy(source / name, out / f"verl-{mode}-{name}")
                else:
                    rows, evals = r3_step_rows(r3_run_dir(setup, mode))
                    if r3_job_path(setup, mode).is_file():  # benchmarks.learning's job, or the `up` variant
                        shutil.copy(r3_job_path(setup, mode), out / f"r3operator-{mode}-job.yaml")
            except MetricsError as exc:
                problems.append(f"{framework} {mode}: {exc}")
                continue
            write_rows(run_dir / "metrics.csv", rows)
            if evals:
                write_rows(run_dir / "eval.csv", evals)
            figures = run_summary(plan, run_dir, gpus=setup.gpus)
            figures["gpu_peak_gib"] = read_gpu_peaks(memory_log(setup, framework, mode))
            if framework == "verl":
                throughput = [v for r in rows if math.isfinite(v := _number(r.get(VERL_THROUGHPUT)))]
                figures["verl_perf_throughput_mean"] = sum(throughput) / len(throughput) if throughput else None
            runs[framework][mode] = figures
            shown.append((framework, mode))
    plot_plan = replace(plan, modes=tuple(label(f, m) for f, m in shown))
    plots = [p.name for p in learning.draw_plots(plot_plan, out)] if shown else []
    start = setup.out / "start.json"
    record = {
        "benchmark": "verl-peer-learning",
        "gpus": setup.gpus,
        "steps_asked": setup.steps,
        "command": f"python3 -m benchmarks.peers.verl_learning --learning-dir {setup.learning_dir} --gpus {setup.gpus} "
        f"--steps {setup.steps} --out {setup.out}",
        "layouts": layouts(setup),
        "plan": {**asdict(plan), "modes": list(plan.modes), "extra_engine_args": list(plan.extra_engine_args)},
        "verl_engine_memory_fraction": setup.engine_memory_fraction,
        "start": json.loads(start.read_text()) if start.is_file() else None,
        "frameworks": runs,
        "comparisons": comparisons(runs),
        "problems": problems,
        "plots": plots,
        "metric_sources": {"verl": {**VERL_COLUMNS, **VERL_TOKENS, "eval_reward": eval_key(eval_samples)}},
    }
    record = learning._finite_json(record)
    (out / "summary.json").write_text(json.dumps(record, indent=2) + "\n")
    text = [
        f"## verl 0.9.1 vs r3operator, {setup.gpus} GPU(s), learning workload",
        "",
        *(f"- {who}: {what}" for who, what in layouts(setup).items()),
        "",
        table(runs, [(f, m) for m in MODES for f in FRAMEWORKS]),
        "",
        *(f"- {name}: {value}" for name, value in record["comparisons"].items()),
        *(["", "Not in the table:", *(f"- {p}" for p in problems)] if problems else []),
    ]
    (out / "table.md").write_text("\n".join(text) + "\n")
    return out / "summary.json"


def layouts(setup: Setup) -> dict[str, str]:
    verl = (
        f"hybrid engine on {setup.gpus} GPU(s): a vLLM replica (TP 1, {setup.engine_memory_fraction:.0%} of a GPU) "
        f"on each, asleep while the Megatron actor trains (TP 1, PP 1, EP {setup.gpus}, DP {setup.gpus}) on the "
        "same GPUs"
    )
    if setup.gpus == 1:
        r3 = (
            "`r3operator run`: the vLLM engine in the trainer's process on the same GPU, FSDP trainer, weights over IPC"
        )
    else:
        r3 = (
            f"`r3operator up`: {setup.r3_engines} engine replica(s) on GPU(s) of their own, the FSDP trainer over "
            f"{setup.gpus - setup.r3_engines} rank(s), weights over NCCL"
        )
    return {"verl": verl, "r3operator": r3}


# ------------------------------------------------------------------------------------------------ dry run


def dry_run(setup: Setup, parts: Sequence[str], *, reference: Path | None) -> int:
    """Every command the parts would run, and verl's configuration as verl would resolve it; runs nothing."""
    from benchmarks.peers.verl_reference import ReferenceError, apply_overrides, changes, find_reference, read_reference

    print(f"# verl 0.9.1 vs r3operator, learning workload, {setup.gpus} GPU(s), {setup.steps} steps, out {setup.out}")
    for who, what in layouts(setup).items():
        print(f"# {who}: {what}")
    try:
        check_learning_dir(setup.learning_dir)
    except LearningPeerError as exc:
        print(f"# not there yet: {exc}")
    with model_config_dir(setup) as config_dir:
        check_experts(config_dir, setup.gpus)
        jobs = {mode: job_document(setup, mode, config_dir) for mode in MODES}
        specs = {mode: parsed_spec(doc) for mode, doc in jobs.items()}
    workloads = {mode: learning_workload(specs[mode], **_memory(setup)) for mode in MODES}
    overrides = {mode: overrides_for(setup, mode, workloads[mode]) for mode in MODES}
    env_keys = ("PYTHONPATH", "VERL_FILE_LOGGER_PATH", "CUDA_DEVICE_MAX_CONNECTIONS")
    for part in parts:
        if part == "prepare":
            print(
                f"\n== prepare: {setup.learning_dir / 'data'}/{{train,eval}}.jsonl -> "
                f"{setup.data_dir}/{{train,val}}.parquet"
            )
        elif part == "r3":
            if setup.gpus == 1:
                print(f"\n== r3: {', '.join(setup.r3_modes)}, one after the other on the GPU (benchmarks.learning)")
                print("   " + shlex.join(r3_run_command(setup)))
            else:
                for mode in setup.r3_modes:
                    spec = specs[mode]
                    print(
                        f"\n== r3 {mode}: {r3_job_path(setup, mode)} (routingReplay {spec.routing_replay.mode}, "
                        f"{spec.inference.replicas} engine(s), trainer {spec.trainer.gpus_per_node} GPU(s))"
                    )
                    print("   " + shlex.join(r3_up_command(setup, mode)))
        elif part.startswith("verl-"):
            mode = part.removeprefix("verl-")
            run_dir = setup.out / part
            env = verl_vs_r3.verl_environment(run_dir, verl_site=setup.verl_site, site=setup.site)
            print(f"\n== {part}: preflight, then verl")
            print("   " + shlex.join(verl_vs_r3.preflight_command(sys.executable, setup.model_dir)))
            print("   " + " ".join(f"{k}={shlex.quote(env[k])}" for k in env_keys) + " \\")
            command = verl_command(sys.executable, overrides[mode])
            start = len(command) - len(overrides[mode])
            lines = [shlex.join(command[:start]), *(shlex.quote(item) for item in command[start:])]
            print("     " + " \\\n       ".join(lines))
        elif part == "summary":
            print(f"\n== summary: {results_dir(setup)}/summary.json, table.md, plots")
    source = find_reference(reference) if reference is not None else _site_reference(setup)
    if source is None:
        print("\n# verl's configuration: not checked (no verl here; give --verl-config VERL_WHEEL_OR_SITE)")
        return 0
    try:
        config, where = read_reference(source)
        ours = {mode: apply_overrides(config, overrides[mode]) for mode in MODES}
    except ReferenceError as exc:
        print(f"\n# verl's configuration: {exc}")
        return 2
    print(f"\n# verl's configuration: every key of both runs is one of verl's ({where}, {ENGINE_CHOICE})")
    print("# resolved, R3 run (verl's default → this run), every value that differs:")
    for key, before, after in changes(config, ours["R3"]):
        print(f"   {key}: {before!r} → {after!r}")
    print("# the Disabled run differs from the R3 run in:")
    for key, _before, after in changes(ours["R3"], ours["Disabled"]):
        print(f"   {key}: {after!r}")
    return 0


def _site_reference(setup: Setup) -> Path | None:
    """verl's site dir on the GPU machine (verl-setup.sh), else a verl importable here."""
    from benchmarks.peers.verl_reference import REFERENCE, find_reference

    site = Path(setup.verl_site)
    return site if (site / REFERENCE).is_file() else find_reference(None)


# ------------------------------------------------------------------------------------------------ main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--learning-dir", type=Path, required=True, help="benchmarks.learning's --out (data, warm)")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs each framework uses (1, or 4 where lent)")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, in order: {', '.join(PARTS)}")
    parser.add_argument("--dry-run", action="store_true", help="print the commands and verl's resolved config only")
    parser.add_argument(
        "--verl-config", type=Path, default=None, help="a verl 0.9.1 wheel or site dir to check the keys against"
    )
    parser.add_argument("--engine-memory-fraction", type=float, default=ENGINE_MEMORY_FRACTION, help="verl's vLLM")
    parser.add_argument("--r3-engines", type=int, default=1, help="r3operator's engine GPUs (2 or more GPUs)")
    parser.add_argument("--r3-modes", default=",".join(MODES), help="the modes the r3 part runs, in order")
    parser.add_argument("--site", default="/tmp/site", help="r3operator's GPU packages (scripts/gpu-setup.sh)")
    parser.add_argument("--verl-site", default="/tmp/verl-site", help="verl's packages (verl-setup.sh)")
    parser.add_argument("--timeout-s", type=int, default=3600, help="limit of each run")
    parser.add_argument("--machine", default=None, help="summary: the machine's name (default: the run's, in run.json)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.gpus < 1 or args.steps < 1:
        parser.error("--gpus and --steps must be at least 1")
    if args.gpus > 1 and not 1 <= args.r3_engines < args.gpus:
        parser.error(f"--r3-engines {args.r3_engines}: between 1 and {args.gpus - 1} (the trainer needs a GPU)")
    if not 0 < args.engine_memory_fraction < 1:
        parser.error(f"--engine-memory-fraction: expected a fraction of a GPU, got {args.engine_memory_fraction}")
    r3_modes = tuple(m.strip() for m in args.r3_modes.split(",") if m.strip())
    if not r3_modes or set(r3_modes) - set(MODES) or len(set(r3_modes)) != len(r3_modes):
        parser.error(f"--r3-modes {args.r3_modes!r}: some of {', '.join(MODES)}, each once")
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if unknown := [p for p in parts if p not in PARTS]:
        parser.error(f"--parts: unknown {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    setup = Setup(
        learning_dir=args.learning_dir.resolve(),
        out=args.out.resolve(),
        gpus=args.gpus,
        steps=args.steps,
        engine_memory_fraction=args.engine_memory_fraction,
        r3_engines=args.r3_engines,
        site=args.site,
        verl_site=args.verl_site,
        timeout_s=args.timeout_s,
        r3_modes=r3_modes,
    )
    try:
        if args.dry_run:
            return dry_run(setup, parts, reference=args.verl_config)
        setup.out.mkdir(parents=True, exist_ok=True)
        failed = []
        for part in parts:
            if part == "prepare":
                rc = prepare(setup)
            elif part == "r3":
                rc = run_r3(setup)
            elif part.startswith("verl-"):
                rc = run_verl(setup, part.removeprefix("verl-"))
            else:
                path = summarize(setup, machine=args.machine)
                print(f"== summary: {path}\n{(path.parent / 'table.md').read_text()}", flush=True)
                rc = 0
            if rc:
                failed.append(part)
    except LearningPeerError as exc:
        print(f"== {exc}", flush=True)
        return 2
    if failed:
        print(f"failed: {', '.join(failed)} (see O/<part>/console.log)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
