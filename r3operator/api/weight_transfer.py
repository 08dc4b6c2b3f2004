"""Which weight-sync transport a job uses: vLLM's native transfer (NCCL or CUDA IPC) or the packed fallback.

Pure: a function of where trainer and engines run and of the engine's vLLM version (the feature matrix in
`api/versions.py`). The operator renders `--weight-transfer-config` from it and writes the choice into the
runtime config; the trainer driver makes the same choice for the engines it starts itself and re-checks it
against what the running engines and its own vLLM actually offer (`weightsync/sync.py`).

- NCCL when trainer and engines hold separate GPUs (the cluster topology: engine pods and trainer pods);
- CUDA IPC when they share one GPU (the local run: the engine is an actor on the driver's GPU);
- the packed path (our worker extension: packed chunks through Ray's object store, or safetensors files on
  the shared volume over HTTP) where neither exists: CPU engines, or a vLLM without the native API.

The native path needs the backend AND the start/finish bracket (one layerwise reload per sync, so MoE
experts sent per expert are processed once); a version with the backend but not the bracket falls back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum

from r3operator.api.enums import WeightSyncLayout
from r3operator.api.v1alpha1 import RLJobSpec
from r3operator.api.versions import FEATURES, EngineVersion, resolve_engine_version, supports, version_from_image


class TransferMethod(StrEnum):
    NCCL = "nccl"
    IPC = "ipc"
    PACKED = "packed"
    """Our worker extension's packed chunks (Ray object store, or safetensors files on the shared volume)."""


class Topology(StrEnum):
    SEPARATE_GPUS = "separate-gpus"
    """Trainer and engines on different GPUs (possibly different nodes): the cluster."""
    SHARED_GPU = "shared-gpu"
    """The engine runs on the trainer's GPU (local run, engine in a Ray actor)."""
    CPU = "cpu"


NATIVE_BACKEND_FEATURE: dict[TransferMethod, str] = {
    TransferMethod.NCCL: "weight-transfer-nccl",
    TransferMethod.IPC: "weight-transfer-ipc",
}
BRACKET_FEATURE = "weight-transfer-bracket"


@dataclass(frozen=True, slots=True)
class TransferChoice:
    method: TransferMethod
    reason: str
    """Why this method; for a fallback, what the native path lacked."""
    fallback: bool = False
    """True when a native method was wanted but is not available (logged and pushed to status)."""

    @property
    def native(self) -> bool:
        return self.method is not TransferMethod.PACKED

    def describe(self) -> str:
        """One line for logs, reports and status.progress.weightSync."""
        return f"{self.method.value} ({'fallback: ' if self.fallback else ''}{self.reason})"


def wanted_method(topology: Topology) -> TransferMethod:
    """The transport the topology calls for if the engine had every feature."""
    if topology is Topology.SEPARATE_GPUS:
        return TransferMethod.NCCL
    if topology is Topology.SHARED_GPU:
        return TransferMethod.IPC
    return TransferMethod.PACKED


def choose_transfer(topology: Topology, version: EngineVersion) -> TransferChoice:
    """The transport for `topology` on an engine of `version` (unknown versions fail closed: packed)."""
    wanted = wanted_method(topology)
    if wanted is TransferMethod.PACKED:
        return TransferChoice(wanted, "engines on CPU: vLLM's NCCL and IPC backends need CUDA")
    missing = []
    for key in (NATIVE_BACKEND_FEATURE[wanted], BRACKET_FEATURE):
        ok = supports(version, key)
        if ok is None:
            return TransferChoice(
                TransferMethod.PACKED,
                f"engine vLLM version unknown; native {wanted.value} transfer needs vLLM >= "
                f"{native_since(wanted)} (set spec.inference.vllmVersion)",
                fallback=True,
            )
        if not ok:
            missing.append(FEATURES[key])
    if missing:
        lacks = "; ".join(f"{f.key} needs >= {f.since}" for f in missing)
        reason = f"engine vLLM {version} lacks native {wanted.value} transfer ({lacks})"
        return TransferChoice(TransferMethod.PACKED, reason, fallback=True)
    return TransferChoice(wanted, f"vLLM {version} native {wanted.value} weight transfer")


def native_since(method: TransferMethod) -> str:
    """The first vLLM release with everything the native `method` needs."""
    return str(max(FEATURES[NATIVE_BACKEND_FEATURE[method]].since, FEATURES[BRACKET_FEATURE].since))


def weight_transfer_config_arg(method: TransferMethod) -> str:
    """The value of `vllm serve --weight-transfer-config` for a native method."""
    if method is TransferMethod.PACKED:
        raise ValueError("the packed path needs no --weight-transfer-config")
    return json.dumps({"backend": method.value}, separators=(",", ":"))


def cluster_transfer(spec: RLJobSpec) -> TransferChoice:
    """The transport of the rendered topology: engine pods and trainer pods hold separate GPUs.

    The native sender is vLLM's own code in the trainer process, so the trainer image must carry the engines'
    vLLM release (the update-info wire format changes between releases). A trainer image whose tag names
    another release falls back to packed here; one whose tag names none is left to the driver, which checks
    the vLLM it can import at start (`weightsync/sync.py`) and reports a fallback in status and the report.
    """
    engine = resolve_engine_version(image=spec.inference.image, explicit=spec.inference.vllm_version)
    choice = choose_transfer(Topology.SEPARATE_GPUS, engine)
    if not choice.native or engine.version is None:
        return choice
    trainer = version_from_image(spec.trainer.image)
    if trainer is None:
        return TransferChoice(
            choice.method,
            f"{choice.reason} if the trainer image carries vLLM {engine}: its tag names no vLLM release, so the "
            f"trainer checks at start and falls back to packed without it; images/trainer builds one with "
            f"VLLM_VERSION={engine}",
        )
    if trainer.base_version != engine.version.base_version:
        return TransferChoice(
            TransferMethod.PACKED,
            f"trainer image vLLM {trainer} != engine vLLM {engine}: the native sender must be the engines' "
            f"release; a trainer image tagged -vllm{engine} restores {choice.method.value}",
            fallback=True,
        )
    return TransferChoice(choice.method, f"{choice.reason}; the trainer image carries vLLM {trainer}")


# -------------------------------------------------------------------------------- sync layout

KERNEL_BRACKETS: tuple[tuple[str, str], ...] = (
    ("0.22", "weight-transfer-kernel-format"),
    ("", "weight-transfer-own-kernel-bracket"),
)
"""Where the kernel layout has a bracket: vLLM 0.22.x's own (`start_weight_update(is_checkpoint_format=False)`, gone
from 0.30) for the minor release named, and from 0.30 the worker extension's (engine/worker.py), for every release
the feature covers. 0.23 to 0.29 are unverified (0.26.0's wheel has neither the flag nor 0.30's trainer factory)."""

QUANTIZATION_FLAGS = ("--quantization", "-q")
SHARDED_KERNEL_FEATURE = "weight-transfer-sharded-kernel-layout"


def _has_kernel_bracket(version: EngineVersion) -> bool | None:
    if version.version is None:
        return None
    minor = ".".join(str(part) for part in version.version.release[:2])
    return any((not only or minor == only) and supports(version, key) for only, key in KERNEL_BRACKETS)


def kernel_refusal(spec: RLJobSpec, version: EngineVersion) -> str | None:
    """Why the kernel layout cannot be right for `spec`'s engines, whatever `weightSync.layout` says; None when it can.

    The kernel layout copies each sent tensor (or the engine rank's part of it) over an engine parameter as it is
    loaded, so it is only right where that is the layout the engine serves: vLLM processes nothing after the copy, so
    a quantized engine (repacked scales and weights), a pipeline- or context-parallel engine, a tensor- or
    expert-parallel one on a release whose layers' sharding is not verified (each rank takes its part of the whole
    parameters sent, engine/shards.py), EPLB, and a release with no kernel bracket (`KERNEL_BRACKETS`) are refused.
    What the spec cannot show (the MoE backend, the CPU) the engine refuses itself (engine/worker.py
    `kernel_layout_refusal`)."""
    inference = spec.inference
    brackets = "vLLM 0.22.x (its is_checkpoint_format=False) or >= 0.30 (the worker extension's own bracket)"
    has = _has_kernel_bracket(version)
    if has is None:
        return (
            f"the kernel layout needs {brackets}, but the vLLM version of inference.image {inference.image} is "
            "unknown (set spec.inference.vllmVersion)"
        )
    if not has:
        return f"the kernel layout needs {brackets}; engine vLLM {version} has no kernel bracket we verified"
    staged = {
        "inference.pipelineParallelSize": inference.pipeline_parallel_size,
        "inference.decodeContextParallelSize": inference.decode_context_parallel_size,
    }
    for field, size in staged.items():
        if size > 1:
            return f"the kernel layout gives each engine rank its part of whole parameters, but {field} is {size}"
    sharded = "inference.tensorParallelSize" if inference.tensor_parallel_size > 1 else None
    sharded = sharded or ("inference.enableExpertParallel" if inference.enable_expert_parallel else None)
    if sharded and not supports(version, SHARDED_KERNEL_FEATURE):
        count = f" is {inference.tensor_parallel_size}" if inference.tensor_parallel_size > 1 else ""
        return (
            f"{sharded}{count}: each engine rank holds a part of the whole parameters the kernel layout sends, which "
            f"it reads off vLLM >= 0.30's layers ({SHARDED_KERNEL_FEATURE}); engine vLLM {version} is not verified"
        )
    if inference.enable_expert_parallel and any(a.split("=", 1)[0] == "--enable-eplb" for a in inference.extra_args):
        return "inference.extraArgs enables EPLB: its redundant physical experts are not the logical blocks sent"
    quantized = [a for a in inference.extra_args if a.split("=", 1)[0] in QUANTIZATION_FLAGS]
    if quantized:
        return (
            f"the kernel layout copies unquantized tensors over the served parameters, but inference.extraArgs "
            f"quantizes the engine ({quantized[0]}): its served layout is not the loaded one"
        )
    return None


def kernel_layout_refusal(spec: RLJobSpec, version: EngineVersion) -> str | None:
    """Rule WEIGHT-SYNC-KERNEL-LAYOUT: an explicit `weightSync.layout: kernel` where `kernel_refusal` says no
    (`auto` is never refused: it takes the checkpoint layout and says why, `choose_layout`)."""
    if spec.weight_sync.layout is not WeightSyncLayout.KERNEL:
        return None
    reason = kernel_refusal(spec, version)
    return f"spec.weightSync.layout kernel: {reason}; use layout auto or checkpoint" if reason else None


@dataclass(frozen=True, slots=True)
class LayoutChoice:
    """The layout a native sync sends in, and why: what `status.resolved`, `r3operator explain`, the run's report and
    `status.progress.weightSync` say, in the same words, at admission and when the run falls back."""

    layout: WeightSyncLayout
    """CHECKPOINT or KERNEL, never AUTO."""
    reason: str
    fallback: bool = False
    """True when the kernel layout was wanted (`auto` or `kernel`) and the checkpoint layout syncs instead."""

    def describe(self) -> str:
        return f"layout {self.layout.value} ({'fallback: ' if self.fallback else ''}{self.reason})"

    def refused(self, reason: str) -> LayoutChoice:
        """The checkpoint layout in place of this kernel one, for `reason` (the run's fallback: its reference check
        against vLLM's own load_weights failed, or the engines refused the plan)."""
        return LayoutChoice(WeightSyncLayout.CHECKPOINT, f"kernel refused at run time: {reason}", fallback=True)


def choose_layout(spec: RLJobSpec, version: EngineVersion, transfer: TransferChoice) -> LayoutChoice:
    """The layout of `spec`'s syncs over `transfer` to engines of `version`: `auto` (the default) takes the fastest the
    engines admit, kernel where `kernel_refusal` has no objection and the transfer is native, else checkpoint, the
    fallback the rule names. An explicit `kernel` the rule refused at admission is given as checkpoint here too."""
    wanted = spec.weight_sync.layout
    if wanted is WeightSyncLayout.CHECKPOINT:
        return LayoutChoice(WeightSyncLayout.CHECKPOINT, "spec.weightSync.layout checkpoint")
    how = "auto" if wanted is WeightSyncLayout.AUTO else "spec.weightSync.layout kernel"
    if not transfer.native:
        # The packed path has no kernel layout; on CPU engines that is by design, not a fallback.
        return LayoutChoice(
            WeightSyncLayout.CHECKPOINT,
            f"{how}: the kernel layout needs vLLM's native transfer; this job syncs "
            + (transfer.describe() if transfer.fallback else "packed"),
            fallback=transfer.fallback,
        )
    if reason := kernel_refusal(spec, version):
        return LayoutChoice(WeightSyncLayout.CHECKPOINT, f"{how}: {reason}", fallback=True)
    return LayoutChoice(
        WeightSyncLayout.KERNEL,
        f"{how}: engine vLLM {version} over {transfer.method.value}, unquantized parameters (each engine rank its "
        "part); the first sync checks the plan against vLLM's own load_weights",
    )


def resolve_layout(spec: RLJobSpec, transfer: TransferChoice, engine: EngineVersion) -> LayoutChoice:
    """The layout a run syncs in (`choose_layout`, over the transfer the run checked it has and the version its engines
    report). An explicit `kernel` the engines cannot take here (the packed path: CPU engines, a fallback) is refused,
    naming the field, instead of silently syncing in the checkpoint layout; `auto` never is."""
    chosen = choose_layout(spec, engine, transfer)
    if spec.weight_sync.layout is WeightSyncLayout.KERNEL and chosen.layout is not WeightSyncLayout.KERNEL:
        raise ValueError(f"spec.weightSync.layout kernel cannot be used here: {chosen.reason}; use layout auto")
    return chosen
