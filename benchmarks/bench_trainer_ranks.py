"""The trainer on 1, 2, 4 ranks (Ray actors, FSDP2 over all, `trainer/distributed.py`): step time split,
tokens/s per GPU, peak memory per GPU, and the checkpoint's in-step cost vs its background copy and write.

    python3 -m benchmarks.bench_trainer_ranks --model gpu --device cuda --ranks 1 2 4 --json out.json
    python -m benchmarks.bench_trainer_ranks --model tiny --device cpu --ranks 1 2

One global batch (`--batch` rows of `--seq` tokens, the second half a response, R3 routes drawn at
random) for every rank count, so the ranks split the same work (strong scaling). Every rank count runs
through the same Ray-actor path, one rank included. Per step: old-logprob pass (R3 replay), PPO update,
weight-sync gather (rank 0 packs the full bf16 weights, as for the engines), checkpoint staging (what
the step waits for: the copy into host memory enqueued). After the step, timed one after the other: the
copy into host memory (in a run it overlaps the next step's rollout and old-logprob pass; the next
optimizer step waits for it) and the write to disk. The first step is a
warm-up and not reported; figures are medians over `--steps`. Rank counts above the GPUs present are
skipped and said so.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.report_json import emit

PHASES = ("old_logprob", "update", "weight_sync", "checkpoint_stage")


def r3_batch(*, rows: int, seq: int, vocab: int, layers: int, experts: int, top_k: int, seed: int = 0) -> Any:
    import torch

    from r3operator.trainer.batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, seq), generator=g)
    resp = torch.zeros(rows, seq - 1, dtype=torch.bool)
    resp[:, seq // 2 - 1 :] = True
    routes = torch.rand(rows, seq, layers, experts, generator=g).argsort(-1)[..., :top_k]
    return TrainBatch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        response_mask=resp,
        rollout_logprobs=torch.zeros(rows, seq - 1),
        advantages=torch.randn(rows, generator=g),
        engine_routes=routes,
        route_pad=torch.zeros(rows, seq, dtype=torch.bool),
        sample_ids=[f"b{i}" for i in range(rows)],
    )


def measure(
    model_dir: Path, *, ranks: int, device: str, batch: Any, steps: int, mini_batches: int, compute_dtype: str
) -> dict[str, Any]:
    import torch

    from r3operator.api.enums import ReplayMode
    from r3operator.trainer.distributed import DistributedTrainer, PolicyOptions

    options = PolicyOptions(learning_rate=1e-6, seed=0, compute_dtype=compute_dtype)
    begin = time.perf_counter()
    trainer = DistributedTrainer(model_dir, world_size=ranks, device=device, options=options)
    start_s = time.perf_counter() - begin
    per_step: list[dict[str, float]] = []
    sync_bytes = 0
    try:
        with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as ckpt_root:
            trainer.peak_memory_bytes(reset=True)
            for step in range(steps + 1):  # step 0: warm-up
                t: dict[str, float] = {}
                mark = time.perf_counter()
                old = trainer.old_logprobs(batch, ReplayMode.R3)
                t["old_logprob"] = time.perf_counter() - mark
                mark = time.perf_counter()
                trainer.update(batch, old, mini_batches=mini_batches, clip_low=0.2, clip_high=0.28)
                t["update"] = time.perf_counter() - mark
                mark = time.perf_counter()
                sync_bytes = sum(c.nbytes for c in trainer.weight_chunks(chunk_size_mb=512, dtype=torch.bfloat16))
                t["weight_sync"] = time.perf_counter() - mark
                mark = time.perf_counter()
                trainer.save_checkpoint_async(Path(ckpt_root) / f"step-{step}")
                t["checkpoint_stage"] = time.perf_counter() - mark
                t["step"] = sum(t[p] for p in PHASES)
                mark = time.perf_counter()
                trainer.wait_checkpoint_staged()  # outside the step: the rest of the copy into host memory
                t["checkpoint_copy_after_step"] = time.perf_counter() - mark
                mark = time.perf_counter()
                trainer.wait_checkpoint()  # then the write to disk
                t["checkpoint_write_after_step"] = time.perf_counter() - mark
                # One checkpoint on disk at a time: the a3b model's is 30 GB, a GPU machine's disk 64 GB.
                shutil.rmtree(Path(ckpt_root) / f"step-{step}")
                if step:
                    per_step.append(t)
            peaks = trainer.peak_memory_bytes()
    finally:
        trainer.close()
    medians = {k: statistics.median(s[k] for s in per_step) for k in per_step[0]}
    tokens = int(batch.attention_mask.sum())
    train_s = medians["old_logprob"] + medians["update"]
    return {
        "ranks": ranks,
        "start_seconds": round(start_s, 2),
        "median_seconds": {k: round(v, 4) for k, v in medians.items()},
        "tokens_per_step": tokens,
        "tokens_per_second_per_rank": round(tokens / train_s / ranks, 1),
        "peak_memory_gib_per_rank": [round(b / 2**30, 3) for b in peaks],
        "weight_sync_gib": round(sync_bytes / 2**30, 3),
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--batch", type=int, default=None, help="rows per step (all ranks together)")
    parser.add_argument("--seq", type=int, default=None, help="tokens per row")
    parser.add_argument("--steps", type=int, default=3, help="measured steps after one warm-up")
    parser.add_argument("--mini-batches", type=int, default=1)
    parser.add_argument("--compute-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    import os

    import ray
    import torch
    from transformers import AutoConfig

    from r3operator.models import ensure_reference_model

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    rows = args.batch or (32 if device == "cuda" else 4)
    seq = args.seq or (512 if device == "cuda" else 64)
    model_dir = ensure_reference_model(args.model)
    cfg = AutoConfig.from_pretrained(model_dir)
    batch = r3_batch(
        rows=rows,
        seq=seq,
        vocab=int(cfg.vocab_size),
        layers=int(cfg.num_hidden_layers),
        experts=int(cfg.num_experts),
        top_k=int(cfg.num_experts_per_tok),
    )
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if not ray.is_initialized():
        ray.init(num_cpus=max(os.cpu_count() or 1, 2), num_gpus=gpus, include_dashboard=False, log_to_driver=False)
    results: list[dict[str, Any]] = []
    skipped: list[str] = []
    for ranks in args.ranks:
        if device == "cuda" and ranks > gpus:
            skipped.append(f"{ranks} ranks: only {gpus} GPU(s) here")
            print(f"-- {ranks} ranks skipped: only {gpus} GPU(s) here", flush=True)
            continue
        result = measure(
            model_dir,
            ranks=ranks,
            device=device,
            batch=batch,
            steps=args.steps,
            mini_batches=args.mini_batches,
            compute_dtype=args.compute_dtype,
        )
        results.append(result)
        m = result["median_seconds"]
        print(
            f"{ranks} rank(s): step {m['step']:.3f} s = old_logprob {m['old_logprob']:.3f} + update "
            f"{m['update']:.3f} + weight_sync {m['weight_sync']:.3f} + checkpoint staging "
            f"{m['checkpoint_stage']:.3f} (after the step: copy {m['checkpoint_copy_after_step']:.3f}, write "
            f"{m['checkpoint_write_after_step']:.3f}); "
            f"{result['tokens_per_second_per_rank']:.0f} tokens/s per rank; peak memory per rank "
            f"{result['peak_memory_gib_per_rank']} GiB",
            flush=True,
        )
    report = {
        "model": args.model,
        "device": device,
        "gpu": torch.cuda.get_device_name(0) if gpus else None,
        "torch": torch.__version__,
        "batch_rows": rows,
        "seq": seq,
        "compute_dtype": args.compute_dtype,
        "mini_batches": args.mini_batches,
        "results": results,
        "skipped": skipped,
    }
    emit(report, args.json, echo=False)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
