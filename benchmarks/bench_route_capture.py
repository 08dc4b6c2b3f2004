"""Routed-experts capture on a real vLLM engine under a given MoE kernel or EPLB, judged by the route checks.

    python -m benchmarks.bench_route_capture --model gpu --device cuda --engine-args '{"moe_backend": "triton"}'
    python -m benchmarks.bench_route_capture --model gpu --device cuda --engine-args \
        '{"tensor_parallel_size": 2, "enable_expert_parallel": true, "enable_eplb": true}'
    python -m benchmarks.bench_route_capture --model tiny --device cpu

Starts one engine with capture on and the given `vllm.LLM` arguments (what the operator renders for R3: for a
0.22 image, `--moe-backend triton`), samples `--prompts` completions, and runs every sample's routes through
routing/checks.py's `check_sample_routes` (route-shape, expert-range over the logical experts, zero-route).
The JSON says which MoE kernel vLLM chose (from its log), how many samples failed which rule, and the largest
expert id seen: a capture that skipped the hook (a monolithic kernel) shows as zero-route on every sample, one in
EPLB's physical id space as expert-range. GPU-only modes (FlashInfer, EPLB) are rows of benchmarks/gpu_accept.py.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="an r3operator reference model name")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--engine-args", default="{}", help="JSON: extra vllm.LLM keyword arguments")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    from transformers import AutoConfig

    from r3operator.engine.llm import apply_engine_env, llm_kwargs
    from r3operator.models import ensure_reference_model
    from r3operator.rollout.client import InProcessLLMClient
    from r3operator.routing.checks import check_sample_routes
    from r3operator.routing.codec import decode
    from r3operator.runtime.route_checks import model_routing

    model_dir = ensure_reference_model(args.model)
    apply_engine_env(args.device)
    lines = _Lines()
    logging.getLogger("vllm").addHandler(lines)
    extra: dict[str, Any] = json.loads(args.engine_args)
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    client = InProcessLLMClient(
        **llm_kwargs(model_dir, device=args.device, seed=0, max_model_len=512, dtype=dtype, extra=extra)
    )
    vocab = int(AutoConfig.from_pretrained(model_dir).vocab_size)
    prompts = [[1 + (7 * i + j) % (vocab - 1) for j in range(12 + i % 5)] for i in range(args.prompts)]
    samples = client.generate(prompts, max_tokens=args.max_tokens, temperature=1.0, seed=0)
    import vllm

    vllm_version = str(vllm.__version__)
    model = model_routing(model_dir)
    failures: dict[str, int] = {}
    first: str | None = None
    max_id = -1
    for sample in samples:
        if sample.routes is None:
            rule = "routes-missing" if sample.routes_status == "missing" else "routes-invalid"
            failures[rule] = failures.get(rule, 0) + 1
            first = first or f"{rule}: {sample.routes_error}"
            continue
        ids = decode(sample.routes, validate=False)
        max_id = max(max_id, int(ids.max()) if ids.size else -1)
        failure = check_sample_routes(sample.sample_id, ids, model)
        if failure is not None:
            failures[failure.rule] = failures.get(failure.rule, 0) + 1
            first = first or str(failure)
    kernels = sorted({line for line in lines.lines if "MoE backend" in line or "moe backend" in line.lower()})
    result = {
        "model": args.model,
        "device": args.device,
        "engine_args": extra,
        "vllm": vllm_version,
        "samples": len(samples),
        "failures": failures,
        "first_failure": first,
        "max_expert_id": max_id,
        "num_experts": model.num_experts,
        "moe_kernel_lines": kernels[:8],
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text)
    return 0 if not failures and samples else 1


if __name__ == "__main__":
    sys.exit(main())
