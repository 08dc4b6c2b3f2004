"""Engine faults: keep every rollout engine on the trainer's current policy while engines fail and return.

The fault model (docs/runtime.md, "Faults and retries"):

- a single engine call that fails transiently is retried with backoff by the engine façade itself
  (`wire/retry.py`); what reaches this module is an `EngineUnavailableError` (retries spent) or an engine
  that answers again but was restarted meanwhile;
- every finished weight sync stamps each engine with a policy tag (`<run nonce>:<policy version>`, kept in
  the engine's worker extension). A restarted engine, or one whose sync was aborted, reports another tag
  (None), so it is found before and after every rollout and canary decode;
- a weight sync that fails part-way is aborted without finalising (the engine restores the layers that were
  still loading) and then repeated in full, after every engine answers again; the engine's tag stays None
  until a complete sync finishes, so no rollout runs on mixed weights;
- an engine found stale is waited for, re-synced with the current weights, and must pass the canary
  before any rollout goes to it; a rollout or canary decode that ran while an engine was stale is discarded
  and run again (same prompts and seeds, so the same samples a healthy engine would have produced).

Everything is bounded by the `Backoff` attempts; the final error names the engine, what was tried and
the last error. A canary mismatch is never retried: it means the sync is wrong, not that an engine is away.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from r3operator.rollout.base import Engine, StaleEngineError
from r3operator.rollout.engines import EngineGroup
from r3operator.weightsync.endpoints import EngineEndpoint, SyncCounts, endpoints
from r3operator.weightsync.packed import install_packed
from r3operator.wire.retry import Backoff, EngineUnavailableError
from r3operator.wire.sync_phases import SyncPhases
from r3operator.wire.weights import PackedChunk

log = logging.getLogger("r3operator.runtime")
T = TypeVar("T")

FaultCounter = Callable[[str], None]  # called with the fault kind, e.g. "engine_call" (a metrics counter)
Install = Callable[[Sequence[Engine], str], SyncCounts]
"""How one attempt installs a policy on the given engines, stamped with the tag."""


class EngineSupervisor:
    """Installs policies on the engines and runs calls only against engines that serve the current one.

    `chunks()` yields the trainer's current weights as packed chunks (called afresh for every attempt);
    `canary(engines)` checks the given engines against the trainer and raises on a mismatch.
    """

    def __init__(
        self,
        group: EngineGroup,
        *,
        chunks: Callable[[], Iterable[PackedChunk]],
        canary: Callable[[Sequence[Engine]], object],
        backoff: Backoff | None = None,
        on_fault: FaultCounter | None = None,
        nonce: str | None = None,
        install: Install | None = None,
        phases: SyncPhases | None = None,
    ) -> None:
        self.group = group
        self.chunks = chunks
        # How one attempt installs a policy: vLLM's native transfer (weightsync/sync.py) or, by
        # default, the packed chunks through our worker extension.
        self.install: Install = install or self._install_packed
        self.phases = phases if phases is not None else SyncPhases()  # of the packed path's syncs
        self.canary = canary
        self.backoff = backoff or Backoff.from_env()
        self.on_fault = on_fault or (lambda kind: None)
        self.nonce = nonce or secrets.token_hex(4)  # a previous driver's "version 5" is not this run's
        self.tag: str | None = None

    def tag_for(self, version: int) -> str:
        return f"{self.nonce}:{version}"

    # -- weight sync --------------------------------------------------------------------------------
    def sync(self, version: int) -> SyncCounts:
        """Install the trainer's current weights as policy `version` on every engine."""
        result = self._install(self.group.engines, self.tag_for(version))
        self.tag = self.tag_for(version)
        return result

    def _install_packed(self, engines: Sequence[Engine], tag: str) -> SyncCounts:
        return install_packed(endpoints(engines), self.chunks(), policy_tag=tag, phases=self.phases)

    def _install(self, engines: Sequence[Engine], tag: str) -> SyncCounts:
        for attempt in range(self.backoff.attempts):
            try:
                for engine in engines:
                    if attempt:
                        engine.wait_ready()
                    # A bracket left open (an abort that never reached the engine, a driver killed
                    # mid-sync) would make `begin` refuse; closing it unfinalised is a no-op otherwise. An
                    # install that closes open brackets itself (the native one) does it on a first attempt.
                    if attempt or not getattr(self.install, "closes_open_brackets", False):
                        EngineEndpoint(engine).abort_weight_update()
                return self.install(engines, tag)
            except EngineUnavailableError as exc:
                self.on_fault("weight_sync")
                if attempt + 1 == self.backoff.attempts:
                    raise EngineUnavailableError(
                        f"weight sync of policy {tag} to {', '.join(e.name for e in engines)} failed "
                        f"{self.backoff.attempts} times; each attempt was aborted without finalising, so these "
                        f"engines serve no complete policy; last error: {exc}"
                    ) from exc
                pause = self.backoff.delay(attempt)
                log.warning(
                    "weight sync of policy %s failed (attempt %d/%d), aborted without finalising; "
                    "repeating it in full in %.2f s: %s",
                    tag,
                    attempt + 1,
                    self.backoff.attempts,
                    pause,
                    exc,
                )
                self.backoff.sleep(pause)
        raise AssertionError("unreachable: attempts >= 1")

    # -- calls that need the current policy -----------------------------------------------------------
    def stale_engines(self) -> list[Engine]:
        """Engines whose policy tag is not the current one (restarted, or their last sync was aborted)."""
        stale = []
        for engine in self.group.engines:
            endpoint = EngineEndpoint(engine)
            try:
                tag = endpoint.policy_tag()
            except EngineUnavailableError as exc:
                log.warning("%s does not answer (%s); waiting for it", engine.name, exc)
                engine.wait_ready()
                tag = endpoint.policy_tag()
            if tag != self.tag:
                stale.append(engine)
        return stale

    def ensure_current(self) -> list[Engine]:
        """Re-sync and canary every stale engine; returns them (empty when all were current)."""
        stale = self.stale_engines()
        if stale and self.tag is not None:
            for engine in stale:
                self.on_fault("stale_engine")
                log.warning(
                    "%s does not serve policy %s (restarted or an aborted sync): waiting for it, "
                    "re-syncing the current weights and checking the canary before it gets rollouts",
                    engine.name,
                    self.tag,
                )
                engine.wait_ready()
            self._install(stale, self.tag)
            self.canary(stale)
        return stale

    def current_only(self, call: Callable[[], T], *, what: str) -> T:
        """`call()` only while every engine serves the current policy, before and after it; installs nothing.

        The asynchronous producer's calls: a re-sync from its thread would load the trainer's live weights
        (possibly mid-update) stamped with the published version, and its canary would arm the trainer's
        router replay beside an update. Raises `StaleEngineError` (or the `EngineUnavailableError` of the
        call) so that the trainer thread recovers the engines inside the gate (rollout/producer.py)."""
        if self.stale_engines():
            raise StaleEngineError(f"an engine does not serve policy {self.tag}; the {what} waits for its re-sync")
        result = call()
        if self.stale_engines():
            self.on_fault("stale_result")
            raise StaleEngineError(f"an engine lost policy {self.tag} during the {what}: its result is discarded")
        return result

    def on_policy(self, call: Callable[[], T], *, what: str) -> T:
        """`call()` with every engine on the current policy before and after it; a call that failed on an
        engine, or that ran while an engine was stale, is repeated after the engines are re-synced."""
        last: BaseException | None = None
        for attempt in range(self.backoff.attempts):
            try:
                self.ensure_current()
                result = call()
                if not self.stale_engines():
                    return result
                self.on_fault("stale_result")
                last = RuntimeError(f"an engine changed policy during the {what}")
                log.warning("an engine lost policy %s during the %s: its result is discarded", self.tag, what)
            except EngineUnavailableError as exc:
                self.on_fault("engine_call")
                last = exc
                log.warning("%s failed (attempt %d/%d): %s", what, attempt + 1, self.backoff.attempts, exc)
            if attempt + 1 < self.backoff.attempts:
                self.backoff.sleep(self.backoff.delay(attempt))
        raise EngineUnavailableError(f"{what} failed {self.backoff.attempts} times; last error: {last}") from last
