"""The trainer over 2 gloo ranks (Ray actors, FSDP2 across them) against the one-process trainer on the
same batch, with R3 replay: each rank must receive its rows' routes, and the update must come out as
if one process had seen the whole batch. Then an asynchronous sharded checkpoint and its resume."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tiny_moe import r3_batch  # noqa: E402

from r3operator.api.enums import ReplayMode  # noqa: E402
from r3operator.trainer.batch import TrainBatch  # noqa: E402

pytestmark = pytest.mark.slow
LR = 1e-3
CLIP = {"clip_low": 0.2, "clip_high": 0.28}


def single_trainer(model_dir: Path) -> Any:
    from r3operator.trainer.hf_policy import PolicyTrainer

    return PolicyTrainer(model_dir, device="cpu", learning_rate=LR, seed=0, compute_dtype="float32")


def two_ranks(model_dir: Path) -> Any:
    from r3operator.trainer.distributed import DistributedTrainer, PolicyOptions

    options = PolicyOptions(learning_rate=LR, seed=0, compute_dtype="float32")
    return DistributedTrainer(model_dir, world_size=2, device="cpu", options=options)


def assert_states_close(got: dict[str, Any], want: dict[str, Any], *, atol: float) -> None:
    assert got.keys() == want.keys()
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert worst <= atol, f"largest difference {worst:g} > {atol:g}"


def test_two_ranks_train_like_one_process_with_r3_replay(tiny_moe_dir: Path, ray_started: None) -> None:
    batch = r3_batch()
    single = single_trainer(tiny_moe_dir)
    before = {k: v.clone() for k, v in single.model_state_dict().items()}
    ranks = two_ranks(tiny_moe_dir)
    try:
        one = single.old_logprobs(batch, ReplayMode.R3)
        two = ranks.old_logprobs(batch, ReplayMode.R3)
        # The experts of each rank received exactly that row's engine routes (rows 0-2 on rank 0, 3-4 on 1).
        real = ~batch.route_pad
        assert torch.equal(two.used_ids[real], batch.engine_routes[real])
        torch.testing.assert_close(two.logprobs, one.logprobs, atol=1e-5, rtol=0)
        torch.testing.assert_close(two.natural_ids, one.natural_ids, atol=0, rtol=0)
        # Routes handed to the wrong rows change the logprobs far beyond that tolerance.
        swapped = TrainBatch(
            **{
                **batch.__dict__,
                "engine_routes": batch.engine_routes.roll(1, dims=0),
                "route_pad": batch.route_pad.roll(1, dims=0),
            }
        )
        off = single.old_logprobs(swapped, ReplayMode.R3).logprobs
        assert (off - one.logprobs)[batch.response_mask].abs().max() > 1e-2

        # 3 mini-batches of rows [0, 3], [1, 4], [2]: rank 1 has no row in the last one (a padding row).
        s1 = single.update(batch, one, mini_batches=3, **CLIP)
        s2 = ranks.update(batch, two, mini_batches=3, **CLIP)
        assert s2.tokens == s1.tokens == int(batch.response_mask.sum())
        for name in ("loss", "clip_fraction", "approx_kl", "grad_norm"):
            assert getattr(s2, name) == pytest.approx(getattr(s1, name), rel=1e-4, abs=1e-6), name
        assert s1.grad_norm > 0 and s1.loss != 0
        after = single.model_state_dict()
        assert max((after[k] - before[k]).abs().max().item() for k in before) > 100 * 1e-5  # it trained
        assert_states_close(ranks.model_state_dict(), after, atol=1e-5)

        # The supervised warm-up over ranks: the same loss and the same weights afterwards.
        prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14, 15, 16]]
        answers = [[20, 21], [22, 23, 24], [25], [26, 27]]
        assert ranks.sft_step(prompts, answers) == pytest.approx(single.sft_step(prompts, answers), rel=1e-5)
        assert_states_close(ranks.model_state_dict(), single.model_state_dict(), atol=1e-5)
    finally:
        ranks.close()


def test_async_sharded_checkpoint_resumes_two_ranks_exactly(
    tiny_moe_dir: Path, ray_started: None, tmp_path: Path
) -> None:
    batch = r3_batch(seed=1)
    checkpoint = tmp_path / "step-1"
    first = two_ranks(tiny_moe_dir)
    try:
        first.update(batch, first.old_logprobs(batch, ReplayMode.R3), mini_batches=2, **CLIP)  # step 1
        first.save_checkpoint_async(checkpoint)
        at_save = first.model_state_dict()
        # Step 2 runs while the shards are written; it must not leak into them (the save staged step 1).
        first.update(batch, first.old_logprobs(batch, ReplayMode.R3), mini_batches=2, **CLIP)
        first.wait_checkpoint()
        after_two = first.model_state_dict(), first.optimizer_state_dict()
    finally:
        first.close()
    assert sorted(p.name for p in checkpoint.iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "rng-rank00000.pt",
        "rng-rank00001.pt",
    ]

    resumed = two_ranks(tiny_moe_dir)  # a fresh driver's ranks: the first ones are gone
    try:
        resumed.load_checkpoint(checkpoint)
        assert_states_close(resumed.model_state_dict(), at_save, atol=0.0)
        resumed.update(batch, resumed.old_logprobs(batch, ReplayMode.R3), mini_batches=2, **CLIP)  # step 2 again
        model, optim = resumed.model_state_dict(), resumed.optimizer_state_dict()
    finally:
        resumed.close()
    assert_states_close(model, after_two[0], atol=0.0)
    want_optim = after_two[1]["state"]
    assert optim["state"].keys() == want_optim.keys() and len(want_optim) > 0
    for name, slots in want_optim.items():
        for slot in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(optim["state"][name][slot], slots[slot]), (name, slot)

    # DCP reshards on load: one process reads the two ranks' shards.
    single = single_trainer(tiny_moe_dir)
    single.load_checkpoint(checkpoint)
    assert_states_close(single.model_state_dict(), at_save, atol=0.0)


def test_two_fsdp_ranks_read_the_parameters_at_their_bf16_values(tiny_moe_dir: Path, ray_started: None) -> None:
    """Under bf16 compute, FSDP2's unsharded parameters are rounded too: the two ranks' R3 old logprobs are
    the one-process trainer's (whose rounding tests/trainer/test_bf16_params.py checks bit for bit against
    a copy rounded by the test), not those of the same trainer reading its unrounded fp32 masters."""
    from r3operator.trainer import bf16_params
    from r3operator.trainer.distributed import DistributedTrainer, PolicyOptions
    from r3operator.trainer.hf_policy import PolicyTrainer

    batch = r3_batch()
    mask = batch.response_mask
    single = PolicyTrainer(tiny_moe_dir, device="cpu", learning_rate=LR, seed=0)
    rounded = single.old_logprobs(batch, ReplayMode.R3).logprobs
    bf16_params.uninstall(single.model)
    unrounded = single.old_logprobs(batch, ReplayMode.R3).logprobs
    gap = float((rounded - unrounded)[mask].abs().max())
    ranks = DistributedTrainer(
        tiny_moe_dir, world_size=2, device="cpu", options=PolicyOptions(learning_rate=LR, seed=0)
    )
    try:
        two = ranks.old_logprobs(batch, ReplayMode.R3).logprobs
    finally:
        ranks.close()
    assert gap > 1e-4  # the embedding is off the bf16 grid
    assert float((two - rounded)[mask].abs().max()) < gap / 10
