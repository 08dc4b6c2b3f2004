"""The resolved plan of an RLJob: what it will cost and which code paths it takes.

Pure function of the spec (plus the version matrix). The operator writes it into
``status.resolved``; ``r3operator explain`` prints it before anything is scheduled.
"""

from __future__ import annotations

from dataclasses import dataclass

from r3operator.api.disaggregation import role_spec, roles
from r3operator.api.engine_layout import engine_layout
from r3operator.api.enums import ReplayMode, TrainerBackend
from r3operator.api.v1alpha1 import ResolvedSpec, RLJob, RLJobSpec
from r3operator.api.versions import FEATURES, EngineVersion, resolve_engine_version, supports
from r3operator.api.weight_transfer import LayoutChoice, TransferChoice, choose_layout, cluster_transfer


@dataclass(frozen=True, slots=True)
class Plan:
    engine_version: EngineVersion
    engine_gpus_per_replica: int
    engine_pods_per_replica: int
    engine_gpus_total: int
    engine_expert_parallel_size: int
    trainer_gpus_total: int
    trainer_expert_parallel_size: int
    routing_bytes_per_token: int | None
    route_dtype: str | None
    replay_path: str
    features: dict[str, bool | None]
    weight_transfer: TransferChoice
    weight_sync_layout: LayoutChoice

    def to_resolved(self) -> ResolvedSpec:
        return ResolvedSpec(
            vllm_version=str(self.engine_version.version) if self.engine_version.known else None,
            vllm_version_source=self.engine_version.source.value,
            engine_gpus_per_replica=self.engine_gpus_per_replica,
            engine_gpus_total=self.engine_gpus_total,
            engine_expert_parallel_size=self.engine_expert_parallel_size,
            trainer_gpus_total=self.trainer_gpus_total,
            trainer_expert_parallel_size=self.trainer_expert_parallel_size,
            routing_bytes_per_token=self.routing_bytes_per_token,
            features=[k for k, v in self.features.items() if v],
            weight_sync_layout=self.weight_sync_layout.layout,
            weight_sync_layout_reason=self.weight_sync_layout.describe()[:1024],
        )


def route_dtype(num_experts: int) -> str:
    """vLLM's scheduler-side dtype (and r3operator's wire dtype) for expert ids."""
    return "uint8" if num_experts <= 256 else "uint16"


def _replay_path(spec: RLJobSpec) -> str:
    mode = spec.routing_replay.mode
    backend = spec.trainer.backend
    if mode is ReplayMode.DISABLED:
        return "natural routing on engines and trainer (no capture, no replay)"
    if mode is ReplayMode.R2:
        where = (
            "Megatron RouterReplay RECORD → REPLAY_FORWARD/BACKWARD"
            if backend is TrainerBackend.MEGATRON
            else "HF router hooks: record in the old-logprob pass, replay in the update"
        )
        return f"R2: {where}; engines do not capture routes"
    where = (
        "Megatron RouterReplay REPLAY_FORWARD/REPLAY_BACKWARD per micro-batch"
        if backend is TrainerBackend.MEGATRON
        else "HF *TopKRouter forward hooks"
    )
    ref = " + ref model" if spec.routing_replay.replay_ref else ""
    return f"R3: vLLM --enable-return-routed-experts → routing-data volume → {where} (old-logprob + update{ref})"


def plan(job: RLJob | RLJobSpec) -> Plan:
    spec = job.spec if isinstance(job, RLJob) else job
    inf, trainer, arch = spec.inference, spec.trainer, spec.model.architecture
    version = resolve_engine_version(image=inf.image, explicit=inf.vllm_version)
    pods_per_replica = engine_layout(spec).pods_per_replica
    per_replica = inf.tensor_parallel_size * inf.pipeline_parallel_size * inf.data_parallel_size
    total = per_replica * inf.replicas
    if roles(spec):  # a disaggregated job: both roles' GPUs; "per replica" is the decode role's
        parts = [role_spec(spec, role).inference for role in roles(spec)]
        gpus = [p.tensor_parallel_size * p.pipeline_parallel_size * p.data_parallel_size for p in parts]
        per_replica, total = gpus[-1], sum(g * p.replicas for g, p in zip(gpus, parts, strict=True))
    engine_ep = inf.tensor_parallel_size * inf.data_parallel_size if inf.enable_expert_parallel else 1
    trainer_ep = (
        trainer.megatron.expert_parallel_size
        if trainer.backend is TrainerBackend.MEGATRON and trainer.megatron is not None
        else 1
    )
    dtype = route_dtype(arch.num_experts) if arch is not None else None
    bytes_per_token = None
    if arch is not None and spec.routing_replay.mode is ReplayMode.R3:
        bytes_per_token = arch.num_layers * arch.top_k * (1 if dtype == "uint8" else 2)
    transfer = cluster_transfer(spec)
    return Plan(
        engine_version=version,
        engine_gpus_per_replica=per_replica,
        engine_pods_per_replica=pods_per_replica,
        engine_gpus_total=total,
        engine_expert_parallel_size=engine_ep,
        trainer_gpus_total=trainer.nodes * trainer.gpus_per_node,
        trainer_expert_parallel_size=trainer_ep,
        routing_bytes_per_token=bytes_per_token,
        route_dtype=dtype,
        replay_path=_replay_path(spec),
        features={k: supports(version, k) for k in FEATURES},
        weight_transfer=transfer,
        weight_sync_layout=choose_layout(spec, version, transfer),
    )
