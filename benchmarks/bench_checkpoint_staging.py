"""What a checkpoint save costs the training step: `ShardedCheckpointer` (asynchronous staging into host
buffers reused across saves; pinned on CUDA) against a plain `dcp.async_save` (its default stager copies
the state into fresh host memory before it returns).

    python -m benchmarks.bench_checkpoint_staging --device cpu --params-m 25
    python3 -m benchmarks.bench_checkpoint_staging --device cuda --params-m 1000 --json OUT.json

The state is an MLP's fp32 weights + AdamW moments (12 bytes a parameter), one optimizer step into the
run. Per save: `in_step` (until the save call returns), `copy_after` (until the copy into host memory is
done; the next optimizer step waits for it in a run) and `write_after` (until the files are on disk).
The first save is a warm-up (it allocates, and on CUDA pins, the reused buffers) and is reported apart;
figures are medians over the other `--saves`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.report_json import emit

HIDDEN = 4096


def _model(params_m: float, device: str) -> tuple[Any, Any]:
    import torch

    layers = max(1, round(params_m * 1e6 / (HIDDEN * HIDDEN)))
    model = torch.nn.Sequential(*[torch.nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(layers)]).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    model(torch.ones(1, HIDDEN, device=device)).sum().backward()
    optimizer.step()
    return model, optimizer


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed_saves(
    saves: int, device: str, start: Callable[[Path], None], staged: Callable[[], None], written: Callable[[], None]
) -> dict[str, Any]:
    rows: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="bench-staging-") as root:
        for i in range(saves + 1):
            _sync(device)
            mark = time.perf_counter()
            start(Path(root) / f"save-{i}")
            t = {"in_step": time.perf_counter() - mark}
            mark = time.perf_counter()
            staged()
            t["copy_after"] = time.perf_counter() - mark
            mark = time.perf_counter()
            written()
            t["write_after"] = time.perf_counter() - mark
            rows.append(t)
    first, rest = rows[0], rows[1:]
    return {
        "first_save_seconds": {k: round(v, 4) for k, v in first.items()},
        "median_seconds": {k: round(statistics.median(r[k] for r in rest), 4) for k in first},
    }


def measure(*, params_m: float, device: str, saves: int) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict_saver import async_save

    from r3operator.trainer.sharded_checkpoint import ShardedCheckpointer, policy_state

    model, optimizer = _model(params_m, device)
    state = policy_state(model, optimizer)
    n_params = sum(p.numel() for p in model.parameters())

    checkpointer = ShardedCheckpointer()
    try:
        ours = _timed_saves(
            saves, device, lambda d: checkpointer.save_async(d, state), checkpointer.wait_staged, checkpointer.wait
        )
    finally:
        checkpointer.close()

    pending: list[Any] = []
    plain = _timed_saves(
        saves,
        device,
        lambda d: pending.append(async_save(state, checkpoint_id=str(d))),
        lambda: None,
        lambda: pending.pop().result(),
    )
    return {
        "parameters": n_params,
        "state_gib": round(n_params * 12 / 2**30, 3),
        "sharded_checkpointer": ours,
        "plain_async_save": plain,
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--params-m", type=float, default=25.0, help="model parameters, millions")
    parser.add_argument("--saves", type=int, default=3, help="measured saves after one warm-up")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    import torch

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    result = measure(params_m=args.params_m, device=device, saves=args.saves)
    report = {
        "device": device,
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None,
        "torch": torch.__version__,
        **result,
    }
    for name in ("sharded_checkpointer", "plain_async_save"):
        m = report[name]["median_seconds"]
        print(
            f"{name}: {report['state_gib']} GiB state, in step {m['in_step']:.3f} s, then copy "
            f"{m['copy_after']:.3f} s, write {m['write_after']:.3f} s (first save: "
            f"{report[name]['first_save_seconds']})",
            flush=True,
        )
    emit(report, args.json, echo=False)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
