"""Copy bandwidth of this machine's GPUs: the ceiling next to which the weight sync's figures are read.

    python3 -m benchmarks.bench_gpu_copy --mib 1024 --json OUT/gpu_copy.json

- device copy: one GPU copying a buffer into another buffer of its own (read + write of `--mib`);
- peer copy: GPU 0 to GPU 1 (`tensor.copy_` across devices: NVLink/PCIe peer access where the driver
  allows it, else staged through the host), on 2 GPUs or more;
- host to device: pinned host memory to GPU 0.
Each figure is the median of `--iters` copies after one warm-up, in GB/s (10^9 bytes of the buffer per
second). The raw NCCL broadcast between two GPUs is `bench_weight_sync --methods nccl,…`'s own figure.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.report_json import emit
from benchmarks.timing import median_seconds


def _median_gbps(copy: Callable[[], Any], nbytes: int, iters: int, sync: Callable[[], None]) -> float:
    return round(nbytes / median_seconds(copy, iters, sync) / 1e9, 2)


def device_copy_gbps(nbytes: int, *, device: str = "cuda:0", iters: int = 10) -> float:
    """One GPU copying a buffer of `nbytes` into another of its own: the ceiling of a colocated (IPC) sync."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    try:
        return _median_gbps(partial(dst.copy_, src), nbytes, iters, partial(torch.cuda.synchronize, device))
    finally:
        del src, dst


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024, help="buffer size")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        parser.error("needs CUDA")
    nbytes = args.mib * 2**20
    count = torch.cuda.device_count()
    result: dict[str, Any] = {
        "torch": torch.__version__,
        "gpus": [torch.cuda.get_device_name(i) for i in range(count)],
        "mib": args.mib,
        "device_copy_gbps": [],
        "peer_copy_gbps": None,
        "host_to_device_gbps": None,
    }

    def sync_all() -> None:
        for i in range(count):
            torch.cuda.synchronize(i)

    for i in range(count):
        result["device_copy_gbps"].append(device_copy_gbps(nbytes, device=f"cuda:{i}", iters=args.iters))
    if count >= 2:
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
        result["peer_access_0_1"] = bool(torch.cuda.can_device_access_peer(0, 1))
        result["peer_copy_gbps"] = _median_gbps(lambda: dst.copy_(src), nbytes, args.iters, sync_all)
        del src, dst
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    result["host_to_device_gbps"] = _median_gbps(
        lambda: dev.copy_(host, non_blocking=True), nbytes, args.iters, sync_all
    )
    emit(result, args.json)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
