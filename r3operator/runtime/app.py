"""What `r3operator run` runs, on a workstation (an RLJob file) and in the trainer pod (`--config`)."""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from r3operator.runtime.config import RunSettings, load_job_config, load_job_file, resolve_device
from r3operator.runtime.progress import StepTable
from r3operator.runtime.report import EVAL_CSV, read_eval_rows, read_rows, write_plot, write_report
from r3operator.settings import RUNS_DIR, runtime_settings, unknown_variables

if TYPE_CHECKING:  # pragma: no cover (the run's modules load torch and Ray: imported when a run starts)
    from r3operator.rollout.engines import EngineGroup
    from r3operator.runtime.loop import GRPORun


def build_settings(
    file: Path | None,
    *,
    config: Path | None = None,
    steps: int | None = None,
    out_dir: Path = Path("runs"),
    resume: bool = True,
    device: str = "auto",
    model: str | None = None,
    metrics_port: int | None = None,
    trainer_ranks: int | None = None,
) -> RunSettings:
    """Arguments win over the environment (RuntimeSettings: R3OPERATOR_STEPS, R3OPERATOR_MODEL, …),
    which wins over the RLJob and the operator's runtime config."""
    env = runtime_settings()
    if unknown := unknown_variables():
        logging.getLogger("r3operator.runtime").warning(
            "ignored: %s (not a setting; see docs/runtime.md, Overrides)", ", ".join(unknown)
        )
    engine_urls: list[str] = []
    prefill_urls: list[str] = []
    run_dir: Path | None = None
    routing_dir: Path | None = None
    weight_transfer = None
    if config is not None:
        # Paths inside a pod; R3OPERATOR_MOUNTS says where they are outside one (`r3operator up`).
        config_file = env.host_path(config)
        runtime_config = load_job_config(config_file)
        job, runtime = runtime_config.job, runtime_config.runtime
        if runtime.weight_transfer is not None:
            weight_transfer = runtime.weight_transfer.choice()
        engine_urls = list(runtime.engine_urls)
        prefill_urls = list(runtime.prefill_engine_urls)
        routing_dir = env.host_path(runtime.routing_dir)
        run_dir = routing_dir / RUNS_DIR / job.metadata.name
    elif file is not None:
        job = load_job_file(file)
    else:
        raise ValueError("give an RLJob file or --config")
    if env.engine_urls:
        engine_urls = list(env.engine_urls)
    if env.prefill_engine_urls:
        prefill_urls = list(env.prefill_engine_urls)
    total = steps or env.steps or job.spec.algorithm.steps
    resolved = resolve_device(device)
    port = metrics_port if metrics_port is not None else env.driver_metrics_port
    if port is None:
        port = job.spec.monitoring.port if config else 0
    settings = RunSettings(
        job=job,
        run_dir=run_dir or out_dir / job.metadata.name,
        routing_dir=routing_dir,
        device=resolved,
        steps=total,
        resume=resume,
        model_override=model or env.model,
        metrics_port=port or None,
        engine_urls=engine_urls,
        prefill_engine_urls=prefill_urls,
        engine_dtype=env.engine_dtype or default_engine_dtype(resolved),
        trainer_ranks=trainer_ranks or env.trainer_ranks,
        weight_transfer=weight_transfer,
    )
    if not engine_urls:  # an engine this run starts itself: R3 on one that cannot capture is refused here
        from r3operator.runtime.setup import check_local_capture

        check_local_capture(settings)
    return settings


def default_engine_dtype(device: str) -> str:
    """fp32 on CPU (the canary demands exact greedy equality), bf16 on GPU (production numerics; the
    canary then runs in near-tie mode, see weightsync/canary.py)."""
    return "bfloat16" if device.startswith("cuda") else "float32"


SINGLE_PROCESS_DCP = (
    r"torch\.distributed is (disabled, )?unavailable or uninitialized, assuming the intent is to (save|load) in a "
    r"single process"
)
"""DCP's note on every checkpoint of a one-rank trainer, which saves without a process group on purpose."""


def _prepare_env(device: str) -> None:
    warnings.filterwarnings("ignore", message=SINGLE_PROCESS_DCP, category=UserWarning)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not sys.stdout.isatty():  # CI log: no carriage-return progress bars between the step lines
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    if device.startswith("cuda"):
        # The driver touches CUDA (trainer) before any engine exists; see docs/runtime.md, "The GPU path".
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def run_once(
    settings: RunSettings, *, engines: EngineGroup | None = None, label: str | None = None
) -> tuple[list[dict[str, Any]], GRPORun]:
    """One training run; returns its metrics rows (from metrics.csv, resumed steps included) and the run."""
    from r3operator.runtime.async_loop import AsyncGRPORun
    from r3operator.runtime.loop import GRPORun

    _prepare_env(settings.device)
    run_class = AsyncGRPORun if settings.job.spec.algorithm.mode == "async" else GRPORun
    run = run_class(settings, engines=engines)
    title = f"{settings.name} [{label or run.mode.value}] on {settings.device}"
    with StepTable(title, total_steps=settings.steps, enabled=settings.show_progress) as table:
        run.run(table=table)
    return read_rows(settings.run_dir / "metrics.csv"), run


def run_job(settings: RunSettings, *, compare_replay: bool = False, engines: EngineGroup | None = None) -> Path:
    """Run (or compare replay off vs on) and write metrics.csv, report.md and plot.png; return the run dir.

    `--compare-replay`: Disabled then R3 with the same seed (same SFT warm-up, same rollout seeds, so step
    1 samples identical sequences) into <run>/disabled and <run>/r3, sharing the engines; one plot.
    """
    from dataclasses import replace

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    begin = time.perf_counter()
    # Engines handed in (a test, a benchmark) or reached by URL (`up`, the operator's engine pods) were
    # started before this invocation: its wall time then does not contain their start.
    engines_started_here = engines is None and not settings.engine_urls
    runs: dict[str, list[dict[str, Any]]] = {}
    evals: dict[str, list[dict[str, Any]]] = {}  # spec.evaluation: each run's eval.csv
    if compare_replay:
        for label, mode in (("replay off (Disabled)", "Disabled"), ("replay on (R3)", "R3")):
            sub = replace(settings, replay_override=mode, run_dir=settings.run_dir / mode.lower())
            runs[label], run = run_once(sub, engines=engines, label=label)
            evals[label] = read_eval_rows(sub.run_dir / EVAL_CSV)
            engines = run.engines
    else:
        label = settings.job.spec.routing_replay.mode.value
        runs[label], run = run_once(settings, engines=engines)
        evals[label] = read_eval_rows(settings.run_dir / EVAL_CSV)
    out = settings.run_dir
    out.mkdir(parents=True, exist_ok=True)
    plot_problem = write_plot(out / "plot.png", runs, evals)
    facts = {
        "model": str(run.model_dir),
        "device": settings.device,
        "vLLM": run.vllm_version,
        "engine dtype": settings.engine_dtype,
        "trainer": _trainer_fact(settings, run),
        "weight sync": run.weight_sync.described,
        "weight-sync canary": canary_fact(settings, run),
        "task": f"{settings.job.spec.task.name} ({settings.job.spec.task.reward})",
        **({"held-out evaluation": evaluation_fact(settings)} if settings.job.spec.evaluation else {}),
        "steps": settings.steps,
        "wall time (s, this invocation)": wall_time_fact(time.perf_counter() - begin, engines_started_here),
        "plot": plot_problem or "plot.png",
    }
    text = write_report(
        out / "report.md",
        job_name=settings.name,
        runs=runs,
        facts=facts,
        canary=settings.job.spec.weight_sync.canary,
        evals=evals,
    )
    if settings.show_progress:
        print(text, flush=True)  # plain: readable in a CI log, markdown on a terminal
    if plot_problem:
        logging.getLogger("r3operator.runtime").warning(plot_problem)
    return out


def evaluation_fact(settings: RunSettings) -> str:
    """Where the eval reward comes from and how it is sampled."""
    evaluation, rollout = settings.job.spec.evaluation, settings.job.spec.rollout
    assert evaluation is not None
    temperature = rollout.temperature if evaluation.temperature is None else evaluation.temperature
    rows = "every row" if evaluation.max_prompts is None else f"the first {evaluation.max_prompts} rows"
    when = "before training and " if evaluation.before_training else ""
    return (
        f"{rows} of {evaluation.dataset_path}, {evaluation.samples_per_prompt} sample(s) each at temperature "
        f"{temperature:g}, {when}every {evaluation.interval_steps} steps and after the last (eval.csv)"
    )


def wall_time_fact(seconds: float, engines_started_here: bool) -> str:
    if engines_started_here:
        return f"{seconds:.1f}, incl. engine start"
    return f"{seconds:.1f}, excl. engine start (the engines were serving before this invocation)"


def canary_fact(settings: RunSettings, run: GRPORun) -> str:
    """What the canary checked after each sync, or that it did not run."""
    if not settings.job.spec.weight_sync.canary:
        return "off (spec.weightSync.canary: false): no check after the syncs"
    from r3operator.settings import runtime_settings

    receipt = (
        "every engine worker's receipt matched the trainer's fingerprints of each tensor sent"
        if runtime_settings().sync_receipt
        else "receipt check off (R3OPERATOR_SYNC_RECEIPT=false)"
    )
    return f"{receipt}; greedy decode: {run.weight_sync.plan.tolerance.describe()}"


def _trainer_fact(settings: RunSettings, run: GRPORun) -> str:
    trainer = run.trainer
    compute = getattr(trainer, "compute_dtype", "float32")
    backend = settings.job.spec.trainer.backend.value
    ranks = getattr(trainer, "world_size", 1)
    # The canary's forward matches the engine: fp32 against an fp32 engine, the trainer's compute otherwise.
    canary = f"{compute} autocast" if run.weight_sync.plan.tolerance.autocast else "fp32"
    return (
        f"{backend} on {ranks} rank(s), fp32 master weights + AdamW, forwards under {compute} autocast, "
        f"canary forward {canary} with the engine's routes replayed"
    )
