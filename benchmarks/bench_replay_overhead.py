"""Replay overhead: forward + backward with the HF router-replay hooks armed vs no hooks.

    python -m benchmarks.bench_replay_overhead --model gpu --device cuda    # target ≤ 3 %
    python -m benchmarks.bench_replay_overhead --model tiny --device cpu

Same model, same batch, same routes. "off" has no hooks installed at all; "replay" installs
RouterReplay and arms it with routes (the engine's would be used in training; here the model's own
natural routing, recorded once, so both runs compute the same experts and differ only by the hook
work: an index lookup, a gather of the live logits and a renormalisation per router). Timings are
medians over interleaved repetitions so clock drift hits both arms alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any


def _timer(device: str) -> Callable[[Callable[[], None]], float]:
    import torch

    def run(fn: Callable[[], None]) -> float:
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return run


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    from r3operator.models import ensure_reference_model
    from r3operator.trainer.replay.hf import RouterRecorder, RouterReplay

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    batch = args.batch or (8 if device == "cuda" else 2)
    seq = args.seq or (1024 if device == "cuda" else 128)
    reps = args.reps or (20 if device == "cuda" else 5)
    torch.manual_seed(0)
    model_dir = ensure_reference_model(args.model)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype))
    model = hf.to(device)  # type: ignore[arg-type]  # mypy reads transformers' decorated .to as taking a model
    model.train()
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (batch, seq), device=device)
    mask = torch.ones_like(ids)

    recorder = RouterRecorder().install(model)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    routes = recorder.stacked().reshape(batch, seq, -1, model.config.num_experts_per_tok)
    recorder.remove()

    def step() -> None:
        out = model(input_ids=ids, attention_mask=mask)
        out.logits.float().logsumexp(-1).mean().backward()
        model.zero_grad(set_to_none=True)

    replay = RouterReplay()
    timer = _timer(device)

    def off() -> float:
        return timer(step)

    def on() -> float:
        replay.install(model)
        try:
            with replay.armed(routes):
                return timer(step)
        finally:
            replay.remove()

    for _ in range(3):  # warm-up both paths (allocator, kernels, autotuning)
        off()
        on()
    t_off, t_on = [], []
    for _ in range(reps):
        t_off.append(off())
        t_on.append(on())
    m_off, m_on = statistics.median(t_off), statistics.median(t_on)
    result = {
        "model": args.model,
        "device": device if device == "cpu" else torch.cuda.get_device_name(),
        "dtype": args.dtype,
        "batch": batch,
        "seq": seq,
        "reps": reps,
        "fwd_bwd_seconds_off": round(m_off, 5),
        "fwd_bwd_seconds_replay": round(m_on, 5),
        "overhead_pct": round(100 * (m_on - m_off) / m_off, 2),
        "torch": torch.__version__,
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
