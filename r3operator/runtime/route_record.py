"""The step's record of R3 routes on the routing volume, written beside training, never read back by it.

Routes cross a process boundary exactly once: in the engine's answer (vLLM's `routed_experts` field over
HTTP, or Ray's object store from an actor engine). The driver validates them there (`build_sample`) and
hands them to the batch builder from memory. Reading them back from a file the same process has just
written would add a disk round trip to every step's critical path and buy nothing.

What the volume keeps is the *record*: every R3 sample's routes of the last `retentionSteps` steps, in
the checksummed `.r3r` format, for `r3operator routes inspect` and for a post-mortem when
`R3RoutingAgreementLow` fires. One background thread writes it (and prunes old steps, in order with the
writes), so a slow or failing volume costs the step nothing: a failed write is logged and counted in
`r3operator_route_record_failures_total`, and training goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from r3operator.rollout.client import write_samples
from r3operator.routing.sample import RolloutSample
from r3operator.routing.store import RoutingStore

log = logging.getLogger(__name__)


class RouteRecorder:
    """Writes each step's routes to `store` on one background thread, in submission order."""

    def __init__(
        self,
        store: RoutingStore,
        *,
        num_experts: int,
        retention_steps: int,
        on_failure: Callable[[str], None] = lambda reason: None,
    ) -> None:
        self.store = store
        self.num_experts = num_experts
        self.retention_steps = retention_steps
        self.on_failure = on_failure
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="route-record")
        self._pending: list[Future[None]] = []

    def record(self, step: int, samples: Sequence[RolloutSample], *, policy_version: int) -> None:
        """Queue the step's routes (samples are immutable; the arrays are not copied), then prune."""
        snapshot = list(samples)

        def write() -> None:
            try:
                write_samples(
                    self.store, snapshot, step=step, num_experts=self.num_experts, policy_version=policy_version
                )
            except Exception as exc:  # the record is for people; training must not stop for it
                log.error("step %d: writing the routing record to %s failed: %s", step, self.store.root, exc)
                self.on_failure("write")
                return
            try:
                self.store.gc(keep_last_steps=self.retention_steps)
            except Exception as exc:
                log.error("pruning the routing record in %s failed: %s", self.store.root, exc)
                self.on_failure("gc")

        self._pending = [f for f in self._pending if not f.done()]
        self._pending.append(self._pool.submit(write))

    def flush(self) -> None:
        """Wait until every queued step is on the volume (end of run, tests)."""
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def close(self) -> None:
        self.flush()
        self._pool.shutdown(wait=True)
