"""Shared builders for RLJob API tests."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from r3operator.api import RLJob, parse_rljob

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
            "inference": {"image": "vllm/vllm-openai:v0.30.0", "tensorParallelSize": 2},
            "trainer": {"image": "ghcr.io/r3operator/trainer:0.1.0", "backend": "FSDP"},
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
