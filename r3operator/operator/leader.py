"""Leader election on a coordination.k8s.io/v1 Lease: only the replica holding it runs kopf.

Why a Lease and not kopf's peering: peering needs CRDs of its own (KopfPeering/ClusterKopfPeering) and
is not mutual exclusion: replicas of equal priority only log a warning and keep handling, and a new
replica handles events before its first peering round. The Lease is what client-go's leader election
(and so KubeRay, the Prometheus Operator, every controller-runtime operator) uses, it needs only
`get/create/update` on one Lease in the operator's namespace, and its timing gives the guarantee a
rolling update needs:

- a standby takes the Lease only when the holder released it or has not renewed it for
  `lease_duration` as measured by the standby's own clock since it last saw the record change (no
  cross-node clock comparison);
- the holder that cannot renew for `renew_deadline` (< `lease_duration`) exits the process at once,
  before any standby may take over, so a partitioned leader never overlaps its successor;
- on SIGTERM the holder stops kopf first, and releases the Lease only once no handler runs: the
  successor starts at once instead of after `lease_duration`.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from r3operator.operator.kube import Kind, KubeClient, KubeError

LEASE = Kind("coordination.k8s.io/v1", "leases")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LeaseConfig:
    namespace: str
    name: str = "r3operator-leader"
    identity: str = ""
    lease_duration_s: float = 15.0
    renew_deadline_s: float = 10.0
    retry_period_s: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.retry_period_s < self.renew_deadline_s < self.lease_duration_s:
            raise ValueError(
                "leader election needs retry period < renew deadline < lease duration, got "
                f"{self.retry_period_s} < {self.renew_deadline_s} < {self.lease_duration_s}"
            )


def default_identity() -> str:
    """The pod name plus a random suffix: a restarted container is a new candidate."""
    from r3operator.settings import operator_settings

    return f"{operator_settings().pod_name or socket.gethostname()}_{uuid.uuid4().hex[:8]}"


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    def __init__(
        self,
        client: KubeClient,
        config: LeaseConfig,
        *,
        exit_on_loss: Callable[[], None] | None = None,
        on_leading: Callable[[bool], None] | None = None,
    ) -> None:
        self.client, self.config = client, config
        self._on_leading = on_leading or (lambda _: None)
        self.identity = config.identity or default_identity()
        self.leading = False
        self.last_contact = 0.0  # monotonic time of the last answer from the API server
        self._observed: tuple[str | None, str | None] = (None, None)  # (holder, renewTime) last seen
        self._observed_at = 0.0
        self._exit_on_loss = exit_on_loss or (lambda: os._exit(1))

    # -- one round ------------------------------------------------------------------------------

    async def try_acquire_or_renew(self) -> bool:
        """One client-go style round: True when this candidate holds the Lease afterwards."""
        c = self.config
        lease = await self.client.get(LEASE, c.namespace, c.name)
        self.last_contact = time.monotonic()
        spec_now = {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": int(c.lease_duration_s),
            "renewTime": _now(),
        }
        if lease is None:
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": c.name, "namespace": c.namespace},
                "spec": {**spec_now, "acquireTime": spec_now["renewTime"], "leaseTransitions": 0},
            }
            return await self._write("POST", LEASE.path(c.namespace), body)
        spec = lease.get("spec") or {}
        holder, renewed = spec.get("holderIdentity"), spec.get("renewTime")
        if (holder, renewed) != self._observed:
            self._observed, self._observed_at = (holder, renewed), time.monotonic()
        duration = float(spec.get("leaseDurationSeconds") or c.lease_duration_s)
        held_by_other = bool(holder) and holder != self.identity
        if held_by_other and time.monotonic() - self._observed_at < duration:
            return False
        new_spec = {**spec, **spec_now}
        if holder != self.identity:
            new_spec["acquireTime"] = spec_now["renewTime"]
            new_spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + 1
        # resourceVersion makes the update conditional: of two candidates racing, one gets 409.
        body = {**lease, "spec": new_spec}
        return await self._write("PUT", LEASE.path(c.namespace, c.name), body)

    async def _write(self, method: str, path: str, body: dict[str, Any]) -> bool:
        try:
            await self.client.request(method, path, body)
        except KubeError as exc:
            if exc.status in (409, 422):  # another candidate wrote first
                return False
            raise
        self.last_contact = time.monotonic()
        return True

    # -- loops ----------------------------------------------------------------------------------

    async def acquire(self) -> None:
        """Block until this candidate leads."""
        c = self.config
        log.info("leader election: candidate %s for lease %s/%s", self.identity, c.namespace, c.name)
        while True:
            try:
                if await self.try_acquire_or_renew():
                    self.leading = True
                    self._on_leading(True)
                    log.info("leader election: %s acquired lease %s/%s", self.identity, c.namespace, c.name)
                    return
            except (TimeoutError, KubeError, OSError) as exc:
                log.warning("leader election: lease %s/%s not readable: %s", c.namespace, c.name, exc)
            await asyncio.sleep(c.retry_period_s)

    async def keep(self) -> None:
        """Renew every retry period; exit the process when no renewal succeeded for the renew deadline."""
        c = self.config
        last_renewal = time.monotonic()
        while True:
            await asyncio.sleep(c.retry_period_s)
            # One round may take what is left of the renew deadline, as client-go's renew loop allows: on a
            # loaded API server (or a busy event loop) a GET + PUT can outlast the retry period with the Lease
            # in no danger; a leader that gave each round only the retry period exited while it still held it.
            remaining = c.renew_deadline_s - (time.monotonic() - last_renewal)
            try:
                renewed = remaining > 0 and await asyncio.wait_for(self.try_acquire_or_renew(), timeout=remaining)
            except (TimeoutError, KubeError, OSError) as exc:
                log.warning("leader election: renewal failed: %s", exc)
                renewed = False
            if renewed:
                last_renewal = time.monotonic()
            elif time.monotonic() - last_renewal >= c.renew_deadline_s or self._lost_to_another():
                self.leading = False
                self._on_leading(False)
                log.error(
                    "leader election: lost lease %s/%s; exiting so no two replicas reconcile", c.namespace, c.name
                )
                self._exit_on_loss()
                return

    def _lost_to_another(self) -> bool:
        holder = self._observed[0]
        return bool(holder) and holder != self.identity

    async def release(self) -> None:
        """Give the Lease up (after kopf stopped) so a standby takes over without waiting for expiry."""
        c = self.config
        if not self.leading:
            return
        self.leading = False
        self._on_leading(False)
        try:
            lease = await self.client.get(LEASE, c.namespace, c.name)
            if lease is None or (lease.get("spec") or {}).get("holderIdentity") != self.identity:
                return
            spec = {**lease["spec"], "holderIdentity": None, "leaseDurationSeconds": 1, "renewTime": _now()}
            await self.client.request("PUT", LEASE.path(c.namespace, c.name), {**lease, "spec": spec})
            log.info("leader election: %s released lease %s/%s", self.identity, c.namespace, c.name)
        except (TimeoutError, KubeError, OSError) as exc:
            log.warning("leader election: release failed (the lease expires by itself): %s", exc)


async def run_as_leader(elector: LeaderElector, operate: Callable[[], Awaitable[None]]) -> None:
    """Acquire, run `operate()` (kopf) while renewing, release once it returned."""
    await elector.acquire()
    keeper = asyncio.create_task(elector.keep(), name="r3operator-lease-renewal")
    try:
        await operate()
    finally:
        keeper.cancel()
        await asyncio.gather(keeper, return_exceptions=True)
        await elector.release()
