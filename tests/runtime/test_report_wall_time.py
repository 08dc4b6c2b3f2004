"""The report's wall time says whether it contains the engines' start: only when this invocation started
them. `up` and the operator start the engines first and hand the driver their URLs; a report that then
claimed "incl. engine start" undercounted (35 s for a run whose engine alone took 100 s to come up)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from r3operator.runtime.app import build_settings, run_job
from r3operator.runtime.config import RunSettings

LOCAL = Path(__file__).resolve().parents[2] / "examples" / "rljob-local.yaml"


@pytest.fixture
def trained(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """`run_once` without training: the report's facts are what is under test, not the steps."""
    handed: list[Any] = []

    def run_once(settings: RunSettings, *, engines: Any = None, label: str | None = None) -> tuple[list, Any]:
        handed.append(engines)
        described = SimpleNamespace(describe=lambda: "-", mode="exact", autocast=False)
        run = SimpleNamespace(
            model_dir="m",
            vllm_version="v",
            weight_transfer=described,
            weight_sync=SimpleNamespace(described="-", plan=SimpleNamespace(tolerance=described)),
            trainer=SimpleNamespace(),
            engines=object(),
        )
        return [], run

    monkeypatch.setattr("r3operator.runtime.app.run_once", run_once)
    return handed


def _wall_time_line(out: Path) -> str:
    [line] = [x for x in (out / "report.md").read_text().splitlines() if x.startswith("- wall time")]
    return line


def _settings(tmp_path: Path) -> RunSettings:
    return replace(build_settings(LOCAL, out_dir=tmp_path, device="cpu"), show_progress=False)


def test_engines_reached_by_url_are_not_counted_as_started_here(tmp_path: Path, trained: list[Any]) -> None:
    settings = replace(_settings(tmp_path), engine_urls=["http://127.0.0.1:8000"])
    line = _wall_time_line(run_job(settings))
    assert "excl. engine start" in line and "incl." not in line


def test_engines_handed_in_are_not_counted_as_started_here(tmp_path: Path, trained: list[Any]) -> None:
    engines = object()
    line = _wall_time_line(run_job(_settings(tmp_path), engines=engines))
    assert trained == [engines]
    assert "excl. engine start" in line


def test_engines_started_by_this_invocation_are_counted(tmp_path: Path, trained: list[Any]) -> None:
    line = _wall_time_line(run_job(_settings(tmp_path), compare_replay=True))
    assert trained[0] is None  # the first run starts them, the second reuses them
    assert "incl. engine start" in line
