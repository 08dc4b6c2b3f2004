"""benchmarks/bench_route_checks.py times the passing path of the route checks: its synthetic routes must pass
every check, and the rows it replays must be the rows the engine computed (prompt + response - 1 per sample)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from benchmarks import bench_route_checks


def _run(tmp_path: Path, *argv: str) -> dict[str, Any]:
    out = tmp_path / "route-checks.json"
    assert bench_route_checks.main([*argv, "--repeats", "1", "--json", str(out)]) == 0
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def test_the_synthetic_step_passes_every_check_and_replays_the_engines_rows(tmp_path: Path) -> None:
    one_token = _run(tmp_path, "--samples", "12", "--prompt-tokens", "5", "--max-response", "1")
    assert one_token["route_tokens"] == 12 * (5 + 1 - 1)  # every response one token: prompt + 1 - 1 rows a sample
    drawn = _run(tmp_path, "--samples", "12", "--prompt-tokens", "5", "--max-response", "9", "--seed", "3")
    assert 12 * 5 <= drawn["route_tokens"] <= 12 * (5 + 9 - 1)
    for result in (one_token, drawn):
        assert result["samples_kept"] == 12 and result["suspects"] == 0 and result["agreement_matches_host"] is True
        assert set(result["seconds"]) == {"before_forward", "constant_layer_suspects", "tally", "routing_agreement"}
