"""benchmarks/bench_route_checks.py times the passing path of the route checks: its synthetic routes must pass
every check, and the rows it replays must be the rows the engine computed (prompt + response - 1 per sample)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

from benchmarks import bench_route_checks


def test_the_synthetic_step_passes_every_check_and_replays_the_engines_rows(tmp_path: Path) -> None:
    out = tmp_path / "route-checks.json"
    argv = ["--samples", "12", "--prompt-tokens", "5", "--max-response", "9", "--repeats", "1", "--seed", "3"]
    assert bench_route_checks.main([*argv, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    # the benchmark's response lengths, drawn again from the same seed: one route row per token but the last
    rng = np.random.default_rng(3)
    rows = 0
    for _ in range(12):
        response = int(rng.integers(1, 10))
        rows += 5 + response - 1
        bench_route_checks._routes(rng, 5 + response - 1, 8, 8, 64)
        rng.integers(1, 1000, response)
    assert result["route_tokens"] == rows
    assert result["samples_kept"] == 12 and result["suspects"] == 0
    assert set(result["seconds"]) == {"before_forward", "constant_layer_suspects", "tally", "routing_agreement"}
