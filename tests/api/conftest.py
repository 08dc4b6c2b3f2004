"""Shared builders for RLJob API tests, and RLJobs on the session's real control plane."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kubecluster.clients import apply_crd, create_namespace

from r3operator.api import RLJob, parse_rljob
from tests.api.real_apiserver import RLJobApi

ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "crds" / "rljob.yaml"

Mutation = Callable[[dict[str, Any]], None]


def base_manifest() -> dict[str, Any]:
    """A valid R3 job on the FSDP trainer that no rule flags, on a vLLM with every feature."""
    return {
        "apiVersion": "r3operator.io/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "base", "namespace": "rl"},
        "spec": {
            "model": {
                "uri": "hf://Qwen/Qwen3-30B-A3B",
                "architecture": {"numLayers": 48, "numExperts": 128, "topK": 8, "family": "qwen3_moe"},
            },
            "routingReplay": {"mode": "R3", "replayRef": True},
            "inference": {"image": "ghcr.io/r3operator/engine:0.1.0-vllm0.30.0", "tensorParallelSize": 2},
            "trainer": {"image": "ghcr.io/r3operator/trainer:0.1.0", "backend": "FSDP"},
            # Two ~335 GiB checkpoints of the 30B model fit (CHECKPOINT-FITS-STORAGE).
            "storage": {"size": "1Ti"},
        },
    }


def build(mutate: Mutation | None = None) -> RLJob:
    manifest = base_manifest()
    if mutate is not None:
        mutate(manifest)
    return parse_rljob(manifest)


def set_path(manifest: dict[str, Any], dotted: str, value: Any) -> None:
    node = manifest["spec"]
    *parents, last = dotted.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = value


def sets(**paths: Any) -> Mutation:
    """sets(**{"inference.executorBackend": "ray"}) -> a mutation setting those spec paths."""

    def mutate(m: dict[str, Any]) -> None:
        for dotted, value in paths.items():
            set_path(m, dotted, copy.deepcopy(value))

    return mutate


@pytest.fixture
def manifest() -> dict[str, Any]:
    return base_manifest()


@pytest.fixture(scope="module")
def rljob_api(control_plane: Any, request: pytest.FixtureRequest) -> RLJobApi:
    """The RLJob CRD from crds/ applied to the real apiserver, and a namespace of this module's own."""
    apply_crd(control_plane, CRD_FILE)
    module = re.sub(r"[^a-z0-9-]", "-", request.module.__name__.rsplit(".", 1)[-1].lower())
    return RLJobApi(control_plane, create_namespace(control_plane, f"m-{module}"[:63]))
