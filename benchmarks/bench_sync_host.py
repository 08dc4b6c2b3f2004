"""The trainer's host work per tensor of a kernel-layout sync: the receipt's fingerprints and the gather.

    python3 -m benchmarks.bench_sync_host --model a3b-x16l --json OUT/sync-host.json

A GPU sync of `a3b-x16l` in the kernel layout is host-bound (docs/benchmarks.md): between two of vLLM's
broadcasts the one Python thread issues the next buffer's gather (`kernel_tensors`) and fingerprints
(`FingerprintLog.add`), and each aten operator it issues costs host time whatever the bytes. This measures
that host work on the CPU, as a proxy (a CUDA launch costs the host a few µs more than a tiny CPU kernel):

- fingerprints: the model's kernel-layout tensors (`bench_fingerprint.kernel_shapes`, bf16), the open
  buckets closed at each of vLLM's packed buffers (`packed_buffer_bytes`: the largest tensor), where its
  producer switches streams. On `meta` (the real shapes, no data: each operator's dispatch and its shape
  rules only, some of them Python, so more host µs per operator than a CUDA launch: an upper bound)
  without the read-back; on the CPU each tensor shrunk `--scale` times (1-D) with `BUCKET_BYTES` and
  `SLICE_BYTES` shrunk alike (at 4096: the same tensors bigger than a bucket, the same slices each, 5 MB
  in all), and `result()` reading everything back once, as `NativeSender.send` does; its seconds include
  the CPU's sums of that data;
- gather: `kernel_tensors` over a trainer state dict of the same model with small dimensions (same layers,
  same tensors), cast from fp32 to bf16, as plain tensors and as FSDP2 DTensors on a one-rank mesh (the
  single-GPU trainer's layout);
- direct send: one whole sync of that state dict through the kernel layout's own NCCL sender
  (`weightsync/direct.py`: gather, the casting build into staging, fingerprints, the broadcast call) to a
  broadcaster that does nothing, the small model's bucket set so that the same tensors are staged as in the real
  one.

For each: aten operators that do work (views left out: on a GPU each launches a kernel or more), and host
µs (median of `--repeats`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.bench_fingerprint import counted_ops, kernel_shapes
from benchmarks.report_json import emit


def _median_seconds(run: Callable[[], Any], repeats: int) -> float:
    run()
    seconds = []
    for _ in range(repeats):
        begin = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - begin)
    return statistics.median(seconds)


def _row(run: Callable[[], Any], count: int, repeats: int) -> dict[str, Any]:
    ops, _ = counted_ops(run)
    seconds = _median_seconds(run, repeats)
    return {
        "tensors": count,
        "ops": ops,
        "ops_per_tensor": round(ops / max(count, 1), 2),
        "host_ms": round(seconds * 1e3, 3),
        "host_us_per_tensor": round(seconds * 1e6 / max(count, 1), 1),
    }


def fingerprint_rows(model: str, *, scale: int, repeats: int) -> dict[str, Any]:
    """`meta`: the real shapes, no data: the adds and each buffer's bucket (what the host issues between two
    broadcasts), without `result()`'s read-back (nothing to read). `cpu`: every tensor shrunk `scale`
    times, the whole sync with `result()`."""
    import torch

    from r3operator.wire import receipt

    shapes = kernel_shapes(model)
    full = [(name, torch.empty(shape, dtype=torch.bfloat16, device="meta")) for name, shape in shapes]
    tiny = [(name, torch.randn(max(1, _numel(shape) // scale)).to(torch.bfloat16)) for name, shape in shapes]

    def sync(named: list[tuple[str, Any]], shrink: int, read: bool) -> Callable[[], Any]:
        bucket = receipt.BUCKET_BYTES // shrink
        buffer = max(t.numel() * t.element_size() for _, t in named)  # `packed_buffer_bytes`: the largest

        def run() -> Any:
            log, filled = receipt.FingerprintLog(bucket_bytes=bucket), 0
            for name, tensor in named:
                if filled > buffer:  # vLLM's producer starts the next buffer on its other stream
                    log.flush()
                    filled = 0
                log.add(name, tensor)
                filled += tensor.numel() * tensor.element_size()
            return log.result() if read else log.flush()

        return run

    def big(named: list[tuple[str, Any]], shrink: int) -> list[tuple[str, Any]]:
        return [(n, t) for n, t in named if t.numel() * t.element_size() > receipt.BUCKET_BYTES // shrink]

    saved = receipt.NUMPY_ON_CPU, receipt.SLICE_BYTES, receipt.GROUP_ROWS
    receipt.NUMPY_ON_CPU = False  # the GPU's path
    try:
        out: dict[str, Any] = {
            "meta": {
                "sync_without_read_back": _row(sync(full, 1, False), len(full), repeats),
                "big_tensors_only": _row(sync(big(full, 1), 1, False), len(big(full, 1)), repeats),
            }
        }
        receipt.SLICE_BYTES //= scale
        out["cpu"] = {
            "scale": scale,
            "bytes": sum(t.numel() * t.element_size() for _, t in tiny),
            "sync": _row(sync(tiny, scale, True), len(tiny), repeats),
            "big_tensors_only": _row(sync(big(tiny, scale), scale, True), len(big(tiny, scale)), repeats),
        }
        return out
    finally:
        receipt.NUMPY_ON_CPU, receipt.SLICE_BYTES, receipt.GROUP_ROWS = saved


def _small_spec(model: str) -> Any:
    from r3operator.models.reference import get_spec

    update = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
    update |= {"moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2, "vocab_size": 1024}
    return get_spec(model).model_copy(update=update)


def gather_rows(model: str, *, repeats: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from transformers import Qwen3MoeForCausalLM

    from r3operator.wire.kernel_layout import EngineParameter, kernel_tensors, plan_kernel_layout, trainer_shapes

    config = _small_spec(model).hf_config()
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in Qwen3MoeForCausalLM(config).state_dict().items()}
    state = {name: torch.randn(shape) for name, shape in shapes.items()}
    engine = [EngineParameter(name, "bfloat16", _kernel_shape(name, state, config)) for name in _engine_names(config)]
    plan = plan_kernel_layout(trainer_shapes(state), engine)

    def gather(sd: dict[str, Any]) -> Callable[[], Any]:
        return lambda: list(kernel_tensors(sd, plan, dtype=torch.bfloat16, device="cpu"))

    def direct(sd: dict[str, Any]) -> Callable[[], Any]:
        return lambda: _direct_send(sd, plan, big_over=_BIG_OVER_BYTES)

    rows: dict[str, Any] = {"trainer_tensors": len(state), "tensor_fp32": _row(gather(state), len(plan), repeats)}
    rows["direct_send_fp32"] = _row(direct(state), len(plan), repeats)
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        sharded = {name: distribute_tensor(t, mesh, [Shard(0)]).requires_grad_() for name, t in state.items()}
        rows["dtensor_fp32_one_rank"] = _row(gather(sharded), len(plan), repeats)
        rows["direct_send_dtensor_fp32_one_rank"] = _row(direct(sharded), len(plan), repeats)
    finally:
        if own_group:  # `make bench` runs other benchmarks in this process
            dist.destroy_process_group()
    return rows


_BIG_OVER_BYTES = 24 << 10
"""The small model's fingerprint bucket: its embedding, lm_head and expert blocks are bigger (staged, fingerprinted
by slices), its q/k/v and the rest smaller (own tensors, bucketed), as the real model's are against 256 MB."""


def _direct_send(state: dict[str, Any], plan: Sequence[Any], *, big_over: int) -> None:
    """One sync through the kernel layout's own sender (weightsync/direct.py) to a broadcaster that does nothing:
    its per-parameter host work (gather, build, fingerprint, the broadcast call), no bytes moved anywhere."""

    from r3operator.weightsync.direct import DirectKernelSend
    from r3operator.wire.receipt import FingerprintLog
    from r3operator.wire.sync_phases import SyncPhases

    class Nowhere:
        def broadcast(self, tensor: Any, src: int, stream: Any = None) -> None:
            return None

    sent = FingerprintLog(bucket_bytes=big_over)
    DirectKernelSend().send(Nowhere(), state, plan, device="cpu", sent=sent, phases=SyncPhases())
    sent.flush()


def _engine_names(config: Any) -> list[str]:
    names = ["model.embed_tokens.weight"]
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}"
        names += [
            f"{prefix}.input_layernorm.weight",
            f"{prefix}.self_attn.qkv_proj.weight",
            f"{prefix}.self_attn.o_proj.weight",
            f"{prefix}.self_attn.q_norm.weight",
            f"{prefix}.self_attn.k_norm.weight",
            f"{prefix}.post_attention_layernorm.weight",
            f"{prefix}.mlp.gate.weight",
            f"{prefix}.mlp.experts.w13_weight",
            f"{prefix}.mlp.experts.w2_weight",
        ]
    return [*names, "model.norm.weight", "lm_head.weight"]


def _kernel_shape(name: str, state: dict[str, Any], config: Any) -> tuple[int, ...]:
    if name in state:
        return tuple(state[name].shape)
    prefix = name.rsplit(".", 1)[0]
    if name.endswith("qkv_proj.weight"):
        heads = config.num_attention_heads + 2 * config.num_key_value_heads
        return (heads * config.head_dim, config.hidden_size)
    if name.endswith("w13_weight"):
        return tuple(state[f"{prefix}.gate_up_proj"].shape)
    return tuple(state[f"{prefix}.down_proj"].shape)


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for dim in shape:
        count *= int(dim)
    return count


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="a3b-x16l", help="a reference model")
    parser.add_argument("--scale", type=int, default=4096, help="fingerprints: shrink every tensor this many times")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.scale < 1 or args.repeats < 1:
        parser.error(f"--scale and --repeats must be >= 1, got {args.scale} and {args.repeats}")
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # host cost, not parallel kernels (and a shared 2-core box)
    try:
        result = {
            "model": args.model,
            "fingerprint": fingerprint_rows(args.model, scale=args.scale, repeats=args.repeats),
            "gather": gather_rows(args.model, repeats=args.repeats),
        }
    finally:
        torch.set_num_threads(threads)
    emit(result, args.json)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
