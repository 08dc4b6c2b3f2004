"""vLLM worker extension for multi-chunk weight sync inside ONE layerwise-reload bracket.

Pass `worker_extension_cls="r3operator.engine.worker.WeightSyncWorkerExtension"` to `vllm.LLM` (or
`--worker-extension-cls` to `vllm serve`). The driver sends each verb of a sync as a typed message
(`wire/sync_messages.py`) through `collective_rpc` to `r3_handle`, which decodes it and dispatches on its type to
the `r3_` method below.

Why a bracket (reference §2.6, SkyRL #1737, vLLM #42821): after loading, vLLM converts MoE weights to
a kernel layout in place while keeping the checkpoint-format `weight_loader`; a second raw
`model.load_weights` then writes checkpoint-layout bytes into kernel-layout buffers, and the per-chunk
`reload_weights` restores every layer *absent* from the chunk. The correct sequence is:

    r3_begin_weight_update()        initialize_layerwise_reload(model)            once
    r3_load_chunk(chunk) × N        model.load_weights(chunk)  (loaders buffer per layer,
                                     a layer is processed when all its weights arrived)
    r3_finish_weight_update()       finalize_layerwise_reload(model, model_config) once

then the driver's requests salt the prefix cache with the new policy (cached KV and routes predate it). The
runtime sends each chunk as ONE flat buffer (`r3_load_packed`, or `r3_load_packed_file` from the shared volume over
HTTP; `runtime/weights.pack_chunk`), unpacked into views and passed to `r3_load_chunk`.

Every bracket also keeps a receipt (`wire/receipt.py`): the fingerprint of every tensor `load_weights` was
handed, and whether the parameters named like them changed; `r3_sync_receipt` returns it for the canary,
with the host seconds the engine spent in `load_weights` and in the receipt (`engine_seconds`).

Every attribute here is prefixed `r3_` / `_r3_`: vLLM >= 0.22 asserts that an extension never shadows a
`Worker` attribute (SkyRL's `start_weight_update` collided with the native method and killed every
worker).
"""

from __future__ import annotations

import hashlib
import inspect
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import ExitStack
from typing import Any

from r3operator.engine.shards import parameter_shards
from r3operator.wire.shards import Shard, take
from r3operator.wire.sync_messages import (
    AbortNative,
    AbortPacked,
    BeginNative,
    BeginPacked,
    BracketLayout,
    DeviceUUIDs,
    DirectSync,
    DirectUpdate,
    EngineBuild,
    FinishNative,
    FinishPacked,
    LoadPacked,
    LoadPackedFile,
    MappedAttach,
    MappedSync,
    ParameterFingerprints,
    ParameterMetadata,
    PolicyTag,
    Receipts,
    StagedAttach,
    StagedSync,
    WeightsDigest,
    WeightUpdateStateError,
    decode,
)

# Any: this class is mixed into vLLM's Worker, whose model, transfer engine and configs are vLLM's objects (vLLM is
# imported inside methods): they, and the tensors they hold, are Any here.

WORKER_EXTENSION_CLS = f"{__name__}.WeightSyncWorkerExtension"

# Host clock of the engine-side timing (a module attribute, so that a test can drive it).
_clock: Callable[[], float] = time.perf_counter


def _timed_load(receipt: Any, batch: list[tuple[str, Any]], load: Callable[[], Any]) -> Any:
    """Record `batch` in the receipt, then `load()` it; the host seconds of each part go into the receipt's
    `engine_seconds` ("receipt", "load"). Measurement only: nothing waits for the device here, so on a GPU
    "load" is the host's part (name matching, loaders, launching the copies), the part a sync cannot
    overlap with the transfer."""
    start = _clock()
    receipt.record(batch)
    recorded = _clock()
    receipt.add_engine_seconds("receipt", recorded - start)
    try:
        return load()
    finally:
        receipt.add_engine_seconds("load", _clock() - recorded)


# vLLM's unquantized MoE backends that serve w13/w2 as they were loaded. The others lay them out again after
# loading (read in vLLM 0.22.1's fused_moe/oracle/unquantized.py: FlashInfer TRT-LLM and CUTLASS swap w13's
# halves to [up; gate], TRT-LLM also re-blocks, AITER shuffles, CPU prepacks, XPU transposes), so a
# kernel-format copy would be served in the wrong layout.
SERVED_AS_LOADED_MOE_BACKENDS = frozenset({"TRITON", "BATCHED_TRITON"})


def kernel_layout_refusal(model: Any) -> str | None:
    """Why a kernel-format sync (one `copy_` per parameter, nothing processed after it) cannot be right for
    this engine model, or None: a quantized layer, or an MoE backend that re-lays out its weights."""
    for name, module in model.named_modules():
        # A FusedMoE layer may wrap its method in a modular one (all2all); the weights are the base method's.
        method = getattr(module, "base_quant_method", None) or getattr(module, "quant_method", None)
        if method is None:
            continue
        kind = type(method).__name__
        if not kind.startswith("Unquantized"):
            return f"{name or 'model'} is loaded by {kind}: quantized weights are repacked after loading"
        backend = getattr(method, "unquantized_backend", None)
        label = getattr(backend, "name", None)
        if backend is not None and label not in SERVED_AS_LOADED_MOE_BACKENDS:
            shown = getattr(backend, "value", label)
            return f"{name} runs the {shown} MoE backend, which lays w13/w2 out again after loading"
    return None


def vllm_brackets_kernel_format(start_weight_update: Callable[..., Any]) -> bool:
    """Whether vLLM's `Worker.start_weight_update` opens a kernel-format bracket itself: vLLM 0.22's takes
    `is_checkpoint_format` (read in its wheel); 0.26, 0.30 and 0.33 take no argument and always reload layerwise."""
    return "is_checkpoint_format" in inspect.signature(start_weight_update).parameters


def receive_into_parameters(
    model: Any, group: Any, update: Any, receipt: Any, shards: Mapping[str, Shard] | None = None
) -> bool:
    """A kernel-format sync over NCCL sent unpacked (weightsync/direct.py): one broadcast per announced tensor,
    each received straight into the parameter of its name, so no buffer is allocated and no byte copied again;
    then the trainer's commit flag, returned (False: the trainer failed and sent zeros for the rest).

    A parameter this rank holds a part of (`shards`, engine/shards.py: a tensor- or expert-parallel engine) comes
    whole, as to every rank, into a buffer of its own: the receipt fingerprints what arrived, and the rank copies
    its part (`take`) into the parameter; the buffer goes back before the next broadcast.

    Every announced tensor and the flag are received, in order, whatever happens: the trainer is inside each
    broadcast. A tensor whose parameter is missing or of another dtype, shape or layout goes into a scratch tensor,
    and the error naming it is raised after the flag (the caller then aborts the bracket). Each parameter received
    is left to the receipt's finish (`record_later`): it holds the received bytes until the next bracket, and the
    receive queues no fingerprint beside the broadcasts. Returns once the device is done (the flag is read)."""
    import torch

    from r3operator.wire.kernel_layout import COMMIT_DTYPE

    device = next(model.parameters()).device
    stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
    wrong: list[str] = []
    begin = _clock()
    for name, shape, dtype_name in zip(update.names, update.shapes, update.dtype_names, strict=True):
        dtype, param = getattr(torch, dtype_name), _parameter(model, name)
        shard = (shards or {}).get(name)
        if shard is not None:
            whole = torch.empty(shape, dtype=dtype, device=device)
            group.broadcast(whole, src=0, stream=stream)
            if param is None or param.dtype != dtype or tuple(shape) != shard.whole or param.shape != shard.shape:
                wrong.append(name)
                continue
            receipt.record([(name, whole)])  # what arrived, before the buffer goes
            with torch.no_grad():
                param.data.copy_(take(whole, shard))
            del whole
            continue
        direct = (
            param is not None and param.dtype == dtype and list(param.shape) == list(shape) and param.is_contiguous()
        )
        target = param.data if direct else torch.empty(shape, dtype=dtype, device=device)
        group.broadcast(target, src=0, stream=stream)
        if not direct:
            wrong.append(name)
            continue
        receipt.record_later([(name, target)])
    flag = torch.empty(1, dtype=getattr(torch, COMMIT_DTYPE), device=device)
    group.broadcast(flag, src=0, stream=stream)
    committed = bool(flag.item())  # the host waits here for every receive
    receipt.add_engine_seconds("load", _clock() - begin)
    if wrong:
        raise WeightUpdateStateError(
            f"kernel-format weight sync: {len(wrong)} announced tensor(s) match no parameter of this engine by "
            f"name, dtype, shape and layout, e.g. {wrong[0]}; they were received and dropped"
        )
    return committed


def drain_direct(group: Any, update: Any, device: Any) -> None:
    """Receive every announced tensor and the flag into one scratch buffer (`announced_zeros`): what an engine that
    cannot open its bracket still owes the trainer, which is inside each broadcast."""
    import torch

    from r3operator.wire.kernel_layout import COMMIT_DTYPE
    from r3operator.wire.weights import announced_zeros

    announced = [
        (name, getattr(torch, dtype_name), tuple(shape))
        for name, dtype_name, shape in zip(update.names, update.dtype_names, update.shapes, strict=True)
    ]
    announced.append(("commit flag", getattr(torch, COMMIT_DTYPE), (1,)))
    stream = torch.cuda.current_stream(device) if torch.device(device).type == "cuda" else None
    for _, scratch in announced_zeros(announced, device):
        group.broadcast(scratch, src=0, stream=stream)
    if stream is not None:
        stream.synchronize()


def staged_targets(model: Any, entries: Sequence[Any], views: Sequence[Any]) -> list[tuple[str, Any, Any]]:
    """(name, staging slot, parameter data) for every slot of a staging buffer the trainer shares
    (weightsync/staged.py), each checked against this engine's parameter of its name: dtype, shape and a contiguous
    layout, as `receive_into_parameters` checks a broadcast. Raises `WeightUpdateStateError` naming the first
    mismatch, before any sync uses the buffer."""
    targets, wrong = [], []
    for entry, view in zip(entries, views, strict=True):
        param = _parameter(model, entry.name)
        if param is None or param.dtype != view.dtype or param.shape != view.shape or not param.is_contiguous():
            held = "none" if param is None else f"{str(param.dtype).removeprefix('torch.')} {list(param.shape)}"
            wrong.append(f"{entry.name} (staged {entry.dtype} {list(entry.shape)}, engine holds {held})")
            continue
        targets.append((entry.name, view, param.data))
    if wrong:
        raise WeightUpdateStateError(
            f"kernel-format staging buffer: {len(wrong)} slot(s) match no parameter of this engine by name, dtype, "
            f"shape and layout, e.g. {wrong[0]}"
        )
    return targets


def copy_staged(targets: Sequence[tuple[str, Any, Any]], receipt: Any) -> None:
    """Copy every staging slot into its parameter and fingerprint the parameter for the receipt (what the engine
    now holds, compared with what the trainer staged); returns once the device is done, because the trainer
    writes the slots again at its next sync as soon as this returns."""
    import torch

    begin, receipt_seconds = _clock(), 0.0
    with torch.no_grad():
        for name, slot, target in targets:
            target.copy_(slot)
            started = _clock()
            receipt.record([(name, target)], flush=False, parameters=True)
            receipt_seconds += _clock() - started
        started = _clock()
        receipt.received.flush()
        receipt_seconds += _clock() - started
    if targets and targets[0][2].is_cuda:
        torch.cuda.current_stream(targets[0][2].device).synchronize()
    receipt.add_engine_seconds("receipt", receipt_seconds)
    receipt.add_engine_seconds("load", _clock() - begin - receipt_seconds)


def _parameter(model: Any, name: str) -> Any:
    try:
        return model.get_parameter(name)
    except AttributeError:
        return None


class WeightSyncWorkerExtension:
    """Mixed into vLLM's Worker by `worker_extension_cls`; `self` is the Worker."""

    _r3_update_active: bool = False
    _r3_chunks_loaded: int = 0
    _r3_tensors_loaded: int = 0
    # Which policy the weights are, as the driver named it at the last finished sync. None: the weights the
    # engine started with, or a bracket is open / was aborted (weights in flux). A restarted engine process
    # starts at None, which is how the driver tells that it must be re-synced before it gets rollouts.
    _r3_policy_tag: str | None = None
    _r3_receipt_state: Any = None  # wire/receipt.py SyncReceipt, created at the first bracket
    _r3_staged: Any = None  # (OpenedBuffer, staged_targets) of the trainer's staging buffer, once attached
    _r3_mapped: Any = None  # engine/mapped.py MappedParameters, once the trainer mapped this worker's parameters
    _r3_own_kernel_bracket: bool = False  # the kernel layout's bracket is this extension's own (vLLM >= 0.30)

    # -- the one entry point: a typed message per verb ----------------------------------------------
    def r3_handle(self, payload: dict[str, Any]) -> Any:
        """Decode one weight-sync message (`wire/sync_messages.py`) and run its verb on this worker; the answer is
        JSON (the transport hands every worker's to the message's `answer`)."""
        match decode(payload):
            case BeginPacked():
                return self.r3_begin_weight_update()
            case LoadPacked(chunk=chunk):
                return self.r3_load_packed(chunk.buffer, chunk.entries)
            case LoadPackedFile(path=path):
                return self.r3_load_packed_file(path)
            case FinishPacked(policy_tag=tag):
                return self.r3_finish_weight_update(tag)
            case AbortPacked():
                return self.r3_abort_weight_update()
            case BeginNative(layout=layout, in_place=in_place):
                return self.r3_native_begin(layout, in_place)
            case FinishNative(policy_tag=tag):
                return self.r3_native_end(tag)
            case AbortNative():
                return self.r3_abort_native_weight_update()
            case ParameterMetadata():
                return self.r3_parameter_metadata()
            case ParameterFingerprints():
                return self.r3_parameter_fingerprints()
            case DirectSync(update=update, policy_tag=tag):
                return self.r3_direct_sync(update, tag)
            case StagedAttach(share=share):
                return self.r3_staged_attach(share)
            case StagedSync(policy_tag=tag):
                return self.r3_staged_sync(tag)
            case MappedAttach(share=share):
                return self.r3_mapped_attach(share)
            case MappedSync(number=number, policy_tag=tag, timeout_s=timeout_s):
                return self.r3_mapped_sync(number, tag, timeout_s)
            case Receipts():
                return self.r3_sync_receipt()
            case PolicyTag():
                return self.r3_policy_tag()
            case DeviceUUIDs():
                return self.r3_device_uuid()
            case WeightsDigest():
                return self.r3_weights_digest()
            case EngineBuild():
                return self.r3_engine_build()
            case other:  # vLLM's own API (init, update, world size): the transport sends those to vLLM
                raise WeightUpdateStateError(f"{type(other).__name__} is vLLM's own call, not the worker extension's")

    # -- helpers ----------------------------------------------------------------------------------
    def _r3_model(self) -> Any:
        return self.model_runner.get_model()  # type: ignore[attr-defined]

    def _r3_context(self) -> ExitStack:
        """vLLM config + target device current, as layerwise processing allocates and reads config."""
        import torch
        from vllm.config import set_current_vllm_config

        stack = ExitStack()
        stack.enter_context(set_current_vllm_config(self.vllm_config))  # type: ignore[attr-defined]
        stack.enter_context(torch.device(self.device))  # type: ignore[attr-defined]
        return stack

    def _r3_receipt(self) -> Any:
        from r3operator.wire.receipt import SyncReceipt

        if self._r3_receipt_state is None:
            self._r3_receipt_state = SyncReceipt()
        return self._r3_receipt_state

    def _r3_parameters(self) -> list[tuple[str, Any]]:
        return [(name, param.detach()) for name, param in self._r3_model().named_parameters()]

    # -- the bracket ------------------------------------------------------------------------------
    def r3_begin_weight_update(self) -> None:
        from r3operator.engine.plugin import self_check

        if self._r3_update_active:
            raise WeightUpdateStateError(
                "r3_begin_weight_update: an update is already active; call r3_finish_weight_update "
                "(or r3_abort_weight_update) first"
            )
        api = self_check().reload_api
        self._r3_receipt().begin(self._r3_parameters())
        with self._r3_context():
            api["initialize_layerwise_reload"](self._r3_model())
        self._r3_update_active = True
        self._r3_policy_tag = None
        self._r3_chunks_loaded = 0
        self._r3_tensors_loaded = 0

    def r3_load_chunk(self, named_tensors: Sequence[tuple[str, Any]]) -> int:
        """Load one chunk of checkpoint-format (HF names) tensors; returns how many were loaded."""
        if not self._r3_update_active:
            raise WeightUpdateStateError("r3_load_chunk outside r3_begin_weight_update/r3_finish_weight_update")
        batch = list(named_tensors)
        model = self._r3_model()

        def load() -> Any:
            with self._r3_context():
                return model.load_weights(iter(list(batch)))

        loaded = _timed_load(self._r3_receipt(), batch, load)
        self._r3_chunks_loaded += 1
        count = len(loaded) if loaded is not None else len(batch)
        self._r3_tensors_loaded += count
        return count

    def r3_load_packed(self, buffer: Any, entries: Sequence[Sequence[Any]]) -> int:
        """Load one chunk sent as ONE flat uint8 buffer + (name, dtype, shape, offset) entries.

        The tensors are views of `buffer` (zero-copy from Ray's object store); `load_weights` copies
        them into the parameters. See `r3operator.wire.weights.pack_chunk`.
        """
        from r3operator.wire.weights import unpack_chunk

        return self.r3_load_chunk(unpack_chunk(buffer, entries))

    def r3_load_packed_file(self, path: str) -> int:
        """A packed chunk staged on a shared volume as safetensors: tensor "buffer" + JSON "entries"."""
        import json

        from safetensors import safe_open

        with safe_open(path, framework="pt", device="cpu") as fh:
            entries = json.loads(fh.metadata()["entries"])
            buffer = fh.get_tensor("buffer")
        return self.r3_load_packed(buffer, entries)

    def r3_finish_weight_update(self, policy_tag: str | None = None) -> dict[str, int]:
        """Close the bracket (finalize the layerwise reload) and record `policy_tag` as what the engine serves."""
        if not self._r3_update_active:
            raise WeightUpdateStateError("r3_finish_weight_update without r3_begin_weight_update")
        from r3operator.engine.plugin import self_check

        api = self_check().reload_api
        try:
            with self._r3_context():
                api["finalize_layerwise_reload"](self._r3_model(), self.model_config)  # type: ignore[attr-defined]
        finally:
            self._r3_update_active = False
        self._r3_receipt().finish(self._r3_parameters())
        self._r3_policy_tag = policy_tag
        self._r3_release_sync_buffers()
        return {"chunks": self._r3_chunks_loaded, "tensors": self._r3_tensors_loaded}

    def r3_abort_weight_update(self) -> dict[str, int]:
        """Close a bracket left open by a failed sync WITHOUT finalising it.

        Finalising would process every partially loaded layer: vLLM materialises its missing tensors
        uninitialised and copies them into the kernel storage, so the engine would serve garbage in those
        layers. Instead every layer still waiting for weights gets its kernel tensors back untouched (its
        previous weights: loading only buffered into meta tensors). Layers that had received all their
        weights were already processed and hold the new ones, so the engine is a mix of two policies until
        the next complete sync: the policy tag stays None and the driver re-syncs before any rollout.
        Returns how many layers were put back. Idempotent; a no-op outside a bracket.
        """
        if not self._r3_update_active:
            return {"layers_restored": 0}
        restored = self._r3_restore_loading_layers()
        self._r3_update_active = False
        self._r3_policy_tag = None
        self._r3_receipt().abandon()
        return {"layers_restored": restored}

    def _r3_restore_loading_layers(self) -> int:
        """Give every layer still waiting for weights its kernel tensors back; returns how many."""
        from vllm.model_executor.model_loader.reload import layerwise

        model = self._r3_model()
        restored = 0
        for layer in model.modules():
            info = layerwise.get_layerwise_info(layer)
            if not info.can_load():  # processed already, or not part of the bracket
                continue
            if info.kernel_tensors is not None:
                layerwise._place_kernel_tensors(layer, info)  # the inverse of restore_layer_on_meta
                restored += 1
            info.reset()
        layerwise.LOADING_LAYERS.clear()
        if hasattr(model, "_original_do_torchao_reload"):
            model._do_torchao_reload = model._original_do_torchao_reload
        return restored

    # -- around vLLM's native weight transfer (start/update/finish_weight_update of the Worker) ------
    # vLLM's bracket has no abort and no notion of which policy the weights are; these two add that.
    def r3_before_native_weight_update(
        self, layout: BracketLayout = BracketLayout.CHECKPOINT, in_place: bool = False
    ) -> None:
        """Called right before vLLM's `start_weight_update`: the weights are in flux until a finished sync
        stamps them, and the plugin's patches must be in force in this worker (`self_check` registers it
        where vLLM did not load general plugins, e.g. r3operator not installed as a package).

        `layout`: "checkpoint" (vLLM's receiver hands each batch to `model.load_weights`, tapped there) or
        "kernel" (`start_weight_update(is_checkpoint_format=False)`: vLLM 0.22 hands each batch to its own
        direct-copy loader instead, so the tap goes on the transfer engine's `receive_weights`)."""
        from r3operator.engine.plugin import self_check

        layout = BracketLayout.parse(layout)  # a direct caller's value is refused here, naming the field
        if layout is BracketLayout.KERNEL:
            self._r3_check_kernel_layout()
        self_check()
        self._r3_policy_tag = None
        self._r3_receipt().begin(self._r3_parameters(), in_place=in_place)
        self._r3_untap_load_weights()
        if layout is not BracketLayout.KERNEL:
            self._r3_tap_load_weights()
        elif vllm_brackets_kernel_format(self.start_weight_update):  # type: ignore[attr-defined]  # vLLM's Worker
            self._r3_tap_kernel_receive()  # vLLM 0.22 may receive it itself (its packed IPC); >= 0.30 never does

    def r3_native_begin(self, layout: BracketLayout = BracketLayout.CHECKPOINT, in_place: bool = False) -> None:
        """Open a native bracket in ONE round trip: `r3_before_native_weight_update`, then this worker's own vLLM
        `start_weight_update`. That is all vLLM's `/start_weight_update` does (its AsyncLLM sends
        `collective_rpc("start_weight_update", ...)` to every worker: read in 0.22.1 and 0.30), so the bracket is
        vLLM's own; the HTTP round trip and engine-core hop it saves are a sync's fixed cost (issue 24).

        The kernel layout: vLLM 0.22's `start_weight_update(is_checkpoint_format=False)`, which only marks the update
        active. vLLM >= 0.30 dropped the flag (its start always opens a layerwise reload, which would take the layers'
        parameters away from the copies and process them again at the finish), so there the bracket is this
        extension's own (`_r3_open_kernel_bracket`): vLLM's flag set, nothing else of vLLM's run."""
        layout = BracketLayout.parse(layout)
        self.r3_before_native_weight_update(layout, in_place)
        if layout is not BracketLayout.KERNEL:
            self.start_weight_update()  # type: ignore[attr-defined]  # vLLM's Worker
        elif vllm_brackets_kernel_format(self.start_weight_update):  # type: ignore[attr-defined]  # vLLM's Worker
            self.start_weight_update(is_checkpoint_format=False)  # type: ignore[attr-defined]  # vLLM 0.22.1's Worker
        else:
            self._r3_open_kernel_bracket()

    def _r3_open_kernel_bracket(self) -> None:
        """The kernel layout's bracket on vLLM >= 0.30: vLLM's own "update active" flag, so that none of vLLM's
        start/update/finish runs inside it (each refuses while it is set), and nothing else: the copies are the
        sender's, the receipt and the policy tag this extension's."""
        if getattr(self, "_weight_update_active", False):
            raise WeightUpdateStateError(
                "kernel-format weight sync: a weight update is already active on this worker (abort it first)"
            )
        self._weight_update_active = True
        self._r3_own_kernel_bracket = True

    def r3_native_end(self, policy_tag: str | None = None, in_place: bool = False) -> None:
        """Close a native bracket in one round trip: this worker's vLLM `finish_weight_update` (as vLLM's
        `/finish_weight_update` runs it), or the kernel layout's own bracket on vLLM >= 0.30, then
        `r3_after_native_weight_update`. A failure of the first leaves the policy unstamped and the bracket to the
        caller's abort, as before."""
        if self._r3_own_kernel_bracket:
            self._weight_update_active = self._r3_own_kernel_bracket = False
        else:
            self.finish_weight_update()  # type: ignore[attr-defined]  # vLLM's Worker
        self.r3_after_native_weight_update(policy_tag, in_place)

    def _r3_check_kernel_layout(self) -> None:
        if reason := kernel_layout_refusal(self._r3_model()):
            raise WeightUpdateStateError(f"weightSync.layout kernel cannot be right on this engine: {reason}")

    def r3_parameter_metadata(self) -> dict[str, Any]:
        """{"parameters": [name, dtype, shape] of every parameter of this worker's model, WHOLE (a parameter this rank
        holds a part of by the shape of the whole: what a kernel-format sender must send, wire/kernel_layout.py plans
        from it and names any mismatch); "shards": the part this rank holds of each such parameter (engine/shards.py);
        "refused": why this engine's served layout is not its loaded one, or None}. Answered, not raised, so that
        the reason reaches the trainer whatever the transport (an RPC error over HTTP is retried as a server
        error); the sender refuses before any bracket opens."""
        model = self._r3_model()
        shards, unsharded = self._r3_shards()
        return {
            "parameters": [
                [
                    name,
                    str(param.dtype).removeprefix("torch."),
                    list(shards[name].whole) if name in shards else list(param.shape),
                ]
                for name, param in model.named_parameters()
            ],
            "shards": {name: shard.to_wire() for name, shard in shards.items()},
            "refused": kernel_layout_refusal(model) or unsharded,
        }

    def _r3_shards(self) -> tuple[dict[str, Shard], str | None]:
        """The part of each whole parameter this rank holds, and why the layout cannot be right if a sharding is not
        served as loaded (engine/shards.py `parameter_shards`): read once, for the metadata and every receive alike,
        since a model's layers keep their sharding for the engine's life."""
        read: tuple[dict[str, Shard], str | None] | None = getattr(self, "_r3_shards_read", None)
        if read is None:
            read = self._r3_shards_read = parameter_shards(self._r3_model())
        return read

    def r3_parameter_fingerprints(self) -> dict[str, list[int]]:
        """The fingerprint (wire/receipt.py) of every parameter of this worker's model as it holds them now: after a
        checkpoint-layout sync, what vLLM's own `load_weights` made of the trainer's tensors, which the kernel
        layout's reference check compares with what it would send (weightsync/transfer.py `_reference_sync`)."""
        from r3operator.wire.receipt import FingerprintLog

        log = FingerprintLog()
        log.add_many(self._r3_parameters())
        return {name: list(value) for name, value in log.result().items()}

    def _r3_tap_kernel_receive(self) -> None:
        """Kernel format (vLLM 0.22 `Worker.update_weights`): the receiver gets vLLM's direct-copy loader as
        `load_weights=` (`model.get_parameter(name).copy_(weight)` per tensor, not `model.load_weights`). An
        instance attribute in front of the transfer engine's `receive_weights` wraps that loader: every
        batch is recorded in the receipt and timed as on the checkpoint path, and loaded under `no_grad`
        (an RMSNorm weight is a plain `nn.Parameter` that requires grad, and `copy_` into it otherwise
        fails). The bytes and the copies are vLLM's."""
        import torch

        engine = getattr(self, "weight_transfer_engine", None)
        if engine is None:
            raise WeightUpdateStateError("kernel-format weight sync: this worker has no weight transfer engine")
        engine.__dict__.pop("receive_weights", None)
        original = engine.receive_weights
        receipt = self._r3_receipt()

        def receive_weights(update_info: Any, *args: Any, **kwargs: Any) -> Any:
            direct = kwargs.pop("load_weights", None)
            if direct is None:
                raise WeightUpdateStateError(
                    "kernel-format weight sync needs vLLM 0.22's receiver, which takes the loader as "
                    "load_weights=; this vLLM's does not (weightSync.layout: use checkpoint)"
                )

            def load_weights(weights: Iterable[tuple[str, Any]]) -> Any:
                batch = list(weights)

                def load() -> Any:
                    with torch.no_grad():
                        return direct(batch)

                return _timed_load(receipt, batch, load)

            return original(update_info, *args, load_weights=load_weights, **kwargs)

        engine.receive_weights = receive_weights

    def _r3_tap_load_weights(self) -> None:
        """vLLM's receivers hand each unpacked batch to `model.load_weights` (looked up on the model at every
        call): an instance attribute in front of the class's method records the batch in the receipt and
        times the receipt and the load (`_timed_load`)."""
        model = self._r3_model()
        model.__dict__.pop("load_weights", None)
        original = model.load_weights
        receipt = self._r3_receipt()

        def load_weights(weights: Iterable[tuple[str, Any]], *args: Any, **kwargs: Any) -> Any:
            batch = list(weights)
            return _timed_load(receipt, batch, lambda: original(iter(batch), *args, **kwargs))

        model.load_weights = load_weights

    def _r3_untap_load_weights(self) -> None:
        self._r3_model().__dict__.pop("load_weights", None)
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is not None and hasattr(engine, "__dict__"):
            engine.__dict__.pop("receive_weights", None)

    def r3_after_native_weight_update(self, policy_tag: str | None = None, in_place: bool = False) -> None:
        """Called right after vLLM's `finish_weight_update`: close the receipt, record the policy. `in_place` (the
        bracket's tensors landed in the parameters themselves, as its begin said): the receipt is finished when it is
        read (`SyncReceipt.finish_later`), so the call returns once the tag is stamped."""
        self._r3_untap_load_weights()
        receipt = self._r3_receipt()
        if in_place:
            receipt.finish_later(self._r3_parameters())
        else:
            receipt.finish(self._r3_parameters())
        self._r3_policy_tag = policy_tag
        self._r3_release_sync_buffers()

    def _r3_release_sync_buffers(self) -> None:
        """The receive buffers a sync left in torch's cache go back to the device (wire/cuda_cache.py)."""
        from r3operator.wire.cuda_cache import release_cached_blocks

        receipt = self._r3_receipt()
        released = release_cached_blocks()
        receipt.released_bytes = released.freed_bytes
        receipt.add_engine_seconds("release", released.seconds)

    def r3_sync_receipt(self) -> dict[str, Any]:
        """What the last bracket delivered (wire/receipt.py `SyncReceipt.report`)."""
        return dict(self._r3_receipt().report())

    def r3_abort_native_weight_update(self) -> dict[str, int]:
        """Close a native bracket (`start_weight_update`) left open by a failed sync WITHOUT finalising it.

        The same restoration as `r3_abort_weight_update`, then vLLM's own "update active" state is cleared
        so that the next `start_weight_update` is accepted. The weights may mix two policies (layers that
        completed hold the new ones): the tag stays None until a complete sync. Outside a bracket it
        restores nothing and leaves the tag alone. A kernel-format sync has no layers to restore: what it
        copied before the failure is served until the re-sync, which the None tag (set at its start) forces.
        """
        # Restore by layer state, not by vLLM's flag: vLLM 0.30 clears the flag itself when an update
        # fails, leaving the layers that were loading on meta tensors.
        self._r3_untap_load_weights()
        self._r3_receipt().abandon()
        restored = self._r3_restore_loading_layers()
        self._weight_update_active = self._r3_own_kernel_bracket = False
        if hasattr(self, "_is_checkpoint_format"):  # vLLM 0.22: its default, as its own finish leaves it
            self._is_checkpoint_format = True
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is not None and hasattr(engine, "reset_weight_update_target"):  # vLLM >= 0.30
            engine.reset_weight_update_target()
        if restored:
            self._r3_policy_tag = None
        return {"layers_restored": restored}

    def r3_device_uuid(self) -> str | None:
        """The physical GPU this worker runs on (None on CPU): the driver compares it with its own, because
        NCCL cannot join two ranks on one GPU (a shared GPU needs the IPC backend)."""
        import torch

        if not torch.cuda.is_available():
            return None
        return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)

    def r3_policy_tag(self) -> str | None:
        return self._r3_policy_tag

    def r3_engine_build(self) -> str:
        """This engine's vLLM release and the image its pod runs (ENGINE_IMAGE_ENV, set on a disaggregated job's
        engines): a prefill engine serves rollouts only with a decode engine of the same build."""
        import vllm

        from r3operator.settings import engine_image

        return f"vllm {vllm.__version__} image {engine_image() or 'unknown'}"

    # -- the kernel layout over NCCL in one call (weightsync/direct.py) ----------------------------------
    def r3_direct_sync(self, update: DirectUpdate | dict[str, Any], policy_tag: str | None = None) -> dict[str, int]:
        """One kernel-format NCCL sync, in this one call: vLLM's bracket opened (`r3_native_begin`), every announced
        tensor received into its parameter and the trainer's commit flag (`receive_into_parameters`), the bracket
        closed and `policy_tag` stamped (`r3_native_end`) when the flag is 1. A bracket that cannot open still
        receives every broadcast (`drain_direct`); a flag of 0 or any failure aborts the bracket here (the tag stays
        None) and is raised."""
        info = update if isinstance(update, DirectUpdate) else DirectUpdate.from_json(update)
        engine = getattr(self, "weight_transfer_engine", None)
        group = getattr(engine, "model_update_group", None)
        if group is None:
            raise WeightUpdateStateError(
                "direct weight sync: this worker has no NCCL weight-transfer group (init_weight_transfer_engine first)"
            )
        try:
            self.r3_native_begin(BracketLayout.KERNEL, in_place=True)
        except BaseException:
            drain_direct(group, info, self.device)  # type: ignore[attr-defined]  # vLLM's Worker
            raise
        try:
            if not receive_into_parameters(self._r3_model(), group, info, self._r3_receipt(), self._r3_shards()[0]):
                raise WeightUpdateStateError(
                    "direct weight sync: the trainer failed mid-sync (its commit flag is 0): the bracket is aborted "
                    "and the engine serves no policy until the next complete sync"
                )
            self.r3_native_end(policy_tag, in_place=True)
        except BaseException:
            self.r3_abort_native_weight_update()
            raise
        return {"tensors": len(info.names)}

    # -- the kernel layout from a staging buffer the trainer shares (weightsync/staged.py) ---------------
    def r3_staged_attach(self, share: dict[str, Any]) -> dict[str, int]:
        """Map the trainer's staging buffer ({"buffer": wire/shared_buffer description, "entries": slots}) and check
        every slot against this worker's parameters; replaces an earlier attachment. Returns the slot and byte
        counts."""
        from r3operator.wire.shared_buffer import SharedBufferError, StagedEntry, entry_views, open_shared

        self.r3_staged_detach()
        if not isinstance(share, dict) or "buffer" not in share:
            raise SharedBufferError("r3_staged_attach expects {'buffer': ..., 'entries': [...]}")
        entries = [StagedEntry.from_json(e) for e in share.get("entries") or []]
        opened = open_shared(share["buffer"])
        try:
            targets = staged_targets(self._r3_model(), entries, entry_views(opened.tensor, entries))
        except BaseException:
            opened.close()
            raise
        self._r3_staged = (opened, targets)
        return {"tensors": len(targets), "bytes": int(opened.tensor.numel())}

    def r3_staged_detach(self) -> None:
        """Let go of the trainer's staging buffer (its memory returns to the trainer once it collects)."""
        if self._r3_staged is not None:
            opened, _ = self._r3_staged
            self._r3_staged = None
            opened.close()

    def r3_staged_sync(self, policy_tag: str | None = None) -> dict[str, int]:
        """One kernel-format sync from the attached staging buffer, in this one call: vLLM's bracket opened
        (`r3_native_begin`), every slot copied into its parameter and fingerprinted (`copy_staged`), the bracket
        closed and `policy_tag` stamped (`r3_native_end`). A failure inside aborts the bracket here (the tag stays
        None) and is raised."""
        if self._r3_staged is None:
            raise WeightUpdateStateError(
                "r3_staged_sync: no staging buffer attached (r3_staged_attach first; a restarted engine is attached "
                "again at the trainer's next rendezvous)"
            )
        _, targets = self._r3_staged
        self.r3_native_begin(BracketLayout.KERNEL)
        try:
            copy_staged(targets, self._r3_receipt())
            self.r3_native_end(policy_tag)
        except BaseException:
            self.r3_abort_native_weight_update()
            raise
        return {"tensors": len(targets)}

    # -- the kernel layout written by the colocated trainer into the parameters (weightsync/mapped.py) ---------
    def r3_mapped_attach(self, share: dict[str, Any]) -> dict[str, Any]:
        """Share this worker's parameters with the trainer ({"doorbell": wire/doorbell description, "slot_base": int})
        and map its doorbell; replaces an earlier attachment. Answers {"slot", "buffers", "entries"}
        (engine/mapped.py `map_parameters`); raises `SharedBufferError` when they cannot be shared."""
        from r3operator.engine.mapped import map_parameters

        self.r3_mapped_detach()
        self._r3_check_kernel_layout()
        named = list(self._r3_model().named_parameters())
        self._r3_mapped, answer = map_parameters(named, share, rank=int(getattr(self, "local_rank", 0) or 0))
        return answer

    def r3_mapped_detach(self) -> None:
        if self._r3_mapped is not None:
            state, self._r3_mapped = self._r3_mapped, None
            state.close()

    def r3_mapped_sync(self, number: int, policy_tag: str | None = None, timeout_s: float = 300.0) -> dict[str, int]:
        """Mapped sync `number`, in this one call: the parameters checked where they were shared, vLLM's bracket
        opened (`r3_native_begin`), the trainer's writes awaited (engine/mapped.py `take_mapped_sync`), the bracket
        closed and `policy_tag` stamped; the receipt is finished when it is read. A failure inside aborts the bracket
        here (the tag stays None) and is raised."""
        from r3operator.engine.mapped import take_mapped_sync

        state = self._r3_mapped
        if state is None:
            raise WeightUpdateStateError(
                "r3_mapped_sync: the trainer has not mapped this worker's parameters (r3_mapped_attach first; a "
                "restarted engine is mapped again at the trainer's next sync)"
            )
        if moved := state.moved(self._r3_model()):
            self.r3_mapped_detach()
            raise WeightUpdateStateError(
                f"r3_mapped_sync: {len(moved)} parameter(s) are no longer where the trainer mapped them, e.g. "
                f"{moved[0]}: the trainer maps them again at its next sync"
            )
        self.r3_native_begin(BracketLayout.KERNEL, in_place=True)
        try:
            take_mapped_sync(state, int(number), timeout_s=float(timeout_s))
            self._r3_receipt().record_later([(name, data) for name, data, _ in state.parameters])
            self.r3_native_end(policy_tag, in_place=True)
        except BaseException:
            self.r3_abort_native_weight_update()
            raise
        return {"tensors": len(state.parameters)}

    # -- diagnostics ------------------------------------------------------------------------------
    def r3_weights_digest(self, names: Iterable[str] | None = None) -> str:
        """sha256 over (name, dtype, shape, bytes) of the engine's parameters (kernel layout)."""
        import torch

        wanted = set(names) if names is not None else None
        digest = hashlib.sha256()
        for name, param in sorted(self._r3_model().named_parameters()):
            if wanted is not None and name not in wanted:
                continue
            tensor = param.detach().to("cpu").contiguous()
            digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
            digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
        return digest.hexdigest()
