"""`r3operator explain`'s scheduling picture (operator/picture.py), and the command printing it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from r3operator.api import load_rljob
from r3operator.operator.picture import scheduling_picture

REPO = Path(__file__).resolve().parents[2]
QUEUED = REPO / "examples" / "qwen3-30b-a3b-r3-fsdp-kueue.yaml"
PLAIN = REPO / "examples" / "qwen3-30b-a3b-r3-fsdp.yaml"


def test_the_picture_has_each_roles_pods_gpus_and_constraints_in_force():
    picture = scheduling_picture(load_rljob(QUEUED))
    roles = {r.role: r for r in picture.roles}
    assert {name: (r.pods, r.gpus_per_pod) for name, r in roles.items()} == {
        "engines": (4, 4),
        "trainer head": (1, 8),
        "trainer workers": (1, 8),
    }
    assert picture.gpus == 32
    for role in roles.values():
        assert role.node_selector == "nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3"
        assert role.tolerations == "nvidia.com/gpu:NoSchedule (Exists), dedicated=rl-training:NoSchedule (Equal)"
        assert (role.priority_class, role.image_pull_secrets) == ("rl-training", "ghcr-pull")
    assert roles["engines"].affinity == "none"
    assert roles["trainer head"].affinity == "podAntiAffinity: 0 required, 1 preferred term(s)"
    assert picture.queue.startswith("LocalQueue gpu-research: Kueue Workload qwen3-30b-a3b-r3-queued-workload")
    assert "32 GPUs" in picture.queue
    fetch = "fetched once by Job qwen3-30b-a3b-r3-queued-model-fetch"
    assert picture.model.startswith(f"hf://Qwen/Qwen3-30B-A3B @ main: {fetch}")


def test_an_unqueued_job_says_so_and_keeps_the_gpu_toleration():
    picture = scheduling_picture(load_rljob(PLAIN))
    assert picture.queue.startswith("none: no spec.queueName")
    assert {r.tolerations for r in picture.roles} == {"nvidia.com/gpu:NoSchedule (Exists)"}
    assert {r.node_selector for r in picture.roles} == {"none (any node)"}


def test_explain_prints_the_picture_after_the_plan():
    result = subprocess.run(
        [sys.executable, "-m", "r3operator", "explain", str(QUEUED)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    plan_at, picture_at = result.stdout.index("resolved plan"), result.stdout.index("scheduling: 32 GPUs in all")
    assert plan_at < picture_at
    assert "LocalQueue gpu-research" in result.stdout and "rl-training" in result.stdout
