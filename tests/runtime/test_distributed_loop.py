"""The step loop with its trainer on 2 gloo ranks (Ray actors, FSDP2): R3 steps against an in-process
fake engine, the weights the engine receives, the sharded checkpoints and a resume from them."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest
from fake_engine import FakeEngine, RecordingEngine
from runtime_test_helpers import settings_for, write_job

pytestmark = pytest.mark.slow


def assert_two_replayed_steps(run: Any) -> None:
    with (run.run_dir / "metrics.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert [r["step"] for r in rows] == ["1", "2"] and all(r["skipped"] == "0" for r in rows)
    assert all(float(r["replay_applied"]) == 1.0 for r in rows)  # R3 replay reached the ranks' experts


def _run(tmp_path: Path, engine: FakeEngine, *, steps: int, **spec: Any) -> Any:
    from r3operator.rollout.engines import EngineGroup
    from r3operator.runtime.loop import GRPORun

    job = write_job(tmp_path, weightSync={"canary": False}, algorithm={"steps": steps}, **spec)
    settings = settings_for(job, tmp_path / "runs", steps=steps, trainer_ranks=2)
    return GRPORun(settings, engines=EngineGroup([engine]))


def test_a_run_on_two_trainer_ranks_syncs_checkpoints_and_resumes(tmp_path: Path) -> None:
    import torch

    from r3operator.trainer.distributed import DistributedTrainer
    from r3operator.trainer.hf_policy import PolicyTrainer
    from r3operator.wire.weights import checkpoint_tensors

    engine = RecordingEngine()
    run = _run(tmp_path, engine, steps=2)
    run.run()
    assert isinstance(run.trainer, DistributedTrainer) and run.trainer.world_size == 2
    assert_two_replayed_steps(run)
    assert run.last_checkpoint_step == 2

    step2 = run.ckpt_root / "step-000002"
    assert json.loads((step2 / "meta.json").read_text())["ranks"] == 2
    assert {p.name for p in (step2 / "policy").glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}
    # What the engine holds after step 2's sync is the step-2 policy, gathered from both ranks' shards.
    single = PolicyTrainer(run.model_dir, device="cpu", learning_rate=1e-6, seed=0)
    single.load_checkpoint(step2 / "policy")
    want = dict(checkpoint_tensors(single.model_state_dict(), dtype=torch.float32))
    assert engine.weights.keys() == want.keys()
    assert all(torch.equal(engine.weights[name], want[name]) for name in want)

    resumed = _run(tmp_path, engine, steps=3)
    resumed.setup()
    try:
        assert resumed.start_step == 3 and resumed.policy_version == run.policy_version
        row = resumed.train_step(3)
        assert row.skipped == 0 and row.policy_version == run.policy_version + 1
        resumed.finish_checkpoint()
        assert resumed.last_checkpoint_step == 3
    finally:
        resumed.trainer.close()


@pytest.mark.parametrize(
    ("megatron", "replicas"), [({"expertParallelSize": 2}, 2), ({"pipelineParallelSize": 2}, 1)], ids=["ep2", "pp2"]
)
def test_a_megatron_run_on_two_ranks_syncs_and_checkpoints(
    tmp_path: Path, megatron: dict[str, Any], replicas: int
) -> None:
    """EP=2 over the 2 ranks (two data-parallel replicas) or two pipeline stages (one replica; rank 0, the
    first stage, streams the sync): the loop does not know; the engine receives the weights the ranks
    gathered, equal to the checkpoint's."""
    pytest.importorskip("megatron.core", reason="megatron-core not installed (pip extra `megatron`)")
    import torch

    from r3operator.trainer.distributed import DistributedTrainer
    from r3operator.trainer.sharded_checkpoint import read_full_state
    from r3operator.wire.weights import checkpoint_tensors

    engine = RecordingEngine()
    run = _run(tmp_path, engine, steps=2, trainer={"backend": "Megatron", "megatron": megatron})
    run.run()
    assert isinstance(run.trainer, DistributedTrainer) and run.trainer.dp_size == replicas
    assert_two_replayed_steps(run)
    step2 = run.ckpt_root / "step-000002"
    want = dict(checkpoint_tensors(read_full_state(step2 / "policy")["model"], dtype=torch.float32))
    assert engine.weights.keys() == want.keys()
    assert all(torch.equal(engine.weights[name], want[name]) for name in want)


def test_trainer_ranks_come_from_the_flag_or_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from r3operator.trainer.factory import world_size

    job = write_job(tmp_path, trainer={"nodes": 2, "gpusPerNode": 4})
    monkeypatch.setenv("R3OPERATOR_TRAINER_RANKS", "3")
    from_env = settings_for(job, tmp_path / "runs")
    assert from_env.trainer_ranks == 3
    assert settings_for(job, tmp_path / "runs", trainer_ranks=2).trainer_ranks == 2  # the flag wins
    spec = from_env.job.spec
    assert world_size(spec, device="cpu") == 1
    assert world_size(spec, device="cuda") == 8  # one rank per GPU of the RayJob
    with pytest.raises(ValueError, match="trainer ranks: expected at least 1, got 0"):
        world_size(spec, device="cpu", override=0)


def test_more_ranks_than_the_backend_or_the_cluster_can_take_is_refused(tmp_path: Path) -> None:
    from r3operator.api.enums import TrainerBackend
    from r3operator.api.v1alpha1 import MegatronSpec
    from r3operator.runtime.setup import start_ray
    from r3operator.trainer.distributed import DistributedTrainer, PolicyOptions
    from r3operator.trainer.factory import build_trainer

    spec = settings_for(write_job(tmp_path), tmp_path / "runs").job.spec
    tp2 = MegatronSpec(tensor_parallel_size=2, sequence_parallel=True)
    megatron = spec.model_copy(
        update={"trainer": spec.trainer.model_copy(update={"backend": TrainerBackend.MEGATRON, "megatron": tp2})}
    )
    with pytest.raises(ValueError, match=r"tensorParallelSize × .* = 2 does not divide the trainer's 3 ranks"):
        build_trainer(megatron, tmp_path, device="cpu", ranks=3)
    start_ray(in_cluster=False)  # a CPU-only Ray cluster: no GPU for any rank
    with pytest.raises(ValueError, match=r"asks for 2 trainer GPUs, but the Ray cluster has 0"):
        DistributedTrainer(tmp_path, world_size=2, device="cuda", options=PolicyOptions(learning_rate=1e-6, seed=0))
