"""The "rank" payload encoding: each (token, layer) row as its combinatorial-number-system rank, bit-packed.

The top-k expert ids of one row are a *set* (distinct; their order does not matter for replay, since HF and
Megatron both accumulate per expert), so a row carries only ``log2 C(E, k)`` bits of information: 40.4 bits
for E=128, k=8, against 64 bits raw uint8 and ~85 bits in vLLM's base64-``np.save`` field.

Encoding of one row (sorted ids ``c_0 < c_1 < ... < c_{k-1}``)::

    rank = C(c_0, 1) + C(c_1, 2) + ... + C(c_{k-1}, k)          in [0, C(E, k))

An all-zero row (vLLM's dense layers, or an uncaptured row) gets the reserved code ``C(E, k)`` when k >= 2;
for k = 1 the row ``[0]`` is an ordinary set with rank 0. Every code is stored in
``bits = bit_length(C(E, k))`` bits (k >= 2) or ``bit_length(E - 1)`` bits (k = 1), so the reserved code
costs an extra bit only when C(E, k) is a power of two, which for 2 <= k <= E - 2 never happens.

Codes are concatenated into a little-endian bit stream (code ``j`` occupies stream bits ``[j*bits,
(j+1)*bits)``; stream bit ``i`` is bit ``i % 8`` of byte ``i // 8``), zero-padded to a whole byte. Ranks are
exact uint64 arithmetic, so C(E, k) must be below 2**63; larger (E, k) raise
:class:`RankEncodingUnsupported` and callers fall back to the raw encoding.

Decoding returns the **sorted** rows (writable, in the routes dtype). Two decoders give identical results:
a numba kernel (``_rank_numba``, imported lazily: the operator image does not ship numba) and a vectorised
NumPy fallback (the same lookup tables, one vectorised pass per k position). Neither loops over tokens
in Python.
"""

from __future__ import annotations

import functools
import math
import sys
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Literal

import numpy as np

from r3operator.routing.bitstream import pack_bits, unpack_bits
from r3operator.routing.errors import RoutingDataError

__all__ = [  # pack_bits / unpack_bits are re-exported from bitstream
    "RankEncodingUnsupported",
    "binomial_table",
    "decode_ranks",
    "decode_ranks_numpy",
    "encode_ranks",
    "numba_available",
    "pack_bits",
    "rank_bits",
    "rank_payload_nbytes",
    "rank_supported",
    "unpack_bits",
    "unrank_tables",
]

Backend = Literal["auto", "numba", "numpy"]
_MAX_CODE = 2**63 - 1  # ranks and the reserved code are exact in int64/uint64 arithmetic
_U64_MAX = np.iinfo(np.uint64).max
LUT_MANTISSA_BITS = 6  # float-bucket lookup resolution of the numba unranker (2**6 buckets per octave)
BUCKETS_PER_OCTAVE = 1 << LUT_MANTISSA_BITS
DIRECT_TABLE_MAX = 1 << 20  # levels whose C(E, m) is at most this are unranked by one exact table lookup


class RankEncodingUnsupported(RoutingDataError):
    """The (num_experts, top_k) combination cannot be rank-encoded (C(E, k) >= 2**63, or k > E)."""


def rank_bits(num_experts: int, top_k: int) -> int:
    """Bits per stored code for ``(num_experts, top_k)``; raises :class:`RankEncodingUnsupported`."""
    if not isinstance(num_experts, int) or num_experts <= 0:
        raise RoutingDataError(f"rank encoding needs a positive num_experts, got {num_experts!r}")
    if top_k < 0 or top_k > num_experts:
        raise RankEncodingUnsupported(
            f"rank encoding needs 0 <= top_k <= num_experts, got top_k={top_k}, num_experts={num_experts}"
        )
    if top_k == 0:
        return 0
    combos = math.comb(num_experts, top_k)
    if combos > _MAX_CODE - 1:
        raise RankEncodingUnsupported(
            f"rank encoding needs C(num_experts, top_k) < 2**63, but C({num_experts}, {top_k}) ~ "
            f"2**{math.log2(combos):.1f}; use the raw encoding"
        )
    return combos.bit_length() if top_k >= 2 else (num_experts - 1).bit_length()


def rank_supported(num_experts: int, top_k: int) -> bool:
    try:
        rank_bits(num_experts, top_k)
    except RankEncodingUnsupported:
        return False
    return True


def rank_payload_nbytes(shape: tuple[int, int, int], num_experts: int) -> int:
    return -(-shape[0] * shape[1] * rank_bits(num_experts, shape[2]) // 8)


@functools.lru_cache(maxsize=64)
def binomial_table(num_experts: int, top_k: int) -> np.ndarray:
    """uint64 ``[top_k, E + 1]``: row ``m - 1`` holds C(c, m) for c in [0, E], saturated at 2**64 - 1.

    Saturated entries are never reached by a valid rank (they exceed C(E, k)), and saturation keeps every row
    non-decreasing, which ``searchsorted`` relies on.
    """
    table = np.empty((top_k, num_experts + 1), dtype=np.uint64)
    for m in range(1, top_k + 1):
        table[m - 1] = [min(math.comb(c, m), int(_U64_MAX)) for c in range(num_experts + 1)]
    table.flags.writeable = False
    return table


@functools.lru_cache(maxsize=16)
def unrank_tables(num_experts: int, top_k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """``(binom, lut, direct, direct_offsets, fix_steps)`` for the kernel.

    - ``binom [k, E+1] uint64``: ``C(c, m)`` (see ``packing.binomial_table``).
    - ``lut [k, 64 * 2**M]``: ``lut[m - 1, bucket]`` is the largest c with ``C(c, m) <=`` the smallest r of the
      bucket, a lower bound of the answer for every r in it.
    - ``direct``: the exact answers for every r of each level m with ``C(E, m) <= DIRECT_TABLE_MAX``,
      concatenated; ``direct_offsets[m - 1]`` is where level m starts, or -1 when it has no table.
    - ``fix_steps``: the most upward corrections any reachable bucket needs (1 for E <= 128).
    """
    binom = binomial_table(num_experts, top_k)
    index_dtype = np.uint8 if num_experts <= 0xFF else (np.uint16 if num_experts <= 0xFFFF else np.int32)
    buckets = 64 * BUCKETS_PER_OCTAVE
    lows = [_bucket_low(b) for b in range(buckets)] + [1 << 64]
    # The kernel looks up r | 1 (no branch for r = 0), so an even r = x - 1 shares x's bucket: one below
    # each bucket's smallest integer is the smallest r that lands in it.
    cap = int(_U64_MAX)
    lows_u64 = np.array([min(v - 1, cap) for v in lows[:-1]], dtype=np.uint64)
    highs_u64 = np.array([min(v - 1, cap) for v in lows[1:]], dtype=np.uint64)
    lut = np.empty((top_k, buckets), dtype=index_dtype)
    offsets = np.full(top_k, -1, dtype=np.int64)
    direct_parts: list[np.ndarray] = []
    fix_steps, filled = 0, 0
    for m in range(top_k):
        lut[m] = np.minimum(np.searchsorted(binom[m], lows_u64, side="right") - 1, num_experts - 1)
        limit = int(binom[m, num_experts])  # every remainder at level m + 1 is below C(E, m + 1)
        if m >= 1 and limit <= DIRECT_TABLE_MAX:
            offsets[m] = filled
            direct_parts.append(np.searchsorted(binom[m], np.arange(limit, dtype=np.uint64), "right") - 1)
            filled += limit
        elif m >= 1:
            reachable = lows_u64 < binom[m, num_experts]
            highs = np.minimum(highs_u64, binom[m, num_experts] - np.uint64(1))
            worst = (np.searchsorted(binom[m], highs, side="right") - 1 - lut[m].astype(np.int64))[reachable]
            fix_steps = max(fix_steps, int(worst.max(initial=0)))
    direct = np.concatenate(direct_parts).astype(index_dtype) if direct_parts else np.zeros(1, dtype=index_dtype)
    return binom, lut, direct, offsets, fix_steps


def _bucket_low(bucket: int) -> int:
    """Smallest integer whose octave and next M bits select ``bucket``."""
    octave, step = divmod(bucket, BUCKETS_PER_OCTAVE)
    top = BUCKETS_PER_OCTAVE + step
    if octave >= LUT_MANTISSA_BITS:
        return top << (octave - LUT_MANTISSA_BITS)
    return -(-(top << octave) >> LUT_MANTISSA_BITS)


def _sorting_network(n: int) -> list[tuple[int, int]]:
    """Batcher's merge-exchange comparators (Knuth 5.2.2 M) for ``n`` items, O(n log^2 n)."""
    if n < 2:
        return []
    t = (n - 1).bit_length()
    pairs: list[tuple[int, int]] = []
    p = 1 << (t - 1)
    while p > 0:
        q, r, d = 1 << (t - 1), 0, p
        while True:
            pairs.extend((i, i + d) for i in range(n - d) if i & p == r)
            if q == p:
                break
            d, q, r = q - p, q >> 1, p
        p >>= 1
    return pairs


def _id_dtype(num_experts: int) -> np.dtype:
    """The narrowest routes dtype holding ids up to ``num_experts - 1``."""
    return np.dtype(np.uint8 if num_experts <= 0x100 else (np.uint16 if num_experts <= 0x10000 else np.int32))


def _sorted_planes(arr: np.ndarray, num_experts: int) -> np.ndarray:
    """k-major ``[k, rows]`` copy of ``arr`` (ids already range-checked) in the narrowest dtype holding
    ``num_experts - 1``, with every row sorted ascending: a sorting network on planes, vectorised over rows
    and ~20x faster than ``np.sort`` along a tiny last axis. The narrow dtype keeps the kernels' compiled
    variants to three."""
    planes = np.ascontiguousarray(arr.reshape(-1, arr.shape[-1]).T, dtype=_id_dtype(num_experts))
    for i, j in _sorting_network(planes.shape[0]):
        low = np.minimum(planes[i], planes[j])
        np.maximum(planes[i], planes[j], out=planes[j])
        planes[i] = low
    return planes


def encode_ranks(arr: np.ndarray, *, num_experts: int, backend: Backend = "auto") -> bytearray:
    """Rank-encode a routes array ``[T, L, K]`` into the packed little-endian bit stream.

    Rows are sorted with a sorting network on k-major planes (NumPy); ranks are summed and packed by the
    numba kernel when available (``backend="auto"``), else by NumPy. Both give identical bytes.

    Checks ids in ``[0, num_experts)`` and distinct per row (all-zero rows allowed), so a malformed array can
    never produce a payload that decodes to something else.
    """
    arr = np.asarray(arr)
    if arr.ndim != 3 or arr.dtype.kind not in "iu":
        raise RoutingDataError(f"routes must be a 3-D integer array, got {arr.dtype} shape {arr.shape}")
    rows, top_k = arr.shape[0] * arr.shape[1], arr.shape[2]
    bits = rank_bits(num_experts, top_k)
    if rows == 0 or bits == 0:
        return bytearray(-(-rows * bits // 8))
    if (arr.dtype.kind == "i" and int(arr.min()) < 0) or int(arr.max()) >= num_experts:
        raise RoutingDataError(f"expert ids must lie in [0, {num_experts}) for rank encoding")
    planes = _sorted_planes(arr, num_experts)
    kernel = _kernel_for(backend)
    if kernel is not None:
        words = np.zeros(-(-rows * bits // 64), dtype=np.uint64)
        bad_row = int(kernel.encode_sorted_into(planes, num_experts, bits, binomial_table(num_experts, top_k), words))
        if bad_row >= 0:
            raise _duplicate_error(arr, bad_row)
        if sys.byteorder == "big":  # pragma: no cover - the stream is little-endian
            words.byteswap(inplace=True)
        return bytearray(words.view(np.uint8)[: -(-rows * bits // 8)])
    dense = planes[-1] == 0  # sorted ascending: the last id is 0 only when the whole row is zero
    if top_k >= 2:
        dup = (planes[1:] == planes[:-1]).any(axis=0) & ~dense
        if dup.any():
            raise _duplicate_error(arr, int(np.argmax(dup)))
    table = binomial_table(num_experts, top_k)
    ranks = np.zeros(rows, dtype=np.uint64)
    for m in range(top_k):  # loops over k positions, never over tokens
        ranks += table[m][planes[m]]
    if top_k >= 2:
        ranks[dense] = math.comb(num_experts, top_k)
    return pack_bits(ranks, bits)


def _duplicate_error(arr: np.ndarray, row: int) -> RoutingDataError:
    token, layer = divmod(row, arr.shape[1])
    return RoutingDataError(f"duplicate expert id in row (token={token}, layer={layer}): {arr[token, layer].tolist()}")


def _check_payload(data: bytes | bytearray | memoryview, shape: tuple[int, int, int], num_experts: int) -> int:
    expected = rank_payload_nbytes(shape, num_experts)
    got = memoryview(data).nbytes
    if got != expected:
        raise RoutingDataError(
            f"rank payload is {got} bytes, expected {expected} for shape {shape} and num_experts={num_experts}"
        )
    return rank_bits(num_experts, shape[2])


def _bad_rank_error(row: int, code: int, shape: tuple[int, int, int], num_experts: int) -> RoutingDataError:
    token, layer = divmod(row, shape[1])
    limit = math.comb(num_experts, shape[2]) + (1 if shape[2] >= 2 else 0)
    return RoutingDataError(
        f"corrupt rank payload: code {code} at row (token={token}, layer={layer}) is not "
        f"below {limit} (C({num_experts}, {shape[2]}) plus the dense-row code)"
    )


def decode_ranks_numpy(
    data: bytes | bytearray | memoryview, shape: tuple[int, int, int], dtype: str, *, num_experts: int
) -> np.ndarray:
    """Vectorised NumPy decoder (no numba): per k position, one bucket-table lookup plus fixed corrections
    over all rows (the numba kernel's tables), or a ``searchsorted`` where buckets are coarse."""
    bits = _check_payload(data, shape, num_experts)
    rows, top_k = shape[0] * shape[1], shape[2]
    out = np.zeros((rows, top_k), dtype=np.dtype(dtype))
    if rows == 0 or top_k == 0 or bits == 0:
        return out.reshape(shape)
    ranks = unpack_bits(data, rows, bits)
    combos = math.comb(num_experts, top_k)
    limit = combos + 1 if top_k >= 2 else combos
    bad = ranks >= np.uint64(limit)
    if bad.any():
        row = int(np.argmax(bad))
        raise _bad_rank_error(row, int(ranks[row]), shape, num_experts)
    live = ranks != np.uint64(combos) if top_k >= 2 else np.ones(rows, dtype=bool)
    remaining = ranks[live]
    binom, lut, direct, offsets, fix_steps = unrank_tables(num_experts, top_k)
    picked = np.empty((top_k, remaining.shape[0]), dtype=np.intp)
    for m in range(top_k, 1, -1):  # the largest id first; loops over k positions only
        picked[m - 1] = c = _largest_c(remaining, m, binom, lut, direct, int(offsets[m - 1]), fix_steps)
        remaining -= binom[m - 1][c]
    picked[0] = remaining
    out[live] = picked.T
    return out.reshape(shape)


_EXACT_FLOAT = np.uint64(1 << 53)


def _largest_c(
    r: np.ndarray, m: int, binom: np.ndarray, lut: np.ndarray, direct: np.ndarray, at: int, fix_steps: int
) -> np.ndarray:
    """Vectorised: the largest c with C(c, m) <= r, for every r (same tables as the numba kernel)."""
    row = binom[m - 1]
    if at >= 0:
        return direct[at + r.astype(np.intp)].astype(np.intp)
    if fix_steps > 4:  # coarse buckets (very large E): a binary search per value is cheaper
        return np.searchsorted(row, r, side="right") - 1
    # Bucket of r | 1 = its octave and next M bits, read off an exact float64 conversion: values >= 2**53
    # are shifted right by 11 first (still exact, same leading bits), and 11 octaves added back.
    x = r | np.uint64(1)
    big = x >= _EXACT_FLOAT
    exact = np.where(big, x >> np.uint64(11), x).astype(np.float64).view(np.uint64)
    bucket = (exact >> np.uint64(52 - LUT_MANTISSA_BITS)).astype(np.intp) - (1023 << LUT_MANTISSA_BITS)
    bucket += big * (11 << LUT_MANTISSA_BITS)
    c = lut[m - 1][bucket].astype(np.intp)
    for _ in range(fix_steps):
        c += row[c + 1] <= r
    return c


@functools.lru_cache(maxsize=1)
def _numba_kernel() -> ModuleType | None:
    try:  # lazy: numba is optional (the operator image does not ship it)
        from r3operator.routing import _rank_numba
    except ImportError:
        return None
    return _rank_numba


def _kernel_for(backend: Backend) -> ModuleType | None:
    """The numba kernels for ``backend`` ("auto": when importable), or None for the NumPy path."""
    if backend not in ("auto", "numba", "numpy"):
        raise ValueError(f"backend must be 'auto', 'numba' or 'numpy', got {backend!r}")
    kernel = None if backend == "numpy" else _numba_kernel()
    if kernel is None and backend == "numba":
        raise RoutingDataError("backend='numba' requested but numba (or its intrinsics) cannot be imported")
    return kernel


def numba_available() -> bool:
    return _numba_kernel() is not None


def decode_ranks(
    data: bytes | bytearray | memoryview,
    shape: tuple[int, int, int],
    dtype: str,
    *,
    num_experts: int,
    backend: Backend = "auto",
    threads: int = 1,
) -> np.ndarray:
    """Decode a rank payload into a writable ``[T, L, K]`` array of ``dtype`` with every row sorted.

    ``backend="auto"`` uses the numba kernel when numba is importable, else the NumPy fallback. A code that
    is not a valid rank (bit rot that slipped past the checksum, or a forged payload) raises
    :class:`RoutingDataError` naming the (token, layer) row. ``threads > 1`` splits the rows over that many
    threads (numba kernel only; it releases the GIL).
    """
    kernel = _kernel_for(backend)
    target = np.dtype(dtype)
    if target.kind not in "iu":
        raise RoutingDataError(f"routes dtype must be an integer type, got {dtype!r}")
    # Decode into a dtype that holds every id < num_experts, so a forged payload cannot wrap around silently.
    work = max(target, _id_dtype(num_experts), key=lambda d: d.itemsize)
    if kernel is None:
        out = decode_ranks_numpy(data, shape, work.name, num_experts=num_experts)
    else:
        out = _decode_ranks_numba(kernel, data, shape, work.name, num_experts=num_experts, threads=threads)
    if work == target:
        return out
    over = (out > np.iinfo(target).max).any(axis=-1)
    if over.any():
        token, layer = (int(i) for i in np.argwhere(over)[0])
        raise RoutingDataError(
            f"rank payload decodes to expert ids {out[token, layer].tolist()} at row (token={token}, "
            f"layer={layer}), which do not fit dtype {dtype}"
        )
    return out.astype(target)


def _decode_ranks_numba(
    kernel: ModuleType,
    data: bytes | bytearray | memoryview,
    shape: tuple[int, int, int],
    dtype: str,
    *,
    num_experts: int,
    threads: int,
) -> np.ndarray:
    bits = _check_payload(data, shape, num_experts)
    rows, top_k = shape[0] * shape[1], shape[2]
    if rows == 0 or top_k == 0 or bits == 0:
        return np.zeros(shape, dtype=np.dtype(dtype))
    out = np.empty((rows, top_k), dtype=np.dtype(dtype))  # the kernel writes every element
    # One copy into whole uint64 words plus a zero guard word, so the kernel reads two aligned words per code.
    words = np.zeros(-(-rows * bits // 64) + 1, dtype=np.uint64)
    words.view(np.uint8)[: memoryview(data).nbytes] = np.frombuffer(data, dtype=np.uint8)
    if sys.byteorder == "big":  # pragma: no cover - the stream is little-endian
        words.byteswap(inplace=True)
    tables = unrank_tables(num_experts, top_k)
    bounds = np.linspace(0, rows, max(1, min(int(threads), rows)) + 1).astype(np.int64)

    def run(part: int) -> int:
        return int(kernel.decode_into(words, bits, num_experts, top_k, *tables, bounds[part], bounds[part + 1], out))

    if len(bounds) == 2:
        bad_rows = [run(0)]
    else:  # the kernel releases the GIL, so disjoint row ranges decode in parallel
        with ThreadPoolExecutor(max_workers=len(bounds) - 1) as pool:
            bad_rows = list(pool.map(run, range(len(bounds) - 1)))
    bad_row = min((row for row in bad_rows if row >= 0), default=-1)
    if bad_row >= 0:
        code = int(unpack_bits(data, bad_row + 1, bits)[bad_row])
        raise _bad_rank_error(bad_row, code, shape, num_experts)
    return out.reshape(shape)
