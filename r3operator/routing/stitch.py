"""Stitching per-turn / per-chunk routes into one dense per-trajectory array.

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


def stitch_disaggregated(
    prefill: RoutedExperts,
    decode_routes: RoutedExperts,
    *,
    prompt_len: int,
    generated_len: int,
    num_experts: int | None = None,
) -> tuple[RoutedExperts, bool]:
    """One request served by a prefill engine and a decode engine → the routes a single engine would return, and
    whether the two engines routed the prompt's last token alike.

    ``prefill``: rows ``[start, prompt_len)``, every prompt token, computed by the prefill engine (a request of one
    generated token). ``decode_routes``: rows ``[prompt_len - 1, prompt_len + generated_len - 1)``, asked for with
    ``routed_experts_prompt_start = prompt_len - 1``: the decode engine loaded the KV of the earlier prompt tokens
    (its rows for them are whatever its slots held before, never returned), recomputed the last prompt token to
    sample from, and generated. The result keeps the prefill engine's rows for the whole prompt, the boundary token
    included, and takes the decode engine's from the first generated token on; the decode engine's own row of the
    boundary token is compared with the prefill engine's (False: the KV it attended to was not the prefill's, or the
    engines differ in their numerics). Raises RoutingDataError when either part does not cover its rows.
    """
    check_row_count(prefill, prompt_len=prompt_len, generated_len=1)
    if decode_routes.start != prompt_len - 1:
        raise RoutingDataError(
            f"decode routes start at row {decode_routes.start}, expected the prompt's last token {prompt_len - 1}"
        )
    check_row_count(decode_routes, prompt_len=prompt_len, generated_len=generated_len)
    if (prefill.num_layers, prefill.top_k) != (decode_routes.num_layers, decode_routes.top_k):
        raise RoutingDataError(
            f"prefill routes have (layers, top_k)=({prefill.num_layers}, {prefill.top_k}), decode routes "
            f"({decode_routes.num_layers}, {decode_routes.top_k})"
        )
    head, tail = decode(prefill, validate=False), decode(decode_routes, validate=False)
    boundary_agrees = bool(len(head) and len(tail)) and bool(np.array_equal(head[-1], tail[0]))
    # np.concatenate promotes to the wider of the two compact dtypes: no id wraps (reference §8.8.3).
    rows = np.concatenate([head, tail[1:]], axis=0)
    return encode(rows, start=prefill.start, num_experts=num_experts), boundary_agrees
