"""Compatibility rules as data.

Each :class:`Rule` names the spec fields it reads, its severity, the upstream source that shows
why, and a check that returns a message *with the actual values* when the spec breaks it.

Rules that need only the object itself also carry a CEL expression; the generated CRD installs it
as an ``x-kubernetes-validations`` entry on ``.spec`` so the API server refuses the object before
any GPU is spent. The Python check and the CEL expression are tested to agree on generated specs
(tests/api/test_cel_agreement.py). Rules that need outside facts (the vLLM version matrix) or that
only warn exist in Python alone and surface as ``Valid=False`` / Warning events in the operator.

CEL conventions: ``self`` is ``.spec`` after API-server defaulting (every section has
``default: {}``), so defaulted scalars are always present; optional fields are guarded by
``has()``. No optional syntax (``?.``) and no Kubernetes CEL libraries, so both test evaluators
(common-expression-language and cel-python) can run every rule.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from r3operator.api.enums import ExecutorBackend, KVConnector, ReplayMode, Severity, TrainerBackend
from r3operator.api.families import HF_REPLAY_FAMILIES, HF_REPLAY_ROUTER_TYPES
from r3operator.api.v1alpha1 import RLJobSpec
from r3operator.api.versions import EngineVersion, image_tag, resolve_engine_version, supports


@dataclass(frozen=True, slots=True)
class RuleContext:
    spec: RLJobSpec
    engine_version: EngineVersion

    @classmethod
    def for_spec(cls, spec: RLJobSpec) -> RuleContext:
        version = resolve_engine_version(image=spec.inference.image, explicit=spec.inference.vllm_version)
        return cls(spec=spec, engine_version=version)


@dataclass(frozen=True, slots=True)
class CelRule:
    rule: str
    """Must hold; written over ``self`` = spec."""
    message_expression: str
    field_path: str
    """Relative to .spec, e.g. ``.inference.executorBackend``."""
    reason: str = "FieldValueForbidden"


Check = Callable[[RuleContext], str | None]


@dataclass(frozen=True, slots=True)
class Rule:
    id: str
    severity: Severity
    field: str
    """The field a finding points at (``spec.…``)."""
    reads: tuple[str, ...]
    summary: str
    sources: tuple[str, ...]
    check: Check = field(repr=False)
    cel: CelRule | None = None

    @property
    def needs_outside_facts(self) -> bool:
        return self.cel is None and self.severity is Severity.ERROR


@dataclass(frozen=True, slots=True)
class Finding:
    rule: str
    severity: Severity
    field: str
    message: str
    sources: tuple[str, ...] = ()


# ------------------------------------------------------------------------------------- helpers


def _mode(s: RLJobSpec) -> ReplayMode:
    return s.routing_replay.mode


def _r3(s: RLJobSpec) -> bool:
    return _mode(s) is ReplayMode.R3


def _replay(s: RLJobSpec) -> bool:
    return _mode(s) is not ReplayMode.DISABLED


def _dp_local(s: RLJobSpec) -> int:
    inf = s.inference
    return (
        inf.data_parallel_size_local if inf.data_parallel_size_local is not None else inf.data_parallel_size
    )


# The flags r3operator derives from the spec: setting them again in extraArgs would silently fight
# the rules above (e.g. a KV connector smuggled past R3-KV-CONNECTOR), so they are refused.
DERIVED_VLLM_FLAGS: tuple[str, ...] = (
    "--enable-return-routed-experts",
    "--no-enable-return-routed-experts",
    "--tensor-parallel-size",
    "--pipeline-parallel-size",
    "--data-parallel-size",
    "--decode-context-parallel-size",
    "--enable-expert-parallel",
    "--distributed-executor-backend",
    "--kv-transfer-config",
    "--kv-offloading-size",
    "--speculative-config",
    "--max-model-len",
    "--gpu-memory-utilization",
    "--port",
    "--async-scheduling",
    "--no-async-scheduling",
)

_CEL_R3 = "self.routingReplay.mode == 'R3'"
_CEL_REPLAY = "self.routingReplay.mode != 'Disabled'"
_CEL_DP_LOCAL = (
    "(has(self.inference.dataParallelSizeLocal) ? self.inference.dataParallelSizeLocal"
    " : self.inference.dataParallelSize)"
)


def _cel_list(items: list[str]) -> str:
    return "[" + ", ".join(f"'{i}'" for i in items) + "]"


# ----------------------------------------------------------------------------- intra-object rules


def _r3_executor_ray(c: RuleContext) -> str | None:
    if _r3(c.spec) and c.spec.inference.executor_backend is ExecutorBackend.RAY:
        return (
            "routingReplay.mode R3 needs inference.executorBackend mp, got ray: vLLM's ray executor "
            "hangs with routed-experts return"
        )
    return None


def _mp_single_node(c: RuleContext) -> str | None:
    inf = c.spec.inference
    if inf.executor_backend is not ExecutorBackend.MP:
        return None
    per_pod = inf.tensor_parallel_size * inf.pipeline_parallel_size * _dp_local(c.spec)
    if per_pod > inf.gpus_per_node:
        return (
            f"executorBackend mp runs one engine replica on one node, but tensorParallelSize "
            f"{inf.tensor_parallel_size} x pipelineParallelSize {inf.pipeline_parallel_size} x "
            f"data-parallel-local {_dp_local(c.spec)} = {per_pod} GPUs > gpusPerNode "
            f"{inf.gpus_per_node}"
        )
    return None


def _r3_pp(c: RuleContext) -> str | None:
    pp = c.spec.inference.pipeline_parallel_size
    if _r3(c.spec) and pp > 1:
        return f"routingReplay.mode R3 is incompatible with inference.pipelineParallelSize {pp} (> 1)"
    return None


def _r3_dcp(c: RuleContext) -> str | None:
    dcp = c.spec.inference.decode_context_parallel_size
    if _r3(c.spec) and dcp > 1:
        return f"routingReplay.mode R3 is incompatible with inference.decodeContextParallelSize {dcp} (> 1)"
    return None


def _r3_kv_connector(c: RuleContext) -> str | None:
    kv = c.spec.inference.kv_connector
    if _r3(c.spec) and kv is not KVConnector.NONE:
        return (
            f"routingReplay.mode R3 is incompatible with inference.kvConnector {kv.value}: external KV "
            "hits fill slots without an MoE forward, so routes would be stale or missing"
        )
    return None


def _r3_kv_offload(c: RuleContext) -> str | None:
    if _r3(c.spec) and c.spec.inference.kv_cache_offload:
        return (
            "routingReplay.mode R3 is incompatible with inference.kvCacheOffload true: offloaded KV "
            "hits carry no routed-expert decisions"
        )
    return None


def _replay_needs_moe(c: RuleContext) -> str | None:
    arch = c.spec.model.architecture
    if _replay(c.spec) and arch is not None and arch.num_experts <= 1:
        return (
            f"routingReplay.mode {_mode(c.spec).value} needs an MoE model, but "
            f"model.architecture.numExperts is {arch.num_experts}"
        )
    return None


def _topk_le_experts(c: RuleContext) -> str | None:
    arch = c.spec.model.architecture
    if arch is not None and arch.top_k > arch.num_experts:
        return f"model.architecture.topK {arch.top_k} exceeds numExperts {arch.num_experts}"
    return None


def _megatron_router_fusion(c: RuleContext) -> str | None:
    t = c.spec.trainer
    if (
        t.backend is TrainerBackend.MEGATRON
        and _replay(c.spec)
        and t.megatron is not None
        and t.megatron.router_fusion
    ):
        return (
            f"routingReplay.mode {_mode(c.spec).value} is incompatible with trainer.megatron.routerFusion "
            "true: the fused top-k returns before replay is consulted, so routes are silently ignored"
        )
    return None


def _r3_retokenize(c: RuleContext) -> str | None:
    if _r3(c.spec) and c.spec.rollout.retokenize_chat_history:
        return (
            "routingReplay.mode R3 is incompatible with rollout.retokenizeChatHistory true: trained "
            "tokens would differ from the tokens the engine routed"
        )
    return None


def _r3_stepwise(c: RuleContext) -> str | None:
    if _r3(c.spec) and c.spec.rollout.step_wise_trajectories:
        return (
            "routingReplay.mode R3 is incompatible with rollout.stepWiseTrajectories true: routes for "
            "per-step samples and observations are undefined"
        )
    return None


def _engine_ep(c: RuleContext) -> str | None:
    inf, arch = c.spec.inference, c.spec.model.architecture
    if not inf.enable_expert_parallel or arch is None:
        return None
    ep = inf.tensor_parallel_size * inf.data_parallel_size
    if arch.num_experts % ep != 0:
        return (
            f"model.architecture.numExperts {arch.num_experts} is not divisible by the engine "
            f"expert-parallel size {ep} (tensorParallelSize {inf.tensor_parallel_size} x "
            f"dataParallelSize {inf.data_parallel_size})"
        )
    return None


def _trainer_ep(c: RuleContext) -> str | None:
    t, arch = c.spec.trainer, c.spec.model.architecture
    if t.backend is not TrainerBackend.MEGATRON or t.megatron is None or arch is None:
        return None
    ep = t.megatron.expert_parallel_size
    if arch.num_experts % ep != 0:
        return (
            f"model.architecture.numExperts {arch.num_experts} is not divisible by "
            f"trainer.megatron.expertParallelSize {ep}"
        )
    return None


def _trainer_fit(c: RuleContext) -> str | None:
    t = c.spec.trainer
    if t.backend is not TrainerBackend.MEGATRON or t.megatron is None:
        return None
    m, world = t.megatron, t.nodes * t.gpus_per_node
    dense = m.tensor_parallel_size * m.pipeline_parallel_size * m.context_parallel_size
    expert = m.expert_parallel_size * m.expert_tensor_parallel_size * m.pipeline_parallel_size
    if world % dense != 0 or world % expert != 0:
        return (
            f"trainer GPUs nodes {t.nodes} x gpusPerNode {t.gpus_per_node} = {world} must be divisible by "
            f"tp*pp*cp = {dense} and by ep*etp*pp = {expert}"
        )
    return None


def _backend_union(c: RuleContext) -> str | None:
    t = c.spec.trainer
    if t.backend is TrainerBackend.FSDP and t.megatron is not None:
        return "trainer.backend FSDP takes a trainer.fsdp block; trainer.megatron must not be set"
    if t.backend is TrainerBackend.MEGATRON and t.fsdp is not None:
        return "trainer.backend Megatron takes a trainer.megatron block; trainer.fsdp must not be set"
    return None


def _fsdp_family(c: RuleContext) -> str | None:
    t, arch = c.spec.trainer, c.spec.model.architecture
    if t.backend is not TrainerBackend.FSDP or not _replay(c.spec) or arch is None:
        return None
    if arch.router_type not in HF_REPLAY_ROUTER_TYPES:
        return (
            f"FSDP replay hooks transformers softmax TopKRouter gates; routerType {arch.router_type.value} "
            f"(family {arch.family or 'unset'}) replays only on trainer.backend Megatron"
        )
    if arch.family is not None and arch.family not in HF_REPLAY_FAMILIES:
        return (
            f"FSDP replay supports families {', '.join(sorted(HF_REPLAY_FAMILIES))}; family "
            f"{arch.family} is not one of them: use trainer.backend Megatron"
        )
    return None


def _extra_args_derived(c: RuleContext) -> str | None:
    bad = [a for a in c.spec.inference.extra_args if a.split("=", 1)[0] in DERIVED_VLLM_FLAGS]
    if bad:
        return f"inference.extraArgs sets flags r3operator derives from the spec: {', '.join(bad)}"
    return None


# ------------------------------------------------------------------------- version-gated rules


def _version_gate(c: RuleContext, feature: str, *, applies: bool, what: str) -> str | None:
    if not applies:
        return None
    from r3operator.api.versions import FEATURES

    ok = supports(c.engine_version, feature)
    need = FEATURES[feature].since
    if ok is None:
        return (
            f"{what} needs vLLM >= {need}, but the vLLM version of image {c.spec.inference.image} is "
            "unknown: pin a version tag or set inference.vllmVersion"
        )
    if not ok:
        return f"{what} needs vLLM >= {need}, got {c.engine_version.version}"
    return None


def _r3_min_version(c: RuleContext) -> str | None:
    return _version_gate(
        c, "routed-experts-return", applies=_r3(c.spec), what="routingReplay.mode R3 (routed-experts return)"
    )


def _r3_hybrid(c: RuleContext) -> str | None:
    arch = c.spec.model.architecture
    hybrid = arch is not None and arch.hybrid_attention
    return _version_gate(
        c,
        "routed-experts-transfer-rewrite",
        applies=_r3(c.spec) and hybrid,
        what="R3 on a hybrid-attention model (capture buffer overrun before the rewrite)",
    )


def _r3_spec_decode(c: RuleContext) -> str | None:
    sd = c.spec.inference.speculative_decoding
    return _version_gate(
        c,
        "routed-experts-draft-router-fix",
        applies=_r3(c.spec) and sd is not None,
        what="R3 with speculative decoding (draft routers overwrite layer routes)",
    )


def _r3_mrv2(c: RuleContext) -> str | None:
    return _version_gate(
        c,
        "routed-experts-mrv2",
        applies=_r3(c.spec) and c.spec.inference.model_runner_v2,
        what="R3 with inference.modelRunnerV2",
    )


# -------------------------------------------------------------------------------------- warnings


def _kl_ref_no_replay(c: RuleContext) -> str | None:
    a = c.spec.algorithm
    if _replay(c.spec) and (a.use_kl_loss or a.kl_in_reward) and not c.spec.routing_replay.replay_ref:
        return (
            "KL-to-ref is on (algorithm.useKLLoss/klInReward) but routingReplay.replayRef is false: KL will "
            "compare replay-routed policy logprobs with naturally routed ref logprobs"
        )
    return None


def _partial_rollout(c: RuleContext) -> str | None:
    if _r3(c.spec) and c.spec.rollout.partial_rollout:
        return (
            "rollout.partialRollout with R3: routes of a resumed trajectory keep the old rows and append "
            "only the new tail, so one trajectory may mix routes of two policy versions"
        )
    return None


def _unpinned_image(c: RuleContext) -> str | None:
    inf = c.spec.inference
    if inf.vllm_version is None and c.engine_version.version is None:
        tag = image_tag(inf.image)
        return (
            f"inference.image {inf.image} has {'tag ' + tag if tag else 'no version tag'}, not a version: "
            "pin a version tag or set inference.vllmVersion; version-gated rules fail closed"
        )
    return None


def _arch_unresolved(c: RuleContext) -> str | None:
    if _replay(c.spec) and c.spec.model.architecture is None:
        return (
            f"routingReplay.mode {_mode(c.spec).value} without model.architecture: route-shape, MoE and "
            "expert-parallel checks are deferred to the engine canary"
        )
    return None


def _r3_async_scheduling(c: RuleContext) -> str | None:
    if _r3(c.spec) and c.spec.inference.async_scheduling:
        return (
            "R3 with inference.asyncScheduling: vLLM disabled or rejected this combination in some "
            "releases; verify your vLLM build accepts it"
        )
    return None


# ----------------------------------------------------------------------------------------- table

E, W = Severity.ERROR, Severity.WARNING

RULES: tuple[Rule, ...] = (
    Rule(
        "R3-EXECUTOR-RAY",
        E,
        "spec.inference.executorBackend",
        ("routingReplay.mode", "inference.executorBackend"),
        "R3 needs the mp executor",
        ("vllm-project/vllm#36237", "NovaSky-AI/SkyRL#1273"),
        _r3_executor_ray,
        CelRule(
            f"!({_CEL_R3} && self.inference.executorBackend == 'ray')",
            "'routingReplay.mode R3 needs inference.executorBackend mp, got ' + "
            "self.inference.executorBackend",
            ".inference.executorBackend",
        ),
    ),
    Rule(
        "MP-SINGLE-NODE",
        E,
        "spec.inference.tensorParallelSize",
        (
            "inference.executorBackend",
            "inference.tensorParallelSize",
            "inference.pipelineParallelSize",
            "inference.dataParallelSizeLocal",
            "inference.gpusPerNode",
        ),
        "with the mp executor one engine replica fits one node",
        ("NovaSky-AI/SkyRL#1309",),
        _mp_single_node,
        CelRule(
            "self.inference.executorBackend != 'mp' || self.inference.tensorParallelSize * "
            f"self.inference.pipelineParallelSize * {_CEL_DP_LOCAL} <= self.inference.gpusPerNode",
            "'executorBackend mp runs one engine replica on one node: tp x pp x dpLocal = ' + "
            "string(self.inference.tensorParallelSize * self.inference.pipelineParallelSize * "
            f"{_CEL_DP_LOCAL}) + ' GPUs > gpusPerNode ' + string(self.inference.gpusPerNode)",
            ".inference.tensorParallelSize",
            "FieldValueInvalid",
        ),
    ),
    Rule(
        "R3-INFERENCE-PP",
        E,
        "spec.inference.pipelineParallelSize",
        ("routingReplay.mode", "inference.pipelineParallelSize"),
        "R3 rejects engine pipeline parallelism",
        ("vllm-project/vllm: VllmConfig.__post_init__",),
        _r3_pp,
        CelRule(
            f"!({_CEL_R3} && self.inference.pipelineParallelSize > 1)",
            "'routingReplay.mode R3 is incompatible with inference.pipelineParallelSize ' + "
            "string(self.inference.pipelineParallelSize)",
            ".inference.pipelineParallelSize",
        ),
    ),
    Rule(
        "R3-CONTEXT-PARALLEL",
        E,
        "spec.inference.decodeContextParallelSize",
        ("routingReplay.mode", "inference.decodeContextParallelSize"),
        "R3 rejects decode context parallelism",
        ("vllm-project/vllm: VllmConfig.__post_init__",),
        _r3_dcp,
        CelRule(
            f"!({_CEL_R3} && self.inference.decodeContextParallelSize > 1)",
            "'routingReplay.mode R3 is incompatible with inference.decodeContextParallelSize ' + "
            "string(self.inference.decodeContextParallelSize)",
            ".inference.decodeContextParallelSize",
        ),
    ),
    Rule(
        "R3-KV-CONNECTOR",
        E,
        "spec.inference.kvConnector",
        ("routingReplay.mode", "inference.kvConnector"),
        "R3 rejects every KV connector",
        ("vllm-project/vllm#39568", "PrimeIntellect-ai/prime-rl#2487"),
        _r3_kv_connector,
        CelRule(
            f"!({_CEL_R3} && self.inference.kvConnector != 'none')",
            "'routingReplay.mode R3 is incompatible with inference.kvConnector ' + self.inference.kvConnector",
            ".inference.kvConnector",
        ),
    ),
    Rule(
        "R3-KV-OFFLOAD",
        E,
        "spec.inference.kvCacheOffload",
        ("routingReplay.mode", "inference.kvCacheOffload"),
        "R3 rejects KV-cache offload",
        ("PrimeIntellect-ai/prime-rl: validate_router_replay_without_kv_offload", "vllm-project/vllm#39568"),
        _r3_kv_offload,
        CelRule(
            f"!({_CEL_R3} && self.inference.kvCacheOffload)",
            "'routingReplay.mode R3 is incompatible with inference.kvCacheOffload true'",
            ".inference.kvCacheOffload",
        ),
    ),
    Rule(
        "REPLAY-NEEDS-MOE",
        E,
        "spec.model.architecture.numExperts",
        ("routingReplay.mode", "model.architecture.numExperts"),
        "R2/R3 need an MoE model",
        ("vllm-project/vllm#42593",),
        _replay_needs_moe,
        CelRule(
            f"!({_CEL_REPLAY} && has(self.model.architecture) && self.model.architecture.numExperts <= 1)",
            "'routingReplay.mode ' + self.routingReplay.mode + ' needs an MoE model, numExperts is ' + "
            "string(self.model.architecture.numExperts)",
            ".model.architecture.numExperts",
        ),
    ),
    Rule(
        "MODEL-TOPK",
        E,
        "spec.model.architecture.topK",
        ("model.architecture.topK", "model.architecture.numExperts"),
        "topK cannot exceed numExperts",
        ("transformers: num_experts_per_tok <= num_experts",),
        _topk_le_experts,
        CelRule(
            "!has(self.model.architecture) || self.model.architecture.topK <= self.model.architecture.numExperts",
            "'model.architecture.topK ' + string(self.model.architecture.topK) + ' exceeds numExperts ' + "
            "string(self.model.architecture.numExperts)",
            ".model.architecture.topK",
            "FieldValueInvalid",
        ),
    ),
    Rule(
        "MEGATRON-ROUTER-FUSION",
        E,
        "spec.trainer.megatron.routerFusion",
        ("trainer.backend", "routingReplay.mode", "trainer.megatron.routerFusion"),
        "Megatron replay refuses moe_router_fusion",
        ("NovaSky-AI/SkyRL: utils.py validate_megatron_cfg", "NVIDIA/Megatron-LM: moe_utils.py fused top-k"),
        _megatron_router_fusion,
        CelRule(
            f"!(self.trainer.backend == 'Megatron' && {_CEL_REPLAY} && has(self.trainer.megatron) && "
            "self.trainer.megatron.routerFusion)",
            "'routingReplay.mode ' + self.routingReplay.mode + ' is incompatible with "
            "trainer.megatron.routerFusion true'",
            ".trainer.megatron.routerFusion",
        ),
    ),
    Rule(
        "R3-RETOKENIZE",
        E,
        "spec.rollout.retokenizeChatHistory",
        ("routingReplay.mode", "rollout.retokenizeChatHistory"),
        "R3 refuses re-tokenised chat history",
        ("NovaSky-AI/SkyRL#1273: skyrl_gym_generator",),
        _r3_retokenize,
        CelRule(
            f"!({_CEL_R3} && self.rollout.retokenizeChatHistory)",
            "'routingReplay.mode R3 is incompatible with rollout.retokenizeChatHistory true'",
            ".rollout.retokenizeChatHistory",
        ),
    ),
    Rule(
        "R3-STEPWISE",
        E,
        "spec.rollout.stepWiseTrajectories",
        ("routingReplay.mode", "rollout.stepWiseTrajectories"),
        "R3 refuses step-wise trajectories",
        ("NovaSky-AI/SkyRL#1273: generator _validate_cfg",),
        _r3_stepwise,
        CelRule(
            f"!({_CEL_R3} && self.rollout.stepWiseTrajectories)",
            "'routingReplay.mode R3 is incompatible with rollout.stepWiseTrajectories true'",
            ".rollout.stepWiseTrajectories",
        ),
    ),
    Rule(
        "ENGINE-EP-DIVISIBILITY",
        E,
        "spec.inference.enableExpertParallel",
        (
            "inference.enableExpertParallel",
            "inference.tensorParallelSize",
            "inference.dataParallelSize",
            "model.architecture.numExperts",
        ),
        "numExperts divisible by the engine EP size (tp x dp)",
        ("vllm-project/vllm#52435",),
        _engine_ep,
        CelRule(
            "!(self.inference.enableExpertParallel && has(self.model.architecture)) || "
            "self.model.architecture.numExperts % (self.inference.tensorParallelSize * "
            "self.inference.dataParallelSize) == 0",
            "'numExperts ' + string(self.model.architecture.numExperts) + ' is not divisible by the engine "
            "expert-parallel size ' + string(self.inference.tensorParallelSize * "
            "self.inference.dataParallelSize)",
            ".inference.enableExpertParallel",
            "FieldValueInvalid",
        ),
    ),
    Rule(
        "TRAINER-EP-DIVISIBILITY",
        E,
        "spec.trainer.megatron.expertParallelSize",
        ("trainer.backend", "trainer.megatron.expertParallelSize", "model.architecture.numExperts"),
        "numExperts divisible by the trainer EP size",
        ("PrimeIntellect-ai/prime-rl#3094",),
        _trainer_ep,
        CelRule(
            "!(self.trainer.backend == 'Megatron' && has(self.trainer.megatron) && "
            "has(self.model.architecture)) || self.model.architecture.numExperts % "
            "self.trainer.megatron.expertParallelSize == 0",
            "'numExperts ' + string(self.model.architecture.numExperts) + ' is not divisible by "
            "trainer.megatron.expertParallelSize ' + string(self.trainer.megatron.expertParallelSize)",
            ".trainer.megatron.expertParallelSize",
            "FieldValueInvalid",
        ),
    ),
    Rule(
        "TRAINER-PARALLEL-FIT",
        E,
        "spec.trainer.megatron",
        ("trainer.nodes", "trainer.gpusPerNode", "trainer.megatron"),
        "Megatron parallel sizes divide the trainer GPUs",
        ("NVIDIA/Megatron-LM: parallel_state",),
        _trainer_fit,
        CelRule(
            "!(self.trainer.backend == 'Megatron' && has(self.trainer.megatron)) || "
            "((self.trainer.nodes * self.trainer.gpusPerNode) % (self.trainer.megatron.tensorParallelSize * "
            "self.trainer.megatron.pipelineParallelSize * self.trainer.megatron.contextParallelSize) == 0 && "
            "(self.trainer.nodes * self.trainer.gpusPerNode) % (self.trainer.megatron.expertParallelSize * "
            "self.trainer.megatron.expertTensorParallelSize * self.trainer.megatron.pipelineParallelSize) == 0)",
            "'trainer GPUs ' + string(self.trainer.nodes * self.trainer.gpusPerNode) + ' must be divisible "
            "by tp*pp*cp and by ep*etp*pp'",
            ".trainer.megatron",
            "FieldValueInvalid",
        ),
    ),
    Rule(
        "TRAINER-BACKEND-UNION",
        E,
        "spec.trainer",
        ("trainer.backend", "trainer.fsdp", "trainer.megatron"),
        "only the block matching trainer.backend may be set",
        ("Kubernetes API conventions: unions",),
        _backend_union,
        CelRule(
            "(self.trainer.backend == 'FSDP' && !has(self.trainer.megatron)) || "
            "(self.trainer.backend == 'Megatron' && !has(self.trainer.fsdp))",
            "'trainer.backend ' + self.trainer.backend + ' allows only its own block (fsdp or megatron)'",
            ".trainer",
            "FieldValueInvalid",
        ),
    ),
    Rule(
        "FSDP-ROUTER-FAMILY",
        E,
        "spec.model.architecture.family",
        (
            "trainer.backend",
            "routingReplay.mode",
            "model.architecture.routerType",
            "model.architecture.family",
        ),
        "FSDP replay only for softmax TopKRouter families",
        ("NovaSky-AI/SkyRL#1772",),
        _fsdp_family,
        CelRule(
            f"!(self.trainer.backend == 'FSDP' && {_CEL_REPLAY} && has(self.model.architecture)) || "
            "(self.model.architecture.routerType == 'softmax' && (!has(self.model.architecture.family) || "
            f"self.model.architecture.family in {_cel_list(sorted(HF_REPLAY_FAMILIES))}))",
            "'FSDP replay does not support this router family/type (' + self.model.architecture.routerType + "
            "'): use trainer.backend Megatron'",
            ".model.architecture.family",
        ),
    ),
    Rule(
        "EXTRA-ARGS-DERIVED",
        E,
        "spec.inference.extraArgs",
        ("inference.extraArgs",),
        "extraArgs may not override derived vLLM flags",
        ("r3operator: derived flags",),
        _extra_args_derived,
        CelRule(
            "self.inference.extraArgs.all(a, "
            + " && ".join(f"a != '{f}' && !a.startsWith('{f}=')" for f in DERIVED_VLLM_FLAGS)
            + ")",
            "'inference.extraArgs sets flags r3operator derives from the spec'",
            ".inference.extraArgs",
        ),
    ),
    # Python-only: need the vLLM version matrix (outside facts).
    Rule(
        "R3-VLLM-MIN-VERSION",
        E,
        "spec.inference.image",
        ("routingReplay.mode", "inference.image", "inference.vllmVersion"),
        "R3 needs a vLLM with routed-experts return",
        ("vllm-project/vllm#28284",),
        _r3_min_version,
    ),
    Rule(
        "R3-HYBRID-VLLM",
        E,
        "spec.inference.image",
        (
            "routingReplay.mode",
            "model.architecture.hybridAttention",
            "inference.image",
            "inference.vllmVersion",
        ),
        "R3 on hybrid-attention models needs vLLM >= 0.22.0",
        ("vllm-project/vllm#40692", "vllm-project/vllm#35744", "verl-project/verl#6922"),
        _r3_hybrid,
    ),
    Rule(
        "R3-SPEC-DECODE-VLLM",
        E,
        "spec.inference.speculativeDecoding",
        ("routingReplay.mode", "inference.speculativeDecoding", "inference.image", "inference.vllmVersion"),
        "R3 + speculative decoding needs the draft-router fix",
        ("vllm-project/vllm#48622",),
        _r3_spec_decode,
    ),
    Rule(
        "R3-MRV2-VLLM",
        E,
        "spec.inference.modelRunnerV2",
        ("routingReplay.mode", "inference.modelRunnerV2", "inference.image", "inference.vllmVersion"),
        "R3 under Model Runner V2 needs MRV2 capture",
        ("vllm-project/vllm#50721",),
        _r3_mrv2,
    ),
    # Warnings: legal but risky.
    Rule(
        "KL-REF-NO-REPLAY",
        W,
        "spec.routingReplay.replayRef",
        ("routingReplay.mode", "routingReplay.replayRef", "algorithm.useKLLoss", "algorithm.klInReward"),
        "KL-to-ref while the ref does not replay",
        ("NovaSky-AI/SkyRL#1772",),
        _kl_ref_no_replay,
    ),
    Rule(
        "R3-PARTIAL-ROLLOUT",
        W,
        "spec.rollout.partialRollout",
        ("routingReplay.mode", "rollout.partialRollout"),
        "partial rollouts use tail-append route semantics",
        ("verl-project/verl#6046", "verl-project/verl#6029"),
        _partial_rollout,
    ),
    Rule(
        "IMAGE-TAG-UNPINNED",
        W,
        "spec.inference.image",
        ("inference.image", "inference.vllmVersion"),
        "the engine image tag is not a version",
        ("r3operator: version-gated rules",),
        _unpinned_image,
    ),
    Rule(
        "MODEL-ARCH-UNRESOLVED",
        W,
        "spec.model.architecture",
        ("routingReplay.mode", "model.architecture"),
        "replay without architecture facts",
        ("r3operator: route shape checks",),
        _arch_unresolved,
    ),
    Rule(
        "R3-ASYNC-SCHEDULING",
        W,
        "spec.inference.asyncScheduling",
        ("routingReplay.mode", "inference.asyncScheduling"),
        "R3 with async scheduling is vLLM-version dependent",
        ("vllm-project/vllm#28284", "vllm-project/vllm#39917", "PrimeIntellect-ai/prime-rl#2487"),
        _r3_async_scheduling,
    ),
)

RULES_BY_ID: dict[str, Rule] = {r.id: r for r in RULES}


def evaluate(spec: RLJobSpec, *, context: RuleContext | None = None) -> list[Finding]:
    """Run every rule; errors first, then warnings, each in table order."""
    ctx = context or RuleContext.for_spec(spec)
    findings = []
    for rule in RULES:
        message = rule.check(ctx)
        if message is not None:
            findings.append(Finding(rule.id, rule.severity, rule.field, message, rule.sources))
    return sorted(findings, key=lambda f: f.severity is not Severity.ERROR)


def errors(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.severity is Severity.ERROR]
