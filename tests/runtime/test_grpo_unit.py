"""GRPO advantages, PPO-clip loss (hand-computed), tasks/rewards, status patch body, checkpoint atomicity."""

from __future__ import annotations

import datetime as dt
import logging
import math
import os
from pathlib import Path

import numpy as np
import pytest

from r3operator.runtime.metrics import progress_patch
from r3operator.tasks import toy as tasks
from r3operator.trainer.grpo.advantages import group_advantages


def test_group_advantages_hand_values() -> None:
    # group 1: [1, 0, 0, 1] mean .5, unbiased std sqrt(1/3) -> ±0.5/0.57735 = ±0.866025
    # group 2: all equal -> 0
    adv = group_advantages(np.array([1, 0, 0, 1, 0.5, 0.5, 0.5, 0.5]), group_size=4)
    expected = 0.5 / math.sqrt(1 / 3)
    np.testing.assert_allclose(adv[:4], [expected, -expected, -expected, expected], rtol=1e-5)
    np.testing.assert_array_equal(adv[4:], 0.0)


def verl_grpo_advantages(scores: list[float], index: list[int], *, norm_adv_by_std_in_grpo: bool) -> list[float]:
    """verl `compute_grpo_outcome_advantage` (verl/trainer/ppo/core_algos.py), written out for one scalar
    reward per sample: a group of one gets mean 0 and std 1; larger groups torch.mean / torch.std
    (unbiased); epsilon 1e-6 added to the std."""
    torch = pytest.importorskip("torch")
    epsilon = 1e-6
    t = torch.tensor(scores, dtype=torch.float32)
    id2score: dict[int, list[torch.Tensor]] = {}
    for i, idx in enumerate(index):
        id2score.setdefault(idx, []).append(t[i])
    id2mean, id2std = {}, {}
    for idx, group in id2score.items():
        if len(group) == 1:
            id2mean[idx], id2std[idx] = torch.tensor(0.0), torch.tensor(1.0)
        else:
            stacked = torch.stack(group)
            id2mean[idx], id2std[idx] = torch.mean(stacked), torch.std(stacked)
    out = t.clone()
    for i, idx in enumerate(index):
        if norm_adv_by_std_in_grpo:
            out[i] = (t[i] - id2mean[idx]) / (id2std[idx] + epsilon)
        else:
            out[i] = t[i] - id2mean[idx]
    return [float(x) for x in out]


@pytest.mark.parametrize("normalize", [True, False], ids=["std-normalised", "dr-grpo"])
@pytest.mark.parametrize("group_size", [1, 2, 4])
def test_group_advantages_are_verls(group_size: int, normalize: bool) -> None:
    """rollout.groupSize 1 included: a group of one is trained on its raw reward (verl), not given 0."""
    rewards = [1.0, 0.0, 1.0, 1.0, 0.25, 0.75, 0.5, 0.5]
    index = [i // group_size for i in range(len(rewards))]
    want = verl_grpo_advantages(rewards, index, norm_adv_by_std_in_grpo=normalize)
    got = group_advantages(np.array(rewards), group_size=group_size, normalize_std=normalize)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_groups_of_one_get_their_raw_reward() -> None:
    """The review's case: rewards [1, 0, 1, 1] in four groups of one."""
    adv = group_advantages(np.array([1.0, 0.0, 1.0, 1.0]), group_size=1)
    np.testing.assert_allclose(adv, [1 / (1 + 1e-6), 0.0, 1 / (1 + 1e-6), 1 / (1 + 1e-6)], rtol=1e-7)


def test_group_advantages_rejects_partial_group() -> None:
    with pytest.raises(ValueError, match="groupSize=4"):
        group_advantages(np.zeros(6), group_size=4)


def test_prefix_and_exact_rewards() -> None:
    answer = [10, 11, 12, 2]
    assert tasks.reward([10, 11, 12, 2, 5], answer, kind="exact-match") == 1.0
    assert tasks.reward([10, 11, 13, 2], answer, kind="exact-match") == 0.0
    assert tasks.reward([10, 11, 13, 2], answer, kind="prefix-match") == 0.5
    assert tasks.reward([], answer, kind="prefix-match") == 0.0


def test_count_task_problems_decode_to_the_rule() -> None:
    from r3operator.models.tokenizer import vocabulary

    vocab = vocabulary(512)
    pool = tasks.problems("count", vocab_size=512)
    assert len(pool) == 21  # starts 0..6 x lengths 2..4
    for p in pool:
        words = [vocab[i] for i in p.prompt_ids]
        start, end = int(words[3]), int(words[5])
        assert [vocab[i] for i in p.answer_ids] == [*map(str, range(start, end + 1)), "<eos>"]
    with pytest.raises(ValueError, match=r"spec\.task\.name"):
        tasks.problems("sort", vocab_size=512)


def test_progress_patch_body() -> None:
    from r3operator.runtime.step_record import StepRecord

    row = StepRecord(
        step=3,
        policy_version=0,
        replay_mode="R3",
        reward_mean=0.25,
        reward_std=0.0,
        samples=0,
        samples_dropped=0,
        tokens=0,
        tokens_per_second=0.0,
        logprob_abs_diff_mean=0.01,
        logprob_abs_diff_max=float("nan"),
        kl_k3=1e-4,
        replay_applied=1.0,
        routing_natural_agreement=0.97,
    )
    body = progress_patch(row, total_steps=10, last_checkpoint_step=2, now=dt.datetime(2026, 1, 2, 3, 4, 5))
    assert body == {
        "status": {
            "progress": {
                "step": 3,
                "totalSteps": 10,
                "rewardMean": 0.25,
                "logprobAbsDiffMean": 0.01,
                "logprobAbsDiffMax": None,
                "klK3": 1e-4,
                "routingAgreement": 0.97,
                "lastCheckpointStep": 2,
                "updatedAt": "2026-01-02T03:04:05Z",
                # Figures the step lacks are sent as null, clearing the last step's.
                "replayedFraction": None,
                "fallbackFraction": None,
                "extremeTokenFraction": None,
                "routeCheckFailures": None,
                "routeCheckMessage": None,
            }
        }
    }
    # The body validates against the API's Progress model (camelCase aliases).
    from r3operator.api.v1alpha1 import Progress

    Progress.model_validate(body["status"]["progress"])


@pytest.mark.slow
def test_ppo_clip_loss_hand_values() -> None:
    import torch

    from r3operator.trainer.grpo.loss import ppo_clip_loss

    old = torch.zeros(1, 3)
    new = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))  # ratios 1.5, 0.5, 1.1
    mask = torch.tensor([[True, True, False]])
    # A = +1: token0 max(-1.5, -1.28) = -1.28 (clipped); token1 max(-0.5, -0.8) = -0.5 -> mean -0.89
    loss, stats = ppo_clip_loss(new, old, torch.tensor([1.0]), mask, clip_low=0.2, clip_high=0.28)
    assert float(loss) == pytest.approx(-0.89, abs=1e-6)
    assert stats.clip_fraction == pytest.approx(0.5)
    # A = -1: token0 max(1.5, 1.28) = 1.5; token1 max(0.5, 0.8) = 0.8 (clipped) -> mean 1.15
    loss, _ = ppo_clip_loss(new, old, torch.tensor([-1.0]), mask, clip_low=0.2, clip_high=0.28)
    assert float(loss) == pytest.approx(1.15, abs=1e-6)
    # gradient flows only through unclipped tokens: d/dlp of -A*r = -r for token1 (A=+1 case)
    new = new.clone().requires_grad_(True)
    loss, _ = ppo_clip_loss(new, old, torch.tensor([1.0]), mask, clip_low=0.2, clip_high=0.28)
    loss.backward()
    assert new.grad is not None
    np.testing.assert_allclose(new.grad.numpy(), [[0.0, -0.25, 0.0]], atol=1e-6)


class LinearPolicy:
    """The checkpoint side of a Trainer over one nn.Linear + AdamW (the real sharded checkpointer)."""

    def __init__(self, fill: float = 0.0) -> None:
        import torch

        from r3operator.trainer.sharded_checkpoint import ShardedCheckpointer

        self.model = torch.nn.Linear(2, 1)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.1)
        self.checkpointer = ShardedCheckpointer()
        self.fill(fill)

    def fill(self, value: float) -> None:
        import torch

        # A mutation of the live weights, like an optimizer step: it waits for the save in flight's copy.
        self.checkpointer.wait_staged()
        with torch.no_grad():
            self.model.weight.fill_(value)

    def save_checkpoint_async(self, directory: Path) -> None:
        from r3operator.trainer.sharded_checkpoint import policy_state

        self.checkpointer.save_async(directory, policy_state(self.model, self.optimizer))

    def wait_checkpoint(self) -> None:
        self.checkpointer.wait()

    def load_checkpoint(self, directory: Path) -> None:
        from r3operator.trainer.sharded_checkpoint import load_policy_state, policy_state

        state = policy_state(self.model, self.optimizer)
        self.checkpointer.load(directory, state)
        load_policy_state(self.model, self.optimizer, state)


@pytest.mark.slow
def test_checkpoint_async_commit_atomic_and_latest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from r3operator.runtime import checkpoint as ckpt

    root = tmp_path / "checkpoints"
    policy = LinearPolicy()
    saver = ckpt.AsyncCheckpoints(root, policy, keep_last=2)  # type: ignore[arg-type]
    assert saver.start(step=1, policy_version=2) is None
    assert ckpt.find_latest(root) is None  # in flight: not visible until committed
    for step in (2, 3):
        policy.fill(float(step - 1))  # the weights this step's checkpoint stages
        committed = saver.start(step=step, policy_version=step + 1)
        assert committed is not None and committed.step == step - 1  # starting a save commits the previous
    policy.fill(3.0)
    assert saver.finish() is not None
    assert [c.step for c in ckpt.list_checkpoints(root)] == [2, 3]
    latest = ckpt.find_latest(root)
    assert latest is not None and (latest.step, latest.policy_version) == (3, 4)
    fresh = LinearPolicy(fill=-7.0)
    driver = ckpt.load_checkpoint(latest, fresh)  # type: ignore[arg-type]
    assert set(driver) == {"rng"} and float(fresh.model.weight[0, 0]) == 2.0  # staged at start(step=3)

    # A commit killed before its rename leaves no step-4 directory and no temp dir; latest stays at 3.
    def boom(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    saver.start(step=4, policy_version=5)
    policy.wait_checkpoint()  # the shards are written; only the commit's rename fails
    monkeypatch.setattr(os, "rename", boom)
    with pytest.raises(KeyboardInterrupt):
        saver.finish()
    monkeypatch.undo()
    assert not list(root.glob(".tmp-*"))
    assert ckpt.find_latest(root).step == 3  # type: ignore[union-attr]
    # A stale `latest` pointing at a pruned dir falls back to the newest complete checkpoint.
    (root / "latest").write_text("step-000009\n")
    assert ckpt.find_latest(root).step == 3  # type: ignore[union-attr]
    # An incomplete directory (no meta.json) is ignored.
    (root / "step-000010").mkdir()
    assert ckpt.find_latest(root).step == 3  # type: ignore[union-attr]


@pytest.mark.slow
def test_step_checkpoints_are_due_every_interval_and_after_the_last_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from r3operator.runtime import checkpoint as ckpt

    root = tmp_path / "checkpoints"
    policy = LinearPolicy()
    saver = ckpt.StepCheckpoints(root, policy, keep_last=10, ranks=1, interval_steps=3, last_step=7)  # type: ignore[arg-type]
    saver.committed_step = 1  # a resume from step 1's checkpoint
    committed = []
    for step in range(2, 8):
        saver.after_step(step, policy_version=step)
        committed.append(saver.committed_step)
    # Due after steps 3 and 6 (every third) and 7 (the last); each is committed when the next one starts.
    assert committed == [1, 1, 1, 1, 3, 6]
    saver.finish_run()
    assert saver.committed_step == 7
    assert [c.step for c in ckpt.list_checkpoints(root)] == [3, 6, 7]

    # A failed run's end: a commit that fails is logged, not raised, and the newest committed step stays.
    def no_rename(*args: object, **kwargs: object) -> None:
        raise OSError("volume gone")

    saver.after_step(9, policy_version=9)
    policy.wait_checkpoint()  # the shards are written; only the commit's rename fails
    monkeypatch.setattr(os, "rename", no_rename)
    with caplog.at_level(logging.ERROR, logger="r3operator.runtime"):
        saver.finish_failed_run()
    assert saver.committed_step == 7 and "could not be committed: volume gone" in caplog.text
    assert not list(root.glob(".tmp-*"))


@pytest.mark.slow
def test_checkpoint_tensors_reproduce_the_checkpoint_file() -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from r3operator.models import ensure_reference_model
    from r3operator.wire.weights import checkpoint_tensors, chunk_tensors

    model_dir = ensure_reference_model("tiny")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    on_disk = load_file(str(model_dir / "model.safetensors"))
    converted = dict(checkpoint_tensors(model.state_dict(), dtype=torch.bfloat16))
    assert converted.keys() == on_disk.keys()
    assert all(torch.equal(converted[k], on_disk[k]) for k in on_disk)
    chunks = list(chunk_tensors(checkpoint_tensors(model.state_dict()), chunk_size_mb=4))
    assert len(chunks) > 1
    assert all(sum(t.numel() * 4 for _, t in c) <= 4 * 1024 * 1024 or len(c) == 1 for c in chunks)
    assert sum(len(c) for c in chunks) == len(on_disk)
