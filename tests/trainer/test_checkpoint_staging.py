"""The checkpoint's staging runs off the step (`checkpoint_staging.py`, `ShardedCheckpointer`): the
optimizer step that follows a save must not change what the save writes."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

DEADLOCK_BREAKER_S = 60.0  # a broken fence fails the test instead of hanging it


def _model_and_optimizer() -> tuple[Any, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def _train_step(model: Any, optimizer: Any) -> None:
    optimizer.zero_grad(set_to_none=True)
    model(torch.ones(2, 8)).square().sum().backward()
    optimizer.step()


def _snapshot(model: Any, optimizer: Any) -> dict[str, Any]:
    from r3operator.trainer.sharded_checkpoint import policy_state

    state = policy_state(model, optimizer)
    return {
        "model": {k: v.clone() for k, v in state["model"].items()},
        "exp_avg": {k: s["exp_avg"].clone() for k, s in state["optimizer"]["state"].items()},
    }


def _assert_equal_state(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["model"].keys() == want["model"].keys()
    assert all(torch.equal(got["model"][k], want["model"][k]) for k in want["model"])
    assert all(torch.equal(got["exp_avg"][k], want["exp_avg"][k]) for k in want["exp_avg"])


def _loaded(directory: Path) -> dict[str, Any]:
    from r3operator.trainer.sharded_checkpoint import ShardedCheckpointer, load_policy_state, policy_state

    model, optimizer = _model_and_optimizer()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(-3.0)  # nothing of the saved state by chance
    state = policy_state(model, optimizer)
    ShardedCheckpointer().load(directory, state)
    load_policy_state(model, optimizer, state)
    return _snapshot(model, optimizer)


class GatedStager:
    """`DefaultStager`'s plain CPU copy, in a thread of its own that starts copying only once `gate` is
    set: the test opens it when the checkpointer's fence is reached, or the optimizer step has run."""

    def __init__(self) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager

        from r3operator.trainer.checkpoint_staging import staging_options

        self.gate = threading.Event()
        options = staging_options(cuda=False)
        options.use_async_staging = False
        self._copy = DefaultStager(options)
        self._thread = ThreadPoolExecutor(max_workers=1)

    def stage(self, state_dict: Any) -> Future[Any]:
        return self._thread.submit(self._stage, state_dict)

    def _stage(self, state_dict: Any) -> Any:
        self.gate.wait(timeout=DEADLOCK_BREAKER_S)
        return self._copy.stage(state_dict)

    def close(self) -> None:
        self._thread.shutdown(wait=True)
        self._copy.close()


def test_the_optimizer_step_after_a_save_waits_for_the_copy(tmp_path: Path) -> None:
    from r3operator.trainer.sharded_checkpoint import ShardedCheckpointer, policy_state

    stager = GatedStager()

    class FenceOpensTheGate(ShardedCheckpointer):
        def wait_staged(self) -> None:
            stager.gate.set()  # the copy may start only now: before the fence, the step must not run
            super().wait_staged()

    model, optimizer = _model_and_optimizer()
    checkpointer = FenceOpensTheGate(stager=stager)
    checkpointer.guard(optimizer)
    _train_step(model, optimizer)
    at_save = _snapshot(model, optimizer)
    # Without the fence, the step runs first and this opens the gate: the copy then holds post-step values.
    optimizer.register_step_post_hook(lambda *_: stager.gate.set())
    stager.gate.clear()  # the first step's fence opened it (no save was in flight then)

    checkpointer.save_async(tmp_path / "ckpt", policy_state(model, optimizer))
    _train_step(model, optimizer)  # mutates the weights and AdamW moments in place
    checkpointer.close()

    after = _snapshot(model, optimizer)
    assert any(not torch.equal(after["model"][k], at_save["model"][k]) for k in at_save["model"])
    _assert_equal_state(_loaded(tmp_path / "ckpt"), at_save)


def test_default_stager_saves_the_state_of_the_save_call_across_saves(tmp_path: Path) -> None:
    """The real stager (no CUDA here: a plain copy in its thread), reused by two saves with steps between."""
    from r3operator.trainer.sharded_checkpoint import ShardedCheckpointer, policy_state

    model, optimizer = _model_and_optimizer()
    checkpointer = ShardedCheckpointer()
    checkpointer.guard(optimizer)
    wanted = []
    for save in range(2):
        _train_step(model, optimizer)
        wanted.append(_snapshot(model, optimizer))
        checkpointer.save_async(tmp_path / f"ckpt-{save}", policy_state(model, optimizer))
        _train_step(model, optimizer)
    checkpointer.close()
    for save, want in enumerate(wanted):
        _assert_equal_state(_loaded(tmp_path / f"ckpt-{save}"), want)


def test_close_finishes_the_save_in_flight(tmp_path: Path) -> None:
    from r3operator.trainer.sharded_checkpoint import ShardedCheckpointer, policy_state

    model, optimizer = _model_and_optimizer()
    _train_step(model, optimizer)
    checkpointer = ShardedCheckpointer()
    checkpointer.save_async(tmp_path / "ckpt", policy_state(model, optimizer))
    checkpointer.close()
    assert (tmp_path / "ckpt" / ".metadata").is_file()
    assert (tmp_path / "ckpt" / "__0_0.distcp").is_file()
