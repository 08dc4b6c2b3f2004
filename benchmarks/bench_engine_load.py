"""The engine side of a weight sync: vLLM's `model.load_weights` over one full sync, per tensor (issue 24).

    # CPU, no memory needed: the model and the tensors on `meta` (shapes only): the host (Python) work alone
    python3 -m benchmarks.bench_engine_load --models gpu,a3b,a3b-x16l --device meta --json OUT/engine_load.json
    # CPU with real bytes (a model that fits the box): the same load plus the copies
    python3 -m benchmarks.bench_engine_load --models gpu --device cpu
    # GPU: the same load with the copies on the device (a3b-x16l: ~40 GB, model + one sync's tensors)
    python3 -m benchmarks.bench_engine_load --models gpu,a3b,a3b-x16l --device cuda
    # the kernel layout next to it: one copy_ per vLLM parameter (wire/kernel_layout.py), no bracket
    python3 -m benchmarks.bench_engine_load --models gpu,a3b,a3b-x16l --device meta --layout both

What it runs: vLLM's own `Qwen3MoeForCausalLM` (the engine's model class, built from the reference model's
config; no weights read from disk) and the checkpoint tensors the trainer sends in a sync (experts unfused,
bf16, `wire/weights.checkpoint_metadata`), grouped as vLLM's packed receiver hands them to `load_weights`:
a new batch once `--batch-mb` would overflow. One `load_weights` call per batch, as the receiver does.

On `meta` no byte moves (every copy is a shape check), so the seconds are what a GPU engine also spends on
its host, in Python and in dispatching operators, per sync: the floor below which the engine's part of
`transfer` cannot go unless the load is overlapped with the transfer or done differently. A cProfile run
of the same load splits those seconds by where they go (`load_weights`' own loop and name matching, the
FusedMoE expert loader, the other loaders, the torch operators).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import math
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks.report_json import write_json


def checkpoint_metadata_for(model: str) -> list[tuple[str, Any, tuple[int, ...]]]:
    """(checkpoint name, dtype, shape) of every tensor the trainer sends for reference model `model`."""
    import torch
    from transformers import Qwen3MoeForCausalLM

    from r3operator.models.reference import get_spec
    from r3operator.wire.weights import checkpoint_metadata

    with torch.device("meta"):
        hf = Qwen3MoeForCausalLM(get_spec(model).hf_config())
    return checkpoint_metadata(hf.state_dict(), dtype=torch.bfloat16)


_distributed_ready = False


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def engine_config(model: str) -> Iterator[Any]:
    """vLLM's config for reference model `model` (config + tokenizer only, no weights) made current, with
    vLLM's single-rank process groups initialised once per process (gloo: CPU)."""
    global _distributed_ready
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (
        ensure_model_parallel_initialized,
        init_distributed_environment,
        model_parallel_is_initialized,
    )
    from vllm.engine.arg_utils import EngineArgs

    from r3operator.models.reference import get_spec
    from r3operator.models.tokenizer import save_tokenizer

    spec = get_spec(model)
    with tempfile.TemporaryDirectory(prefix=f"r3-engine-load-{model}-") as tmp:
        spec.hf_config().save_pretrained(tmp)
        save_tokenizer(Path(tmp), spec.vocab_size, spec.max_position_embeddings)
        args = EngineArgs(model=tmp, dtype="bfloat16", max_model_len=512, enforce_eager=True, skip_tokenizer_init=True)
        config = args.create_engine_config()
        with set_current_vllm_config(config):
            if not _distributed_ready and not model_parallel_is_initialized():
                init_distributed_environment(
                    world_size=1,
                    rank=0,
                    local_rank=0,
                    distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
                    backend="gloo",
                )
                ensure_model_parallel_initialized(1, 1)
                _distributed_ready = True
            yield config


@contextmanager
def meta_safe_cpu_prepack(device: str) -> Iterator[None]:
    """On `meta`, the CPU MoE kernel's weight prepack (a C++ op with no meta kernel, run when a layer is
    processed in the bracket) returns the weight as it is: a GPU engine does not prepack, and on meta no
    byte moves anyway. On a real device nothing is changed."""
    if device != "meta":
        yield
        return
    from unittest import mock

    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    def unchanged(weight: Any, *_isa: Any) -> Any:
        return weight

    with mock.patch.object(cpu_moe, "cpu_prepack_moe_weight", unchanged):
        yield


def build_engine_model(config: Any, device: str) -> Any:
    """vLLM's Qwen3-MoE model class on `device` (uninitialised parameters)."""
    import torch
    from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM

    # Typed as Any: vLLM's mixins declare attributes (lora_manager) that mypy takes for abstract ones.
    model_class: Any = Qwen3MoeForCausalLM
    with torch.device(device):
        model = model_class(vllm_config=config, prefix="")
    return model.to(torch.bfloat16)


def sync_batches(
    metadata: Sequence[tuple[str, Any, tuple[int, ...]]], device: str, batch_mb: int
) -> list[list[tuple[str, Any]]]:
    """One sync's tensors on `device`, in the batches vLLM's packed producer sends (the runtime's own
    `chunk_tensors`: a new batch once the buffer would overflow)."""
    import torch

    from r3operator.wire.weights import chunk_tensors

    fill = torch.zeros if device != "meta" else torch.empty
    tensors = ((name, fill(shape, dtype=dtype, device=device)) for name, dtype, shape in metadata)
    return list(chunk_tensors(tensors, chunk_size_mb=batch_mb))


def kernel_sync_batches(
    model: str, engine: Any, device: str, batch_mb: int
) -> tuple[list[list[tuple[str, Any]]], list[tuple[str, Any, tuple[int, ...]]]]:
    """One kernel-format sync (wire/kernel_layout.py: one tensor per vLLM parameter, planned from the
    engine's own `named_parameters` and the trainer's state-dict shapes) on `device`, batched as
    `sync_batches` does; and its metadata."""
    import torch
    from transformers import Qwen3MoeForCausalLM

    from r3operator.models.reference import get_spec
    from r3operator.wire.kernel_layout import engine_parameters, kernel_metadata, plan_kernel_layout, trainer_shapes
    from r3operator.wire.weights import chunk_tensors

    with torch.device("meta"):
        hf = Qwen3MoeForCausalLM(get_spec(model).hf_config())
    reported = engine_parameters([(n, str(p.dtype), tuple(p.shape)) for n, p in engine.named_parameters()])
    metadata = kernel_metadata(plan_kernel_layout(trainer_shapes(hf.state_dict()), reported), dtype=torch.bfloat16)
    fill = torch.zeros if device != "meta" else torch.empty
    tensors = ((name, fill(shape, dtype=dtype, device=device)) for name, dtype, shape in metadata)
    return list(chunk_tensors(tensors, chunk_size_mb=batch_mb)), metadata


def load_sync_kernel(model: Any, batches: Sequence[Sequence[tuple[str, Any]]]) -> int:
    """One kernel-format sync's engine load, as vLLM 0.22.1's `update_weights` does it with
    `is_checkpoint_format=False` (`load_weights_direct`): per received tensor `model.get_parameter(name)`
    and one `param.copy_`, no bracket, no loader; under `no_grad`, as the worker extension calls it (an
    RMSNorm weight is a plain `nn.Parameter` that requires grad). Returns how many parameters were written."""
    import torch

    written = 0
    with torch.no_grad():
        for batch in batches:
            for name, weight in batch:
                model.get_parameter(name).copy_(weight)
                written += 1
    return written


def load_sync(model: Any, batches: Sequence[Sequence[tuple[str, Any]]], bracket: Any = None) -> int:
    """One sync's engine load: `load_weights` once per received batch; returns how many of the model's
    parameters were loaded (a fused parameter whose experts span two batches counts once).

    `bracket`: the model config, to load inside vLLM's layerwise-reload bracket as the native
    `start_weight_update` / `finish_weight_update` do (each layer's weights buffered, then replayed into a
    fresh copy of the layer and copied into the kernel tensors); None: plain `load_weights`.
    """
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    if bracket is not None:
        initialize_layerwise_reload(model)
    loaded: set[str] = set()
    for batch in batches:
        loaded |= model.load_weights(iter(list(batch)))
    if bracket is not None:
        finalize_layerwise_reload(model, bracket)
    return len(loaded)


# Where a profiled load's seconds go: (label, predicate on cProfile's (file, line, function) key). The first
# match wins for a function's OWN time (tottime), so every second lands in exactly one bucket.
_BUCKETS: list[tuple[str, Any]] = [
    ("torch operators (narrow, copy_, views)", lambda f, fn: "/torch/" in f or (f == "~" and "torch" in fn)),
    (
        "layerwise reload (buffer, bind, count, replay)",
        lambda f, fn: "model_loader/reload/" in f or f.endswith("inspect.py"),
    ),
    ("FusedMoE expert weight_loader", lambda f, fn: "fused_moe/layer.py" in f or "fused_moe/" in f),
    ("load_weights loop + name matching", lambda f, fn: "models/qwen3_moe.py" in f or "models/utils.py" in f),
    ("other weight loaders", lambda f, fn: "model_loader/weight_utils.py" in f or "parameter.py" in f),
]


def profile_split(model: Any, batches: Sequence[Sequence[tuple[str, Any]]], bracket: Any) -> dict[str, float]:
    """Own (tottime) seconds of one profiled sync, summed per bucket of `_BUCKETS` (profiler overhead included:
    only the shares mean anything)."""
    profiler = cProfile.Profile()
    profiler.enable()
    load_sync(model, batches, bracket)
    profiler.disable()
    stats = pstats.Stats(profiler)
    split: dict[str, float] = {label: 0.0 for label, _ in _BUCKETS}
    split["other Python (re, builtins, vLLM helpers)"] = 0.0
    for (filename, _line, function), row in stats.stats.items():  # type: ignore[attr-defined]
        tottime = float(row[2])
        for label, matches in _BUCKETS:
            if matches(filename, function):
                split[label] += tottime
                break
        else:
            split["other Python (re, builtins, vLLM helpers)"] += tottime
    return {label: round(seconds, 4) for label, seconds in split.items()}


def receipt_seconds(batches: Sequence[Sequence[tuple[str, Any]]], repeats: int) -> float:
    """Median seconds of the receipt's records alone over one sync's batches (a fresh receipt each time): what
    the worker extension's tap on `load_weights` adds to a native sync (engine/worker.py)."""
    from r3operator.wire.receipt import SyncReceipt

    seconds = []
    for _ in range(repeats):
        receipt = SyncReceipt()
        start = time.perf_counter()
        for batch in batches:
            receipt.record(list(batch))
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def _load(engine: Any, batches: Sequence[Sequence[tuple[str, Any]]], model_config: Any, kernel: bool) -> int:
    return load_sync_kernel(engine, batches) if kernel else load_sync(engine, batches, model_config)


def measure(
    model: str, *, device: str, batch_mb: int, repeats: int, bracket: bool, layout: str = "checkpoint"
) -> dict[str, Any]:
    import torch

    kernel = layout == "kernel"
    bracket = bracket and not kernel  # vLLM skips the bracket for kernel-format weights
    checkpoint_meta = checkpoint_metadata_for(model)
    with engine_config(model) as config, meta_safe_cpu_prepack(device):
        engine = build_engine_model(config, device)
        model_config = config.model_config if bracket else None
        if bracket:
            from vllm.model_executor.model_loader.reload import record_metadata_for_reloading

            with torch.device(device):
                record_metadata_for_reloading(engine)
        if kernel:
            batches, metadata = kernel_sync_batches(model, engine, device, batch_mb)
        else:
            metadata = checkpoint_meta
            batches = sync_batches(metadata, device, batch_mb)

        batch_count = len(batches)
        loaded = _load(engine, batches, model_config, kernel)  # warm-up (first-call imports and caches)
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            _load(engine, batches, model_config, kernel)
            if device.startswith("cuda"):  # the copies too, not only the host's part
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
        split = {} if kernel else profile_split(engine, batches, model_config)
        receipt_s = receipt_seconds(batches, repeats)
        del engine, batches
    total_bytes = sum(math.prod(shape) * dtype.itemsize for _, dtype, shape in metadata)
    median = statistics.median(seconds)
    return {
        "model": model,
        "device": device,
        "layout": layout,
        "checkpoint_tensors": len(checkpoint_meta),
        "bracket": bracket,
        "tensors": len(metadata),
        "bytes_bf16": total_bytes,
        "batches": batch_count,
        "batch_mb": batch_mb,
        "params_loaded": loaded,
        "sync_s": [round(s, 4) for s in seconds],
        "sync_median_s": round(median, 4),
        "per_tensor_us": round(median / len(metadata) * 1e6, 1),
        "profile_own_s": split,
        "receipt_record_median_s": round(receipt_s, 4),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gpu,a3b,a3b-x16l", help="comma-separated reference models")
    parser.add_argument("--device", default="meta", help="meta (host work only), cpu (with the copies), cuda")
    parser.add_argument("--batch-mb", type=int, default=512, help="vLLM's packed receive buffer (chunkSizeMB)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--no-bracket", action="store_true", help="plain load_weights, without vLLM's layerwise-reload bracket"
    )
    parser.add_argument(
        "--layout",
        default="checkpoint",
        choices=("checkpoint", "kernel", "both"),
        help="checkpoint: HF tensors through load_weights; kernel: one copy_ per vLLM parameter "
        "(wire/kernel_layout.py, vLLM 0.22's is_checkpoint_format=False); both: one after the other",
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.batch_mb < 1:
        parser.error(f"--batch-mb must be >= 1, got {args.batch_mb}")
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    layouts = ("checkpoint", "kernel") if args.layout == "both" else (args.layout,)
    results: list[dict[str, Any]] = []
    for m in args.models.split(","):
        for layout in layouts:
            results.append(
                measure(
                    m,
                    device=args.device,
                    batch_mb=args.batch_mb,
                    repeats=args.repeats,
                    bracket=not args.no_bracket,
                    layout=layout,
                )
            )
            if args.json is not None:  # after every model and layout: a run killed at a time limit keeps them
                write_json(args.json, results)
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
