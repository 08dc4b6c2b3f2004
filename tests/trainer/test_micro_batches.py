"""`trainer.fsdp.microBatchTokens`: the old-logprob pass and the update in length-grouped micro-batches are the
one-forward pass and update (the reference: the same one-process trainer without a budget), in every replay
mode; and the planner's groups keep to the budget."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from r3operator.trainer.micro import micro_batches, micro_weights

torch = pytest.importorskip("torch")

from tiny_moe import r3_batch  # noqa: E402

from r3operator.api.enums import ReplayMode  # noqa: E402
from r3operator.trainer.hf_policy import PolicyTrainer  # noqa: E402


@given(st.lists(st.integers(1, 64), min_size=1, max_size=40), st.integers(1, 400))
def test_groups_cover_every_row_once_and_keep_to_the_budget(lengths: list[int], budget: int) -> None:
    groups = micro_batches(lengths, budget=budget)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for group in groups:
        assert group == sorted(group)
        padded = len(group) * max(lengths[i] for i in group)
        assert padded <= budget or len(group) == 1  # a row longer than the budget goes alone


def test_rows_of_similar_length_share_a_micro_batch() -> None:
    # Longest first: the three long rows together, the three short ones together (2 × 3 × 10 would not fit).
    assert micro_batches([10, 2, 9, 3, 10, 2], budget=30) == [[0, 2, 4], [1, 3, 5]]
    assert micro_batches([5, 6], budget=None) == [[0, 1]]


def test_the_weights_are_token_shares() -> None:
    assert micro_weights([3, 1, 4], [[0, 2], [1]]) == [7 / 8, 1 / 8]
    assert micro_weights([0, 0], [[0], [1]]) == [0.0, 0.0]


def _trainer(model_dir: Path, budget: int | None) -> PolicyTrainer:
    return PolicyTrainer(
        model_dir, device="cpu", learning_rate=1e-3, seed=0, compute_dtype="float32", micro_batch_tokens=budget
    )


@pytest.mark.slow
@pytest.mark.parametrize("mode", [ReplayMode.R3, ReplayMode.R2, ReplayMode.DISABLED])
def test_micro_batches_give_the_one_forward_pass_and_update(tiny_moe_dir: Path, mode: ReplayMode) -> None:
    batch = r3_batch()
    results = []
    for budget in (None, 24):  # rows of 7..14 tokens: 24 puts one or two rows in each micro-batch
        trainer = _trainer(tiny_moe_dir, budget)
        old = trainer.old_logprobs(batch, mode)
        # One mini-batch: the gradient left on the parameters is the whole batch's, at the initial weights (after
        # an AdamW step, elements whose gradient is near its epsilon move by up to lr on a rounding difference).
        stats = trainer.update(batch, old, mini_batches=1, clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0)
        grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
        results.append((old, stats, grads))
    (ref_old, ref_stats, ref_grads), (old, stats, grads) = results
    mask = batch.response_mask
    assert torch.allclose(old.logprobs[mask], ref_old.logprobs[mask], rtol=0, atol=1e-5)
    assert torch.allclose(old.entropy[mask], ref_old.entropy[mask], rtol=0, atol=1e-5)
    real = batch.attention_mask.bool()
    assert torch.equal(old.natural_ids[real], ref_old.natural_ids[real])
    assert torch.equal(old.used_ids[real], ref_old.used_ids[real])
    assert stats.loss == pytest.approx(ref_stats.loss, rel=1e-5, abs=1e-6)
    assert stats.grad_norm == pytest.approx(ref_stats.grad_norm, rel=1e-5)
    assert stats.tokens == ref_stats.tokens == int(mask.sum())
    assert stats.clip_fraction == pytest.approx(ref_stats.clip_fraction, abs=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        assert torch.allclose(grads[name], ref, rtol=1e-4, atol=1e-7), name


@pytest.mark.slow
def test_the_entropy_is_the_distributions_own(tiny_moe_dir: Path) -> None:
    """The old pass's entropy against -Σ p log p of a softmax written out here, on the same forward's logits."""
    batch = r3_batch()
    trainer = _trainer(tiny_moe_dir, None)
    old = trainer.old_logprobs(batch, ReplayMode.DISABLED)
    with torch.no_grad():
        logits = trainer.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    p = torch.softmax(logits.double(), dim=-1)
    expected = -(p * p.log()).sum(-1)
    mask = batch.response_mask
    assert torch.allclose(old.entropy[mask].double(), expected[mask], atol=1e-4)


@pytest.mark.slow
def test_a_supervised_step_in_micro_batches_is_the_one_forward_step(tiny_moe_dir: Path) -> None:
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    answers = [[20, 21, 22, 23, 2], [24, 2], [25, 26, 2]]
    results = []
    for budget in (None, 8):  # rows of 5 to 7 tokens: one or two rows per micro-batch
        trainer = _trainer(tiny_moe_dir, budget)
        loss = trainer.sft_step(prompts, answers)
        grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
        results.append((loss, grads))
    (ref_loss, ref_grads), (loss, grads) = results
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        assert torch.allclose(grads[name], ref, rtol=1e-4, atol=1e-7), name
