"""The weight sync's verbs, as typed messages from the driver to an engine.

The driver's weight-sync code (`weightsync/`) builds one message per verb; an engine handle (`rollout/`: a Ray actor,
or `vllm serve` over HTTP) carries it with its one transport call, `send`; inside vLLM the worker extension
(`engine/worker.py`, `r3_handle`) decodes it and dispatches on its type. The layout a bracket opens in is a
`BracketLayout` in `BeginNative`, from the session's choice (weightsync/session.py `bracket_for`) to the worker's
branch; between them the sender alone reads it (weightsync/transfer.py), the layers that carry the message do not.

Each message says what the transport needs to know:

- `answer(results)`: its typed answer, from the workers' results (vLLM's `collective_rpc` answers one per worker);
- `retry`: whether the transport may repeat it after a transient failure (queries and aborts: yes; a verb inside a
  bracket: never, `wire/retry.py` says why);
- `what`: the call's name in errors and logs;
- `clears_prefix_cache`: the engine's prefix cache is reset after it (an abort: cached blocks may come from layers
  that took new weights);
- `STAMPING` messages finish a sync: after them the engine serves `policy_tag` (the next requests salt the prefix
  cache with it, or without a tag the cache is reset).

Three verbs are vLLM's own weight-transfer API, not the extension's: `InitTransfer`, `UpdateWeights` and
`WorldSize` go to vLLM's HTTP routes or `LLM` methods.

On the wire a message is a JSON object (`encode`, `decode`): `{"kind": ..., <its fields>}`, the layout by its value.
`/collective_rpc` over HTTP takes JSON, and vLLM's engine core serializes its RPC arguments as msgpack; a packed
chunk's buffer stays a numpy array there (Ray's object store and vLLM's msgpack carry it without a copy).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from enum import StrEnum
from typing import Any, ClassVar, Generic, TypeVar, cast

from r3operator.wire.receipt import Fingerprint, parse_fingerprints
from r3operator.wire.weights import PackedChunk

A = TypeVar("A")


class BracketLayout(StrEnum):
    """The layout a sync's tensors arrive in (`spec.weightSync.layout` once `auto` is resolved)."""

    CHECKPOINT = "checkpoint"
    """The checkpoint's names and shapes (experts unfused): vLLM's `load_weights` lays them out."""
    KERNEL = "kernel"
    """One tensor per engine parameter, as the engine serves it: copied in place, nothing processed after."""

    @classmethod
    def parse(cls, value: object) -> BracketLayout:
        """`value` as a layout; anything else is refused naming the field it comes from."""
        try:
            return cls(str(value))
        except ValueError:
            raise ValueError(f"weightSync.layout must be checkpoint or kernel, got {value!r}") from None


class WeightUpdateStateError(RuntimeError):
    """A weight-update call came out of order (chunk outside a bracket, nested begin, finish without begin) or its
    message was malformed."""


@dataclass(frozen=True)
class SyncMessage(Generic[A]):
    """One verb of the sync (see the module doc); subclasses are the verbs."""

    kind: ClassVar[str]
    what: ClassVar[str]
    retry: ClassVar[bool] = False
    clears_prefix_cache: ClassVar[bool] = False

    def answer(self, results: Sequence[Any]) -> A:
        """The typed answer, from every worker's result (one per worker)."""
        return cast(A, None)

    def encode(self) -> dict[str, Any]:
        """The message as JSON (an array stays an array): {"kind": ..., fields}."""
        out: dict[str, Any] = {"kind": self.kind}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = value.encode() if isinstance(value, DirectUpdate) else value
        return out


def _first(results: Sequence[Any]) -> Any:
    return results[0] if results else None


# -- the packed path: the trainer's chunks through the extension, inside vLLM's layerwise reload ----------


@dataclass(frozen=True)
class BeginPacked(SyncMessage[None]):
    """Open the layerwise-reload bracket (`r3_begin_weight_update`)."""

    kind: ClassVar[str] = "begin_packed"
    what: ClassVar[str] = "begin weight update"


@dataclass(frozen=True)
class LoadPacked(SyncMessage[int]):
    """One packed chunk (wire/weights.py `pack_chunk`): on the wire its buffer (uint8) and its (name, dtype, shape,
    offset) entries; the transports keep what they made of it in `chunk.handles` (one Ray object or one staged file
    for every engine). Answers how many tensors the workers loaded."""

    kind: ClassVar[str] = "load_packed"
    what: ClassVar[str] = "load weight chunk"
    chunk: PackedChunk

    def answer(self, results: Sequence[Any]) -> int:
        return int(sum(int(r) for r in results))

    def encode(self) -> dict[str, Any]:
        return {"kind": self.kind, "buffer": self.chunk.buffer, "entries": self.chunk.entries}


@dataclass(frozen=True)
class LoadPackedFile(SyncMessage[int]):
    """One packed chunk staged on the shared volume as safetensors (over HTTP: a buffer is not JSON)."""

    kind: ClassVar[str] = "load_packed_file"
    what: ClassVar[str] = "load weight chunk"
    path: str

    def answer(self, results: Sequence[Any]) -> int:
        return int(_first(results) or 0)


@dataclass(frozen=True)
class PackedCounts:
    """What a finished packed bracket loaded: chunks and tensors (the first worker's count)."""

    chunks: int = 0
    tensors: int = 0


@dataclass(frozen=True)
class FinishPacked(SyncMessage[PackedCounts]):
    """Close the bracket (finalise the layerwise reload) and serve `policy_tag`."""

    kind: ClassVar[str] = "finish_packed"
    what: ClassVar[str] = "finish weight update"
    policy_tag: str | None = None

    def answer(self, results: Sequence[Any]) -> PackedCounts:
        first = _first(results)
        if not isinstance(first, Mapping):
            return PackedCounts()
        return PackedCounts(chunks=int(first.get("chunks") or 0), tensors=int(first.get("tensors") or 0))


@dataclass(frozen=True)
class AbortPacked(SyncMessage[None]):
    """Close a bracket left open WITHOUT finalising it (the loading layers get their weights back)."""

    kind: ClassVar[str] = "abort_packed"
    what: ClassVar[str] = "abort weight update"
    retry: ClassVar[bool] = True
    clears_prefix_cache: ClassVar[bool] = True


# -- vLLM's native transfer: our hooks around vLLM's own bracket ----------


@dataclass(frozen=True)
class BeginNative(SyncMessage[None]):
    """Open a native bracket in `layout` in one round trip (`r3_native_begin`); `in_place`: the tensors land in the
    parameters themselves (the receipt is finished when it is read)."""

    kind: ClassVar[str] = "begin_native"
    what: ClassVar[str] = "start weight update"
    layout: BracketLayout = BracketLayout.CHECKPOINT
    in_place: bool = False

    @property
    def kernel(self) -> bool:
        """The tensors arrive in the kernel layout (one per engine parameter), not vLLM's checkpoint one."""
        return self.layout is BracketLayout.KERNEL


@dataclass(frozen=True)
class FinishNative(SyncMessage[None]):
    """Close a native bracket (vLLM's finish, then ours) and serve `policy_tag`."""

    kind: ClassVar[str] = "finish_native"
    what: ClassVar[str] = "finish weight update"
    policy_tag: str | None = None


@dataclass(frozen=True)
class AbortNative(SyncMessage[None]):
    """Close a native bracket left open WITHOUT finalising it; vLLM's own "update active" state is cleared."""

    kind: ClassVar[str] = "abort_native"
    what: ClassVar[str] = "abort weight update"
    retry: ClassVar[bool] = True
    clears_prefix_cache: ClassVar[bool] = True


@dataclass(frozen=True)
class ParameterMetadata(SyncMessage[dict[str, Any]]):
    """{"parameters": [name, dtype, shape] of every parameter, whole (the kernel layout's planner reads them), "shards":
    each worker's part of the parameters it holds a part of (wire/shards.py; one dict per worker, empty on a rank
    holding whole parameters), "refused": why the kernel layout cannot be right on this engine, or None}. The
    workers of one engine must report the same whole parameters: the first that does not is a refusal."""

    kind: ClassVar[str] = "parameter_metadata"
    what: ClassVar[str] = "parameter metadata"
    retry: ClassVar[bool] = True

    def answer(self, results: Sequence[Any]) -> dict[str, Any]:
        workers = [dict(result or {}) for result in results]
        first = workers[0] if workers else {}
        refused = next((w["refused"] for w in workers if w.get("refused")), None)
        for index, worker in enumerate(workers[1:], start=1):
            if refused is None and worker.get("parameters") != first.get("parameters"):
                refused = f"its worker {index} reports other whole parameters than worker 0"
        return {
            "parameters": first.get("parameters") or [],
            "shards": [dict(w.get("shards") or {}) for w in workers],
            "refused": refused,
        }


@dataclass(frozen=True)
class ParameterFingerprints(SyncMessage[list[dict[str, Fingerprint]]]):
    """Every worker's fingerprint of every parameter it holds now (the kernel layout's reference check)."""

    kind: ClassVar[str] = "parameter_fingerprints"
    what: ClassVar[str] = "parameter fingerprints"
    retry: ClassVar[bool] = True

    def answer(self, results: Sequence[Any]) -> list[dict[str, Fingerprint]]:
        return [parse_fingerprints(result) for result in results]


@dataclass(frozen=True)
class DirectUpdate:
    """What a direct kernel-format sync announces (weightsync/direct.py): its tensors in broadcast order."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def encode(self) -> dict[str, Any]:
        return {"names": list(self.names), "dtype_names": list(self.dtype_names), "shapes": list(self.shapes)}

    @classmethod
    def from_json(cls, value: Any) -> DirectUpdate:
        try:
            update = cls(
                [str(n) for n in value["names"]],
                [str(d) for d in value["dtype_names"]],
                [[int(x) for x in shape] for shape in value["shapes"]],
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise WeightUpdateStateError(
                f"direct weight sync: the update must hold names, dtype_names and shapes: {exc}"
            ) from exc
        if not len(update.names) == len(update.dtype_names) == len(update.shapes):
            raise WeightUpdateStateError(
                f"direct weight sync: {len(update.names)} names, {len(update.dtype_names)} dtype names, "
                f"{len(update.shapes)} shapes"
            )
        return update


@dataclass(frozen=True)
class DirectSync(SyncMessage[None]):
    """One kernel-format NCCL sync in one call (weightsync/direct.py): bracket, receive, commit flag, tag."""

    kind: ClassVar[str] = "direct_sync"
    what: ClassVar[str] = "direct weight update"
    update: DirectUpdate
    policy_tag: str | None = None


@dataclass(frozen=True)
class StagedAttach(SyncMessage[None]):
    """Map the trainer's staging buffer (weightsync/staged.py: {"buffer": ..., "entries": [...]}) on every worker."""

    kind: ClassVar[str] = "staged_attach"
    what: ClassVar[str] = "attach staging buffer"
    share: dict[str, Any]


@dataclass(frozen=True)
class StagedSync(SyncMessage[None]):
    """One kernel-format sync from the mapped staging buffer in one call: bracket, copies, receipt, tag."""

    kind: ClassVar[str] = "staged_sync"
    what: ClassVar[str] = "staged weight update"
    policy_tag: str | None = None


@dataclass(frozen=True)
class MappedAttach(SyncMessage[list[dict[str, Any]]]):
    """Every worker shares its parameters' memory with the trainer (weightsync/mapped.py); one answer per worker."""

    kind: ClassVar[str] = "mapped_attach"
    what: ClassVar[str] = "map parameters"
    share: dict[str, Any]

    def answer(self, results: Sequence[Any]) -> list[dict[str, Any]]:
        return [dict(result) for result in results]


@dataclass(frozen=True)
class MappedSync(SyncMessage[None]):
    """Mapped sync `number` in one call, which returns once the trainer has written the parameters."""

    kind: ClassVar[str] = "mapped_sync"
    what: ClassVar[str] = "mapped weight update"
    number: int
    policy_tag: str | None = None
    timeout_s: float = 300.0


# -- queries ----------


@dataclass(frozen=True)
class Receipts(SyncMessage[list[dict[str, Any]]]):
    """Every worker's receipt of the last finished sync (wire/receipt.py `SyncReceipt.report`)."""

    kind: ClassVar[str] = "receipts"
    what: ClassVar[str] = "sync receipts"
    retry: ClassVar[bool] = True

    def answer(self, results: Sequence[Any]) -> list[dict[str, Any]]:
        return [dict(result) for result in results]


@dataclass(frozen=True)
class PolicyTag(SyncMessage[str | None]):
    """The tag of the last finished sync if every worker holds it, else None (weights in flux, or a restart)."""

    kind: ClassVar[str] = "policy_tag"
    what: ClassVar[str] = "policy tag"
    retry: ClassVar[bool] = True

    def answer(self, results: Sequence[Any]) -> str | None:
        tags = set(results or [None])
        return tags.pop() if len(tags) == 1 else None


@dataclass(frozen=True)
class DeviceUUIDs(SyncMessage[list[str | None]]):
    """The physical GPU of each worker (None on CPU)."""

    kind: ClassVar[str] = "device_uuids"
    what: ClassVar[str] = "device uuids"
    retry: ClassVar[bool] = True

    def answer(self, results: Sequence[Any]) -> list[str | None]:
        return [None if r is None else str(r) for r in results]


@dataclass(frozen=True)
class WeightsDigest(SyncMessage[str]):
    """sha256 over (name, dtype, shape, bytes) of the first worker's parameters."""

    kind: ClassVar[str] = "weights_digest"
    what: ClassVar[str] = "weights digest"
    retry: ClassVar[bool] = True

    def answer(self, results: Sequence[Any]) -> str:
        return str(_first(results))


@dataclass(frozen=True)
class EngineBuild(SyncMessage[str]):
    """The engine's vLLM release and pod image: pairs a disaggregated job's roles."""

    kind: ClassVar[str] = "engine_build"
    what: ClassVar[str] = "engine build"
    retry: ClassVar[bool] = True

    def answer(self, results: Sequence[Any]) -> str:
        return str(_first(results))


# -- vLLM's own weight-transfer API (its HTTP routes, or `LLM` methods) ------------------------------------------------


@dataclass(frozen=True)
class InitTransfer(SyncMessage[None]):
    """Join the trainer's transfer group (`init_weight_transfer_engine`)."""

    kind: ClassVar[str] = "init_transfer"
    what: ClassVar[str] = "init weight transfer"
    init_info: dict[str, Any]


@dataclass(frozen=True)
class UpdateWeights(SyncMessage[None]):
    """Receive one update of vLLM's sender inside the open bracket (`update_weights`)."""

    kind: ClassVar[str] = "update_weights"
    what: ClassVar[str] = "update weights"
    update_info: dict[str, Any]


@dataclass(frozen=True)
class WorldSize(SyncMessage[int]):
    """The engine's worker count (TP x PP x DP): its share of an NCCL group."""

    kind: ClassVar[str] = "world_size"
    what: ClassVar[str] = "world size"
    retry: ClassVar[bool] = True

    def answer(self, results: Sequence[Any]) -> int:
        return int(_first(results))


STAMPING = (FinishPacked, FinishNative, DirectSync, StagedSync, MappedSync)
"""The messages that finish a sync: afterwards the engine serves their `policy_tag`."""

_BY_KIND: dict[str, type[SyncMessage[Any]]] = {
    cls.kind: cls
    for cls in (
        BeginPacked,
        LoadPacked,
        LoadPackedFile,
        FinishPacked,
        AbortPacked,
        BeginNative,
        FinishNative,
        AbortNative,
        ParameterMetadata,
        ParameterFingerprints,
        DirectSync,
        StagedAttach,
        StagedSync,
        MappedAttach,
        MappedSync,
        Receipts,
        PolicyTag,
        DeviceUUIDs,
        WeightsDigest,
        EngineBuild,
        InitTransfer,
        UpdateWeights,
        WorldSize,
    )
}


def decode(payload: Mapping[str, Any]) -> SyncMessage[Any]:
    """The message `encode` made (its layout an enum again); a malformed one raises `WeightUpdateStateError`."""
    if not isinstance(payload, Mapping) or payload.get("kind") not in _BY_KIND:
        kind = payload.get("kind") if isinstance(payload, Mapping) else type(payload).__name__
        raise WeightUpdateStateError(f"not a weight-sync message: {kind!r}")
    cls = _BY_KIND[str(payload["kind"])]
    if cls is LoadPacked:
        return LoadPacked(PackedChunk(payload["buffer"], list(payload.get("entries") or [])))
    values = {f.name: payload[f.name] for f in fields(cls) if f.name in payload}
    if "layout" in values:
        values["layout"] = BracketLayout.parse(values["layout"])
    if "update" in values:
        values["update"] = DirectUpdate.from_json(values["update"])
    try:
        return cls(**values)
    except TypeError as exc:
        raise WeightUpdateStateError(f"weight-sync message {payload['kind']!r}: {exc}") from exc
