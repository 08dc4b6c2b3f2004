"""The operator writes the runtime config; the driver in the trainer pod reads it. One contract, pinned here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from r3operator.api import load_rljob
from r3operator.api.load import RLJobLoadError
from r3operator.operator.builders.config import CONFIG_KEY, build_config_map
from r3operator.runtime.app import build_settings
from r3operator.runtime.config import load_job_config

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "qwen3-30b-a3b-r3-fsdp.yaml"


def _mounted(tmp_path: Path) -> tuple[Path, dict]:
    job = load_rljob(EXAMPLE)
    config_map = build_config_map(job)
    path = tmp_path / CONFIG_KEY
    path.write_text(config_map["data"][CONFIG_KEY])
    return path, json.loads(config_map["data"][CONFIG_KEY])


def test_driver_reads_the_operators_config_map(tmp_path: Path) -> None:
    path, written = _mounted(tmp_path)
    config = load_job_config(path)
    job, original = config.job, load_rljob(EXAMPLE)
    assert job.spec == original.spec
    assert job.metadata.name == original.metadata.name and job.metadata.namespace == original.metadata.namespace
    assert config.runtime.engine_urls == written["runtime"]["engineURLs"]
    assert len(config.runtime.engine_urls) == original.spec.inference.replicas
    assert config.to_json() == path.read_text()  # what the driver reads is what the operator wrote


def test_settings_from_config_use_the_engine_services_and_the_shared_volume(tmp_path: Path) -> None:
    path, written = _mounted(tmp_path)
    settings = build_settings(None, config=path, device="cpu")
    assert settings.engine_urls == written["runtime"]["engineURLs"]
    assert settings.run_dir == Path(written["runtime"]["routingDir"]) / "runs" / "qwen3-30b-a3b-r3"


@pytest.mark.parametrize(("text", "expected"), [("{", "malformed JSON"), ('{"rljob": {}}', "runtime config")])
def test_bad_config_names_the_file(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / CONFIG_KEY
    path.write_text(text)
    with pytest.raises(RLJobLoadError) as info:
        load_job_config(path)
    assert str(path) in str(info.value) and expected in str(info.value)


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        # a string where the list of URLs belongs: read as a list it would be one URL per character
        (lambda runtime: runtime.update(engineURLs="http://rl-engine-0.rl-engine.ns.svc:8000"), "runtime.engineURLs"),
        # without the volume's path the run's outputs would go to the container's working directory
        (lambda runtime: runtime.pop("routingDir"), "runtime.routingDir"),
    ],
)
def test_a_runtime_block_that_does_not_fit_names_the_field(tmp_path: Path, edit: Any, field: str) -> None:
    path, written = _mounted(tmp_path)
    edit(written["runtime"])
    path.write_text(json.dumps(written))
    with pytest.raises(RLJobLoadError) as info:
        build_settings(None, config=path, device="cpu")
    assert str(path) in str(info.value) and field in str(info.value)
