"""The post-sync weight canary: the engine's greedy decode must be the trainer's greedy decode.

The engine greedy-decodes fixed prompts; the trainer then teacher-forces each engine continuation through
ONE forward (fp32 against an fp32 engine, bf16 autocast against a bf16 one, see below) and checks every
generated position: the engine's token must be the
trainer's argmax. With the same prefix at every position this is exactly "engine greedy ==
trainer greedy" (including where each stops: an engine <eos> must be the trainer's argmax, and so must
every token the engine emitted instead of the trainer's <eos>), for the cost of one forward per prompt.

The engine also returns the logprob of each greedy token; it must match the trainer's logprob of that
token within δ. Greedy tokens alone are a weak check on an untrained model: its logits are nearly
flat, so a corrupted MoE layer can leave every argmax in place (measured on the random-init tiny model: a
transposed expert layout moved logits by ~0.37 without changing one greedy token, but moved the greedy
tokens' logprobs by up to 0.12, which δ_exact catches).

Against a bf16 engine (near-tie mode) that forward runs under the trainer's bf16 autocast, like with like: on
the H100 a3b run the fp32 forward put a greedy token 0.53 logits below the trainer's argmax where the
bf16-autocast R3 pass of the same run agreed with the engine to 0.007 mean |Δlogprob|.

The trainer's forward replays the experts the engine chose for that continuation (R3's own mechanism), so
the canary compares the weights, not the routers' near-ties: a bf16 engine and the fp32 trainer route
differently wherever two experts score alike, and on a random-init model with 128 experts one such flip
moved a greedy token's logprob by 0.89 while R3 rollouts of the same run agreed to 0.007 (H100, a3b
model, docs/benchmarks.md). The routers' own weights are checked apart: the trainer's natural choices on
the same forward must agree with the engine's on at least `MIN_ROUTING_AGREEMENT` of the token-layers (a
stale or corrupt gate agrees on about top-k / experts of them). An engine that returned no routes gets
the natural-routing forward.

Before any forward, every engine worker's receipt of the sync is compared with what the trainer sent
(`check_receipts`, wire/receipt.py): exact fingerprints of every tensor, and whether the parameters that
received new bytes changed. That is what catches an engine that kept its previous weights, skipped a tensor
or loaded nothing, on the first sync it happens: those move the greedy logprobs by less than a tolerance
that accepts the engine's rounding (an fp32 engine 10 updates behind moved them by 8e-4).

The tolerances follow the engine's dtype and device (`canary_tolerance`, the derivation is next to the
constants below). A position passes iff the engine token is the trainer's argmax, or
`logit[argmax] - logit[engine token] <= ε` in the trainer's fp32 logits (a near-tie: a low-precision engine
may legitimately pick the trainer's runner-up), and the engine's logprob of it is within δ of the
trainer's. Teacher forcing keeps one accepted near-tie from cascading into "everything after it differs".
A sign-flipped or transposed tensor moves tokens/logprobs by far more and fails; corruption smaller than
the tolerances on the canary prompts is, by construction, left to the receipt.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from r3operator.rollout.base import Greedy
from r3operator.settings import runtime_settings

if TYPE_CHECKING:  # pragma: no cover
    import torch
from r3operator.wire.receipt import Fingerprint, ReceiptMismatchError, compare_receipt

# The tolerances follow the engine's arithmetic: its unit roundoff u (dtype and device) times a fixed
# number of roundings, so an fp32 engine on a GPU is not held to what fp32 achieves on a CPU.
#
# u: fp32 2^-24 on the CPU; fp32 on CUDA 2^-11, TF32's (GPU kernels may take fp32 products at TF32's 10-bit
# mantissa: an fp32 engine on 2 H100s differed from the fp32 trainer by 1.1e-3 in a greedy logprob, two
# orders above fp32 rounding); fp16 2^-11; bf16 2^-8.
# δ = 64·u + 2^-13: bf16 0.25 (measured max 0.075 over 12 steps of rollouts, bf16 trainer vs fp32 engine);
# fp32 on CUDA 0.031 (measured 1.1e-3); fp32 on CPU 1.3e-4, where the 2^-13 floor (a logprob's own fp32
# log-sum-exp over a 150k vocabulary, returned through JSON) dominates (measured <= 6e-6).
# ε = 128·u logits: bf16 0.5 (measured max |Δlogit| 0.097 at logit scale ~3 on the tiny model; a transposed
# expert layout fails with a gap of whole units, tests/runtime/test_runtime_e2e.py); fp32 on CUDA 0.0625;
# fp32 on CPU 7.6e-6 (in effect exact tokens).
# What the tolerances cannot see (an engine that kept its previous weights, skipped a tensor or loaded
# nothing: logprobs move less than any δ that accepts rounding), the sync receipt checks exactly
# (wire/receipt.py, `check_receipts`).
LOGPROB_ROUNDINGS = 64
LOGPROB_FLOOR = 2.0**-13
GAP_ROUNDINGS = 128
UNIT_ROUNDOFF = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}
TF32_ROUNDOFF = 2.0**-11
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}
# Share of routed token-layers where the trainer's natural top-k set must equal the engine's. Measured
# natural agreement, bf16 engine vs trainer: 0.93 on the random-init a3b model (128 experts, H100); a gate
# that does not match the engine's agrees on about top_k / num_experts (0.06 there).
MIN_ROUTING_AGREEMENT = 0.5


@dataclass(frozen=True)
class CanaryTolerance:
    epsilon: float  # logit gap accepted at a near-tie
    logprob: float  # |Δlogprob| accepted per greedy token
    autocast: bool = False  # the trainer's canary forward runs in its compute precision (a low-precision engine)
    basis: str = ""  # where the numbers come from, for reports

    def describe(self) -> str:
        text = (
            f"engine token = trainer argmax, or within ε = {self.epsilon:.2g} logits of it; |Δlogprob| <= "
            f"δ = {self.logprob:.2g}"
        )
        return f"{text} ({self.basis})" if self.basis else text


def engine_roundoff(engine_dtype: str, device: str) -> tuple[float, str]:
    """The unit roundoff of the engine's arithmetic and how it was chosen."""
    dtype = _DTYPE_ALIASES.get(engine_dtype, engine_dtype)
    if dtype not in UNIT_ROUNDOFF:
        raise ValueError(f"engine dtype {engine_dtype!r}: the canary knows {', '.join(sorted(UNIT_ROUNDOFF))}")
    on_gpu = device.startswith("cuda")
    if dtype == "float32" and on_gpu:
        return TF32_ROUNDOFF, "fp32 engine on CUDA: TF32 unit roundoff 2^-11"
    exponent = {"float32": 24, "float16": 11, "bfloat16": 8}[dtype]
    return UNIT_ROUNDOFF[dtype], f"{dtype} engine on {'CUDA' if on_gpu else 'CPU'}: unit roundoff 2^-{exponent}"


def canary_tolerance(engine_dtype: str, device: str = "cpu") -> CanaryTolerance:
    """Tolerances derived from the engine's dtype and device (see above); R3OPERATOR_SYNC_CANARY_EPSILON /
    _LOGPROB_TOL override them."""
    u, basis = engine_roundoff(engine_dtype, device)
    env = runtime_settings()
    eps, tol = env.sync_canary_epsilon, env.sync_canary_logprob_tol
    notes = [basis]
    if eps is not None:
        notes.append("ε set by R3OPERATOR_SYNC_CANARY_EPSILON")
    if tol is not None:
        notes.append("δ set by R3OPERATOR_SYNC_CANARY_LOGPROB_TOL")
    return CanaryTolerance(
        epsilon=eps if eps is not None else GAP_ROUNDINGS * u,
        logprob=tol if tol is not None else LOGPROB_ROUNDINGS * u + LOGPROB_FLOOR,
        autocast=_DTYPE_ALIASES.get(engine_dtype, engine_dtype) != "float32",
        basis="; ".join(notes),
    )


class CanaryMismatchError(RuntimeError):
    """After a weight sync, the engine's greedy decode differs from the trainer's: the sync is broken."""


@dataclass
class CanaryResult:
    positions: int = 0
    near_ties: int = 0  # positions accepted only because of ε
    max_gap: float = 0.0  # largest logit[argmax] - logit[engine token] seen (0 when all equal)
    max_logprob_diff: float = 0.0
    details: list[str] = field(default_factory=list)


def check_engine_greedy(
    logits_fn: Callable[[Sequence[int]], Any],
    prompts: Sequence[Sequence[int]],
    engine_outputs: Sequence[Sequence[int]],
    *,
    tolerance: CanaryTolerance,
    eos_id: int,
    max_tokens: int,
    engine_logprobs: Sequence[Sequence[float]] | None = None,
    where: str = "engine 0",
) -> CanaryResult:
    """Raise `CanaryMismatchError` at the first position where the engine's greedy token is not the
    trainer's (beyond ε) or its logprob differs from the trainer's by more than δ.

    `logits_fn(sequence)` returns [len(sequence), V] fp32 next-token logits (trainer, natural routing).
    """
    epsilon = tolerance.epsilon
    result = CanaryResult()
    for i, (prompt, got) in enumerate(zip(prompts, engine_outputs, strict=True)):
        got = [int(t) for t in got]
        stopped_early = len(got) < max_tokens
        if stopped_early and (not got or got[-1] != eos_id):
            raise CanaryMismatchError(f"{where}, prompt {i} {list(prompt)}: engine stopped after {got} without <eos>")
        logits = logits_fn(list(prompt) + got)
        for j, token in enumerate(got):
            row = logits[len(prompt) - 1 + j]
            best = int(row.argmax())
            result.positions += 1
            if token != best:  # tokens first: the more telling message
                gap = float(row[best] - row[token])
                result.max_gap = max(result.max_gap, gap)
                if gap > epsilon:
                    raise CanaryMismatchError(
                        f"{where}, prompt {i} {list(prompt)}: first difference at generated token {j}: engine "
                        f"chose {token}, trainer argmax {best} (logit gap {gap:.4g} > ε {epsilon:g}); engine "
                        f"output {got}"
                    )
                result.near_ties += 1
                result.details.append(f"prompt {i} token {j}: engine {token} vs trainer {best}, gap {gap:.3g}")
            if engine_logprobs is not None:
                row64 = np.asarray(row, dtype=np.float64)
                top = row64.max()
                trainer_lp = row64[token] - top - np.log(np.exp(row64 - top).sum())
                diff = abs(float(engine_logprobs[i][j]) - trainer_lp)
                result.max_logprob_diff = max(result.max_logprob_diff, diff)
                if not diff <= tolerance.logprob:  # a NaN logprob (corrupt weights) fails too
                    raise CanaryMismatchError(
                        f"{where}, prompt {i} {list(prompt)}: generated token {j} ({token}): engine logprob "
                        f"{float(engine_logprobs[i][j]):.6g} vs trainer {trainer_lp:.6g} (|Δ| {diff:.3g} > δ "
                        f"{tolerance.logprob:g}); engine output {got}"
                    )
    return result


@dataclass(frozen=True)
class CanaryForwards:
    """The trainer's canary forwards of one engine's continuations, by sequence."""

    logits: dict[tuple[int, ...], Any]
    routing_agreement: float | None  # None: the engine returned no routes

    def logits_fn(self, sequence: Sequence[int]) -> Any:
        return self.logits[tuple(sequence)]


class CanaryForwardResult(Protocol):
    """One replayed canary forward (trainer/base.py `CanaryForward`)."""

    logits: torch.Tensor  # [S, V] fp32
    natural_ids: torch.Tensor  # [S, L, K]


class CanaryModel(Protocol):
    """What the canary takes of the trainer (trainer/base.py `Trainer` has it)."""

    eos_id: int

    def canary_logits(self, sequence: Sequence[int]) -> torch.Tensor: ...

    def canary_forward(
        self, sequence: Sequence[int], routes: torch.Tensor, route_pad: torch.Tensor, *, compute: bool = False
    ) -> CanaryForwardResult: ...


def canary_forwards(
    trainer: CanaryModel, prompts: Sequence[Sequence[int]], outputs: Sequence[Greedy], *, compute: bool = False
) -> CanaryForwards:
    """One trainer forward per engine continuation (`Greedy`), the engine's routes replayed where it sent
    them; the natural-vs-engine routing agreement over all of them. `compute`: the replayed forwards run in
    the trainer's compute precision (bf16 autocast), the precision of a bf16 engine."""
    import torch

    from r3operator.routing.agreement import routing_agreement
    from r3operator.routing.placement import place_routes

    logits: dict[tuple[int, ...], Any] = {}
    natural, engine, masks = [], [], []
    for i, (prompt, got) in enumerate(zip(prompts, outputs, strict=True)):
        sequence = tuple(int(t) for t in prompt) + tuple(int(t) for t in got.tokens)
        if got.routes is None:
            logits[sequence] = trainer.canary_logits(list(sequence))
            continue
        placed, no_route = place_routes(
            [got.routes], lengths=[len(sequence)], width=len(sequence), sample_ids=[f"canary prompt {i}"]
        )
        routes, pad = torch.from_numpy(placed), torch.from_numpy(no_route)
        forward = trainer.canary_forward(list(sequence), routes, pad, compute=compute)
        logits[sequence] = forward.logits
        natural.append(np.asarray(forward.natural_ids))
        engine.append(placed[0])
        masks.append(~no_route[0])
    if not natural:
        return CanaryForwards(logits, None)
    agreement = routing_agreement(np.concatenate(natural), np.concatenate(engine), np.concatenate(masks))
    return CanaryForwards(logits, agreement.agreement_ratio)


def check_routing_agreement(agreement: float | None, *, where: str, floor: float = MIN_ROUTING_AGREEMENT) -> None:
    """The routers' weights: natural trainer routing must mostly pick the engine's experts (NaN: no routed
    layer among the canary tokens, nothing to compare)."""
    if agreement is not None and agreement < floor:
        raise CanaryMismatchError(
            f"{where}: the trainer's routers pick the engine's experts on {agreement:.1%} of the canary's "
            f"token-layers (at least {floor:.0%} expected): the router (gate) weights differ"
        )


def check_receipts(sent: Mapping[str, Fingerprint], receipts: Sequence[Mapping[str, Any]], *, where: str) -> int:
    """Every worker's receipt of the last sync against the trainer's sent fingerprints (wire/receipt.py);
    returns how many parameters were checked for having changed. A mismatch is a `CanaryMismatchError`."""
    if not receipts:
        raise CanaryMismatchError(f"{where}: the engine returned no receipt of the weight sync")
    checked = 0
    for worker, receipt in enumerate(receipts):
        label = where if len(receipts) == 1 else f"{where}, worker {worker}"
        try:
            compare_receipt(sent, receipt, where=label)
        except ReceiptMismatchError as exc:
            raise CanaryMismatchError(str(exc)) from None
        checked = max(checked, int(receipt.get("checked") or 0))
    return checked
