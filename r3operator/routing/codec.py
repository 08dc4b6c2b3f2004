"""Routed-expert arrays: validation, compact encoding, zero-copy decoding and transport forms.

An array of routed experts has shape ``(tokens, layers, top_k)``. The layer axis is the absolute decoder
layer index (vLLM reports dense layers as all-zero rows), row 0 is absolute token position ``start``.

Everything here is NumPy only; torch is imported lazily inside :func:`to_torch` so that inference-side
processes and the CLI never pay for it.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from r3operator.routing.errors import RoutingDataError

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

try:  # pybase64 is a SIMD base64 codec; optional, ~10x faster than the stdlib for large payloads.
    import pybase64 as _pybase64
except ImportError:  # pragma: no cover - depends on the environment
    _pybase64 = None  # type: ignore[assignment]  # a module or None: callers test for None

ROUTE_DTYPES: tuple[str, ...] = ("uint8", "uint16", "int32")

# Payload bytes are always little-endian, whatever the host, so files and wire payloads are portable.
_WIRE_DTYPES: dict[str, np.dtype] = {name: np.dtype(name).newbyteorder("<") for name in ROUTE_DTYPES}
_INT32_MAX = np.iinfo(np.int32).max
# Above this top_k a sort is cheaper than K*(K-1)/2 pairwise comparisons for the duplicate check.
_PAIRWISE_MAX_TOPK = 32


@dataclass(frozen=True, slots=True)
class RoutedExperts:
    """Compact routed experts: raw C-contiguous little-endian bytes plus shape, dtype and start row."""

    data: bytes | bytearray | memoryview
    shape: tuple[int, int, int]
    dtype: str
    start: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in ROUTE_DTYPES:
            raise RoutingDataError(f"routes dtype {self.dtype!r} is not one of {ROUTE_DTYPES}")
        shape = tuple(self.shape)
        if len(shape) != 3 or not all(isinstance(d, int | np.integer) and d >= 0 for d in shape):
            raise RoutingDataError(f"routes shape {self.shape!r} must be 3 non-negative ints (tokens, layers, top_k)")
        object.__setattr__(self, "shape", tuple(int(d) for d in shape))
        if not isinstance(self.start, int | np.integer) or self.start < 0:
            raise RoutingDataError(f"routes start {self.start!r} must be a non-negative int")
        got = memoryview(self.data).nbytes
        if got != self.nbytes:
            raise RoutingDataError(
                f"routes byte length {got} does not match shape {self.shape} x {self.dtype} = {self.nbytes} bytes"
            )

    @property
    def num_tokens(self) -> int:
        return self.shape[0]

    @property
    def num_layers(self) -> int:
        return self.shape[1]

    @property
    def top_k(self) -> int:
        return self.shape[2]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    @property
    def end(self) -> int:
        """Absolute token position one past the last row."""
        return self.start + self.shape[0]


def narrowest_dtype(max_id: int) -> np.dtype:
    """Smallest routes dtype holding ids up to ``max_id``: uint8 <= 255, uint16 <= 65535, else int32."""
    max_id = int(max_id)
    if max_id < 0:
        raise RoutingDataError(f"max expert id {max_id} is negative")
    if max_id <= 0xFF:
        return np.dtype(np.uint8)
    if max_id <= 0xFFFF:
        return np.dtype(np.uint16)
    if max_id <= _INT32_MAX:
        return np.dtype(np.int32)
    raise RoutingDataError(f"max expert id {max_id} does not fit in int32")


def _duplicate_mask(arr: np.ndarray) -> np.ndarray:
    """Boolean [tokens, layers]: the row holds some expert id twice."""
    top_k = arr.shape[2]
    if top_k <= _PAIRWISE_MAX_TOPK:
        # k-major copy so each comparison below runs over two contiguous planes (~4x faster than strided
        # columns, ~20x faster than sorting tiny rows). The loops run over top_k pairs, never over tokens.
        planes = np.ascontiguousarray(np.moveaxis(arr, 2, 0))
        dup = np.zeros(arr.shape[:2], dtype=bool)
        for i in range(top_k):
            for j in range(i + 1, top_k):
                dup |= planes[i] == planes[j]
        return dup
    ordered = np.sort(arr, axis=-1)
    return (ordered[:, :, 1:] == ordered[:, :, :-1]).any(axis=-1)


def validate_routes(arr: np.ndarray, *, num_experts: int | None) -> None:
    """Raise :class:`RoutingDataError` unless ``arr`` is a well-formed routes array.

    Rules: 3-D, integer (not bool), ids in ``[0, num_experts)`` (only ``>= 0`` when ``num_experts`` is None),
    and no expert id twice within one (token, layer) row. An all-zero row is accepted as "no route": vLLM
    reports dense (non-MoE) layers that way, and it is not a duplicate in any meaningful sense.
    """
    if not isinstance(arr, np.ndarray):
        raise RoutingDataError(f"routes must be a numpy array, got {type(arr).__name__}")
    if arr.ndim != 3:
        raise RoutingDataError(f"routes must be 3-D (tokens, layers, top_k), got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise RoutingDataError(f"routes dtype must be an integer type, got {arr.dtype}")
    if num_experts is not None and num_experts <= 0:
        raise RoutingDataError(f"num_experts must be positive, got {num_experts}")
    if arr.size == 0:
        return
    _check_range(arr, num_experts=num_experts)
    _check_duplicates(arr)


def check_id_range(arr: np.ndarray, *, num_experts: int | None) -> None:
    """Raise :class:`RoutingDataError` naming the first id that is negative or ``>= num_experts``."""
    if arr.size:
        _check_range(arr, num_experts=num_experts)


def _check_range(arr: np.ndarray, *, num_experts: int | None) -> None:
    if arr.dtype.kind == "i":
        low = int(arr.min())
        if low < 0:
            where = tuple(int(i) for i in np.argwhere(arr < 0)[0])
            raise RoutingDataError(f"negative expert id {low} at (token, layer, k)={where}")
    if num_experts is not None:
        high = int(arr.max())
        if high >= num_experts:
            where = tuple(int(i) for i in np.argwhere(arr >= num_experts)[0])
            raise RoutingDataError(
                f"expert id {int(arr[where])} at (token, layer, k)={where} is out of range "
                f"for num_experts={num_experts}"
            )


def _check_duplicates(arr: np.ndarray) -> None:
    if arr.shape[2] > 1:
        suspects = np.argwhere(_duplicate_mask(arr))
        if len(suspects):
            # All-zero rows are "no route" (dense layer / uncaptured), not duplicates. Only the flagged rows
            # are inspected, so the common case pays nothing for this exception.
            real = arr[suspects[:, 0], suspects[:, 1]].any(axis=-1)
            if real.any():
                token, layer = (int(i) for i in suspects[int(np.argmax(real))])
                ids = arr[token, layer].tolist()
                raise RoutingDataError(f"duplicate expert id in row (token={token}, layer={layer}): {ids}")


def encode(arr: np.ndarray, *, start: int = 0, num_experts: int | None = None) -> RoutedExperts:
    """Validate ``arr`` and pack it in the narrowest dtype as C-contiguous little-endian bytes."""
    arr = np.asarray(arr)
    # Structure checks (ndim, dtype, num_experts) on an empty slice; range and duplicates below.
    validate_routes(arr[:0] if arr.ndim == 3 else arr, num_experts=num_experts)
    if arr.size:
        _check_range(arr, num_experts=num_experts)
    max_id = int(arr.max()) if arr.size else 0
    if num_experts is not None:
        # Narrow by the model's id range, not the sample's max, so every sample of a model shares one dtype
        # and stitching / batching rarely has to upcast.
        max_id = max(max_id, num_experts - 1)
    name = narrowest_dtype(max_id).name
    # One copy, straight into the bytearray that becomes the payload; the range check above makes the
    # narrowing cast exact.
    data = bytearray(arr.size * _WIRE_DTYPES[name].itemsize)
    packed = np.frombuffer(data, dtype=_WIRE_DTYPES[name]).reshape(arr.shape)
    np.copyto(packed, arr, casting="unsafe")
    if packed.size:
        _check_duplicates(packed)  # on the narrowed copy: fewer bytes to compare than the caller's int32/int64
    return RoutedExperts(data=data, shape=arr.shape, dtype=name, start=int(start))


def decode(routes: RoutedExperts, *, num_experts: int | None = None, validate: bool = True) -> np.ndarray:
    """A writable array view of ``routes``.

    Zero-copy when ``routes.data`` is writable (bytearray / writable memoryview); read-only ``bytes`` are
    copied once so the result is never backed by immutable memory.
    """
    wire = _WIRE_DTYPES.get(routes.dtype)
    if wire is None:
        raise RoutingDataError(f"routes dtype {routes.dtype!r} is not one of {ROUTE_DTYPES}")
    view = memoryview(routes.data)
    if view.nbytes != routes.nbytes:
        raise RoutingDataError(
            f"routes byte length {view.nbytes} does not match shape {routes.shape} x {routes.dtype} = {routes.nbytes}"
        )
    if view.readonly:
        view = memoryview(bytearray(view))
    arr = np.frombuffer(view.cast("B") if view.format != "B" or view.ndim != 1 else view, dtype=wire)
    arr = arr.reshape(routes.shape)
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    if validate:
        validate_routes(arr, num_experts=num_experts)
    return arr


def to_torch(routes: RoutedExperts, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A CPU tensor backed by writable memory (never ``torch.frombuffer`` on immutable bytes).

    Keeps the compact dtype unless ``dtype`` is given; expand to int64 per layer at the gather site.
    """
    import torch  # lazy: the data plane must not import torch at module import time

    tensor = torch.from_numpy(decode(routes, validate=False))
    if dtype is not None and dtype != tensor.dtype:
        tensor = tensor.to(dtype)
    return tensor


def _b64decode_to_bytearray(text: str | bytes, *, what: str) -> bytearray:
    try:
        if _pybase64 is not None:
            return _pybase64.b64decode_as_bytearray(text, validate=True)
        return bytearray(base64.b64decode(text, validate=True))
    except (binascii.Error, ValueError, TypeError) as exc:
        raise RoutingDataError(f"{what}: invalid base64 ({exc})") from exc


def _b64encode(data: bytes | bytearray | memoryview) -> str:
    if _pybase64 is not None:
        return _pybase64.b64encode_as_string(data)
    return base64.b64encode(data).decode("ascii")


def from_vllm(value: np.ndarray | str | bytes, *, start: int = 0, num_experts: int | None = None) -> RoutedExperts:
    """Accept vLLM's ``CompletionOutput.routed_experts`` array or the OpenAI field (base64 ``np.save`` bytes).

    ``start`` is the ``routed_experts_prompt_start`` the request was sent with.
    """
    if value is None:
        raise RoutingDataError(
            "routed_experts is None: the server has routed-expert capture off or the request aborted"
        )
    if isinstance(value, str | bytes | bytearray):
        raw = _b64decode_to_bytearray(value, what="routed_experts field")
        try:
            arr = np.load(io.BytesIO(raw), allow_pickle=False)
        except (ValueError, OSError, EOFError) as exc:
            raise RoutingDataError(f"routed_experts field is not base64 of a .npy array ({exc})") from exc
    elif hasattr(value, "detach"):  # a torch tensor: duck-typed so torch stays optional
        arr = value.detach().cpu().numpy()
    else:
        arr = np.asarray(value)
    return encode(arr, start=start, num_experts=num_experts)


def to_wire(routes: RoutedExperts) -> dict[str, Any]:
    """Compact JSON-able form: ``{"data": base64(payload), "shape": [T, L, K], "dtype": str, "start": int}``."""
    return {"data": _b64encode(routes.data), "shape": list(routes.shape), "dtype": routes.dtype, "start": routes.start}


def from_wire(d: Mapping[str, Any]) -> RoutedExperts:
    """Inverse of :func:`to_wire`; payload in a bytearray so :func:`decode` is zero-copy and writable."""
    if not isinstance(d, Mapping):
        raise RoutingDataError(f"wire routes must be a mapping, got {type(d).__name__}")
    missing = [key for key in ("data", "shape", "dtype") if key not in d]
    if missing:
        raise RoutingDataError(f"wire routes missing field(s) {missing}")
    shape = d["shape"]
    if not isinstance(shape, list | tuple) or len(shape) != 3 or not all(isinstance(x, int) for x in shape):
        raise RoutingDataError(f"wire routes shape {shape!r} must be a list of 3 ints")
    if not isinstance(d["data"], str | bytes):
        raise RoutingDataError(f"wire routes data must be a base64 string, got {type(d['data']).__name__}")
    if d.get("encoding", "raw") != "raw":
        raise RoutingDataError(f"wire routes encoding {d['encoding']!r} is not supported (raw payloads only)")
    data = _b64decode_to_bytearray(d["data"], what="wire routes data")
    return RoutedExperts(data=data, shape=tuple(shape), dtype=d["dtype"], start=d.get("start", 0))
