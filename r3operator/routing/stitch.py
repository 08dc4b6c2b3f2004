"""Stitching per-turn / per-chunk routes into one dense per-trajectory array, and padding for replay.

Off-by-one rule (vLLM, SGLang): a request with P prompt tokens and G generated tokens returns routes for
absolute positions ``[start, P + G - 1)``; the last sampled token was never fed back, so it has no route
until the next turn prefills it (the "boundary row").
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from r3operator.routing.codec import RoutedExperts, decode, encode
from r3operator.routing.errors import RoutingDataError


def check_row_count(routes: RoutedExperts, *, prompt_len: int, generated_len: int) -> None:
    """Raise unless ``routes`` has exactly ``prompt_len + generated_len - 1 - start`` rows."""
    expected = max(prompt_len + generated_len - 1 - routes.start, 0)
    if routes.num_tokens != expected:
        raise RoutingDataError(
            f"routes have {routes.num_tokens} rows, expected prompt {prompt_len} + generated {generated_len} "
            f"- 1 - start {routes.start} = {expected}"
        )


class TrajectoryRoutes:
    """Dense routes of one trajectory indexed by absolute token position (multi-turn and partial rollouts).

    ``captured_len`` is the route prefix length: rows ``[0, captured_len)`` hold routes, everything after
    (the last sampled token, trailing observations) has none. When a turn cannot be stitched exactly the
    trajectory is marked invalid (``valid=False`` with ``invalid_reason``) rather than carrying wrong routes;
    the trainer then falls back to native routing for that sample.
    """

    def __init__(self, *, num_layers: int, top_k: int) -> None:
        if num_layers <= 0 or top_k <= 0:
            raise RoutingDataError(f"num_layers and top_k must be positive, got {num_layers}, {top_k}")
        self.num_layers = num_layers
        self.top_k = top_k
        self.tokens: list[int] = []
        self.captured_len = 0
        self.valid = True
        self.invalid_reason: str | None = None
        self._rows = np.zeros((0, num_layers, top_k), dtype=np.uint8)

    def _invalidate(self, reason: str) -> None:
        if self.valid:
            self.valid = False
            self.invalid_reason = reason

    def _chunk(self, routes: RoutedExperts | None) -> np.ndarray | None:
        if routes is None:
            self._invalidate("a turn returned no routed experts")
            return None
        if (routes.num_layers, routes.top_k) != (self.num_layers, self.top_k):
            raise RoutingDataError(
                f"routes have (layers, top_k)=({routes.num_layers}, {routes.top_k}), "
                f"trajectory expects ({self.num_layers}, {self.top_k})"
            )
        return decode(routes, validate=False)

    def _write(self, begin: int, chunk: np.ndarray) -> None:
        """Write ``chunk`` at absolute rows ``[begin, begin + len(chunk))``; upcast first: no id wraps."""
        end = begin + len(chunk)
        common = np.promote_types(self._rows.dtype, chunk.dtype)
        if end > len(self._rows) or common != self._rows.dtype:
            capacity = max(end, 2 * len(self._rows)) if end > len(self._rows) else len(self._rows)
            grown = np.zeros((capacity, self.num_layers, self.top_k), dtype=common)
            grown[: self.captured_len] = self._rows[: self.captured_len]
            self._rows = grown
        self._rows[begin:end] = chunk  # same or wider dtype on the left: exact

    def _fits(self, routes: RoutedExperts, *, prompt_len: int, generated_len: int) -> bool:
        """Row count matches the turn and the chunk starts inside the captured rows; else invalidate."""
        try:
            check_row_count(routes, prompt_len=prompt_len, generated_len=generated_len)
        except RoutingDataError as exc:
            # Never treat a short array as "truncated routes": the rows could be shifted (reference §8.1).
            self._invalidate(str(exc))
            return False
        if routes.start > self.captured_len:
            self._invalidate(f"routes start at row {routes.start} but only {self.captured_len} rows are captured (gap)")
            return False
        return True

    def add_turn(
        self, *, prompt_ids: Sequence[int], generated_ids: Sequence[int], routes: RoutedExperts | None
    ) -> None:
        """Add one turn whose prompt is the whole history so far plus new observation tokens.

        Writes rows ``[routes.start, P + G - 1)``: this overwrites the previously missing boundary row (the
        last token of the previous turn, prefilled now) and keeps the stored rows before ``start``.
        """
        prompt_ids, generated_ids = list(prompt_ids), list(generated_ids)
        history = len(self.tokens)
        if prompt_ids[:history] != self.tokens:
            diverge = next(
                (i for i, (a, b) in enumerate(zip(prompt_ids, self.tokens, strict=False)) if a != b),
                min(len(prompt_ids), history),
            )
            self._invalidate(
                f"prompt is not a token-exact extension of the trajectory (diverges at position {diverge}); "
                "re-tokenized history cannot be replayed"
            )
        self.tokens = prompt_ids + generated_ids
        chunk = self._chunk(routes)
        if not self.valid or chunk is None or routes is None:
            return
        if not self._fits(routes, prompt_len=len(prompt_ids), generated_len=len(generated_ids)):
            return
        self._write(routes.start, chunk)
        self.captured_len = routes.end

    def add_partial(self, *, generated_ids: Sequence[int], routes: RoutedExperts | None) -> None:
        """Resume a partial rollout: the engine re-ran the whole trajectory as prompt and generated more.

        Keeps the stored rows (routed under the weights that produced them, verl #6046) and appends only the
        new tail rows ``[captured_len, P + G - 1)``. Never concatenates whole-sequence arrays (verl #6029).
        """
        generated_ids = list(generated_ids)
        prompt_len = len(self.tokens)
        self.tokens = [*self.tokens, *generated_ids]
        chunk = self._chunk(routes)
        if not self.valid or chunk is None or routes is None:
            return
        if not self._fits(routes, prompt_len=prompt_len, generated_len=len(generated_ids)):
            return
        tail_from = self.captured_len - routes.start  # first chunk row that is new to the trajectory
        self._write(self.captured_len, chunk[tail_from:])
        self.captured_len = routes.end

    def array(self) -> np.ndarray:
        """Copy of the captured rows ``[captured_len, layers, top_k]``; raises when invalid."""
        if not self.valid:
            raise RoutingDataError(f"trajectory routes are invalid: {self.invalid_reason}")
        return self._rows[: self.captured_len].copy()

    def routes(self, *, num_experts: int | None = None) -> RoutedExperts:
        """The captured rows as compact :class:`RoutedExperts` starting at position 0."""
        return encode(self.array(), num_experts=num_experts)


def _dummy_row(num_layers: int, top_k: int, dtype: np.dtype) -> np.ndarray:
    # Distinct ids 0..top_k-1: Megatron's dropless dispatcher assumes tokens * top_k assignments, and
    # duplicate ids (all-zero rows) collapse in its routing map.
    return np.broadcast_to(np.arange(top_k, dtype=dtype), (num_layers, top_k))


def pad_for_replay(
    routes: np.ndarray, *, seq_len: int, left_pad: int = 0, top_k: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Place captured rows at ``[left_pad, left_pad + rows)`` of a ``seq_len`` sequence.

    Returns ``(indices [seq_len, L, K] in the routes' dtype, padding_mask bool [seq_len])``; mask ``True``
    means "no captured route" (left pad, the final sampled token, trailing pad) and those rows hold the
    distinct dummy experts ``arange(top_k)``.
    """
    if routes.ndim != 3:
        raise RoutingDataError(f"routes must be 3-D (tokens, layers, top_k), got shape {routes.shape}")
    rows, num_layers, k = routes.shape
    if top_k is not None and top_k != k:
        raise RoutingDataError(f"top_k={top_k} does not match routes top_k {k}")
    if left_pad < 0 or left_pad + rows > seq_len:
        raise RoutingDataError(f"{rows} route rows at left_pad {left_pad} do not fit in seq_len {seq_len}")
    indices = np.empty((seq_len, num_layers, k), dtype=routes.dtype)
    indices[:] = _dummy_row(num_layers, k, routes.dtype)
    indices[left_pad : left_pad + rows] = routes
    mask = np.ones(seq_len, dtype=bool)
    mask[left_pad : left_pad + rows] = False
    return indices, mask


def stack_for_replay(
    samples: Sequence[np.ndarray],
    *,
    seq_lens: Sequence[int],
    max_len: int | None = None,
    left_padded: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Batch version of :func:`pad_for_replay`: ``([B, S, L, K] in the widest dtype, mask [B, S])``.

    ``seq_lens[i]`` is sample i's real token count (prompt + response); ``S = max_len or max(seq_lens)``.
    With ``left_padded`` (the default, matching left-padded ``sequences``) sample i starts at
    ``S - seq_lens[i]``; otherwise at 0.
    """
    if not samples:
        raise RoutingDataError("stack_for_replay needs at least one sample")
    if len(seq_lens) != len(samples):
        raise RoutingDataError(f"{len(samples)} samples but {len(seq_lens)} seq_lens")
    shapes = {s.shape[1:] for s in samples}
    if len(shapes) != 1 or any(s.ndim != 3 for s in samples):
        raise RoutingDataError(f"samples must share (layers, top_k); got {sorted(shapes)}")
    width = max(seq_lens) if max_len is None else max_len
    if width < max(seq_lens):
        raise RoutingDataError(f"max_len {width} is shorter than the longest sample ({max(seq_lens)})")
    dtype = np.result_type(*samples)  # widest dtype: uint8 + uint16 -> uint16, never a wrapping cast
    num_layers, k = samples[0].shape[1:]
    indices = np.empty((len(samples), width, num_layers, k), dtype=dtype)
    indices[:] = _dummy_row(num_layers, k, dtype)
    mask = np.ones((len(samples), width), dtype=bool)
    for i, (sample, length) in enumerate(zip(samples, seq_lens, strict=True)):
        if len(sample) > length:
            raise RoutingDataError(f"sample {i} has {len(sample)} route rows but only {length} tokens")
        begin = width - length if left_padded else 0
        indices[i, begin : begin + len(sample)] = sample
        mask[i, begin : begin + len(sample)] = False
    return indices, mask
