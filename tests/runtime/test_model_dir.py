"""The driver finds the model where the operator put it: one resolver (api/vllm_args.model_source) for both."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from r3operator.api import vllm_args as args
from r3operator.api.load import parse_rljob
from r3operator.api.v1alpha1 import RLJob
from r3operator.operator.desired import desired
from r3operator.runtime.config import resolve_model_dir
from r3operator.runtime.fetch import SourceNotReady

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "qwen3-30b-a3b-r3-fsdp.yaml"


def _job(uri: str) -> RLJob:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["model"]["uri"] = uri
    return parse_rljob(doc)


def _trainer_model_dir(job: RLJob) -> str:
    ray = next(c for c in desired(job) if c["kind"] == "RayJob")
    env = ray["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]
    return next(e["value"] for e in env if e["name"] == "R3OPERATOR_MODEL_DIR")


def test_runtime_loads_the_directory_the_operator_mounts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("R3OPERATOR_MODEL_DIR", raising=False)
    monkeypatch.setattr(args, "MODEL_MOUNT", str(tmp_path))  # the pod's mount point, here
    job = _job("pvc://weights/qwen/v1")
    mounted = Path(_trainer_model_dir(job))
    assert mounted.is_relative_to(tmp_path)
    mounted.mkdir(parents=True)
    assert resolve_model_dir(job) == mounted
    # The operator also sets R3OPERATOR_MODEL_DIR to the same directory; the variable wins.
    monkeypatch.setenv("R3OPERATOR_MODEL_DIR", str(mounted))
    assert resolve_model_dir(job) == mounted


def test_missing_mount_names_the_directory_and_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("R3OPERATOR_MODEL_DIR", raising=False)
    with pytest.raises(ValueError, match=r"/mnt/model/qwen/v1 is not there.*R3OPERATOR_MODEL_DIR"):
        resolve_model_dir(_job("pvc://weights/qwen/v1"))


def test_file_uri_is_its_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("R3OPERATOR_MODEL_DIR", raising=False)
    assert resolve_model_dir(_job("file:///models/q")) == Path("/models/q")


def test_a_mounted_cache_copy_without_its_ready_marker_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a pod the hf:// model is the cache directory; files without the marker are a fetch in progress."""
    monkeypatch.delenv("R3OPERATOR_MODEL_DIR", raising=False)
    monkeypatch.setattr(args, "MODEL_MOUNT", str(tmp_path))
    job = _job("hf://Qwen/Qwen3-30B-A3B")  # the example pins revision main
    mounted = Path(_trainer_model_dir(job))
    assert mounted == tmp_path / "hf" / "Qwen" / "Qwen3-30B-A3B" / "main"
    mounted.mkdir(parents=True)
    (mounted / "config.json").write_text("{}")
    with pytest.raises(SourceNotReady, match="has no ready marker"):
        resolve_model_dir(job)
