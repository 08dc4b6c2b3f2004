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

KERNEL_LAYOUT_RELEASES = ("0.22",)
"""vLLM minor releases whose native `start_weight_update` takes `is_checkpoint_format=False` (checked in the
0.22.1 wheel: `Worker.update_weights` then copies each received tensor into `model.get_parameter(name)`);
0.30 dropped the flag from its NCCL engine (it always brackets)."""

QUANTIZATION_FLAGS = ("--quantization", "-q")


def kernel_layout_refusal(spec: RLJobSpec, version: EngineVersion) -> str | None:
    """Why `weightSync.layout: kernel` cannot be right for `spec`'s engines, or None.

    The kernel layout copies each sent tensor over an engine parameter as it is loaded, so it is only right
    where that is the layout the engine serves: vLLM processes nothing after the copy (no bracket), so a
    quantized engine (repacked scales and weights), a tensor-, pipeline- or expert-parallel engine (each rank
    holds a shard, the trainer sends whole parameters) and a release without the flag are refused. CPU engines
    never get here: the native transfer needs CUDA (`choose_transfer`), and the driver refuses the layout on
    the packed path (`weightsync/sync.check_layout`)."""
    if spec.weight_sync.layout is not WeightSyncLayout.KERNEL:
        return None
    what = "spec.weightSync.layout kernel"
    inference = spec.inference
    if version.version is None:
        return (
            f"{what} needs an engine vLLM of a release with start_weight_update(is_checkpoint_format=False) "
            f"({', '.join(r + '.x' for r in KERNEL_LAYOUT_RELEASES)}), but the vLLM version of inference.image "
            f"{inference.image} is unknown (set spec.inference.vllmVersion)"
        )
    minor = ".".join(str(part) for part in version.version.release[:2])
    if minor not in KERNEL_LAYOUT_RELEASES:
        return (
            f"{what} needs an engine vLLM {' or '.join(r + '.x' for r in KERNEL_LAYOUT_RELEASES)} (its native "
            f"start_weight_update(is_checkpoint_format=False)); engine vLLM {version} has no such flag: use "
            "layout checkpoint"
        )
    sharded = {
        "inference.tensorParallelSize": inference.tensor_parallel_size,
        "inference.pipelineParallelSize": inference.pipeline_parallel_size,
        "inference.decodeContextParallelSize": inference.decode_context_parallel_size,
    }
    for field, size in sharded.items():
        if size > 1:
            return (
                f"{what} sends whole parameters, but {field} is {size}: each engine rank holds a shard; "
                "use layout checkpoint"
            )
    if inference.enable_expert_parallel:
        return f"{what} sends whole expert blocks, but inference.enableExpertParallel shards them; use checkpoint"
    quantized = [a for a in inference.extra_args if a.split("=", 1)[0] in QUANTIZATION_FLAGS]
    if quantized:
        return (
            f"{what} copies bf16 tensors over the served parameters, but inference.extraArgs quantizes the "
            f"engine ({quantized[0]}): its served layout is not the loaded one; use layout checkpoint"
        )
    return None
