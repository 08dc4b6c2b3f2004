"""Megatron pipeline parallelism: a 4-layer tiny MoE in 2 stages (layers 0-1 and 2-3) on 2 gloo ranks (Ray
actors) against the one-process Megatron trainer, both with 2-row micro-batches, so that the 1F1B order
really interleaves (stage 0 runs micro-batch 1's forward before micro-batch 0's backward) and activation
recompute replays each backward from the REPLAY_BACKWARD FIFO. Under R3 every stage's routers must take
the engine's routes, and the old logprobs, the update's statistics, the weights after it, the weight sync,
an SFT step, the canary forward and a checkpoint that resumes on one process must come out as on one
process; then one R2 step. A second case runs 3 stages of a 6-layer model whose first stage has only
dense layers (no router), and two cases on 4 ranks: PP=2 × TP=2+SP and PP=2 × EP=2 (2 replicas per stage)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core", reason="megatron-core not installed (pip extra `megatron`)")

from tiny_moe import build_tiny_moe, r3_batch  # noqa: E402

from r3operator.api.v1alpha1 import MegatronSpec  # noqa: E402
from tests.trainer.test_megatron_ranks import (  # noqa: E402
    ANSWERS,
    LR,
    PROMPTS,
    assert_r2_step_matches,
    assert_r3_step_matches,
    largest_difference,
)

pytestmark = pytest.mark.slow
LAYERS = 4
MICRO_BATCH = 2  # r3_batch's 5 rows: micro-batches of 2, 2, 1 (mini-batches of 3 and 2 rows: 2 + 1, 2)


@pytest.fixture(scope="module")
def four_layer_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-moe-4")
    build_tiny_moe("qwen3_moe", layers=LAYERS).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def six_layers_first_two_dense_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-moe-6")
    build_tiny_moe("qwen3_moe", layers=6, dense_layers=(0, 1)).save_pretrained(path)
    return path


def one_process(model_dir: Path, micro_batch_size: int | None = MICRO_BATCH) -> Any:
    from r3operator.trainer.megatron import build_megatron_trainer
    from r3operator.trainer.megatron.adapter import MegatronPolicyTrainer

    trainer = build_megatron_trainer(None, model_dir, "cpu", learning_rate=LR, micro_batch_size=micro_batch_size)
    return MegatronPolicyTrainer(trainer, compute_dtype="float32")


def two_stages(
    model_dir: Path,
    stages: int = 2,
    spec: MegatronSpec | None = None,
    ranks: int | None = None,
    micro_batch_size: int | None = MICRO_BATCH,
) -> Any:
    from r3operator.trainer.distributed import DistributedTrainer
    from r3operator.trainer.megatron.ranks import MegatronOptions

    spec = spec or MegatronSpec(pipeline_parallel_size=stages, recompute=True)
    options = MegatronOptions(
        spec, learning_rate=LR, seed=0, compute_dtype="float32", micro_batch_size=micro_batch_size
    )
    return DistributedTrainer(model_dir, world_size=ranks or stages, device="cpu", options=options)


def test_two_pipeline_stages_train_like_one_process_under_r3_then_r2(
    four_layer_moe_dir: Path, ray_started: None, tmp_path: Path
) -> None:
    single = one_process(four_layer_moe_dir)
    ranks = two_stages(four_layer_moe_dir)
    try:
        assert ranks.dp_size == 1
        # Both stages' layers (0-1 on rank 0, 2-3 on rank 1) get the engine's routes, and rank 0 (the first
        # stage) streams a weight sync that holds the last stage's layers too.
        _, two = assert_r3_step_matches(single, ranks, r3_batch(layers=LAYERS), mini_batches=2)
        assert two.used_ids.shape[2] == LAYERS
        torch.testing.assert_close(ranks.canary_logits(PROMPTS[0]), single.canary_logits(PROMPTS[0]), atol=1e-5, rtol=0)
        assert ranks.sft_step(PROMPTS, ANSWERS) == pytest.approx(single.sft_step(PROMPTS, ANSWERS), rel=1e-5)

        # R2 on both stages' layers.
        assert_r2_step_matches(single, ranks, r3_batch(seed=1, layers=LAYERS), mini_batches=2)
        at_save = ranks.model_state_dict()
        ranks.save_checkpoint_async(tmp_path / "ckpt")
        ranks.wait_checkpoint()
        ranks.sft_step(PROMPTS, ANSWERS)
        after_two = ranks.model_state_dict()
    finally:
        ranks.close()
    # The two stages' checkpoint resumes on one process, AdamW moments included (the same next step).
    resumed = one_process(four_layer_moe_dir)
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert largest_difference(resumed.model_state_dict(), at_save) == 0.0
    resumed.sft_step(PROMPTS, ANSWERS)
    assert largest_difference(resumed.model_state_dict(), after_two) <= 1e-5


def test_three_stages_with_a_router_less_first_stage_replay_and_train_like_one_process(
    six_layers_first_two_dense_dir: Path, ray_started: None
) -> None:
    """6 layers, 0-1 dense, in 3 stages: stage 0 has no router (it still sends and receives every
    micro-batch), stage 1 is a middle stage that receives activations and sends gradients both ways."""
    batch = r3_batch(layers=6)
    batch.engine_routes[:, :, :2] = 0  # vLLM reports dense layers as zero rows
    single = one_process(six_layers_first_two_dense_dir)
    ranks = two_stages(six_layers_first_two_dense_dir, stages=3)
    try:  # 5 rows in one mini-batch: micro-batches of 2, 2, 1
        _, three = assert_r3_step_matches(single, ranks, batch, mini_batches=1)
        assert bool((three.used_ids[~batch.route_pad][:, 2:] != 0).any())
    finally:
        ranks.close()


@pytest.mark.parametrize(
    ("spec", "micro_batch_size", "replicas"),
    [
        (MegatronSpec(pipeline_parallel_size=2, tensor_parallel_size=2, sequence_parallel=True), MICRO_BATCH, 1),
        # EP across 2 replicas per stage: one micro-batch per share (build_megatron_trainer refuses more).
        (MegatronSpec(pipeline_parallel_size=2, expert_parallel_size=2), None, 2),
    ],
    ids=["pp2-tp2-sp", "pp2-ep2-dp2"],
)
def test_two_stages_with_tensor_or_expert_parallelism_over_four_ranks(
    four_layer_moe_dir: Path, ray_started: None, spec: MegatronSpec, micro_batch_size: int | None, replicas: int
) -> None:
    """Each stage is itself a TP=2+SP group (activations are this TP rank's sequence chunk) or an EP=2
    group over two replicas (the row agreement stays within a stage)."""
    single = one_process(four_layer_moe_dir, micro_batch_size)
    ranks = two_stages(four_layer_moe_dir, spec=spec, ranks=4, micro_batch_size=micro_batch_size)
    try:
        assert ranks.dp_size == replicas
        assert_r3_step_matches(single, ranks, r3_batch(layers=LAYERS), mini_batches=2)
    finally:
        ranks.close()
