"""`make bench`: run the CPU benchmarks and write their figures to runs/bench/<name>.json.

    python -m benchmarks                  # all CPU benchmarks
    python -m benchmarks routing operator # a subset

GPU figures are produced on the device machine with the same modules (see docs/benchmarks.md for
the exact commands); this runner does not pretend to measure them here.
"""

from __future__ import annotations

import importlib
import inspect
import json
import sys
import time
from pathlib import Path

# name -> (module, argv for its main() on this 2-core CPU machine)
BENCHMARKS: dict[str, tuple[str, list[str]]] = {
    "routing": ("benchmarks.bench_routing", []),
    "operator": ("benchmarks.bench_operator", []),
    "fidelity": ("benchmarks.bench_fidelity", ["--model", "tiny", "--device", "cpu"]),
    "replay_overhead": ("benchmarks.bench_replay_overhead", ["--model", "tiny", "--device", "cpu"]),
    "megatron": ("benchmarks.bench_megatron", ["--device", "cpu"]),
    "trainer_ranks": (
        "benchmarks.bench_trainer_ranks",
        ["--model", "tiny", "--device", "cpu", "--ranks", "1", "2", "--steps", "2"],
    ),
    "async": ("benchmarks.bench_async", ["--device", "cpu"]),
    "partial_routes": ("benchmarks.bench_partial_routes", ["--device", "cpu"]),
    "checkpoint_staging": ("benchmarks.bench_checkpoint_staging", ["--device", "cpu", "--params-m", "50"]),
    "fingerprint": ("benchmarks.bench_fingerprint", ["--models", "a3b"]),
    "engine_load": ("benchmarks.bench_engine_load", ["--models", "gpu,a3b"]),
    "sync_host": ("benchmarks.bench_sync_host", ["--model", "a3b-x16l", "--repeats", "10"]),
}


def main(names: list[str]) -> int:
    selected = names or list(BENCHMARKS)
    unknown = [n for n in selected if n not in BENCHMARKS]
    if unknown:
        print(f"unknown benchmark(s): {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    out_dir = Path("runs/bench")
    out_dir.mkdir(parents=True, exist_ok=True)
    failed = []
    for name in selected:
        module_name, argv = BENCHMARKS[name]
        print(f"== {name} ({module_name} {' '.join(argv)})", flush=True)
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            print(f"   skipped: {exc}", flush=True)
            continue
        start = time.perf_counter()
        try:
            takes_argv = bool(inspect.signature(module.main).parameters)
            result = module.main(argv) if takes_argv else module.main()
        except Exception as exc:  # a benchmark failing must not hide the others' figures
            print(f"   FAILED: {type(exc).__name__}: {exc}", flush=True)
            failed.append(name)
            continue
        record = {
            "benchmark": name,
            "argv": argv,
            "wall_seconds": round(time.perf_counter() - start, 1),
            "date": time.strftime("%Y-%m-%d"),
            "result": result,
        }
        (out_dir / f"{name}.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
