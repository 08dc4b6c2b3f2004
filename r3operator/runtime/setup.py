"""The run's set-up: what the step loop works with, built once before step 1.

`build_parts` reads the model's config, builds the task source and the held-out evaluation (its rows read before
any engine starts), the trainer (on Ray ranks when there are several), its checkpointer, the engines (unless the
caller brought them) and the weight-sync method, in that order, and hands them back as one `RunParts`: the loop
(runtime/loop.py) never sees a part that is not there yet. What needs the loop itself — resuming a checkpoint, the
SFT warm-up, the first weight sync and canary, the evaluation before training — stays in `GRPORun.setup`, which
calls this first.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from r3operator.api.enums import ReplayMode
from r3operator.api.v1alpha1 import RLJobSpec
from r3operator.api.weight_transfer import TransferChoice
from r3operator.rollout.engines import EngineGroup
from r3operator.runtime import checkpoint as ckpt
from r3operator.runtime.config import RunSettings, check_architecture
from r3operator.runtime.dataset_file import resolve_dataset_file, resolve_eval_dataset_file
from r3operator.runtime.evaluation import Evaluation, build_evaluation
from r3operator.runtime.nonfinite import NonFiniteTally
from r3operator.runtime.report import keep_rows_through, read_rows
from r3operator.tasks import envs
from r3operator.tasks.source import TaskSource, build_task_source
from r3operator.trainer.base import Trainer
from r3operator.trainer.distributed import DistributedTrainer
from r3operator.trainer.factory import build_trainer, world_size
from r3operator.weightsync import sync as weight_sync
from r3operator.weightsync.canary import CanaryTolerance, canary_tolerance
from r3operator.weightsync.session import CanaryPlan, SyncMetrics, WeightSyncSession

log = logging.getLogger("r3operator.runtime")
LOCAL_MAX_MODEL_LEN = 512
"""The in-process engines' context when `spec.inference.maxModelLen` is unset: small, for a CPU's KV cache."""


@dataclass(frozen=True)
class RunParts:
    vocab_size: int
    num_experts: int
    task: TaskSource
    trainer: Trainer
    checkpoints: ckpt.StepCheckpoints
    engines: EngineGroup
    vllm_version: str
    weight_transfer: TransferChoice
    canary_tol: CanaryTolerance
    evaluation: Evaluation | None = None


def build_parts(settings: RunSettings, model_dir: Path, *, engines: EngineGroup | None, ckpt_root: Path) -> RunParts:
    from transformers import AutoConfig

    spec = settings.job.spec
    capture = (
        local_route_capture(settings) if engines is None and not settings.engine_urls else True
    )  # R3 refused first
    hf_config = AutoConfig.from_pretrained(model_dir)
    if not settings.model_override:
        check_architecture(settings.job, hf_config)
    vocab_size = int(hf_config.vocab_size)
    task = build_task_source(
        spec, model_dir=model_dir, vocab_size=vocab_size, dataset_file=resolve_dataset_file(settings.job)
    )
    evaluation = build_evaluation(
        spec,
        task,
        resolve_eval_dataset_file(settings.job),
        last_step=settings.steps,
        run_dir=settings.run_dir,
    )
    ranks = world_size(spec, device=settings.device, override=settings.trainer_ranks)
    if ranks > 1:  # the ranks are Ray actors: in a pod, on the RayJob's cluster
        from r3operator.settings import runtime_settings

        start_ray(in_cluster=runtime_settings().in_cluster)
    trainer = build_trainer(spec, model_dir, device=settings.device, ranks=ranks)
    checkpoints = ckpt.StepCheckpoints(
        ckpt_root,
        trainer,
        keep_last=spec.checkpoint.keep_last,
        ranks=ranks,
        interval_steps=spec.checkpoint.interval_steps,
        last_step=settings.steps,
    )
    if engines is None:
        engines = start_engines(settings, model_dir, capture_routes=capture)
    vllm_version = engines.vllm_version()
    transfer = weight_sync.resolve(
        device=settings.device, engines=engines, configured=settings.weight_transfer, engine_vllm=vllm_version
    )
    return RunParts(
        vocab_size=vocab_size,
        num_experts=int(hf_config.num_experts),
        task=task,
        trainer=trainer,
        checkpoints=checkpoints,
        engines=engines,
        vllm_version=vllm_version,
        weight_transfer=transfer,
        canary_tol=canary_tolerance(settings.engine_dtype, settings.device),
        evaluation=evaluation,
    )


def build_session(settings: RunSettings, parts: RunParts, metrics: SyncMetrics) -> WeightSyncSession:
    """The run's weight sync and canary (weightsync/session.py), over the parts `build_parts` made."""
    spec, task = settings.job.spec, parts.task
    return WeightSyncSession(
        spec,
        engines=parts.engines,
        trainer=parts.trainer,
        transfer=parts.weight_transfer,
        engine_vllm=parts.vllm_version,
        engine_dtype=settings.engine_dtype,
        canary=CanaryPlan(spec.weight_sync.canary, task.canary_prompts, task.canary_tokens, parts.canary_tol),
        metrics=metrics,
        ranks=parts.trainer if isinstance(parts.trainer, DistributedTrainer) else None,
    )


def resume(
    settings: RunSettings, checkpoints: ckpt.StepCheckpoints, nonfinite: NonFiniteTally
) -> ckpt.CheckpointInfo | None:
    """The checkpoint this run resumes from, loaded into the checkpoints' trainer with the driver's RNG state (and the
    newest committed step of `checkpoints`), and metrics.csv kept through its step (steps finished after it run
    again: their rows must not appear twice), the non-finite steps of those rows counted in `nonfinite` again. None:
    a fresh start, whose directory must not mix in the rows of an earlier run there (its metrics.csv is removed)."""
    metrics_csv = settings.run_dir / "metrics.csv"
    info = ckpt.find_latest(checkpoints.root) if settings.resume else None
    if info is None:
        metrics_csv.unlink(missing_ok=True)
        return None
    state = ckpt.load_checkpoint(info, checkpoints.trainer)
    ckpt.set_rng_state(state["rng"])
    keep_rows_through(metrics_csv, info.step)
    log.info("resumed from %s (step %d, policy version %d)", info.path, info.step, info.policy_version)
    checkpoints.committed_step = info.step
    nonfinite.resume(read_rows(metrics_csv))
    return info


def check_run_spec(spec: RLJobSpec) -> None:
    """`spec.rollout.multiTurn` and the task agree: a multi-turn task is a game with an environment, and only such a
    task runs multi-turn. (A KL term to a reference model is refused first: this runtime has none.)"""
    if spec.algorithm.use_kl_loss or spec.algorithm.kl_in_reward:
        raise ValueError("spec.algorithm.useKLLoss/klInReward: KL to a reference model is not in this runtime yet")
    multi_turn_task = spec.task.name in envs.ENVIRONMENTS
    if spec.rollout.multi_turn and not multi_turn_task:
        raise ValueError(
            f"spec.rollout.multiTurn: task {spec.task.name!r} has no multi-turn environment; "
            f"set spec.task.name to one of {sorted(envs.ENVIRONMENTS)}"
        )
    if multi_turn_task and not spec.rollout.multi_turn:
        raise ValueError(f"spec.task.name: {spec.task.name!r} is a multi-turn game; set spec.rollout.multiTurn: true")


def start_ray(*, in_cluster: bool) -> None:
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if in_cluster:
        ray.init(address="auto")
    else:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)


def start_engines(settings: RunSettings, model_dir: Path, *, capture_routes: bool = True) -> EngineGroup:
    from r3operator.rollout.engines import HTTPEngine, RayEngine

    disaggregated = settings.job.spec.inference.disaggregation is not None
    if settings.engine_urls:
        from transformers import AutoConfig

        experts = int(AutoConfig.from_pretrained(model_dir).num_experts)

        def engines(urls: list[str]) -> list[HTTPEngine]:
            return [
                HTTPEngine(url, staging_dir=settings.run_dir / "weight-staging", num_experts=experts) for url in urls
            ]

        if disaggregated:
            from r3operator.rollout.disaggregated import DisaggregatedGroup

            if not settings.prefill_engine_urls:
                raise ValueError(
                    "spec.inference.disaggregation is set but no prefill engine URL is given (the runtime config's "
                    "prefillEngineURLs or R3OPERATOR_PREFILL_ENGINE_URLS)"
                )
            return DisaggregatedGroup(engines(settings.prefill_engine_urls), engines(settings.engine_urls))
        return EngineGroup(engines(settings.engine_urls))
    if disaggregated:
        raise ValueError(
            "spec.inference.disaggregation runs prefill and decode engines over HTTP: start the job with "
            "`r3operator up` or on a cluster (`r3operator run` starts one in-process engine)"
        )
    start_ray(in_cluster=False)
    backend = weight_sync.local_engine_backend(settings.device)
    inference = settings.job.spec.inference
    # The API's default assumes a GPU of the engine's own; locally only a value the user wrote is taken.
    share = inference.gpu_memory_utilization if "gpu_memory_utilization" in inference.model_fields_set else None
    if inference.extra_args:
        log.info("in-process engine flags (spec.inference.extraArgs): %s", " ".join(inference.extra_args))
    return EngineGroup(
        [
            RayEngine(
                model_dir,
                device=settings.device,
                dtype=settings.engine_dtype,
                seed=settings.job.spec.seed,
                max_model_len=inference.max_model_len or LOCAL_MAX_MODEL_LEN,
                weight_transfer_backend=backend,
                gpu_memory_utilization=share,
                capture_routes=capture_routes,
                engine_flags=inference.extra_args,
            )
        ]
    )


def local_route_capture(settings: RunSettings) -> bool:
    """Whether the engine this run starts captures routed experts. Always on a GPU, and on a CPU engine of a vLLM that
    can (the routing-agreement figures of Disabled and R2 come from them). A CPU engine of vLLM >= 0.31 cannot
    (api/checks.py `cpu_route_capture_refusal`): R3 is refused there (`check_local_capture`, which `build_settings`
    runs first); Disabled and R2 run without routes, their routing figures empty, with a warning."""
    refused = check_local_capture(settings)
    if refused is not None:
        log.warning(
            "routingReplay.mode %s: the engine captures no routes (%s); the routing figures stay empty",
            _mode(settings).value,
            refused,
        )
    return refused is None


def check_local_capture(settings: RunSettings) -> str | None:
    """Why the CPU engine this run would start cannot capture routes (None: it can, or it runs on a GPU); raises
    `ValueError` naming `spec.routingReplay.mode` when the run is R3, before anything starts."""
    from r3operator.api.checks import cpu_route_capture_refusal
    from r3operator.api.versions import installed_engine_version

    if settings.device.startswith("cuda"):
        return None
    refused = cpu_route_capture_refusal(installed_engine_version())
    if refused is not None and _mode(settings) is ReplayMode.R3:
        raise ValueError(f"spec.routingReplay.mode R3 cannot run here: {refused}")
    return refused


def _mode(settings: RunSettings) -> ReplayMode:
    return ReplayMode(settings.replay_override) if settings.replay_override else settings.job.spec.routing_replay.mode
