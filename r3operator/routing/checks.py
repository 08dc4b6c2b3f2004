"""Checks on one step's routes before the update trains on them (NumPy only).

R3's failures are mostly silent: routes that were never captured (all zero), ids of the wrong space (EPLB's
physical experts), routes on pad tokens, replay hooks sitting on routers the model no longer calls. Each
check here names the sample, the layer and the rule it broke, so the step loop (runtime/route_checks.py)
can fail the job or skip the sample (`spec.routingReplay.onRouteCheckFailure`) with nothing trained on them.

The rules, in the order a step meets them:

- before the old-logprob pass, on each sample's routes as the engine sent them: `route-shape` (layers and
  top-k are the trainer model's), `expert-range` (ids in `[0, numExperts)`: logical ids),
  `zero-route` (a captured row of an MoE layer holding one expert K times: vLLM's untouched capture buffer),
  and on the batch: `pad-replayed` (a replayed row where the engine computed none: a pad column, a
  sample's last token, anything outside the rows it sent);
- after the old-logprob pass, before the update: `constant-layer` (an MoE layer whose replayed rows all
  hold one expert set while the trainer's own routers, on the same rows, do not) and `hooks-not-fired`
  (a replay hook that did not run on an MoE layer of some trainer rank: the model is not replaying).

Missing and undecodable routes (`routes-missing`, `routes-invalid`) are found where the routes arrive
(routing/sample.py); they take the same policy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np

ROUTES_MISSING: Final = "routes-missing"
ROUTES_INVALID: Final = "routes-invalid"
ROUTE_SHAPE: Final = "route-shape"
EXPERT_RANGE: Final = "expert-range"
ZERO_ROUTE: Final = "zero-route"
PAD_REPLAYED: Final = "pad-replayed"
CONSTANT_LAYER: Final = "constant-layer"
HOOKS_NOT_FIRED: Final = "hooks-not-fired"

SAMPLE_RULES: Final = (
    ROUTES_MISSING,
    ROUTES_INVALID,
    ROUTE_SHAPE,
    EXPERT_RANGE,
    ZERO_ROUTE,
    PAD_REPLAYED,
    CONSTANT_LAYER,
)
"""Rules about one sample: the policy may skip the sample."""
MODEL_RULES: Final = (HOOKS_NOT_FIRED,)
"""Rules about the trainer's model: no sample is right, so the job fails whatever the policy."""
RULES: Final = SAMPLE_RULES + MODEL_RULES


@dataclass(frozen=True, slots=True)
class ModelRouting:
    """What the trainer's model says routes must look like."""

    num_layers: int
    """Decoder layers (dense ones included: vLLM reports them as zero rows)."""
    top_k: int
    num_experts: int
    """Logical routed experts: EPLB's redundant physical copies are not ids a route may hold."""
    moe_layers: tuple[int, ...]
    """The absolute decoder layers that have a router."""


@dataclass(frozen=True, slots=True)
class RouteCheckFailure:
    rule: str
    sample_id: str | None
    """None for a rule about the model (`hooks-not-fired`)."""
    layer: int | None
    detail: str

    def __str__(self) -> str:
        where = [f"sample {self.sample_id}"] if self.sample_id is not None else []
        if self.layer is not None:
            where.append(f"layer {self.layer}")
        return f"route check {self.rule} failed ({', '.join(where) or 'every sample'}): {self.detail}"


def check_sample_routes(sample_id: str, ids: np.ndarray, model: ModelRouting) -> RouteCheckFailure | None:
    """The first of `route-shape`, `expert-range`, `zero-route` that the routes [T, L, K] of one sample break.

    `zero-route`: a row of an MoE layer with one id K times is what vLLM's capture buffer holds where
    nothing was captured (it is zeroed every step): a kernel that bypassed the capture hook, or no capture.
    """
    if ids.ndim != 3 or ids.shape[1:] != (model.num_layers, model.top_k):
        return RouteCheckFailure(
            ROUTE_SHAPE,
            sample_id,
            None,
            f"routes have shape {tuple(ids.shape)}, the model needs [tokens, {model.num_layers} layers, "
            f"top-k {model.top_k}]",
        )
    if ids.size == 0:
        return None
    moe = ids[:, list(model.moe_layers)] if model.moe_layers else ids[:, :0]
    out = (moe < 0) | (moe >= model.num_experts)
    if out.any():
        token, i, _ = (int(v) for v in np.argwhere(out)[0])
        layer = model.moe_layers[i]
        return RouteCheckFailure(
            EXPERT_RANGE,
            sample_id,
            layer,
            f"token {token} holds expert ids {ids[token, layer].tolist()}, outside [0, {model.num_experts}) "
            "(physical ids of a redundant-expert (EPLB) engine, or a corrupt capture)",
        )
    if model.top_k > 1 and moe.size:
        same = (moe == moe[..., :1]).all(axis=-1)  # [T, L_moe]: one id K times
        if same.any():
            token, i = (int(v) for v in np.argwhere(same)[0])
            layer = model.moe_layers[i]
            rows = int(same[:, i].sum())
            return RouteCheckFailure(
                ZERO_ROUTE,
                sample_id,
                layer,
                f"{rows} of {moe.shape[0]} captured rows hold one expert {model.top_k} times (token {token}: "
                f"{ids[token, layer].tolist()}): the engine's capture never ran for them (a MoE kernel that "
                "bypasses it, or capture off)",
            )
    return None


def check_replay_mask(
    sample_ids: Sequence[str], lengths: Sequence[int], replayed: np.ndarray, captured: Sequence[tuple[int, int]]
) -> list[RouteCheckFailure]:
    """`pad-replayed`: a replayed column (`replayed` [B, S] True) outside the rows the engine sent.

    Sample i's engine rows are positions `captured[i]` = [start, end), inside its first `lengths[i] - 1`
    positions (the last token is never fed to the engine). A replayed pad column would hand every pad
    token expert 0's placeholder route; a replayed last token or environment token the engine never saw
    replays a route nobody computed.
    """
    failures: list[RouteCheckFailure] = []
    width = replayed.shape[1]
    columns = np.arange(width)
    for i, (sample_id, length, (start, end)) in enumerate(zip(sample_ids, lengths, captured, strict=True)):
        allowed = (columns >= start) & (columns < min(end, length - 1))
        wrong = replayed[i] & ~allowed
        if wrong.any():
            column = int(np.argmax(wrong))
            what = "a pad column" if column >= length else ("its last token" if column == length - 1 else "a token")
            failures.append(
                RouteCheckFailure(
                    PAD_REPLAYED,
                    sample_id,
                    None,
                    f"position {column} ({what}) would replay a route the engine did not send (it sent rows "
                    f"[{start}, {end}) of {length} tokens)",
                )
            )
    return failures


def check_constant_layers(
    sample_ids: Sequence[str],
    engine: np.ndarray,
    natural: np.ndarray,
    replayed: np.ndarray,
    moe_layers: Sequence[int],
) -> list[RouteCheckFailure]:
    """`constant-layer`: an MoE layer whose replayed rows of a sample all hold one expert set while the
    trainer's own routers chose more than one set on the same rows (engine and natural ids [B, S, L, K],
    `replayed` [B, S]). At most one failure per sample (its first such layer)."""
    failures: list[RouteCheckFailure] = []
    layers = list(moe_layers)
    if not layers:
        return failures
    eng = np.sort(engine[:, :, layers], axis=-1)
    nat = np.sort(natural[:, :, layers], axis=-1)
    for i, sample_id in enumerate(sample_ids):
        rows = replayed[i]
        if int(rows.sum()) < 2:
            continue
        e, n = eng[i, rows], nat[i, rows]  # [R, L_moe, K]
        engine_constant = (e == e[:1]).all(axis=(0, 2))
        natural_varies = ~(n == n[:1]).all(axis=(0, 2))
        bad = engine_constant & natural_varies
        if bad.any():
            j = int(np.argmax(bad))
            distinct = len({tuple(row) for row in n[:, j].tolist()})
            failures.append(
                RouteCheckFailure(
                    CONSTANT_LAYER,
                    sample_id,
                    layers[j],
                    f"all {e.shape[0]} replayed rows route to experts {e[0, j].tolist()} while the trainer's routers "
                    f"chose {distinct} different expert sets on them (a capture that wrote a constant)",
                )
            )
    return failures


def check_hooks_fired(
    expected: Mapping[int, Sequence[int]], fired: Mapping[int, Mapping[int, int]]
) -> RouteCheckFailure | None:
    """`hooks-not-fired`: some rank's MoE layer whose replay hook ran no time in a pass that replayed.

    `expected` maps each trainer rank to its MoE layers, `fired` each rank to {layer: hook calls}. A hook
    left on a router the model replaced (rebuilt or swapped after the hooks were placed) never runs, and
    that layer routes naturally while everything reads as replayed.
    """
    missing = [
        (rank, layer)
        for rank, layers in sorted(expected.items())
        for layer in layers
        if fired.get(rank, {}).get(layer, 0) == 0
    ]
    if not missing:
        return None
    _rank, layer = missing[0]
    named = ", ".join(f"rank {r} layer {lay}" for r, lay in missing[:8]) + (" ..." if len(missing) > 8 else "")
    return RouteCheckFailure(
        HOOKS_NOT_FIRED,
        None,
        layer,
        f"the replay hook did not run on {len(missing)} MoE layer(s) ({named}): the router the model calls is not "
        "the one the hook was placed on (rebuilt or swapped after install), so those layers routed naturally",
    )


@dataclass(frozen=True, slots=True)
class ReplayFractions:
    replayed: float
    """Rows replayed over every row the step's samples needed (each sample's tokens but its last)."""
    fallback: float
    """Of the trained samples' rows, those routed naturally (no engine route)."""


def replay_fractions(*, replayed_rows: int, trained_rows: int, needed_rows: int) -> ReplayFractions:
    """`replayed_rows` replayed in the batch; `trained_rows` and `needed_rows` count every sample's tokens
    but its last (the engine never computes that one's route), in the batch and in the whole rollout."""
    nan = float("nan")
    return ReplayFractions(
        replayed=replayed_rows / needed_rows if needed_rows else nan,
        fallback=(trained_rows - replayed_rows) / trained_rows if trained_rows else nan,
    )
