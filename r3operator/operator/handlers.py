"""kopf handlers: thin. Each unpacks its kwargs, calls the reconciler, maps errors, records metrics.

- a daemon per RLJob runs its passes, one at a time: one when it starts (a new RLJob, or every RLJob when
  the operator starts or takes the lead), then each time it is woken, and at the latest every
  ``R3OPERATOR_RESYNC_SECONDS`` (the level-based safety net, minutes);
- it is woken by a change of one of the RLJob's children (the watches of informer.py: an engine pod
  ready, the RayJob finished, a child deleted or edited by hand), by create / update / resume of the
  RLJob itself (a spec edit), by a status someone else wrote (``on_event``: the pass writes the operator's
  back), and a few seconds after a pass that found a NameConflict (no watch tells when a foreign object goes);
  wake-ups during a pass make one more pass, not one each; a child's event waits
  ``R3OPERATOR_SETTLE_SECONDS`` first, so that the rest of its burst goes into the same pass (``_settle``);
- delete (optional) → keep a Retain PVC free of ownerReferences, forget per-job state.

Run with ``r3operator operator`` or ``kopf run -m r3operator.operator.handlers --standalone``.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import socket
import time
from typing import Any

import aiohttp
import kopf

from r3operator.api.v1alpha1 import GROUP, PLURAL, VERSION
from r3operator.operator import allocator, meta, metrics
from r3operator.operator.diffbase import LeanDiffBaseStorage
from r3operator.operator.informer import ChildCache, Wake, Wakeups
from r3operator.operator.kube import KINDS, KubeClient, KubeError
from r3operator.operator.reconcile import Outcome, Reconciler, ReconcilerSettings
from r3operator.operator.takeover import FirstPasses, first_turn
from r3operator.settings import operator_settings, unknown_variables

# Any: kopf passes its handlers' bodies, patches and memos as untyped keyword arguments: they are Any here.

CONFIG = operator_settings()
_state: dict[str, Any] = {"connection": None, "reconciler": None, "wakeups": Wakeups(), "first_passes": FirstPasses()}
# Passes ended (ok or not) per RLJob, (namespace, name): a clock for whoever runs the operator in its process
# (the tests' "n more passes") now that a pass reads its RLJob from kopf's live body, not with a GET.
PASSES: collections.Counter[tuple[str, str]] = collections.Counter()
RETRY_S = 5.0
"""A pass that failed (API error, connection) runs again after this long."""


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, logger: kopf.Logger, **_: Any) -> None:
    _state["wakeups"] = Wakeups()  # its asyncio.Events belong to this run's event loop
    _state["first_passes"] = FirstPasses()
    _state["trimmer"] = asyncio.create_task(allocator.trim_periodically(), name="malloc_trim")
    settings.watching.server_timeout = CONFIG.watch_server_timeout_seconds
    settings.watching.client_timeout = CONFIG.watch_client_timeout_seconds
    settings.watching.connect_timeout = 30
    settings.persistence.finalizer = meta.FINALIZER
    # A resync pass still running when its RLJob is deleted keeps kopf from releasing the finalizer until
    # kopf looks again: every 60 s by default, which made a deletion wait a minute for a pass of a second.
    settings.background.cancellation_polling = 2.0
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=meta.PREFIX)
    # kopf's own, but without deep-copying the managedFields and status it then drops (diffbase.py).
    settings.persistence.diffbase_storage = LeanDiffBaseStorage(prefix=meta.PREFIX, key="last-handled-configuration")
    # Our own Events are posted explicitly (one per condition transition); kopf's log-to-event
    # bridge is limited to warnings so a reconcile never floods the Event stream.
    settings.posting.level = logging.WARNING
    # `kubectl describe` shows the component as the Events' `From`: this operator, not the framework.
    settings.posting.reporting_component = meta.EVENT_COMPONENT
    settings.posting.reporting_instance = socket.gethostname()
    if unknown := unknown_variables():
        logger.warning("ignored: %s (not a setting; see docs/operator.md, Settings)", ", ".join(unknown))
    if CONFIG.metrics_port:
        try:
            metrics.serve(CONFIG.metrics_port)
        except OSError as exc:  # a second operator in one process (tests) or a taken port
            logger.warning("metrics server not started on :%s: %s", CONFIG.metrics_port, exc)


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo:
    info = kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
    if info is None:
        raise kopf.LoginError("no in-cluster service account and no kubeconfig ($KUBECONFIG or ~/.kube/config)")
    _state["connection"] = info
    _state["reconciler"] = None  # rebuilt with the new credentials on next use
    return info


@kopf.on.cleanup()
async def close(**_: Any) -> None:
    if (trimmer := _state.pop("trimmer", None)) is not None:
        trimmer.cancel()
    reconciler: Reconciler | None = _state.get("reconciler")
    if reconciler is not None:
        if reconciler.cache is not None:
            await reconciler.cache.close()
        await reconciler.client.close()


def reconciler() -> Reconciler:
    if _state["reconciler"] is None:
        client = KubeClient.from_connection_info(_state["connection"])
        wakeups: Wakeups = _state["wakeups"]
        first_passes: FirstPasses = _state["first_passes"]

        def on_change(key: tuple[str, str]) -> None:
            wakeups.wake_by_child(key)
            first_passes.hurry(key)

        timeout_s = CONFIG.watch_server_timeout_seconds
        cache = ChildCache(
            client,
            on_change,
            wakeups.wake_namespace,
            on_end=functools.partial(wakeups.wake, urgent=True),
            watch_timeout_s=timeout_s,
        )
        _state["reconciler"] = Reconciler(
            client,
            ReconcilerSettings(
                discovery_ttl_s=CONFIG.discovery_ttl_seconds,
                canary=CONFIG.canary,
                canary_url_template=CONFIG.canary_url,
                operator_namespace=CONFIG.operator_namespace,
                engine_ingress_namespaces=tuple(CONFIG.engine_ingress_namespaces),
                service_account=CONFIG.service_account,
            ),
            cache=cache,
        )
    return _state["reconciler"]


async def _run(body: kopf.Body, logger: kopf.Logger, *, first: bool = False) -> Outcome:
    """One pass and its outcome (Outcome.marks: when it reached each step). The RLJob's series are set on its
    daemon's first pass and then when its status changes: they are read from the spec's name and the status, and
    most passes (a child's event) change neither."""
    started = time.perf_counter()
    try:
        outcome = await reconciler().reconcile(dict(body), live=True)
    except KubeError as exc:
        metrics.RECONCILE_TOTAL.labels("error").inc()
        metrics.RECONCILE_ERRORS.labels(exc.reason or str(exc.status)).inc()
        raise kopf.TemporaryError(f"API error: {exc}", delay=5) from exc
    except (aiohttp.ClientError, TimeoutError) as exc:
        # The API server restarting, a dropped connection, or the operator shutting down mid-pass:
        # the next pass (retry or timer) converges from whatever this one left.
        metrics.RECONCILE_TOTAL.labels("error").inc()
        metrics.RECONCILE_ERRORS.labels(type(exc).__name__).inc()
        raise kopf.TemporaryError(f"API connection: {type(exc).__name__}: {exc}", delay=5) from exc
    except Exception as exc:
        metrics.RECONCILE_TOTAL.labels("error").inc()
        metrics.RECONCILE_ERRORS.labels(type(exc).__name__).inc()
        raise
    finally:
        metrics.RECONCILE_DURATION.observe(time.perf_counter() - started)
        meta = body.get("metadata", {})
        PASSES[(str(meta.get("namespace", "")), str(meta.get("name", "")))] += 1
    for event in outcome.events:
        kopf.event(body, type=event.type, reason=event.reason, message=event.message)
    if outcome.written:
        logger.info("reconciled: %s", "; ".join(outcome.written))
    if outcome.job is not None and (first or outcome.status_written):
        metrics.observe_job(outcome.job, outcome.status)
    error = outcome.error
    if error is not None and not error.namespace_terminating:
        # Already in status (once it persists) and in the events above; kopf retries the pass.
        metrics.RECONCILE_TOTAL.labels("error").inc()
        metrics.RECONCILE_ERRORS.labels(error.reason or str(error.status)).inc()
        raise kopf.TemporaryError(f"API error: {error}", delay=5)
    metrics.RECONCILE_TOTAL.labels("ok" if outcome.valid else "invalid").inc()
    return outcome


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
async def on_new(name: str, namespace: str | None, **_: Any) -> None:
    """A new RLJob, or every RLJob when the operator starts: the daemon's first pass, which does not wait, reads
    the same body. This wake-up (kopf may call it before or during that pass) waits as a child's event does, so
    that it does not add an immediate second pass that only sees the first pass's own writes half-applied."""
    _state["wakeups"].wake((namespace or "", name))


@kopf.on.update(GROUP, VERSION, PLURAL)
async def on_change(name: str, namespace: str | None, **_: Any) -> None:
    """The spec (or labels, annotations) changed: the RLJob's daemon makes a pass at once."""
    _state["wakeups"].wake((namespace or "", name), urgent=True)


@kopf.on.event(GROUP, VERSION, PLURAL)
async def on_event(
    event: kopf.RawEvent, body: kopf.Body, name: str, namespace: str | None, logger: kopf.Logger, **_: Any
) -> None:
    """A status the operator did not write (a namespace user's, anyone's with rljobs/status): the RLJob's daemon
    makes a pass at once, which writes the operator's status back whole. The echo of the operator's own writes
    carries the status it wrote and wakes nothing."""
    if event.get("type") != "MODIFIED" or _state["reconciler"] is None:
        return
    if reconciler().foreign_status(body):
        logger.info("status written by someone else: writing the operator's back")
        _state["wakeups"].wake((namespace or "", name), urgent=True)


async def _stopping(stopped: kopf.DaemonStopped) -> None:
    await stopped.wait()


async def _settle(wake: Wake, stop: asyncio.Future[Any]) -> None:
    """Wait ``R3OPERATOR_SETTLE_SECONDS`` after a child's event before the pass, so that one pass (and at most one
    status write) takes the burst it starts: a StatefulSet's status moves one field per write (replicas, current,
    updated, ready, available), and the controllers answer a pass's own writes with several. The wait starts at
    the first event and is not extended by the next; a change of the RLJob itself (``urgent``) or a stop ends it."""
    if CONFIG.settle_seconds <= 0:
        return
    urgent: asyncio.Future[Any] = asyncio.ensure_future(wake.urgent.wait())
    await asyncio.wait({urgent, stop}, timeout=CONFIG.settle_seconds, return_when=asyncio.FIRST_COMPLETED)
    urgent.cancel()


# On stop (the RLJob deleted, the operator exiting or losing the Lease) a pass under way finishes first
# (backoff), so no pass is cut between two writes; one still running after that is cancelled.
@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_backoff=10.0, cancellation_timeout=5.0)
async def reconcile_loop(
    body: kopf.Body, name: str, namespace: str | None, stopped: kopf.DaemonStopped, logger: kopf.Logger, **_: Any
) -> None:
    """The RLJob's passes, one at a time (module docstring)."""
    key = (namespace or "", name)
    spawned = time.time()
    wakeups: Wakeups = _state["wakeups"]
    first_passes: FirstPasses = _state["first_passes"]
    wake = wakeups.subscribe(key)
    first = True
    loop = asyncio.get_running_loop()
    stop = asyncio.ensure_future(_stopping(stopped))
    turn = False
    try:
        # The first pass waits its turn: when a leader takes over, those that need it go first (takeover.py).
        waiting = asyncio.ensure_future(
            first_turn(first_passes, key, body, reconciler().cache, child_event=lambda: wake.by_child)
        )
        await asyncio.wait({waiting, stop}, return_when=asyncio.FIRST_COMPLETED)
        if not waiting.done():
            waiting.cancel()  # stopped while waiting (the RLJob deleted, the Lease lost): its turn goes to another
            await asyncio.gather(waiting, return_exceptions=True)
        turn = waiting.done() and not waiting.cancelled() and waiting.exception() is None
        if turn and (why := waiting.result()) is not None and first_passes.waiting:
            logger.info("first pass before %d others: %s", first_passes.waiting, why)
        wake.set(urgent=True)  # the first pass
        while not stopped:
            woken = asyncio.ensure_future(wake.any.wait())
            await asyncio.wait({woken, stop}, timeout=CONFIG.resync_seconds, return_when=asyncio.FIRST_COMPLETED)
            woken.cancel()
            if not stopped and wake.any.is_set() and not wake.urgent.is_set():
                await _settle(wake, stop)
            if stopped:
                break
            wake.clear()
            try:
                try:
                    outcome = await _run(body, logger, first=first)
                finally:
                    if turn:
                        turn = False
                        first_passes.done()
                if outcome.recheck_s is not None:
                    loop.call_later(outcome.recheck_s, wake.set)
                if first:
                    # One line per RLJob and operator start: where a new RLJob's time to its children goes.
                    steps = " ".join(f"{step}={at:.3f}" for step, at in outcome.marks.items())
                    logger.info("first pass timeline: daemon=%.3f %s", spawned, steps)
                first = False
            except kopf.TemporaryError as exc:
                logger.warning("%s; again in %.0f s", exc, exc.delay or RETRY_S)
                loop.call_later(exc.delay or RETRY_S, functools.partial(wake.set, urgent=True))
            except Exception:
                logger.exception("reconcile failed; again in %.0f s", RETRY_S)
                loop.call_later(RETRY_S, functools.partial(wake.set, urgent=True))
    finally:
        if turn:
            first_passes.done()
        stop.cancel()
        wakeups.unsubscribe(key)


@kopf.on.delete(GROUP, VERSION, PLURAL, optional=True)
async def on_delete(body: kopf.Body, name: str, namespace: str | None, logger: kopf.Logger, **_: Any) -> None:
    """Retain: make sure the routing and model cache claims have no ownerReference left, so the GC keeps them.

    A Retain PVC is created without one; this covers a policy flipped to Retain shortly before the
    delete (before a reconcile dropped the reference), and a model cache created with one by an operator
    from before its retainPolicy. Delete policy: the GC removes the children.
    """
    if namespace is None:  # kopf types it optional for cluster-scoped kinds; the RLJob CRD is namespaced
        raise kopf.PermanentError(f"rljob {name} has no namespace")
    spec = body.get("spec", {})
    storage = spec.get("storage") or {}
    cache = (spec.get("model") or {}).get("cache") or {}
    kept: list[str] = []
    if storage.get("retainPolicy") == "Retain" and not storage.get("existingClaim"):
        kept.append(f"{name}-routing")
    if cache.get("retainPolicy", "Retain") == "Retain" and not cache.get("claimName"):
        kept.append(f"{name}-model-cache")
    client = reconciler().client
    uid = body.get("metadata", {}).get("uid")
    for claim in kept:
        pvc = await client.get(KINDS["PersistentVolumeClaim"], namespace, claim)
        refs = (pvc or {}).get("metadata", {}).get("ownerReferences") or []
        if any(r.get("uid") == uid for r in refs):  # only this RLJob's own reference, on its own claim
            others = [r for r in refs if r.get("uid") != uid]
            patch = {"metadata": {"ownerReferences": others or None}}
            await client.merge_patch(KINDS["PersistentVolumeClaim"], namespace, claim, patch)
            logger.info("retained PVC %s: ownerReference removed", claim)
    reconciler().forget(str(body.get("metadata", {}).get("uid", "")))
    metrics.forget_job(namespace, name)
    # A job waiting for a kept ReadWriteOnce model cache this one held takes it over now (model_cache_hold.py).
    _state["wakeups"].wake_namespace(namespace)
