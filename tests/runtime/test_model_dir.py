"""The driver finds the model where the operator put it: one resolver (engine/args.model_source) for both."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from r3operator.api.load import parse_rljob
from r3operator.api.v1alpha1 import RLJob
from r3operator.engine import args
from r3operator.operator.builders.model import FETCH_SCRIPT
from r3operator.operator.desired import desired
from r3operator.runtime.config import resolve_model_dir

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "qwen3-30b-a3b-r3-fsdp.yaml"


def _job(uri: str) -> RLJob:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["model"]["uri"] = uri
    return parse_rljob(doc)


def _trainer_model_dir(job: RLJob) -> str:
    ray = next(c for c in desired(job) if c["kind"] == "RayJob")
    env = ray["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]
    return next(e["value"] for e in env if e["name"] == "R3OPERATOR_MODEL_DIR")


@pytest.mark.parametrize("uri", ["pvc://weights/qwen/v1", "hf://Qwen/Qwen3-30B-A3B"])
def test_runtime_loads_the_directory_the_operator_mounts(
    uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("R3OPERATOR_MODEL_DIR", raising=False)
    monkeypatch.setattr(args, "MODEL_MOUNT", str(tmp_path))  # the pod's mount point, here
    job = _job(uri)
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


def test_fetch_script_calls_huggingface_hub_with_the_arguments_it_is_given(tmp_path: Path) -> None:
    """Runs the init container's script against the installed huggingface_hub, offline: the call's
    signature and argument order are real, and an offline miss fails the container (nonzero exit)."""
    from huggingface_hub import snapshot_download

    assert {"revision", "local_dir"} <= set(inspect.signature(snapshot_download).parameters)
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, "-c", FETCH_SCRIPT, "org/absent-model", "", str(tmp_path / "out")],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "org/absent-model" in proc.stderr or "offline" in proc.stderr.lower(), proc.stderr[-2000:]
