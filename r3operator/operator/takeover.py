"""The order of the first passes when the operator starts or takes the Lease.

A new leader makes a first pass over every RLJob (kopf's ``resume``), hundreds at once. Most find their
children as the old leader left them and write nothing; the few that need the pass (a child deleted or
changed while no leader ran, a child's event since the informers listed, a spec edit not yet observed)
would otherwise wait for their turn in no useful order: at 500 RLJobs, up to the 30 s all first passes take.
:class:`FirstPasses` lets the first pass of an RLJob that needs it start at once, and at most ``limit``
of the others run at a time, in the order they asked; a new RLJob's first pass is an urgent one (nothing
observed yet), so an operator already running, with RLJobs arriving, makes none of them wait.

:func:`needs_pass_first` decides from what is in memory only: the RLJob's live body, the informer cache
(informer.py) and the wake-ups its daemon got; no request, no render of desired().
"""

from __future__ import annotations

import asyncio
import collections
import datetime as dt
from collections.abc import Mapping
from typing import Any, Final

from r3operator.operator.desired import standing_children
from r3operator.operator.informer import ChildCache, Key
from r3operator.operator.kube import MAX_CONNECTIONS
from r3operator.operator.lifecycle import recorded_end_in
from r3operator.operator.meta import has_true_condition

DEFAULT_LIMIT: Final = MAX_CONNECTIONS
"""First passes at a time: as many as the client has connections, so that the API round trips of a pass (references,
a missing child, a status write) overlap; more would only queue for a connection. At 500 RLJobs, 32 at a time made a
new leader's first passes over all take 61 s against 24 s with no limit (docs/benchmarks.md, "Operator")."""
CACHE_SYNC_WAIT_S: Final = 10.0


def _expired(body: Mapping[str, Any], now: dt.datetime) -> bool:
    """The RLJob ended (the operator's finished annotation, which holds the RayJob's endTime) and its
    ``ttlSecondsAfterFinished`` has run: its children are gone by design (lifecycle.ttl_expired)."""
    ended = recorded_end_in((body.get("metadata") or {}).get("annotations") or {})
    ttl = ((body.get("spec") or {}).get("runPolicy") or {}).get("ttlSecondsAfterFinished")
    if ended is None or not isinstance(ttl, int):
        return False
    return (now - ended).total_seconds() >= ttl


def missing_child(body: Mapping[str, Any], cache: ChildCache, now: dt.datetime | None = None) -> str | None:
    """A child every RLJob has until its TTL runs (desired.standing_children) that the cache knows absent, for an
    RLJob whose status says a leader made its children (Valid) and whose TTL has not run: ``Kind/name``, or
    None. A kind the cache cannot answer for (not listed, not served) is taken as present."""
    metadata = body.get("metadata") or {}
    namespace, name = str(metadata.get("namespace") or ""), str(metadata.get("name") or "")
    if not has_true_condition(body, "Valid") or _expired(body, now or dt.datetime.now(dt.UTC)):
        return None
    for kinds, child in standing_children(name):
        found = [cache.lookup(kind, namespace, child) for kind in kinds]
        if all(f is None for f in found):  # known absent under every kind it may be (UNKNOWN is not None)
            return f"{kinds[0]}/{child}"
    return None


def needs_pass_first(body: Mapping[str, Any], cache: ChildCache | None, *, child_event: bool) -> str | None:
    """Why this RLJob's first pass goes before the others (None: it may wait): a child's event since the
    informers listed (``child_event``), a spec generation its status has not observed, or a standing child
    missing from the cache."""
    if child_event:
        return "a child changed"
    metadata = body.get("metadata") or {}
    if metadata.get("deletionTimestamp"):
        return None
    status = body.get("status") or {}
    if status.get("observedGeneration") != metadata.get("generation"):
        return "spec not observed"
    if cache is not None and (missing := missing_child(body, cache)) is not None:
        return f"{missing} missing"
    return None


class FirstPasses:
    """Urgent first passes never wait; at most ``limit`` of the others run at a time (the urgent ones count), first
    come first served. Their turns are handed out on the event loop's next round, not within :meth:`turn`: when a
    leader's informers have listed, every daemon waiting for that resumes in the same round and asks, so the
    urgent among them start before any other."""

    def __init__(self, limit: int = DEFAULT_LIMIT) -> None:
        if limit < 1:
            raise ValueError(f"first passes at a time: {limit} (at least 1)")
        self._limit = limit
        self._running = 0
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()
        self._futures: dict[Key, asyncio.Future[None]] = {}
        self._grant_scheduled = False

    @property
    def running(self) -> int:
        return self._running

    @property
    def waiting(self) -> int:
        """First passes waiting for a turn (a turn granted early, or a wait cancelled, leaves its entry in the
        queue, done)."""
        return sum(1 for granted in self._waiting if not granted.done())

    async def turn(self, key: Key, *, urgent: bool) -> None:
        """Wait for a turn; :meth:`done` gives it back (also when the wait is cancelled after the grant). An urgent
        first pass does not wait: kopf spawns a new leader's daemons one after another, and the one that needs its
        pass may ask after the limit's worth of others have their turns."""
        if urgent:
            self._running += 1
            return
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._futures[key] = granted
        self._waiting.append(granted)
        self._schedule()
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():
                self.done()  # granted, then cancelled before it ran: pass the turn on
            else:
                granted.cancel()
            raise
        finally:
            if self._futures.get(key) is granted:
                del self._futures[key]

    def hurry(self, key: Key) -> None:
        """A child's event for an RLJob still waiting for its first pass: its turn comes now, as an urgent one's."""
        granted = self._futures.get(key)
        if granted is not None and not granted.done():
            granted.set_result(None)  # its entry in the queue is skipped when it comes up
            self._running += 1

    def done(self) -> None:
        self._running -= 1
        self._schedule()

    def _schedule(self) -> None:
        if not self._grant_scheduled:
            self._grant_scheduled = True
            asyncio.get_running_loop().call_soon(self._grant)

    def _grant(self) -> None:
        self._grant_scheduled = False
        while self._waiting and self._running < self._limit:
            granted = self._waiting.popleft()
            if not granted.done():
                granted.set_result(None)
                self._running += 1


async def first_turn(
    gate: FirstPasses, key: Key, body: Mapping[str, Any], cache: ChildCache | None, *, child_event: Any
) -> str | None:
    """Before an RLJob's first pass: its namespace's informers started and listed (so the cache can say what is
    missing), then its turn; why it went first, or None. ``child_event``: a callable saying whether a child's
    event woke the RLJob meanwhile. The caller calls ``gate.done()`` after the pass."""
    namespace = key[0]
    if cache is not None and namespace:
        cache.watch_namespace(namespace)
        await cache.wait_synced(namespace, CACHE_SYNC_WAIT_S)
    why = needs_pass_first(body, cache, child_event=bool(child_event()))
    await gate.turn(key, urgent=why is not None)
    return why
