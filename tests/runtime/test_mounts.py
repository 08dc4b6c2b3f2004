"""R3OPERATOR_MOUNTS: the driver reads pod paths (``--config``, ``routingDir``, the model directory) where a
volume lives outside a pod, with its argv unchanged; reference models land where the engines' argv says."""

from __future__ import annotations

from pathlib import Path

import pytest

from r3operator.api import load_rljob
from r3operator.models import place_reference_model
from r3operator.operator.builders.config import build_config_map
from r3operator.runtime.app import build_settings
from r3operator.runtime.config import resolve_model_dir
from r3operator.settings import CONFIG_KEY, SettingsError, runtime_settings

REPO = Path(__file__).resolve().parents[2]
LOCAL = REPO / "examples" / "rljob-local.yaml"


def test_host_path_takes_the_longest_matching_mount(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("R3OPERATOR_MOUNTS", "/var/lib/r3operator=/data/routing,/var/lib/r3operator/models=/m,/mnt=/x")
    env = runtime_settings()
    assert env.host_path("/var/lib/r3operator/runs/j") == Path("/data/routing/runs/j")
    assert env.host_path("/var/lib/r3operator/models/tiny") == Path("/m/tiny")
    assert env.host_path("/var/lib/r3operator") == Path("/data/routing")
    assert env.host_path("/var/lib/r3operatorX/a") == Path("/var/lib/r3operatorX/a")  # a prefix, not a mount
    assert env.host_path("/etc/r3operator/config.json") == Path("/etc/r3operator/config.json")


@pytest.mark.parametrize("value", ["relative=/x", "/etc/r3operator", "/etc/r3operator="])
def test_a_malformed_mount_names_the_variable(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("R3OPERATOR_MOUNTS", value)
    with pytest.raises(SettingsError, match="R3OPERATOR_MOUNTS"):
        runtime_settings()


def test_the_driver_finds_config_and_volume_through_the_mounts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config_dir, routing = tmp_path / "config", tmp_path / "routing"
    config_dir.mkdir()
    (config_dir / CONFIG_KEY).write_text(build_config_map(load_rljob(LOCAL))["data"][CONFIG_KEY])
    monkeypatch.setenv("R3OPERATOR_MOUNTS", f"/etc/r3operator={config_dir},/var/lib/r3operator={routing}")
    monkeypatch.setenv("R3OPERATOR_DRIVER_METRICS_PORT", "0")
    settings = build_settings(None, config=Path("/etc/r3operator/config.json"), device="cpu")
    assert settings.routing_dir == routing
    assert settings.run_dir == routing / "runs" / "tiny-count-r3"
    assert settings.metrics_port is None  # 0: off, instead of spec.monitoring.port


def test_a_reference_model_is_placed_where_the_engine_pods_look(tmp_path: Path) -> None:
    routing = tmp_path / "routing"
    path = resolve_model_dir(load_rljob(LOCAL), routing_dir=routing)
    # api/vllm_args.model_source: r3operator://reference/tiny → <routing volume>/models/tiny
    assert path == routing / "models" / "tiny"
    assert path.is_symlink() and not path.readlink().is_absolute()
    assert (path / "config.json").is_file()
    assert place_reference_model("tiny", routing / "models") == path  # idempotent


def test_a_real_directory_in_the_way_is_not_replaced(tmp_path: Path) -> None:
    (tmp_path / "tiny").mkdir()
    with pytest.raises(ValueError, match="expected a link to a generated reference model"):
        place_reference_model("tiny", tmp_path)
