"""Fixed-width little-endian bit streams of uint64 codes (the "rank" payload's container), NumPy only.

Code ``j`` of width ``bits`` occupies stream bits ``[j*bits, (j+1)*bits)``; stream bit ``i`` is bit ``i % 8`` of
byte ``i // 8``. The stream is zero-padded to a whole byte.
"""

from __future__ import annotations

import numpy as np

_GROUP = 64  # codes per packing group: 64 codes of `bits` bits are exactly `bits` uint64 words


def pack_bits(values: np.ndarray, bits: int) -> bytearray:
    """Little-endian bit stream of ``values`` (uint64, each < 2**bits), ``bits`` in [1, 63]."""
    count = values.shape[0]
    groups = -(-count // _GROUP)
    padded = np.zeros(groups * _GROUP, dtype=np.uint64)
    padded[:count] = values
    codes = padded.reshape(groups, _GROUP)
    words = np.zeros((groups, bits), dtype=np.uint64)
    # Code p of a group starts at bit p*bits: the same word and shift for every group, so each of the 64
    # positions is one vectorised OR over all groups.
    for p in range(_GROUP):
        word, shift = divmod(p * bits, 64)
        words[:, word] |= codes[:, p] << np.uint64(shift)
        if shift + bits > 64:
            words[:, word + 1] |= codes[:, p] >> np.uint64(64 - shift)
    out = bytearray(-(-count * bits // 8))
    np.frombuffer(out, dtype=np.uint8)[:] = words.astype("<u8", copy=False).view(np.uint8).ravel()[: len(out)]
    return out


def unpack_bits(data: bytes | bytearray | memoryview, count: int, bits: int) -> np.ndarray:
    """Inverse of :func:`pack_bits`: ``count`` uint64 codes."""
    groups = -(-count // _GROUP)
    raw = np.zeros(groups * bits * 8, dtype=np.uint8)
    src = np.frombuffer(data, dtype=np.uint8)[: raw.shape[0]]  # callers may ask for a prefix of the codes
    raw[: src.shape[0]] = src
    words = raw.view("<u8").astype(np.uint64, copy=False).reshape(groups, bits)
    codes = np.empty((groups, _GROUP), dtype=np.uint64)
    mask = np.uint64((1 << bits) - 1)
    for p in range(_GROUP):
        word, shift = divmod(p * bits, 64)
        column = words[:, word] >> np.uint64(shift)
        if shift + bits > 64:
            column |= words[:, word + 1] << np.uint64(64 - shift)
        codes[:, p] = column & mask
    return codes.reshape(-1)[:count]
