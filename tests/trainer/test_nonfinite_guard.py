"""The non-finite guard of the optimizer step (trainer/nonfinite.py) on both backends: an update whose loss
or gradient is NaN leaves every parameter and AdamW's state bit-equal to what they were, one that is finite
is applied, and the ranks of a process group agree even when only one of them saw the NaN."""

from __future__ import annotations

import math
import multiprocessing as mp
import os
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tiny_moe import r3_batch  # noqa: E402

from r3operator.api.enums import ReplayMode  # noqa: E402


def _state(model: Any, optimizer: Any) -> dict[str, Any]:
    """Every parameter and every AdamW state tensor, copied."""
    out = {f"param {n}": p.detach().clone() for n, p in model.named_parameters()}
    for i, (p, state) in enumerate(optimizer.state.items()):
        for key, value in state.items():
            out[f"optim {i} {tuple(p.shape)} {key}"] = value.clone() if torch.is_tensor(value) else value
    return out


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a)


def _finite(model: Any) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_a_nan_update_changes_nothing_and_a_finite_one_is_applied(tiny_moe_dir: Path) -> None:
    """Reference: the trainer's own state before the call. One finite update first, so AdamW has state."""
    from r3operator.trainer.hf_policy import PolicyTrainer

    trainer = PolicyTrainer(tiny_moe_dir, device="cpu", learning_rate=1e-3, seed=0, compute_dtype="float32")
    batch = r3_batch()
    old = trainer.old_logprobs(batch, ReplayMode.DISABLED)
    first = trainer.update(batch, old, mini_batches=1, clip_low=0.2, clip_high=0.28)
    assert (first.updates, first.updates_skipped) == (1, 0) and trainer.optimizer.state

    before = _state(trainer.model, trainer.optimizer)
    batch.advantages[0] = float("nan")
    stats = trainer.update(
        batch, trainer.old_logprobs(batch, ReplayMode.DISABLED), mini_batches=1, clip_low=0.2, clip_high=0.28
    )
    assert (stats.updates, stats.updates_skipped, stats.applied_any) == (1, 1, False)
    assert math.isnan(stats.loss)
    assert _same(before, _state(trainer.model, trainer.optimizer))  # no optimizer step, AdamW state untouched
    assert all(p.grad is None for p in trainer.model.parameters())  # the NaN gradients were dropped

    # Two mini-batches (rows 0, 2, 4 and 1, 3): the one holding the NaN row is skipped, the other applied.
    stats = trainer.update(
        batch, trainer.old_logprobs(batch, ReplayMode.DISABLED), mini_batches=2, clip_low=0.2, clip_high=0.28
    )
    assert (stats.updates, stats.updates_skipped, stats.applied_any) == (2, 1, True)
    assert _finite(trainer.model) and not _same(before, _state(trainer.model, trainer.optimizer))


def test_the_sft_warm_up_skips_a_nan_step(tiny_moe_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from r3operator.trainer.hf_policy import PolicyTrainer

    trainer = PolicyTrainer(tiny_moe_dir, device="cpu", learning_rate=1e-3, seed=0, compute_dtype="float32")
    trainer.sft_step([[5, 6, 7]], [[8, 9, 2]])
    before = _state(trainer.model, trainer.optimizer)
    # The forward's logprobs made NaN: a NaN loss and NaN gradients, as a diverged model would give.
    from r3operator.trainer import hf_policy

    real = hf_policy.token_logprobs
    monkeypatch.setattr(hf_policy, "token_logprobs", lambda *a, **k: real(*a, **k) * float("nan"))
    assert math.isnan(trainer.sft_step([[5, 6, 7]], [[8, 9, 2]]))
    assert _same(before, _state(trainer.model, trainer.optimizer))


@pytest.mark.slow
def test_a_nan_megatron_train_step_changes_nothing(tmp_path: Path) -> None:
    pytest.importorskip("megatron.core", reason="megatron-core not installed (pip extra `megatron`)")
    from tiny_moe import build_tiny_moe

    from r3operator.trainer.megatron import build_megatron_trainer
    from r3operator.trainer.megatron.adapter import MegatronPolicyTrainer

    build_tiny_moe("qwen3_moe").save_pretrained(tmp_path)
    policy = MegatronPolicyTrainer(
        build_megatron_trainer(None, tmp_path, "cpu", micro_batch_size=2), compute_dtype="float32"
    )
    mt = policy.mt
    batch = r3_batch()
    old = policy.old_logprobs(batch, ReplayMode.DISABLED)
    first = policy.update(batch, old, mini_batches=1, clip_low=0.2, clip_high=0.28)
    assert first.updates_skipped == 0 and mt.optimizer.state

    before = _state(mt.model, mt.optimizer)
    batch.advantages[3] = float("nan")  # the second micro-batch: the first one's gradient is finite
    stats = policy.update(
        batch, policy.old_logprobs(batch, ReplayMode.DISABLED), mini_batches=1, clip_low=0.2, clip_high=0.28
    )
    assert (stats.updates, stats.updates_skipped) == (1, 1)
    assert _same(before, _state(mt.model, mt.optimizer))


def _rank(rank: int, port: int, results: Any) -> None:
    import torch.distributed as dist

    from r3operator.trainer.nonfinite import finite_on_every_rank

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        # Rank 1 alone sees a NaN loss (its rows); the gradient norm, already reduced, is finite on both.
        results.put((rank, "one", finite_on_every_rank(float("nan") if rank == 1 else 0.5, 1.0)))
        results.put((rank, "none", finite_on_every_rank(0.5, 1.0)))
    finally:
        dist.destroy_process_group()


def test_the_ranks_agree_when_only_one_sees_a_non_finite_loss() -> None:
    from r3operator.trainer.fsdp import free_local_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_local_port()
    procs = [ctx.Process(target=_rank, args=(rank, port, results)) for rank in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    got = sorted(results.get(timeout=5) for _ in range(4))
    assert got == [(0, "none", True), (0, "one", False), (1, "none", True), (1, "one", False)]
