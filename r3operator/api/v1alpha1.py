"""The RLJob custom resource, version ``r3operator.io/v1alpha1``.

This module is the single source of truth: the CRD in ``crds/rljob.yaml`` is generated from these
models (``r3operator crd``), and the operator, the CLI and the runtime all parse RLJobs with them.
Attribute docstrings become the CRD ``description`` fields, so write them for users.

Conventions (Kubernetes API conventions, see docs/api.md):
- camelCase field names in YAML; unknown fields are rejected with their path;
- derived values (GPUs per replica, EP sizes, the vLLM version) never go into ``spec`` — they are
  computed into ``status.resolved``;
- every string and list is bounded (the CEL cost estimator needs it).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.alias_generators import to_camel

from r3operator.api.base import ApiModel as _Model
from r3operator.api.enums import (
    AccessMode,
    ConditionStatus,
    ExecutorBackend,
    ExportDType,
    ExportFailurePolicy,
    KVConnector,
    PDConnector,
    ReplayMode,
    RetainPolicy,
    RewardKind,
    RouteCheckPolicy,
    RouterType,
    TrainerBackend,
    WeightSyncLayout,
    WhenHeld,
)
from r3operator.api.names import DNS1035_LABEL_PATTERN, MAX_JOB_NAME_LENGTH, RESERVED_NAME_PREFIX
from r3operator.api.pods import PodTemplate

GROUP = "r3operator.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "RLJob"
PLURAL = "rljobs"
SINGULAR = "rljob"
SHORT_NAMES = ("rlj",)
CATEGORIES = ("rl",)

# Kubernetes resource.Quantity, e.g. "500m", "16Gi", "1.5".
QUANTITY_PATTERN = r"^[+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+|[KMGTPE]i|[mkMGTPE])?$"
MODEL_URI_PATTERN = r"^(hf|s3|gs|pvc|file|r3operator)://[^\s]+$"
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
REWARD_FUNCTION_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
EXPORT_URI_PATTERN = r"^(pvc|s3|gs|file)://[^\s]+$"
MANAGED_BY_PATTERN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
MANAGED_BY_OPERATOR = "r3operator.io/operator"
"""spec.managedBy of an RLJob this operator runs (the same as leaving it unset)."""
MANAGED_BY_MULTIKUEUE = "kueue.x-k8s.io/multikueue"
"""spec.managedBy of an RLJob Kueue's MultiKueue dispatches to a worker cluster (Kueue's MultiKueueControllerName)."""

Quantity = Annotated[str, Field(pattern=QUANTITY_PATTERN, max_length=64)]
ImageRef = Annotated[str, Field(min_length=1, max_length=512, pattern=r"^[^\s]+$")]


# ----------------------------------------------------------------------------------------- model


class ModelArchitecture(_Model):
    """Architecture facts of the MoE model. The routing shape is [tokens, numLayers, topK]."""

    num_layers: int = Field(ge=1, le=512)
    """num_hidden_layers: vLLM reports routes for every decoder layer, dense ones included."""
    num_experts: int = Field(ge=1, le=4096)
    """Routed experts per MoE layer (1 for a dense model)."""
    top_k: int = Field(alias="topK", ge=1, le=64)
    """Experts chosen per token per MoE layer (num_experts_per_tok)."""
    router_type: RouterType = RouterType.SOFTMAX
    """Score function of the router: softmax (Qwen/OLMoE/Mixtral) or sigmoid-bias (DeepSeek-V3)."""
    family: str | None = Field(default=None, max_length=64, pattern=r"^[a-z0-9_]+$")
    """transformers model_type, e.g. qwen3_moe, qwen2_moe, olmoe, mixtral, deepseek_v3."""
    hybrid_attention: bool = False
    """Hybrid attention (several KV-cache groups, e.g. Qwen3.5/3.6, Nemotron-H)."""
    first_k_dense_layers: int = Field(default=0, ge=0, le=512)
    """Leading dense decoder layers (DeepSeek-V3 has 3); their route rows are zero-filled."""


class SecretKeyRef(_Model):
    """A key of a Secret in the RLJob's namespace."""

    name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)
    key: str = Field(default="token", min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$")


class S3Access(_Model):
    """How to reach an s3:// bucket: AWS S3 or any S3-compatible store (MinIO, Ceph RGW, R2, ...)."""

    credentials_secret: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)
    """Secret in the RLJob's namespace with the keys AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and
    AWS_SESSION_TOKEN for temporary credentials); only the container that uses them gets them, as secretKeyRef env
    (the fetch step; for export.s3 the trainer's head pod)."""
    endpoint_url: str | None = Field(
        default=None, alias="endpointURL", max_length=512, pattern=r"^https?://[^\s/]+(/[^\s]*)?$"
    )
    """An S3-compatible store's URL, e.g. http://minio.storage:9000; unset: AWS S3."""
    region: str | None = Field(default=None, max_length=64, pattern=r"^[a-z0-9-]+$")


class GCSAccess(_Model):
    """How to reach a gs:// bucket: Google Cloud Storage through its S3-compatible XML API, with an HMAC key."""

    credentials_secret: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)
    """Secret in the RLJob's namespace with the HMAC key: its access ID under AWS_ACCESS_KEY_ID and its secret
    under AWS_SECRET_ACCESS_KEY (the names the S3 client reads); only the fetch step gets them."""
    endpoint_url: str | None = Field(
        default=None, alias="endpointURL", max_length=512, pattern=r"^https?://[^\s/]+(/[^\s]*)?$"
    )
    """The XML API endpoint; unset: https://storage.googleapis.com (a Private Service Connect endpoint here)."""


class ModelCacheSpec(_Model):
    """The volume hf://, s3:// and gs:// models are fetched into once, then mounted read-only by every engine and
    trainer pod."""

    claim_name: str | None = Field(default=None, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)
    """A claim the user owns, shared by RLJobs (a model already in it is not fetched again); unset: the
    operator creates one: with retainPolicy Retain (the default) model-cache-<hash of the source and revision>
    (-rwo appended for ReadWriteOnce), kept and reused by the namespace's RLJobs of that model; with Delete
    <job>-model-cache."""
    size: Quantity = "200Gi"
    """Size of the created claim: the model's files (about 2 bytes per parameter in bf16) plus headroom."""
    storage_class_name: str | None = Field(default=None, max_length=253)
    """StorageClass of the created claim; unset: ``storage.storageClassName``, else the cluster's default class."""
    access_mode: AccessMode = AccessMode.READ_WRITE_MANY
    """ReadWriteMany lets engine and trainer pods on several nodes, and several RLJobs at once, read it.
    ReadWriteOnce fits one node: a kept one is mounted by one RLJob at a time, and another RLJob of the same
    source and revision waits (Progressing=False, reason ModelCacheHeld, naming the holder) until that RLJob is
    deleted or finishes, then reuses the copy."""
    retain_policy: RetainPolicy = RetainPolicy.RETAIN
    """What happens to the created claim when the RLJob is deleted (or its ttlSecondsAfterFinished passes).
    Retain (default): it stays, with the model in it, and the next RLJob in the namespace with the same source
    and revision mounts it (the claim's name derives from them; its fetch finds the verified copy and downloads
    nothing); deleting an RLJob never deletes it. Delete: the claim is this RLJob's own and goes with it."""
    when_held: WhenHeld = WhenHeld.WAIT
    """Only for a kept ReadWriteOnce cache, which one RLJob mounts at a time: while another live RLJob holds it,
    Wait (default) until that one is deleted or finishes, then reuse the copy (Progressing=False ModelCacheHeld
    meanwhile); OwnClaim: fetch into <job>-model-cache, this RLJob's own claim, kept by retainPolicy and reused
    only by an RLJob applied again under this name."""


class ModelSpec(_Model):
    uri: str = Field(max_length=1024, pattern=MODEL_URI_PATTERN)
    """Where the weights live: hf://org/name[@revision], s3://bucket/prefix or gs://bucket/prefix (fetched once
    into the model cache), pvc://claim/path (mounted read-only), file:///path (inside the image), or
    r3operator://reference/<name> for the project's generated reference MoE. docs/models.md has each scheme."""
    revision: str | None = Field(default=None, max_length=128)
    """Commit, tag or branch for hf:// models (or hf://org/name@revision); pin it for reproducible runs."""
    s3: S3Access | None = None
    """Credentials and endpoint for an s3:// model (required with one: S3-CREDENTIALS)."""
    gcs: GCSAccess | None = None
    """HMAC credentials for a gs:// model (required with one: MODEL-GCS-CREDENTIALS)."""
    cache: ModelCacheSpec | None = None
    """Where hf://, s3:// and gs:// models are fetched to (unset: a per-job claim of the default size, kept when
    the RLJob is deleted; unused by the other schemes)."""
    trust_remote_code: bool = False
    """Run the model repository's own Python code (vLLM --trust-remote-code). Off by default: it also
    gates the code-loading flags in inference.extraArgs (rule EXTRA-ARGS-CODE-LOADING)."""
    token_secret_ref: SecretKeyRef | None = None
    """Secret key holding a Hugging Face token (HF_TOKEN of the download) for gated or private hf:// models."""
    architecture: ModelArchitecture | None = None
    """Architecture facts. Needed by the replay rules; the operator may resolve them from the
    model's config.json in a later version."""


# ------------------------------------------------------------------------------- routing replay


class RoutingReplaySpec(_Model):
    mode: ReplayMode = ReplayMode.DISABLED
    """Disabled, R2 (trainer records then replays its own routing) or R3 (replay the engines')."""
    replay_ref: bool = Field(default=False, alias="replayRef")
    """Also replay routes in the reference-model forward used by KL-to-ref."""
    on_route_check_failure: RouteCheckPolicy = RouteCheckPolicy.FAIL
    """R3: a sample whose routes fail a route check (missing, wrong shape, ids outside numExperts, uncaptured
    rows, replayed pad, a constant layer) stops the job (Fail) or is left out of its step and counted
    (SkipSample). A replay hook that did not run fails the job either way."""


# ------------------------------------------------------------------------------------ inference


class SpeculativeDecodingSpec(_Model):
    method: Literal["mtp", "eagle", "eagle3", "ngram", "draft_model"]
    """vLLM speculative_config.method."""
    num_speculative_tokens: int = Field(ge=1, le=16)


class ResourceSpec(_Model):
    """CPU and memory for each pod. GPUs are derived from the parallel sizes, never set here."""

    cpu: Quantity | None = None
    memory: Quantity | None = None


class UpgradePolicySpec(_Model):
    """How an image change rolls out: engines get a canary replica scored by the trainer before the rest
    move; a new trainer image scores an engine beside the old one before the RayJob is replaced."""

    canary: bool = True
    """Run the fidelity canary before more than one replica moves. Off: every replica rolls at once."""
    prompts: int = Field(default=8, ge=1, le=256)
    """Fixed prompts the canary sends to the engines it scores."""
    max_tokens: int = Field(default=16, ge=1, le=4096)
    max_mismatch_factor: float = Field(default=1.5, ge=1.0, le=100.0)
    """Fail when the new side's natural routing mismatch exceeds the old side's × this."""
    max_logprob_diff_factor: float = Field(default=1.5, ge=1.0, le=100.0)
    """Fail when the new side's mean |rollout - trainer logprob| exceeds the old side's × this."""
    timeout_seconds: int = Field(default=1800, ge=60, le=86_400)
    """A canary without a verdict this long after its replica (and pod) started running blocks the upgrade."""
    start_timeout_seconds: int = Field(default=600, ge=10, le=86_400)
    """A canary whose surge replica or pod does not run this long after the upgrade started (it cannot be
    scheduled, its image cannot be pulled) is rolled back, releasing the GPUs it holds."""


class EngineRoleSpec(_Model):
    """One role of a disaggregated engine group. Unset fields take inference's value."""

    replicas: int | None = Field(default=None, ge=1, le=512)
    """Engine replicas of this role (each one vLLM server with its own KV cache)."""
    tensor_parallel_size: int | None = Field(default=None, ge=1, le=64)
    data_parallel_size: int | None = Field(default=None, ge=1, le=512)
    """vLLM data parallel size within one replica of this role; a replica of a role fits one pod (rules
    PD-PREFILL-ONE-POD, PD-DECODE-ONE-POD)."""


class DisaggregationSpec(_Model):
    """Prefill/decode disaggregation: prompts are prefilled on prefill engines, their KV moves over `connector`
    and decode engines generate. With R3 the routes of every prompt token come from the prefill engine and those
    of every generated token from the decode engine, stitched into one record per sample (docs/runtime.md)."""

    connector: PDConnector = PDConnector.NIXL
    """nixl (vLLM's NixlConnector, GPU engines) or storage (r3operator's shared-storage connector over the routing
    volume; any device)."""
    prefill: EngineRoleSpec = Field(default_factory=EngineRoleSpec)
    decode: EngineRoleSpec = Field(default_factory=EngineRoleSpec)


class InferenceSpec(_Model):
    image: ImageRef
    """vLLM engine image; its tag is the vLLM version (change it to upgrade vLLM)."""
    vllm_version: str | None = Field(
        default=None,
        alias="vllmVersion",
        max_length=32,
        pattern=r"^[0-9]+\.[0-9]+\.[0-9]+([.+-][0-9A-Za-z.+-]*)?$",
    )
    """Explicit vLLM version when the image tag is not one (e.g. a digest or a custom build)."""
    replicas: int = Field(default=1, ge=0, le=512)
    """Engine replicas (each one vLLM server with its own KV cache)."""
    tensor_parallel_size: int = Field(default=1, ge=1, le=64)
    pipeline_parallel_size: int = Field(default=1, ge=1, le=64)
    data_parallel_size: int = Field(default=1, ge=1, le=512)
    """vLLM data parallel size within one engine replica (attention DP for MoE)."""
    data_parallel_size_local: int | None = Field(default=None, ge=1, le=64)
    """DP ranks per engine pod (one node). Default: the whole replica when it fits gpusPerNode, else the largest
    divisor of dataParallelSize whose ranks fit a node; a replica of several pods is a LeaderWorkerSet group."""
    decode_context_parallel_size: int = Field(default=1, ge=1, le=64)
    enable_expert_parallel: bool = False
    """vLLM --enable-expert-parallel: experts sharded over tensorParallelSize × dataParallelSize."""
    executor_backend: ExecutorBackend = ExecutorBackend.MP
    """vLLM --distributed-executor-backend. R3 needs mp (ray hangs, vLLM #36237)."""
    gpus_per_node: int = Field(default=8, ge=1, le=16)
    kv_cache_offload: bool = False
    """CPU KV-cache offload. External KV hits carry no routes, so R3 rejects it."""
    kv_connector: KVConnector = Field(default=KVConnector.NONE, alias="kvConnector")
    """KV transfer connector of every engine (kv_both: offload or sharing). A prefill/decode split is
    `disaggregation` instead."""
    disaggregation: DisaggregationSpec | None = None
    """Prefill and decode engines with a KV connector between them; unset: every engine does both."""
    async_scheduling: bool = False
    """vLLM --async-scheduling."""
    model_runner_v2: bool = Field(default=False, alias="modelRunnerV2")
    """Use vLLM's Model Runner V2 (VLLM_USE_V2_MODEL_RUNNER=1)."""
    speculative_decoding: SpeculativeDecodingSpec | None = None
    max_model_len: int | None = Field(default=None, ge=16, le=1_048_576)
    gpu_memory_utilization: float = Field(default=0.9, gt=0.0, le=0.99)
    extra_args: list[Annotated[str, Field(max_length=256)]] = Field(default_factory=list, max_length=32)
    """Extra `vllm serve` arguments, appended last. Flags the operator derives are refused."""
    port: int = Field(default=8000, ge=1024, le=65535)
    resources: ResourceSpec = Field(default_factory=ResourceSpec)
    pod_template: PodTemplate | None = None
    """Engine pods: scheduling, identity, extra env/volumes (merged over spec.podTemplate)."""


# -------------------------------------------------------------------------------------- trainer


class FSDPSpec(_Model):
    reshard_after_forward: bool = True
    """FSDP2 fully_shard(reshard_after_forward): ZeRO-3 style when true, ZeRO-2 style when false."""
    ulysses_sequence_parallel_size: int = Field(default=1, ge=1, le=64)
    """Ulysses sequence parallelism. Not implemented by the FSDP trainer: only 1 is admitted (rule
    FSDP-UNIMPLEMENTED); long sequences go to trainer.backend Megatron (tensorParallelSize with sequence
    parallelism, contextParallelSize)."""
    sample_packing: bool = False
    """Pack variable-length samples into one row (varlen attention). Not implemented by the FSDP trainer, which
    pads each micro-batch to its longest row: only false is admitted (rule FSDP-UNIMPLEMENTED)."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass (transformers' non-reentrant
    checkpointing); the replayed routes are kept for the recompute."""
    param_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    micro_batch_tokens: int | None = Field(default=None, ge=1, le=1 << 30)
    """Token budget of one forward (and backward) of the old-logprob pass and of each update mini-batch: the
    rows are grouped by length into micro-batches of at most this many padded tokens (rows × the longest row),
    each trimmed to its longest row, and a mini-batch's micro-batches add their gradients before its one
    optimizer step (verl's use_dynamic_bsz with ppo_max_token_len_per_gpu). Bounds the trainer's activation
    memory at long responses; unset: a mini-batch in one forward."""


class MegatronSpec(_Model):
    tensor_parallel_size: int = Field(default=1, ge=1, le=64)
    pipeline_parallel_size: int = Field(default=1, ge=1, le=64)
    context_parallel_size: int = Field(default=1, ge=1, le=64)
    expert_parallel_size: int = Field(default=1, ge=1, le=512)
    expert_tensor_parallel_size: int = Field(default=1, ge=1, le=64)
    sequence_parallel: bool = False
    router_fusion: bool = False
    """moe_router_fusion. The fused top-k returns before replay is consulted, so replay refuses it."""
    recompute: bool = False
    """Activation recompute; replay then pops REPLAY_BACKWARD routes in forward order."""
    micro_batch_size: int | None = Field(default=None, ge=1, le=65536)
    """Rows per micro-batch of each rank's share. Pipeline stages overlap only with several micro-batches per
    share (1F1B); unset: one micro-batch per share."""


class TrainerSpec(_Model):
    image: ImageRef
    """Trainer image (images/trainer/Dockerfile). A `-vllm<version>` part of its tag names the vLLM release it
    carries for the native weight sender; equal to the engines' release, weight sync goes over NCCL, a
    different one falls back to the packed path (`r3operator explain` says which and why)."""
    backend: TrainerBackend = TrainerBackend.FSDP
    """FSDP (transformers models) or Megatron (megatron-core). Exactly the matching block may be set."""
    fsdp: FSDPSpec | None = None
    megatron: MegatronSpec | None = None
    nodes: int = Field(default=1, ge=1, le=1024)
    gpus_per_node: int = Field(default=8, ge=1, le=16)
    resources: ResourceSpec = Field(default_factory=ResourceSpec)
    pod_template: PodTemplate | None = None
    """Trainer (Ray head and worker) pods: scheduling, identity, extra env/volumes (merged over spec.podTemplate)."""


# --------------------------------------------------------------------------- rollout / algorithm


class RolloutSpec(_Model):
    prompts_per_step: int = Field(default=32, ge=1, le=65536)
    group_size: int = Field(default=8, ge=1, le=1024)
    """Samples per prompt; GRPO advantages are normalised within a group. 1: no group baseline, each sample's
    advantage is its own reward (verl's behaviour; rule GROUP-SIZE-ONE warns)."""
    max_tokens: int = Field(default=256, ge=1, le=1_048_576)
    temperature: float = Field(default=1.0, ge=0.0, le=10.0)
    multi_turn: bool = False
    retokenize_chat_history: bool = False
    """Re-render and re-tokenise the chat history each turn (custom chat templates)."""
    step_wise_trajectories: bool = False
    """Train each turn of a multi-turn trajectory as a separate sample."""
    partial_rollout: bool = False
    """algorithm.mode async only: a weight update interrupts unfinished trajectories, which then continue
    under the new weights keeping their earlier tokens and routes (each token records its policy version).
    Off: a weight update waits for the requests in flight to finish."""
    partial_rollout_segment: int | None = Field(default=None, ge=1, le=1_048_576)
    """With partialRollout: tokens one request generates before a pending weight update may interrupt the
    trajectory (the driver's pause point). Default: maxTokens / 4, at least 1."""


class AlgorithmSpec(_Model):
    name: Literal["GRPO"] = "GRPO"
    steps: int = Field(default=100, ge=1, le=10_000_000)
    learning_rate: float = Field(default=1e-6, gt=0.0, le=1.0)
    clip_ratio_low: float = Field(default=0.2, ge=0.0, le=1.0)
    clip_ratio_high: float = Field(default=0.28, ge=0.0, le=10.0)
    clip_ratio_c: float = Field(default=3.0, gt=1.0, le=1000.0, alias="clipRatioC")
    """Dual-clip: a token with a negative advantage contributes at most -A·clipRatioC to the loss, however
    far its ratio pi/pi_old has grown (stale asynchronous samples, later mini-batches). 3.0 as in verl, so
    verl recipes carry over; a sync step with one mini-batch never reaches it (its ratio is 1). 1000 makes
    the bound practically inert."""
    mini_batches: int = Field(default=1, ge=1, le=1024)
    """Policy updates per step; >1 makes later mini-batches off-policy."""
    use_kl_loss: bool = Field(default=False, alias="useKLLoss")
    kl_in_reward: bool = Field(default=False, alias="klInReward")
    kl_coef: float = Field(default=0.0, ge=0.0, le=10.0)
    sft_warmup_steps: int = Field(default=0, ge=0, le=100_000, alias="sftWarmupSteps")
    """Supervised steps on reference answers before RL (for toy tasks on random-init models); a dataset row's
    `solution`, where it has one, is the target instead of its `answer`."""
    mode: Literal["sync", "async"] = "sync"
    """sync: rollout, train, sync, repeat. async: rollouts run continuously while the trainer consumes
    finished trajectories; samples may be up to maxStaleness policy versions old."""
    max_staleness: int = Field(default=1, ge=0, le=1000)
    """async: a sample with a token sampled more than this many policy versions before the update that
    would train on it is dropped (and counted)."""
    importance_weight_cap: float = Field(default=2.0, gt=0.0, le=1000.0)
    """async: token-level importance weights pi_old/pi_rollout are truncated at this value (TIS)."""
    max_non_finite_steps: int = Field(default=3, ge=1, le=1000)
    """An update whose loss or gradient is not finite on some rank is not applied (no optimizer step; a step
    that applied none is not synced or checkpointed) and is counted; this many such steps in a row fail the
    job, naming them."""


class TaskSpec(_Model):
    name: str = Field(default="count", max_length=63, pattern=DNS_LABEL_PATTERN)
    """Built-in verifiable task (`count`, `next`, the multi-turn `guess`) or `dataset` for datasetPath."""
    dataset_path: str | None = Field(default=None, max_length=1024)
    """A JSONL (.jsonl) or Parquet (.parquet) file whose rows hold `prompt` (a string) or `messages` (a chat
    list), `answer` (a string) and optionally `solution` (a worked solution the supervised warm-up trains on instead
    of the answer; the reward still compares with `answer`) and `id`; a path inside the trainer container, or
    s3://bucket/key or gs://bucket/key, which the trainer's head pod fetches before it starts (DATASET-URI-SCHEME,
    docs/models.md)."""
    s3: S3Access | None = None
    """Credentials and endpoint for an s3:// datasetPath or evaluation.datasetPath (required with one:
    DATASET-S3-CREDENTIALS, EVAL-DATASET-CREDENTIALS)."""
    gcs: GCSAccess | None = None
    """HMAC credentials for a gs:// datasetPath or evaluation.datasetPath (required with one: DATASET-GCS-CREDENTIALS,
    EVAL-DATASET-CREDENTIALS)."""
    reward: RewardKind = RewardKind.EXACT_MATCH
    """exact-match / prefix-match (built-in tasks); exact-match / math / function / http (dataset)."""
    reward_function: str | None = Field(default=None, max_length=256, pattern=REWARD_FUNCTION_PATTERN)
    """For reward: function, `module:function` importable in the trainer image, called as
    `(prompt, completion, answer, metadata) -> float`."""
    reward_url: str | None = Field(default=None, max_length=2048, pattern=r"^https?://[^\s]+$", alias="rewardURL")
    """For reward: http, the endpoint the step's samples are POSTed to as JSON; it answers their scores."""
    reward_timeout_seconds: float = Field(default=60.0, gt=0, le=3600)
    """Per-request timeout of the reward endpoint (transient failures are retried with backoff)."""
    max_prompt_tokens: int | None = Field(default=None, ge=1, le=1_048_576)
    """Dataset prompts longer than this (chat template applied) are dropped with a counted warning.
    Default: inference.maxModelLen - rollout.maxTokens when maxModelLen is set, else no limit."""


class EvaluationSpec(_Model):
    """Held-out evaluation, as verl's `trainer.test_freq`: every `intervalSteps` steps, after the step's weight sync
    and canary, the engines answer a fixed set of prompts from `datasetPath` under the new policy, and the task's
    reward scores the answers. Nothing of it is trained on, and the training prompts and their order are the same
    as without it. The eval reward goes to eval.csv in the run directory, the `eval_reward` column of metrics.csv,
    report.md and its plot, `r3operator_eval_reward` and `status.progress.evalReward`."""

    dataset_path: str = Field(min_length=1, max_length=1024)
    """The held-out rows, in task.datasetPath's format (JSONL or Parquet: `prompt` or `messages`, `answer`), read with
    the same reader, chat template and reward; prompts longer than task.maxPromptTokens are left out as in training.
    A path inside the trainer container, or s3://bucket/key or gs://bucket/key, which the trainer's head pod fetches
    before it starts with the credentials of task.s3 or task.gcs (EVAL-DATASET-CREDENTIALS)."""
    interval_steps: int = Field(default=10, ge=1, le=1_000_000)
    """Evaluate after every step that is a multiple of this (verl's trainer.test_freq); the last step always
    evaluates."""
    before_training: bool = True
    """Also evaluate the starting policy, after the first weight sync (and the supervised warm-up), as step 0 (verl's
    trainer.val_before_train). A resumed run does not repeat it."""
    max_prompts: int | None = Field(default=None, ge=1, le=1_000_000)
    """Evaluate only the first this many rows of the file (after over-long prompts are left out): the same rows
    at every evaluation. Unset: every row."""
    samples_per_prompt: int = Field(default=1, ge=1, le=1024)
    """Answers sampled per prompt (verl's val_kwargs.n); the eval reward is the mean over all of them."""
    temperature: float | None = Field(default=None, ge=0.0, le=10.0)
    """Sampling temperature of the answers; 0 is greedy. Unset: rollout.temperature, so the eval reward measures
    the policy as training samples it and sits beside the training reward (verl defaults to greedy,
    val_kwargs.temperature 0, which scores the policy's mode instead, and with samplesPerPrompt > 1 gives the same
    answer every time). The sampling seed is the same at every evaluation, so two evaluations differ by the policy
    alone."""


class WeightSyncSpec(_Model):
    chunk_size_mb: int = Field(default=512, ge=1, le=65536, alias="chunkSizeMB")
    """Weights are streamed in chunks of this size inside one layerwise-reload bracket."""
    canary: bool = True
    """After each sync, greedy-decode fixed prompts on the engine and on the trainer; they must match."""
    layout: WeightSyncLayout = WeightSyncLayout.AUTO
    """What vLLM's native transfer sends: auto (the fastest the engines admit, shown in
    status.resolved.weightSyncLayout), checkpoint (HF tensors through the engine's loader, always right) or kernel
    (one tensor per engine parameter, one copy each: vLLM 0.22.x or >= 0.30, unquantized, whole parameters on each
    engine rank; docs/runtime.md, "Sync layout")."""


class CheckpointSpec(_Model):
    interval_steps: int = Field(default=50, ge=1, le=1_000_000)
    """Save every N steps, and always after the last step. A checkpoint holds fp32 weights and AdamW
    state, 12 bytes per parameter (~360 GB for a 30B model), so saving every step costs real time."""
    keep_last: int = Field(default=1, ge=1, le=1000)
    """Complete checkpoints kept; while a new one is written, keepLast + 1 are on the volume."""


class ExportSpec(_Model):
    """Where and when the trained policy is exported as a Hugging Face model directory (safetensors, config,
    tokenizer, generation config) that `vllm serve` and transformers load as they are (docs/runtime.md, "Export").
    Each export is the directory `<destination>/step-<step, 6 digits>` with the manifest `r3operator-export.json`
    (step, eval reward, source RLJob and uid, each file's sha256), written last: a directory or prefix without
    it is not an export."""

    destination: str = Field(max_length=1024, pattern=EXPORT_URI_PATTERN)
    """pvc://claim/path (the claim is mounted read-write in the trainer's head pod), s3://bucket/prefix,
    gs://bucket/prefix, or file:///path inside the trainer container (e.g. on the routing volume)."""
    s3: S3Access | None = None
    """Credentials and endpoint for an s3:// destination (required with one: EXPORT-S3-CREDENTIALS); only the
    trainer's head pod gets them."""
    gcs: GCSAccess | None = None
    """HMAC credentials for a gs:// destination (required with one: EXPORT-GCS-CREDENTIALS)."""
    interval_steps: int | None = Field(default=None, ge=1, le=1_000_000)
    """Export after every step that is a multiple of this. Unset: only at the end (atEnd)."""
    at_end: bool = True
    """Export after the last step."""
    dtype: ExportDType | None = None
    """The dtype of the exported weights. Unset: the engines' dtype (bfloat16 on GPUs), what the engines served."""
    on_failure: ExportFailurePolicy = ExportFailurePolicy.CONTINUE
    """Continue (default): a failed export is retried, reported (Exported=False with the reason, a Warning event)
    and training goes on; Fail: an export that still fails after maxAttempts fails the job."""
    max_attempts: int = Field(default=5, ge=1, le=100)
    """Tries of one export's upload or copy, with exponential backoff between them (1 s, doubling, at most 60 s).
    An export still being retried when the next one is due is given up for the newer one."""


class StorageSpec(_Model):
    """The routing-data volume shared by engines and trainer (routes, checkpoints, run outputs)."""

    existing_claim: str | None = Field(default=None, max_length=253, pattern=DNS_LABEL_PATTERN)
    """Use this PVC instead of creating one."""
    size: Quantity = "100Gi"
    storage_class_name: str | None = Field(default=None, max_length=253)
    access_mode: AccessMode = AccessMode.READ_WRITE_MANY
    retain_policy: RetainPolicy = RetainPolicy.DELETE
    """Retain keeps the created PVC when the RLJob is deleted."""
    retention_steps: int = Field(default=4, ge=1, le=1_000_000)
    """Routing files of the last N steps are kept on the volume."""


class RunPolicy(_Model):
    suspend: bool = False
    """Scale engines to zero and suspend the trainer; resume restores."""
    backoff_limit: int = Field(default=3, ge=0, le=100)
    """Retries of the trainer RayJob (KubeRay's backoffLimit) and of the model-fetch Job before the job is Failed."""
    active_deadline_seconds: int | None = Field(default=None, ge=1)
    """Wall-clock limit of the trainer RayJob in seconds (KubeRay's activeDeadlineSeconds); past it the job is
    Failed. Unset: no limit."""
    ttl_seconds_after_finished: int | None = Field(default=None, ge=0)
    """Delete workloads this long after Succeeded/Failed; the RLJob (and a Retained PVC) stay."""


class MonitoringSpec(_Model):
    enabled: bool = True
    port: int = Field(default=9400, ge=1024, le=65535)
    """Prometheus port of the trainer driver."""
    pod_monitor: bool = True
    """Create a PodMonitor when the Prometheus Operator CRDs exist."""
    no_progress_seconds: int = Field(default=900, ge=60, le=7 * 24 * 3600)
    """Alert RLJobNoProgress when the job is Ready and no step completed for this long; a step of a large
    model can take longer than the 15-minute default."""


class RLJobSpec(_Model):
    model: ModelSpec
    routing_replay: RoutingReplaySpec = Field(default_factory=RoutingReplaySpec)
    inference: InferenceSpec
    trainer: TrainerSpec
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec)
    task: TaskSpec = Field(default_factory=TaskSpec)
    evaluation: EvaluationSpec | None = None
    """Held-out evaluation every intervalSteps steps on a dataset training never sees (task.name dataset only;
    docs/runtime.md, "Held-out evaluation"). Unset: none."""
    weight_sync: WeightSyncSpec = Field(default_factory=WeightSyncSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    export: ExportSpec | None = None
    """Export the trained policy as a Hugging Face directory every intervalSteps and at the end (docs/runtime.md,
    "Export"). Unset: none; the checkpoints stay in the trainer's sharded format."""
    storage: StorageSpec = Field(default_factory=StorageSpec)
    run_policy: RunPolicy = Field(default_factory=RunPolicy)
    """Suspend and resume, retries, a deadline and the clean-up after the end."""
    monitoring: MonitoringSpec = Field(default_factory=MonitoringSpec)
    upgrade_policy: UpgradePolicySpec = Field(default_factory=UpgradePolicySpec)
    """Engine and trainer image changes: a fidelity canary first, then roll on or back (docs/operator.md)."""
    pod_template: PodTemplate | None = None
    """Every engine and trainer pod; inference.podTemplate and trainer.podTemplate add to it and win on conflicts."""
    queue_name: str | None = Field(default=None, max_length=63, pattern=DNS_LABEL_PATTERN)
    """Kueue LocalQueue in the RLJob's namespace: engines and trainer are admitted as one workload, or not at all."""
    managed_by: str | None = Field(default=None, max_length=63, pattern=MANAGED_BY_PATTERN)
    """The controller that runs this RLJob, as batch/v1 Job's managedBy. Unset or r3operator.io/operator: this
    operator. kueue.x-k8s.io/multikueue: Kueue's MultiKueue dispatches it to a worker cluster (needs queueName:
    MANAGED-BY-QUEUE); here the operator creates only its Workload and Kueue mirrors the worker's status into this
    one (docs/operator.md, "MultiKueue"). Any other value: another controller's; the operator leaves it alone.
    Immutable."""
    seed: int = Field(default=0, ge=0, le=2**31 - 1)


# --------------------------------------------------------------------------------------- status


class Condition(_Model):
    """metav1.Condition."""

    type: str = Field(max_length=316, pattern=r"^[A-Za-z][A-Za-z0-9]*$")
    status: ConditionStatus
    reason: str = Field(max_length=1024, pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
    message: str = Field(default="", max_length=32768)
    last_transition_time: str = Field(max_length=64)
    observed_generation: int | None = Field(default=None, ge=0)


class ResolvedSpec(_Model):
    """Values the operator derived from the spec and outside facts."""

    vllm_version: str | None = Field(default=None, max_length=64)
    vllm_version_source: Literal["spec", "image-tag", "unknown"] | None = None
    engine_gpus_per_replica: int | None = None
    engine_gpus_total: int | None = None
    engine_expert_parallel_size: int | None = None
    trainer_gpus_total: int | None = None
    trainer_expert_parallel_size: int | None = None
    routing_bytes_per_token: int | None = None
    features: list[Annotated[str, Field(max_length=128)]] = Field(default_factory=list, max_length=64)
    """vLLM feature gates in force for the resolved version."""
    weight_sync_layout: WeightSyncLayout | None = None
    """The layout the syncs are planned in (checkpoint or kernel): `weightSync.layout`, with `auto` resolved."""
    weight_sync_layout_reason: str | None = Field(default=None, max_length=1024)
    """Why that layout ("fallback: …" when the kernel layout was wanted and is not admitted)."""


class WorkloadCounts(_Model):
    replicas: int = 0
    ready_replicas: int = 0
    updated_replicas: int = 0


ExportFailureReason = Literal["StoreUnreachable", "AccessDenied", "NoSpace", "NonFiniteWeights", "WriteFailed"]


class ExportRecord(_Model):
    """One complete export (spec.export): a Hugging Face directory with its manifest, written last."""

    step: int = Field(ge=0)
    uri: str = Field(max_length=1100)
    """The export's directory: <destination>/step-<step>."""
    eval_reward: float | None = None
    """The held-out eval reward of the last evaluation at or before the step (spec.evaluation), in the manifest."""
    finished_at: str | None = Field(default=None, max_length=64)


class ExportFailure(_Model):
    """The last export attempt that failed; gone once a later export succeeds."""

    step: int = Field(ge=0)
    reason: ExportFailureReason
    """StoreUnreachable, AccessDenied (wrong or missing credentials), NoSpace (the claim or the volume is full),
    NonFiniteWeights (refused: a weight is NaN or infinite) or WriteFailed."""
    message: str = Field(default="", max_length=1024)
    attempts: int = Field(default=1, ge=1)
    retrying: bool = False
    """True while the export is still being retried."""


class Progress(_Model):
    """Pushed by the trainer driver at step boundaries."""

    step: int = 0
    total_steps: int | None = None
    reward_mean: float | None = None
    logprob_abs_diff_mean: float | None = None
    logprob_abs_diff_max: float | None = None
    kl_k3: float | None = None
    routing_agreement: float | None = None
    last_checkpoint_step: int | None = None
    non_finite_steps: int | None = None
    """Steps so far with an update whose loss or gradient was not finite (not applied: algorithm.maxNonFiniteSteps)."""
    last_non_finite_step: int | None = None
    eval_reward: float | None = None
    """The held-out eval reward of the last evaluation (spec.evaluation), measured after step evalStep (0: before
    training)."""
    eval_step: int | None = None
    weight_sync: str | None = Field(default=None, max_length=512)
    """The weight-sync transport in use (nccl, ipc or packed) and why ("fallback:" when native was not usable)."""
    updated_at: str | None = Field(default=None, max_length=64)
    replayed_fraction: float | None = None
    """R3, last step: token rows replayed with the engine's routes over every row the rollout needed (each
    sample's tokens but its last): 1.0 when every sample trained with its routes."""
    fallback_fraction: float | None = None
    """R3, last step: rows of the trained samples that routed naturally for want of an engine route."""
    extreme_token_fraction: float | None = None
    """Last step: response tokens whose trainer/rollout probability ratio is outside [0.5, 2]."""
    route_check_failures: int | None = None
    """R3: samples that failed a route check in the last step (left out under SkipSample)."""
    route_check_message: str | None = Field(default=None, max_length=1024)
    """R3: the last step's first route-check failure: the rule, the sample and the layer."""
    weight_sync_seconds: float | None = None
    """Wall time of the last weight sync (canary excluded), in seconds."""
    exports: list[ExportRecord] | None = Field(default=None, max_length=5)
    """spec.export: the latest complete exports, oldest first (at most 5)."""
    last_export_step: int | None = None
    """spec.export: the step of the latest complete export."""
    export_failure: ExportFailure | None = None
    """spec.export: the last export attempt that failed, until an export succeeds."""


class EngineFidelity(_Model):
    """One side's figures in the upgrade canary: an engine scored by the trainer on its current weights
    (engine upgrades), or the trainer image scoring one engine (trainer upgrades)."""

    image: str = Field(max_length=512)
    routes_valid: bool
    """Routed experts of shape [*, numLayers, topK], ids in range, no duplicate within a row."""
    replay_agreement: float | None = None
    """Experts the trainer used under replay = the engine's (must be 1.0)."""
    natural_mismatch: float | None = None
    """Fraction of token-layers where the trainer's own router differs from the engine's choice."""
    logprob_abs_diff_off: float | None = None
    logprob_abs_diff_r3: float | None = None
    message: str = Field(default="", max_length=1024)


class UpgradeCanary(_Model):
    """The canary Job's verdict (`r3operator upgrade-canary`): the operator reads it from the canary pod's
    termination message (written by the kubelet) and copies it here; it never reads it back from status."""

    attempt: str = Field(max_length=64)
    """The upgrade attempt it answers (status.upgrade.attempt); a verdict for another attempt is ignored."""
    passed: bool
    message: str = Field(default="", max_length=2048)
    old: EngineFidelity | None = None
    new: EngineFidelity | None = None
    finished_at: str | None = Field(default=None, max_length=64)


class UpgradeStatus(_Model):
    """An image change in progress or the last one's outcome. Output only: the operator keeps its own copy
    on the engine StatefulSet (LeaderWorkerSet), see operator/upgrade_record.py."""

    component: Literal["engine", "trainer"] = "engine"
    """Which image changed: the engines' (inference.image) or the trainer's (trainer.image)."""
    from_image: str = Field(alias="from", max_length=512)
    to: str = Field(max_length=512)
    phase: Literal["Canary", "Rolling", "Complete", "Blocked", "Cancelled"]
    attempt: str = Field(max_length=64)
    replicas_updated: int = 0
    started_at: str | None = Field(default=None, max_length=64)
    canary_started_at: str | None = Field(default=None, max_length=64)
    """When the canary's replica (engine upgrade) or pod (trainer upgrade) first ran: timeoutSeconds counts
    from here."""
    message: str = Field(default="", max_length=2048)
    canary: UpgradeCanary | None = None


class RLJobStatus(_Model):
    observed_generation: int | None = None
    conditions: list[Condition] = Field(default_factory=list, max_length=32)
    resolved: ResolvedSpec | None = None
    engines: WorkloadCounts | None = None
    """The engines' replicas (a disaggregated job's decode engines)."""
    prefill_engines: WorkloadCounts | None = None
    """A disaggregated job's prefill engine replicas."""
    trainer: WorkloadCounts | None = None
    engines_ready: str | None = Field(default=None, max_length=32)
    """"ready/desired" engine replicas, for `kubectl get`; a disaggregated job's per role, "P 1/1 D 2/2"."""
    progress: Progress | None = None
    start_time: str | None = Field(default=None, max_length=64)
    completion_time: str | None = Field(default=None, max_length=64)
    upgrade: UpgradeStatus | None = None


# ----------------------------------------------------------------------------------------- root


class ObjectMeta(BaseModel):
    """The parts of metav1.ObjectMeta r3operator reads; everything else is kept as is."""

    model_config = ConfigDict(extra="allow", populate_by_name=True, alias_generator=to_camel)

    name: str = Field(min_length=1, max_length=MAX_JOB_NAME_LENGTH, pattern=DNS1035_LABEL_PATTERN)
    """Prefixes every child's name (api/names.py): a DNS-1035 label short enough for all of them."""
    namespace: str | None = Field(default=None, max_length=63, pattern=DNS_LABEL_PATTERN)
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    generation: int | None = None
    uid: str | None = None

    @field_validator("name")
    @classmethod
    def _not_reserved(cls, name: str) -> str:
        if name.startswith(RESERVED_NAME_PREFIX):
            raise ValueError(
                f"{name} starts with {RESERVED_NAME_PREFIX}, which Kubernetes reserves for its own components: its "
                "children (<job>-trainer, <job>-engine and the rest) would read as system objects; choose another name"
            )
        return name


class RLJob(_Model):
    """An MoE RL post-training job: vLLM engines + a trainer sharing a routing-data volume."""

    api_version: Literal["r3operator.io/v1alpha1"] = Field(alias="apiVersion")
    kind: Literal["RLJob"]
    metadata: ObjectMeta
    spec: RLJobSpec
    status: RLJobStatus | None = None
