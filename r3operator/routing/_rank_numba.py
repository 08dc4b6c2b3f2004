"""numba kernel for the "rank" payload decoder (see ``packing.py``). Imported lazily: numba is optional.

Unranking one row walks the k positions from the largest id down. At position ``m`` (1-based) it needs the
largest ``c`` with ``C(c, m) <= r``. Instead of a search over ``E`` candidates it looks the answer up:

- ``m = 1``: ``c = r``.
- ``m = 2`` when ``C(E, 2) <= DIRECT_TABLE_MAX``: an exact table indexed by ``r``.
- otherwise (and for ``m = 2`` with large E, by a short scan): a table indexed by ``r``'s octave and its next
  ``LUT_MANTISSA_BITS`` bits (an integer "float bucket") gives a lower bound of ``c``, corrected upwards by a
  fixed number of branch-free comparisons with ``C(c + 1, m)`` (1 for E <= 128, 3 for E = 512).
"""

from __future__ import annotations

import numpy as np
from numba import njit
from numba.cpython.unsafe.numbers import leading_zeros

from r3operator.routing.packing import LUT_MANTISSA_BITS

_BUCKETS_PER_OCTAVE = 1 << LUT_MANTISSA_BITS


@njit(nogil=True, cache=True, inline="always")
def _bucket(r):  # pragma: no cover - compiled
    """Table index of ``r | 1``: its octave and the next M bits after the leading one (unsigned, so numba
    emits no negative-index wraparound code)."""
    x = r | np.uint64(1)
    zeros = leading_zeros(x)
    step = (x << zeros) >> np.uint64(63 - LUT_MANTISSA_BITS) & np.uint64(_BUCKETS_PER_OCTAVE - 1)
    return (np.uint64(63) - zeros) * np.uint64(_BUCKETS_PER_OCTAVE) + step


_BLOCK = 256  # rows unranked together: each level's loop over a block has independent iterations


@njit(nogil=True, cache=True)
def decode_into(
    words, bits, num_experts, top_k, binom, lut, direct, offsets, fix_steps, row_begin, row_end, out
):  # pragma: no cover - compiled
    """Unrank codes ``[row_begin, row_end)`` of the bit stream ``words`` into those rows of ``out [rows, k]``
    (sorted ascending). ``nogil``: disjoint row ranges may be decoded by concurrent threads.

    Returns the first row whose code is not a valid rank (nothing is decoded from its block on), or -1.
    Rows are processed in blocks, level by level, so the CPU overlaps the dependent lookups of different
    rows instead of waiting on one row's chain of table loads.
    """
    mask = (np.uint64(1) << np.uint64(bits)) - np.uint64(1)
    combos = binom[top_k - 1, num_experts]
    dense = top_k >= 2
    limit = combos + np.uint64(1) if dense else combos
    rem = np.empty(_BLOCK, dtype=np.uint64)
    is_dense = np.empty(_BLOCK, dtype=np.bool_)
    for begin in range(row_begin, row_end, _BLOCK):
        n = min(_BLOCK, row_end - begin)
        bad = -1
        for i in range(n):
            pos = (begin + i) * bits
            w = pos >> 6
            s = np.uint64(pos & 63)
            # (x << 1) << (63 - s): the high word's share without an undefined shift by 64 when s == 0.
            r = ((words[w] >> s) | ((words[w + 1] << np.uint64(1)) << (np.uint64(63) - s))) & mask
            if r >= limit and bad < 0:
                bad = i
            flag = dense and r == combos
            is_dense[i] = flag
            rem[i] = np.uint64(0) if flag else r
        if bad >= 0:
            return begin + bad
        for m in range(top_k, 1, -1):
            row = binom[m - 1]
            at = offsets[m - 1]
            if at >= 0:  # exact table for this level
                for i in range(n):
                    r = rem[i]
                    c = direct[at + np.int64(r)]
                    out[begin + i, m - 1] = c
                    rem[i] = r - row[c]
                continue
            table = lut[m - 1]
            column = m - 1
            if fix_steps <= 1:  # unswitched by hand: LLVM keeps the test inside the loop otherwise
                for i in range(n):
                    r = rem[i]
                    c = np.uint64(table[_bucket(r)])
                    c += np.uint64(row[c + np.uint64(1)] <= r)  # the one branch-free step E <= 128 needs
                    out[begin + i, column] = c
                    rem[i] = r - row[c]
            else:
                for i in range(n):
                    r = rem[i]
                    c = np.uint64(table[_bucket(r)])
                    while row[c + np.uint64(1)] <= r:
                        c += np.uint64(1)
                    out[begin + i, column] = c
                    rem[i] = r - row[c]
        for i in range(n):
            out[begin + i, 0] = rem[i]
            if is_dense[i]:
                for m in range(top_k):
                    out[begin + i, m] = 0
    return -1


@njit(nogil=True, cache=True)
def encode_sorted_into(planes, num_experts, bits, binom, words):  # pragma: no cover - compiled
    """Rank-encode the sorted k-major ``planes [k, rows]`` into the bit stream ``words`` (zeroed, whole words).

    Returns -1, or the first row that repeats an id without being all zero (then ``words`` is incomplete).
    Ids are already range-checked by the caller.
    """
    top_k, rows = planes.shape
    combos = binom[top_k - 1, num_experts]
    acc = np.uint64(0)
    filled = 0
    w = 0
    for j in range(rows):
        code = np.uint64(0)
        repeated = False
        for m in range(top_k):
            code += binom[m, planes[m, j]]
        for m in range(top_k - 1):
            repeated |= planes[m, j] == planes[m + 1, j]
        if top_k >= 2 and planes[top_k - 1, j] == 0:
            code = combos  # all-zero (dense) row
        elif repeated:
            return j
        acc |= code << np.uint64(filled)
        filled += bits
        if filled >= 64:
            words[w] = acc
            w += 1
            filled -= 64
            # The bits of this code that did not fit; (x >> 1) >> (n - 1) is x >> n without a shift by 64.
            acc = (code >> np.uint64(1)) >> np.uint64(bits - filled - 1) if filled else np.uint64(0)
    if filled:
        words[w] = acc
    return -1
