"""The operator's children held in memory, fed by one watch per kind and namespace (an informer, as
controller-runtime's), and the wake-up of the owning RLJob's reconcile when one of them changes.

Why our own and not kopf's indexes: kopf watches a kind whole and filters by label in the operator, so
an index over Pods, ConfigMaps or Services would hold (and stream) every one in the namespace; here the
API server filters by the operator's label (``r3operator.io/job``), so only children travel and are kept.
The watches run over the operator's own client (kube.py), in kopf's event loop.

Per kind and namespace: LIST (paged), then WATCH from the list's resourceVersion with bookmarks. A stream
the server ends (its timeout) is resumed from the last resourceVersion seen; a 410 Gone (the version was
compacted), a dropped connection or an API server restart lists again and *replaces* the store, so a child
deleted or edited while the watch was down is seen as such, and its RLJob is woken. A kind the cluster
does not serve (no LeaderWorkerSet, Kueue or Prometheus Operator CRD) is tried again every
``UNSERVED_RETRY_S``; until a kind has listed, :meth:`ChildCache.lookup` answers :data:`UNKNOWN` and the
reconciler reads from the API server instead.

What is kept is each object whole but for ``metadata.managedFields`` (the apply bookkeeping no pass reads,
and most of an object's bytes); a Pod keeps its metadata and status only (scheduling.py reads nothing else);
a RayJob's status lacks KubeRay's copy of its RayCluster's status (``_DROPPED_STATUS``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import aiohttp

from r3operator.operator import meta
from r3operator.operator.kube import KINDS, KubeClient, KubeError
from r3operator.operator.lifecycle import observed_finish

log = logging.getLogger("r3operator.informer")

WATCHED_KINDS: Final = (
    "StatefulSet",
    "LeaderWorkerSet",
    "RayJob",
    "Job",
    "Pod",
    "PersistentVolumeClaim",
    "Service",
    "ConfigMap",
    "ServiceAccount",
    "Role",
    "RoleBinding",
    "NetworkPolicy",
    "PodMonitor",
    "Workload",
)
"""Every kind the operator creates, and the Pods made from them (labelled by the pod templates)."""

SELECTOR: Final = meta.LABEL_JOB
"""Every child, and every pod of a child, carries it (meta.labels); its value is the RLJob's name."""

UNSERVED_RETRY_S: Final = 30.0
ERROR_RETRY_S: Final = (0.5, 8.0)
"""Backoff after a failed list or watch: doubling from the first to the second, with jitter."""


class _Unknown:
    def __repr__(self) -> str:
        return "UNKNOWN"


UNKNOWN: Final = _Unknown()
"""The cache cannot say: that kind has not listed yet (or is not served) in that namespace."""

Key = tuple[str, str]
"""(namespace, name)."""


_DROPPED_STATUS: Final = {"RayJob": ("rayClusterStatus",)}
"""Status fields no pass reads, by kind: KubeRay's copy of the RayCluster's status in the RayJob (its resources,
endpoints, head pod and conditions); lifecycle.py and status.py read the job's own fields only."""


def slim(kind: str, obj: dict[str, Any]) -> dict[str, Any]:
    """`obj` as held in memory: without what no pass reads (the module docstring)."""
    metadata = dict(obj.get("metadata") or {})
    metadata.pop("managedFields", None)
    if kind == "Pod":
        return {"kind": "Pod", "apiVersion": "v1", "metadata": metadata, "status": obj.get("status") or {}}
    slim = {**obj, "metadata": metadata}
    if (dropped := _DROPPED_STATUS.get(kind)) and isinstance(status := obj.get("status"), dict):
        slim["status"] = {k: v for k, v in status.items() if k not in dropped}
    return slim


def _version(obj: dict[str, Any]) -> str | None:
    return (obj.get("metadata") or {}).get("resourceVersion")


def is_newer(obj: dict[str, Any], than: dict[str, Any] | None) -> bool:
    """``obj`` is a later state than ``than``: resourceVersions are etcd revisions (integers) in every
    kube-apiserver; were one not, the later arrival wins."""
    if than is None:
        return True
    mine, theirs = _version(obj), _version(than)
    if mine is not None and theirs is not None and mine.isdigit() and theirs.isdigit():
        return int(mine) >= int(theirs)
    return True


def _owner(obj: dict[str, Any]) -> str | None:
    return ((obj.get("metadata") or {}).get("labels") or {}).get(SELECTOR)


@dataclass(slots=True)
class _Store:
    """One kind in one namespace."""

    objects: dict[str, dict[str, Any]] = field(default_factory=dict)
    by_job: dict[str, set[str]] = field(default_factory=dict)
    """The names of each RLJob's objects: a pass asks for its own pods without a scan of every pod."""
    synced: bool = False
    unserved: bool = False
    """The last list was refused: 404, the kind's CRD is not installed; 403, the operator may not list it."""

    def set(self, name: str, obj: dict[str, Any]) -> None:
        self.pop(name)
        self.objects[name] = obj
        if (job := _owner(obj)) is not None:
            self.by_job.setdefault(job, set()).add(name)

    def pop(self, name: str) -> dict[str, Any] | None:
        old = self.objects.pop(name, None)
        if old is not None and (job := _owner(old)) is not None and (names := self.by_job.get(job)) is not None:
            names.discard(name)
            if not names:
                del self.by_job[job]
        return old

    def reset(self, objects: dict[str, dict[str, Any]]) -> None:
        self.objects, self.by_job = {}, {}
        for name, obj in objects.items():
            self.set(name, obj)


class Wake:
    """What an RLJob's reconcile loop (handlers.py) waits on: ``any`` is set by every wake-up, ``urgent`` also by
    those that must not wait for a burst of child events to settle (a change of the RLJob itself)."""

    def __init__(self) -> None:
        self.any = asyncio.Event()
        self.urgent = asyncio.Event()
        self.by_child = False
        """A child's event (not the RLJob's own) woke it since the last clear: a new leader's first passes take
        such an RLJob before the others (takeover.py)."""

    def set(self, *, urgent: bool = False, by_child: bool = False) -> None:
        self.any.set()
        self.by_child = self.by_child or by_child
        if urgent:
            self.urgent.set()

    def clear(self) -> None:
        self.any.clear()
        self.urgent.clear()
        self.by_child = False


class Wakeups:
    """One :class:`Wake` per RLJob, which its reconcile loop (handlers.py) waits on."""

    def __init__(self) -> None:
        self._events: dict[Key, Wake] = {}

    def subscribe(self, key: Key) -> Wake:
        return self._events.setdefault(key, Wake())

    def unsubscribe(self, key: Key) -> None:
        self._events.pop(key, None)

    def wake(self, key: Key, *, urgent: bool = False) -> None:
        """No-op for an RLJob without a loop (not handled by this operator, or gone). ``urgent``: a change of the
        RLJob itself, passed on without the settle delay a child's event waits (handlers.py)."""
        event = self._events.get(key)
        if event is not None:
            event.set(urgent=urgent)

    def wake_by_child(self, key: Key) -> None:
        """A child's event (ChildCache's ``on_change``)."""
        event = self._events.get(key)
        if event is not None:
            event.set(by_child=True)

    def wake_namespace(self, namespace: str) -> None:
        for (ns, _), event in self._events.items():
            if ns == namespace:
                event.set()


class ChildCache:
    """The children of the RLJobs in the namespaces :meth:`watch_namespace` was called for."""

    def __init__(
        self,
        client: KubeClient,
        on_change: Callable[[Key], None],
        on_served: Callable[[str], None] = lambda namespace: None,
        *,
        on_end: Callable[[Key], None] = lambda key: None,
        kinds: tuple[str, ...] = WATCHED_KINDS,
        watch_timeout_s: int = 600,
    ) -> None:
        self._client = client
        self._on_change = on_change
        self._on_end = on_end
        """Called, after ``on_change``, when an RLJob's RayJob has just ended (Complete or Failed): a state the user
        waits for, which the pass takes without waiting for the rest of the burst (handlers.py, ``urgent``)."""
        self._on_served = on_served
        self._kinds = kinds
        self._watch_timeout_s = watch_timeout_s
        self._stores: dict[tuple[str, str], _Store] = {}
        self._tasks: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._synced: dict[str, asyncio.Event] = {}
        """Per namespace, set once every kind has listed or is known unserved: what a pass waiting for its
        namespace's lists awaits (hundreds at once when a leader takes over), rather than polling."""

    def watch_namespace(self, namespace: str) -> None:
        """Start the watches of ``namespace`` (once; idempotent)."""
        for kind in self._kinds:
            key = (kind, namespace)
            if key not in self._tasks:
                self._stores[key] = _Store()
                self._tasks[key] = asyncio.create_task(self._run(kind, namespace), name=f"informer {kind} {namespace}")

    def synced(self, namespace: str) -> bool:
        """Every kind has listed, or is known not to be served."""
        stores = [self._stores.get((k, namespace), _Store()) for k in self._kinds]
        return all(s.synced or s.unserved for s in stores)

    async def wait_synced(self, namespace: str, timeout_s: float) -> bool:
        if self.synced(namespace):
            return True
        event = self._synced.setdefault(namespace, asyncio.Event())
        event.clear()  # set by an earlier sync that a refused list has undone since
        with contextlib.suppress(TimeoutError):  # the caller reads from the API server then
            await asyncio.wait_for(event.wait(), timeout_s)
        return self.synced(namespace)

    def _check_synced(self, namespace: str) -> None:
        if (event := self._synced.get(namespace)) is not None and self.synced(namespace):
            event.set()

    def lookup(self, kind: str, namespace: str, name: str) -> dict[str, Any] | _Unknown | None:
        """The child as last seen, None when the cache knows it absent (among the labelled objects), or
        UNKNOWN."""
        store = self._stores.get((kind, namespace))
        if store is None or not store.synced:
            return UNKNOWN
        return store.objects.get(name)

    def of_job(self, kind: str, namespace: str, job: str) -> list[dict[str, Any]] | _Unknown:
        """Every cached object of ``kind`` labelled with RLJob ``job``, or UNKNOWN."""
        store = self._stores.get((kind, namespace))
        if store is None or not store.synced:
            return UNKNOWN
        return [store.objects[name] for name in store.by_job.get(job, ())]

    def size(self) -> int:
        return sum(len(s.objects) for s in self._stores.values())

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()

    def remember(self, kind: str, namespace: str, obj: dict[str, Any]) -> None:
        """What a write of this operator's returned: held at once, so that a pass right after it does not
        read the object as it was before (its watch event arrives a moment later and changes nothing)."""
        store = self._stores.get((kind, namespace))
        if store is not None and store.synced:
            name = str((obj.get("metadata") or {}).get("name") or "")
            if is_newer(obj, store.objects.get(name)):
                store.set(name, slim(kind, obj))

    def _put(self, kind: str, namespace: str, obj: dict[str, Any]) -> None:
        store = self._stores[(kind, namespace)]
        name = str((obj.get("metadata") or {}).get("name") or "")
        old = store.objects.get(name)
        if old is not None and _version(old) is not None and _version(old) == _version(obj):
            return  # held already: the echo of this operator's own write (remember), which its pass has seen
        if is_newer(obj, old):
            store.set(name, slim(kind, obj))
        for job in {_owner(obj), _owner(old) if old is not None else None} - {None}:
            self._on_change((namespace, str(job)))
        ended = kind == "RayJob" and observed_finish(obj) is not None and observed_finish(old) is None
        if ended and (job := _owner(obj)) is not None:
            self._on_end((namespace, job))

    def _drop(self, kind: str, namespace: str, obj: dict[str, Any]) -> None:
        store = self._stores[(kind, namespace)]
        old = store.pop(str((obj.get("metadata") or {}).get("name") or ""))
        if (job := _owner(old if old is not None else obj)) is not None:
            self._on_change((namespace, job))

    def _replace(self, kind: str, namespace: str, items: list[dict[str, Any]]) -> None:
        """A fresh list: whatever differs from what the store held (added, changed, gone) wakes its RLJob."""
        store = self._stores[(kind, namespace)]
        old = store.objects
        new = {str(o["metadata"]["name"]): slim(kind, o) for o in items}
        store.reset(new)
        was_synced, store.synced = store.synced, True
        self._check_synced(namespace)
        if store.unserved:  # a CRD installed meanwhile (KubeRay after the RLJob): every RLJob looks again
            store.unserved = False
            self._on_served(namespace)
            return
        if not was_synced and not old:
            return  # the first list: every RLJob's loop makes its first pass anyway
        changed = [o for n, o in new.items() if n not in old or _version(old[n]) != _version(o)]
        changed += [o for n, o in old.items() if n not in new]
        for job in {_owner(o) for o in changed} - {None}:
            self._on_change((namespace, str(job)))

    async def _run(self, kind: str, namespace: str) -> None:
        api_kind = KINDS[kind]
        store = self._stores[(kind, namespace)]
        delay = ERROR_RETRY_S[0]
        while True:
            try:
                items, version = await self._client.list_with_version(api_kind, namespace, label_selector=SELECTOR)
                self._replace(kind, namespace, items)
                delay = ERROR_RETRY_S[0]
                while version:  # resume after each server-side timeout; "" (or a 410) lists again
                    version = await self._watch(kind, namespace, version)
            except asyncio.CancelledError:
                raise
            except KubeError as exc:
                if exc.status in (403, 404):  # no CRD (yet), or no list/watch right: reads go to the API server
                    if exc.status == 403 and not store.unserved:
                        log.warning("no list/watch of %s in %s (%s): its reads are GETs", kind, namespace, exc)
                    store.synced, store.unserved = False, True
                    store.reset({})
                    self._check_synced(namespace)
                    await asyncio.sleep(UNSERVED_RETRY_S)
                    continue
                log.warning("watch of %s in %s: %s; listing again", kind, namespace, exc)
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                # The API server restarting or a dropped connection: the store stays as it was until the next
                # list replaces it (a pass meanwhile writes with server-side apply, which is idempotent).
                log.info("watch of %s in %s: %s: %s; listing again", kind, namespace, type(exc).__name__, exc)
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, ERROR_RETRY_S[1])

    async def _watch(self, kind: str, namespace: str, version: str) -> str:
        """One watch stream; the resourceVersion to resume from, or "" to list again (410 Gone)."""
        stream = self._client.watch(
            KINDS[kind], namespace, label_selector=SELECTOR, resource_version=version, timeout_s=self._watch_timeout_s
        )
        try:
            async for event in stream:
                kind_of_event, obj = event.get("type"), event.get("object") or {}
                if kind_of_event == "ERROR":
                    if obj.get("code") == 410:
                        return ""
                    raise KubeError(
                        int(obj.get("code") or 500), str(obj.get("message", "")), str(obj.get("reason", ""))
                    )
                version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                if kind_of_event == "BOOKMARK":
                    continue
                obj.setdefault("kind", kind)
                if kind_of_event == "DELETED":
                    self._drop(kind, namespace, obj)
                else:
                    self._put(kind, namespace, obj)
        except KubeError as exc:
            if exc.status == 410:
                return ""
            raise
        return version
