"""Step-boundary checkpoints, sharded and asynchronous, committed atomically.

Layout under `<run dir>/checkpoints/` (cluster: the shared volume):

    step-000004/policy/.metadata           DCP's global plan (rank 0)
    step-000004/policy/__<rank>_0.distcp   one shard of model + AdamW state per trainer rank
    step-000004/policy/rng-rank<rank>.pt   each rank's RNG state
    step-000004/driver.pt                  the driver's RNG state
    step-000004/meta.json                  {"format": 2, "step", "policy_version", "ranks"}; written last
    latest                                 "step-000004\\n", replaced atomically after the rename

`AsyncCheckpoints.start` writes into `.tmp-step-000004-<random>/` and returns as soon as the trainer's
ranks have enqueued the copy of their state into host memory; the run goes on while the copy and then
the write proceed (each rank's next optimizer step waits for its copy). The commit
(meta.json, fsync, rename, `latest`, retention) follows once every rank's write has finished: at the
next checkpoint, or at `finish` (end of the run). A reader (a restarted driver) sees a complete
checkpoint or none; a killed writer leaves only a temp dir, removed at the next commit. `latest` is a
hint; `find_latest` falls back to the newest complete `step-*` directory.

`StepCheckpoints` is a run's: a checkpoint after every `checkpoint.intervalSteps`-th step and after the last, and the
step of the newest one committed (`status.progress.lastCheckpointStep`).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from r3operator.trainer.base import Trainer
from r3operator.trainer.sharded_checkpoint import fsync_file, rng_state, set_rng_state

FORMAT = 2
LATEST = "latest"
POLICY = "policy"
DRIVER_STATE = "driver.pt"
META = "meta.json"

log = logging.getLogger("r3operator.runtime")

__all__ = [
    "AsyncCheckpoints",
    "CheckpointInfo",
    "StepCheckpoints",
    "find_latest",
    "list_checkpoints",
    "load_checkpoint",
    "set_rng_state",
]


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int
    policy_version: int


@dataclass(frozen=True)
class _InFlight:
    tmp: Path
    step: int
    policy_version: int


class AsyncCheckpoints:
    """At most one checkpoint in flight; `start` commits the previous one first."""

    def __init__(self, root: Path, trainer: Trainer, *, keep_last: int, ranks: int = 1) -> None:
        if keep_last < 1:
            raise ValueError(f"spec.checkpoint.keepLast: expected at least 1, got {keep_last}")
        self.root, self.trainer, self.keep_last, self.ranks = root, trainer, keep_last, ranks
        self._in_flight: _InFlight | None = None

    def start(self, *, step: int, policy_version: int) -> CheckpointInfo | None:
        """Commit the checkpoint in flight (if any; returned), then start writing this step's."""
        import torch

        committed = self.finish()
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".tmp-step-{step:06d}-{secrets.token_hex(4)}"
        tmp.mkdir()
        try:
            torch.save({"rng": rng_state()}, tmp / DRIVER_STATE)
            fsync_file(tmp / DRIVER_STATE)
            self.trainer.save_checkpoint_async(tmp / POLICY)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._in_flight = _InFlight(tmp, step, policy_version)
        return committed

    def finish(self) -> CheckpointInfo | None:
        """Wait for the checkpoint in flight to be written by every rank, then commit it."""
        pending, self._in_flight = self._in_flight, None
        if pending is None:
            return None
        try:
            self.trainer.wait_checkpoint()
            return self._commit(pending)
        except BaseException:
            shutil.rmtree(pending.tmp, ignore_errors=True)
            raise

    def _commit(self, pending: _InFlight) -> CheckpointInfo:
        meta = {"format": FORMAT, "step": pending.step, "policy_version": pending.policy_version, "ranks": self.ranks}
        (pending.tmp / META).write_text(json.dumps(meta) + "\n")
        fsync_file(pending.tmp / META)
        final = self.root / f"step-{pending.step:06d}"
        if final.exists():  # a re-run of the same step after a crash between rename and `latest`
            shutil.rmtree(final)
        os.rename(pending.tmp, final)
        fsync_file(self.root)
        latest_tmp = self.root / f".{LATEST}.tmp-{secrets.token_hex(4)}"
        latest_tmp.write_text(final.name + "\n")
        os.replace(latest_tmp, self.root / LATEST)
        _prune(self.root, keep_last=self.keep_last)
        return CheckpointInfo(final, pending.step, pending.policy_version)


class StepCheckpoints(AsyncCheckpoints):
    """A run's checkpoints at its step boundaries (phase 10 of runtime/loop.py): due after every `interval_steps`-th
    step and after the run's `last_step`. `committed_step` is the step of the newest one committed: the resumed
    checkpoint's (set by runtime/setup.py `resume`) until this run commits one."""

    def __init__(
        self, root: Path, trainer: Trainer, *, keep_last: int, ranks: int, interval_steps: int, last_step: int
    ) -> None:
        super().__init__(root, trainer, keep_last=keep_last, ranks=ranks)
        self.interval_steps, self.last_step = interval_steps, last_step
        self.committed_step: int | None = None

    def after_step(self, step: int, *, policy_version: int) -> None:
        """Start `step`'s checkpoint when it is due (committing the one in flight first)."""
        if step % self.interval_steps and step != self.last_step:
            return
        self._note(self.start(step=step, policy_version=policy_version))

    def finish_run(self) -> None:
        """Wait for the checkpoint in flight and commit it (the end of a run)."""
        self._note(self.finish())

    def finish_failed_run(self) -> None:
        """The end of a run that failed: a checkpoint already staged is still worth committing; one that cannot be is
        logged, not raised, so that the run's own error is the one that reaches the caller."""
        try:
            self.finish_run()
        except Exception as exc:
            log.error("the checkpoint in flight could not be committed: %s", exc)

    def _note(self, committed: CheckpointInfo | None) -> None:
        if committed is not None:
            self.committed_step = committed.step


def _complete(path: Path) -> CheckpointInfo | None:
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, ValueError):
        return None
    if meta.get("format") != FORMAT or not (path / POLICY / ".metadata").is_file():
        return None
    if not (path / DRIVER_STATE).is_file():
        return None
    return CheckpointInfo(path, int(meta["step"]), int(meta["policy_version"]))


def list_checkpoints(root: Path) -> list[CheckpointInfo]:
    if not root.is_dir():
        return []
    found = [_complete(p) for p in root.iterdir() if p.is_dir() and p.name.startswith("step-")]
    return sorted((c for c in found if c is not None), key=lambda c: c.step)


def find_latest(root: Path) -> CheckpointInfo | None:
    hint = root / LATEST
    if hint.is_file():
        info = _complete(root / hint.read_text().strip())
        if info is not None:
            return info
    found = list_checkpoints(root)
    return found[-1] if found else None


def load_checkpoint(info: CheckpointInfo, trainer: Trainer) -> dict[str, Any]:
    """Load the trainer's shards (on however many ranks it has now) and return the driver's state."""
    import torch

    trainer.load_checkpoint(info.path / POLICY)
    return dict(torch.load(info.path / DRIVER_STATE, map_location="cpu", weights_only=False))


def _prune(root: Path, *, keep_last: int) -> None:
    for info in list_checkpoints(root)[:-keep_last]:
        shutil.rmtree(info.path, ignore_errors=True)
    for stale in root.glob(".tmp-step-*"):  # left by a killed writer; none is in flight during a commit
        shutil.rmtree(stale, ignore_errors=True)
