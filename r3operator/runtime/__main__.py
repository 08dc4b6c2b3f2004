"""`python -m r3operator.runtime FILE` / `--config /etc/r3operator/config.json` (the trainer pod)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from r3operator.runtime.app import build_settings, run_job


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m r3operator.runtime", description=__doc__)
    parser.add_argument("file", nargs="?", type=Path, help="RLJob YAML file")
    parser.add_argument("--config", type=Path, help="operator ConfigMap JSON (RLJob under 'rljob')")
    parser.add_argument("--compare-replay", action="store_true", help="same seed with replay off, then R3")
    parser.add_argument("--steps", type=int, help="override spec.algorithm.steps (env R3_STEPS)")
    parser.add_argument("--out-dir", type=Path, default=Path("runs"))
    parser.add_argument("--no-resume", dest="resume", action="store_false")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--model", help="reference model name or directory (env R3_MODEL), e.g. gpu")
    parser.add_argument("--metrics-port", type=int, help="Prometheus port; 0 = off (default off locally)")
    parser.add_argument("--quiet", action="store_true", help="no live table")
    args = parser.parse_args(argv)
    if args.file is None and args.config is None:
        parser.error("give an RLJob FILE or --config")
    settings = build_settings(
        args.file, config=args.config, steps=args.steps, out_dir=args.out_dir, resume=args.resume,
        device=args.device, model=args.model, metrics_port=args.metrics_port,
    )  # fmt: skip
    settings.show_progress = not args.quiet
    out = run_job(settings, compare_replay=args.compare_replay)
    print(f"run directory: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
