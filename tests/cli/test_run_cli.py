"""`r3operator run`: the one command that starts the runtime, from a file or from the operator's ConfigMap."""

from __future__ import annotations

import shlex
import tomllib
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from r3operator.api import load_rljob
from r3operator.cli.main import app
from r3operator.operator.builders.config import build_config_map
from r3operator.operator.builders.trainer import ENTRYPOINT
from r3operator.runtime.config import RunSettings
from r3operator.settings import CONFIG_KEY, CONFIG_PATH

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "qwen3-30b-a3b-r3-fsdp.yaml"
LOCAL = REPO / "examples" / "rljob-local.yaml"


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[tuple[RunSettings, bool]]:
    """Records what `run` would train instead of training it (training is covered by test_runtime_e2e)."""
    calls: list[tuple[RunSettings, bool]] = []

    def run_job(settings: RunSettings, *, compare_replay: bool = False, engines: Any = None) -> Path:
        calls.append((settings, compare_replay))
        return tmp_path

    monkeypatch.setattr("r3operator.runtime.app.run_job", run_job)
    return calls


def test_the_rayjob_entrypoint_is_r3operator_run_on_the_mounted_config(tmp_path: Path, started) -> None:
    argv = shlex.split(ENTRYPOINT)
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert argv[:2] == ["r3operator", "run"] and scripts["r3operator"] == "r3operator.cli.main:app"
    assert argv[2:] == ["--config", CONFIG_PATH]
    job = load_rljob(EXAMPLE)
    mounted = tmp_path / CONFIG_KEY
    mounted.write_text(build_config_map(job)["data"][CONFIG_KEY])
    result = CliRunner().invoke(app, [*argv[1:-1], str(mounted), "--device", "cpu", "--quiet"])
    assert result.exit_code == 0, result.output
    [(settings, compare)] = started
    assert settings.engine_urls == [
        f"http://qwen3-30b-a3b-r3-engine-{i}.qwen3-30b-a3b-r3-engine.rl.svc:8000" for i in range(4)
    ]
    assert settings.run_dir == Path("/var/lib/r3operator/runs/qwen3-30b-a3b-r3")
    assert settings.metrics_port == 9400  # spec.monitoring.port's default: the PodMonitor scrapes it
    assert settings.steps == 500 and not settings.show_progress and not compare


def test_a_file_runs_locally_with_overrides_from_flags_over_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, started
) -> None:
    monkeypatch.setenv("R3OPERATOR_STEPS", "7")
    monkeypatch.setenv("R3OPERATOR_MODEL", "small")
    result = CliRunner().invoke(
        app, ["run", str(LOCAL), "--device", "cpu", "--model", "tiny", "--out-dir", str(tmp_path), "--compare-replay"]
    )
    assert result.exit_code == 0, result.output
    [(settings, compare)] = started
    assert (settings.steps, settings.model_override, compare) == (7, "tiny", True)
    assert settings.run_dir == tmp_path / "tiny-count-r3"
    assert settings.metrics_port is None and settings.engine_urls == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "give an RLJob FILE or --config (one of them)"),
        ([str(LOCAL), "--config", CONFIG_PATH], "give an RLJob FILE or --config (not both)"),
        (["--config", "/nonexistent/config.json"], "/nonexistent/config.json: cannot read file"),
    ],
)
def test_bad_invocations_exit_2_with_a_message(args: list[str], message: str, started) -> None:
    result = CliRunner().invoke(app, ["run", *args, "--device", "cpu"])
    assert result.exit_code == 2 and message in result.output
    assert started == []


def test_a_refused_environment_value_names_the_variable(monkeypatch: pytest.MonkeyPatch, started) -> None:
    monkeypatch.setenv("R3OPERATOR_ENGINE_URLS", "http://e:8000")
    monkeypatch.setenv("R3OPERATOR_SYNC_CANARY_EPSILON", "-1")
    result = CliRunner().invoke(app, ["run", str(LOCAL), "--device", "cpu"])
    assert result.exit_code == 2 and "R3OPERATOR_SYNC_CANARY_EPSILON='-1'" in result.output
    assert started == []
