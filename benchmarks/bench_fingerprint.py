"""The weight-sync receipt's fingerprints (wire/receipt.py): one tensor at a time vs buckets.

    # CPU, no memory needed: the a3b and a3b-x16l parameter sets as meta tensors (shapes only)
    python3 -m benchmarks.bench_fingerprint --models a3b,a3b-x16l --json OUT/fingerprint.json
    # GPU: the same sets as real bf16 tensors on cuda:0, each way timed with a synchronize
    python3 -m benchmarks.bench_fingerprint --models a3b,a3b-x16l --device cuda --repeats 5
    # what issue 42's receipt adds (the engine reading every parameter; the trainer's composed fingerprints)
    python3 -m benchmarks.bench_fingerprint --receipt --models a3b --experts 16 --device cpu

What a sync fingerprints, per side, as the runtime does it:
- trainer: every checkpoint tensor it sends (experts unfused, bf16), one `FingerprintLog` per sync;
- engine: the same tensors in the batches vLLM's packed receiver hands `load_weights` (`--batch-mb`, the
  job's `weightSync.chunkSizeMB`), `SyncReceipt.record` once per batch.
`--layout kernel` takes the engine's parameters instead (wire/kernel_layout.py: 39 tensors for a3b, its
fused expert blocks 805 MB each), as a kernel-layout sync sends them. `--experts N` shrinks the model's
expert count (a CPU run of the kernel layout in a few GB). On `--device cpu` the GPU's torch path runs
(not the CPU's numpy), and each row also has the largest block allocated at once (`largest_alloc_bytes`,
torch's profiler): the temporary a fingerprint makes beside the weights.

"one_by_one" is `FingerprintLog(bucket_bytes=0)`: every tensor takes the big tensors' path (its slices
reduced at once, a bucket of its own for the rest; before 2026-11-27 it was `_fingerprint_torch` one tensor
at a time, as every tensor was before buckets); "buckets" is the default (`BUCKET_BYTES`).

For each: the aten operators that do work (views left out; on a GPU each launches one kernel or more, and
an MoE sync is launch-bound), the host seconds spent issuing them (on `meta` that is all there is: no data
is touched, so it is the floor a GPU cannot go below while launch-bound), and on a real device the seconds
to the fingerprints on the host (median of `--repeats`, after one warm-up).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.report_json import emit
from benchmarks.timing import median_seconds


def checkpoint_shapes(model: str) -> list[tuple[str, tuple[int, ...]]]:
    """(checkpoint name, shape) of every tensor the trainer sends for reference model `model`."""
    import torch
    from transformers import Qwen3MoeForCausalLM

    from r3operator.models.reference import get_spec
    from r3operator.wire.weights import checkpoint_tensors

    with torch.device("meta"):
        hf = Qwen3MoeForCausalLM(get_spec(model).hf_config())
    return [
        (name, tuple(t.shape)) for name, t in checkpoint_tensors(hf.state_dict(), dtype=torch.bfloat16, device=None)
    ]


def kernel_shapes(model: str, experts: int | None = None) -> list[tuple[str, tuple[int, ...]]]:
    """(vLLM parameter name, shape) of every tensor a kernel-layout sync sends for reference model `model`:
    vLLM's Qwen3-MoE parameters (q/k/v fused, experts fused per layer), as its engine reports them."""
    config = _spec(model, experts).hf_config()
    h, heads, kv, d = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    e, inter, vocab = config.num_experts, config.moe_intermediate_size, config.vocab_size
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, h))]
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}"
        shapes += [
            (f"{prefix}.input_layernorm.weight", (h,)),
            (f"{prefix}.self_attn.qkv_proj.weight", ((heads + 2 * kv) * d, h)),
            (f"{prefix}.self_attn.o_proj.weight", (h, heads * d)),
            (f"{prefix}.self_attn.q_norm.weight", (d,)),
            (f"{prefix}.self_attn.k_norm.weight", (d,)),
            (f"{prefix}.post_attention_layernorm.weight", (h,)),
            (f"{prefix}.mlp.gate.weight", (e, h)),
            (f"{prefix}.mlp.experts.w13_weight", (e, 2 * inter, h)),
            (f"{prefix}.mlp.experts.w2_weight", (e, h, inter)),
        ]
    return [*shapes, ("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]


def _spec(model: str, experts: int | None) -> Any:
    from r3operator.models.reference import get_spec

    spec = get_spec(model)
    if experts is None:
        return spec
    return spec.model_copy(
        update={"num_experts": experts, "num_experts_per_tok": min(spec.num_experts_per_tok, experts)}
    )


def largest_alloc_bytes(run: Callable[[], Any]) -> int:
    """The largest block allocated at once while `run()` runs on the CPU (torch's profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    return max((int(event.self_cpu_memory_usage) for event in prof.events()), default=0)


def counted_ops(run: Callable[[], Any]) -> tuple[int, float]:
    """(aten operators that do work, host seconds) while `run()` runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __init__(self) -> None:  # typed: TorchDispatchMode's own __init__ carries no annotations
            TorchDispatchMode.__init__(self)

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            Count.ops += 0 if func.is_view else 1
            return func(*args, **(kwargs or {}))

    with Count():
        run()
    begin = time.perf_counter()  # again without the counting mode's own overhead
    run()
    return Count.ops, time.perf_counter() - begin


def _trainer(tensors: list[tuple[str, Any]], bucket_bytes: int, read: bool) -> Callable[[], Any]:
    from r3operator.wire.receipt import FingerprintLog

    def run() -> Any:
        log = FingerprintLog(bucket_bytes=bucket_bytes)
        for name, tensor in tensors:
            log.add(name, tensor)
        log.flush()
        return log.result() if read else None

    return run


def _engine(tensors: list[tuple[str, Any]], bucket_bytes: int, batch_mb: int, read: bool) -> Callable[[], Any]:
    from r3operator.wire.receipt import FingerprintLog
    from r3operator.wire.weights import chunk_tensors

    # vLLM's packed producer batches as the runtime's own chunker does: a new batch once the buffer would overflow
    batches = list(chunk_tensors(iter(tensors), chunk_size_mb=batch_mb))

    def run() -> Any:
        log = FingerprintLog(bucket_bytes=bucket_bytes)
        for batch in batches:
            log.add_many(batch)  # what `SyncReceipt.record` does with each batch
        return log.result() if read else None

    return run


def measure(
    model: str, *, device: str, batch_mb: int, repeats: int, layout: str = "checkpoint", experts: int | None = None
) -> dict[str, Any]:
    import torch

    from r3operator.wire import receipt
    from r3operator.wire.receipt import BUCKET_BYTES

    if layout == "kernel":
        shapes = kernel_shapes(model, experts)
    elif experts is not None:
        raise ValueError("--experts: only with --layout kernel")
    else:
        shapes = checkpoint_shapes(model)
    if device == "meta":
        tensors = [(name, torch.empty(shape, dtype=torch.bfloat16, device="meta")) for name, shape in shapes]
    else:
        tensors = [(name, torch.randn(shape, dtype=torch.bfloat16, device=device)) for name, shape in shapes]
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    out: dict[str, Any] = {
        "model": model,
        "layout": layout,
        "experts": experts,
        "tensors": len(tensors),
        "bytes": nbytes,
        "device": device,
    }
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    numpy_on_cpu, receipt.NUMPY_ON_CPU = receipt.NUMPY_ON_CPU, False  # the GPU's path, on whichever device
    try:
        for way, bucket in (("one_by_one", 0), ("buckets", BUCKET_BYTES)):
            for side, make in (
                ("trainer", partial(_trainer, tensors, bucket)),
                ("engine", partial(_engine, tensors, bucket, batch_mb)),
            ):
                ops, host = counted_ops(make(False))
                row: dict[str, Any] = {"ops": ops, "host_s": round(host, 4)}
                if device != "meta":
                    # `result()` reads the fingerprints back: the host waits for every kernel
                    row["seconds"] = round(median_seconds(make(True), repeats, sync), 4)
                if device == "cpu":
                    row["largest_alloc_bytes"] = largest_alloc_bytes(make(True))
                out[f"{side}_{way}"] = row
    finally:  # `make bench` runs the other benchmarks in this process after it
        receipt.NUMPY_ON_CPU = numpy_on_cpu
    return out


def trainer_state(model: str, experts: int | None, device: str) -> dict[str, Any]:
    """The trainer's state dict of reference model `model` (transformers 5: experts fused), fp32 master weights."""
    import torch
    from transformers import Qwen3MoeForCausalLM

    with torch.device("meta"):
        hf = Qwen3MoeForCausalLM(_spec(model, experts).hf_config())
    make = torch.empty if device == "meta" else torch.randn
    return {name: make(tuple(t.shape), dtype=torch.float32, device=device) for name, t in hf.state_dict().items()}


def measure_receipt(model: str, *, device: str, repeats: int, experts: int | None = None) -> dict[str, Any]:
    """What issue 42's receipt adds to a sync, on `device`, with the runtime's own fingerprint path there (numpy on
    the CPU):

    - `unchanged_read`: the engine reading every parameter at a checkpoint-layout sync's finish, fused 3-D expert
      blocks included, for the check that they changed (before: only parameters of at most 2 dimensions, `small_read`);
    - `trainer_composed`: the trainer's side of a kernel-layout receipt, each parameter composed from the fp32 tensors
      it trains, cast to bf16 piece by piece (`add_parameter_pieces`); `trainer_built` is what it replaced, the
      fingerprints of the bf16 tensors the kernel builder made (their build not counted).
    """
    import torch

    from r3operator.wire.kernel_layout import (
        add_parameter_pieces,
        engine_parameters,
        kernel_tensors,
        plan_kernel_layout,
        trainer_shapes,
    )
    from r3operator.wire.receipt import FingerprintLog
    from r3operator.wire.weights import full_tensor

    state = trainer_state(model, experts, device)
    rows = [(name, "bfloat16", shape) for name, shape in kernel_shapes(model, experts)]
    plan = plan_kernel_layout(trainer_shapes(state), engine_parameters(rows))
    params = list(kernel_tensors(state, plan, dtype=torch.bfloat16, device=device))
    small = [(name, t) for name, t in params if t.dim() <= 2]

    def read(named: list[tuple[str, Any]]) -> Callable[[], Any]:
        def run() -> Any:
            log = FingerprintLog()
            log.add_many(named)
            return log.result()

        return run

    def composed() -> Any:
        log = FingerprintLog()
        for source in plan:
            add_parameter_pieces(log, source, [full_tensor(state[p]) for p in source.parts])
        return log.result()

    def built() -> Any:
        log = FingerprintLog()
        log.add_many(params)
        return log.result()

    out: dict[str, Any] = {
        "model": model,
        "experts": experts,
        "device": device,
        "parameters": len(params),
        "bytes": sum(t.numel() * t.element_size() for _, t in params),
    }
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for name, run in (
        ("small_read", read(small)),
        ("unchanged_read", read(params)),
        ("trainer_built", built),
        ("trainer_composed", composed),
    ):
        ops, _ = counted_ops(run)
        out[name] = {"ops": ops, "seconds": round(median_seconds(run, repeats, sync), 4)}
    return out


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="a3b,a3b-x16l", help="reference models, comma-separated")
    parser.add_argument("--device", default="meta", help="meta (shapes only: operator counts), cuda, cuda:1 …")
    parser.add_argument("--batch-mb", type=int, default=512, help="the engine's receive batch (chunkSizeMB)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layout", default="checkpoint", choices=("checkpoint", "kernel"))
    parser.add_argument("--experts", type=int, default=None, help="--layout kernel: this many experts per layer")
    parser.add_argument(
        "--receipt",
        action="store_true",
        help="what issue 42's receipt adds (`measure_receipt`): the engine's read of every parameter, the trainer's "
        "kernel-layout fingerprints composed from its fp32 tensors",
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.experts is not None and (args.experts < 1 or (args.layout != "kernel" and not args.receipt)):
        parser.error(f"--experts needs --layout kernel (or --receipt) and a count >= 1, got {args.experts}")
    if args.receipt:
        if args.device == "meta":
            parser.error("--receipt reads fingerprints back: name a real device (cpu, cuda)")
        receipts = {
            "receipt": [
                measure_receipt(m, device=args.device, repeats=args.repeats, experts=args.experts)
                for m in args.models.split(",")
            ]
        }
        emit(receipts, args.json)
        return receipts
    result = {
        "models": [
            measure(
                m,
                device=args.device,
                batch_mb=args.batch_mb,
                repeats=args.repeats,
                layout=args.layout,
                experts=args.experts,
            )
            for m in args.models.split(",")
        ]
    }
    emit(result, args.json)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
