"""The route checks' and the routing agreement's cost at a step's scale, part by part, on the batch's device.

    python -m benchmarks.bench_route_checks --device cuda           # the learning workload: 512 samples, ≤ 552 tokens
    python -m benchmarks.bench_route_checks --device cpu --samples 128

An R3 step runs the checks twice: before the old-logprob pass on each sample's routes as the engine sent them
(`before_forward`: route-shape, expert-range, zero-route per sample, pad-replayed on the batch) and after it on the
batch's engine and natural ids (`constant_layer_suspects`, on the batch's device; only suspects cross to the host),
then tallies the replayed rows. The step's row then compares the trainer's routers with the engine's routes
(`routing_agreement`, twice a step: the ids replayed and the routers' own). The routes here are random top-k sets of
the `gpu` reference MoE's shape (8 MoE layers, 64 experts, top-8), response lengths drawn uniformly up to
`--max-response`; the natural ids are the engine's with a tenth of the rows re-drawn, as a trainer that mostly agrees.
Seconds are medians over `--repeats` after a warm-up, the device synchronised around each part (benchmarks/timing.py).
`agreement_matches_host` says whether the agreement computed where the routes are equals NumPy's over host copies.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from benchmarks.timing import median_seconds


def _routes(rng: np.random.Generator, tokens: int, layers: int, top_k: int, experts: int) -> np.ndarray:
    """[tokens, layers, top_k] distinct expert ids per row, uint8 as the engine's wire sends them."""
    keys = rng.random((tokens * layers, experts))
    return np.argsort(keys, axis=1)[:, :top_k].reshape(tokens, layers, top_k).astype(np.uint8)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--prompt-tokens", type=int, default=40)
    parser.add_argument("--max-response", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    import torch

    from r3operator.api.enums import RouteCheckPolicy
    from r3operator.routing.agreement import routing_agreement
    from r3operator.routing.checks import ModelRouting
    from r3operator.routing.codec import RoutedExperts
    from r3operator.routing.sample import RolloutSample
    from r3operator.runtime.route_checks import RouteChecks, constant_layer_suspects
    from r3operator.trainer.batch import build_batch

    rng = np.random.default_rng(args.seed)
    samples, routes = [], []
    for i in range(args.samples):
        response = int(rng.integers(1, args.max_response + 1))
        rows = args.prompt_tokens + response - 1  # the engine computes no route for the last token
        ids = _routes(rng, rows, args.layers, args.top_k, args.experts)
        routes.append(RoutedExperts(bytearray(ids.tobytes()), ids.shape, "uint8"))
        samples.append(
            RolloutSample(
                sample_id=f"s{i}",
                prompt_index=i,
                choice_index=0,
                prompt_token_ids=tuple(range(1, args.prompt_tokens + 1)),
                token_ids=tuple(int(t) for t in rng.integers(1, 1000, response)),
                logprobs=np.zeros(response, dtype=np.float32),
                routes=routes[-1],
            )
        )
    cuda = args.device.startswith("cuda")
    sync: Callable[[], None] = torch.cuda.synchronize if cuda else (lambda: None)
    batch = build_batch(samples, [0.0] * len(samples), routes=routes, pad_id=0, device=args.device)
    assert batch.engine_routes is not None and batch.route_pad is not None
    model = ModelRouting(args.layers, args.top_k, args.experts, tuple(range(args.layers)))
    checks = RouteChecks(model, RouteCheckPolicy.FAIL)
    checks.begin_step(samples)
    natural = batch.engine_routes.clone()
    redraw = torch.rand(natural.shape[:3], device=natural.device) < 0.1
    natural[redraw] = natural[redraw].roll(1, dims=0)
    replayed = ~batch.route_pad

    parts = {
        "before_forward": lambda: checks.before_forward(batch, samples),
        "constant_layer_suspects": lambda: constant_layer_suspects(
            batch.engine_routes, natural, replayed, model.moe_layers
        ),
        "tally": lambda: checks.tally(batch),
        "routing_agreement": lambda: routing_agreement(natural, batch.engine_routes, replayed),
    }
    seconds = {name: median_seconds(fn, args.repeats, sync) for name, fn in parts.items()}
    kept = checks.before_forward(batch, samples)  # the timed path is the passing one: every sample kept, no suspect
    suspects = constant_layer_suspects(batch.engine_routes, natural, replayed, model.moe_layers)
    here = routing_agreement(natural, batch.engine_routes, replayed)
    host = routing_agreement(natural.cpu().numpy(), batch.engine_routes.cpu().numpy(), replayed.cpu().numpy())
    result = {
        "benchmark": "route_checks",
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "samples": args.samples,
        "batch_shape": list(batch.engine_routes.shape),
        "route_tokens": int(replayed.sum()),
        "samples_kept": len(kept),
        "suspects": len(suspects),
        "agreement_matches_host": (here.token_layers, here.agreement_ratio, here.per_layer)
        == (host.token_layers, host.agreement_ratio, host.per_layer),
        "seconds": seconds,
        "total_seconds": sum(seconds.values()),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
