"""One reconcile pass: observe → validate → desired → diff → apply → status (via /status only).

Level-based and idempotent: every handler (create, update, resume, the timer) calls
:meth:`Reconciler.reconcile` with the current object, which converges the children to ``desired()``
whatever happened before — including an operator killed halfway through a previous pass (names are
deterministic and every write is a server-side apply, which creates or updates alike).

Validation comes first: an RLJob that does not parse, breaks a compatibility rule (``api.rules``),
whose cluster lacks KubeRay, whose child names are held by objects it does not control, or whose
claims do not exist gets ``Valid=False`` and **no child is created or changed**. Existing children
of a previously valid spec are left exactly as they are (an invalid upgrade changes nothing).

What the pass trusts: the spec, and what it reads of the objects it controls (the RayJob's status
says when training ended; the engine StatefulSet's annotations hold the upgrade record and the image last
verified; the canary pod's termination message, written by the kubelet, holds the canary's verdict; the
trainer's progress report, checked, operator/progress.py). The RLJob's status is output, written by the
operator alone: a pass builds it on its own record of what it wrote last (``_own``), and a status someone
else wrote is written back whole; see "Security model" in docs/operator.md.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import datetime as dt
import hashlib
import json
import logging
import time
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from r3operator.api import names
from r3operator.api.context import RuleContext
from r3operator.api.disaggregation import engine_replicas, role_replicas, roles
from r3operator.api.engine_layout import LWS_API_VERSION, LWS_PLURAL, engine_layout
from r3operator.api.enums import ConditionStatus, ConditionType, EngineRole, ReplayMode, RetainPolicy, WhenHeld
from r3operator.api.load import RLJobLoadError, parse_rljob
from r3operator.api.rules import errors, evaluate
from r3operator.api.v1alpha1 import KIND, Progress, RLJob, RLJobStatus, UpgradeStatus
from r3operator.api.vllm_args import model_path, model_source
from r3operator.operator import meta
from r3operator.operator.admission import read_admission, settle
from r3operator.operator.apply import Action, is_ours, plan_action
from r3operator.operator.builders.export import export_claim
from r3operator.operator.builders.model_cache import (
    cache_spec,
    held_one_at_a_time,
    model_fetch_complete,
    model_fetch_failed,
    own_claim_name,
    shares_model_cache,
    uses_model_cache,
)
from r3operator.operator.builders.upgrade_canary import CONTAINER_NAME as CANARY_CONTAINER
from r3operator.operator.builders.workload import build_workload, priority_class_name
from r3operator.operator.canary import CanaryResult, run_canary
from r3operator.operator.conditions import Reason
from r3operator.operator.desired import Facts, desired
from r3operator.operator.export_status import ExportSeen, export_events
from r3operator.operator.hashing import engine_spec_hash
from r3operator.operator.informer import UNKNOWN, ChildCache, is_newer, slim
from r3operator.operator.kube import KINDS, KubeClient, KubeError, kind_of
from r3operator.operator.lifecycle import (
    ANNOTATION_FINISHED,
    Finish,
    finish_annotation,
    format_time,
    is_suspended,
    observed_finish,
    status_says_finished,
    ttl_expired,
)
from r3operator.operator.managed_by import dispatched_by_multikueue, managed_here, prebuilt_workload
from r3operator.operator.model_cache_hold import hold_model_cache
from r3operator.operator.observed import Observed
from r3operator.operator.progress import ProgressReport, read_report
from r3operator.operator.references import check_references
from r3operator.operator.scheduling import config_errors_by_role, unschedulable_by_role
from r3operator.operator.status import (
    compute_conditions,
    compute_status,
    nonfinite_warning,
    status_changed,
    status_digest,
    status_patch,
    transitions,
)
from r3operator.operator.upgrade import (
    ANNOTATION_UPGRADE,
    FORCE,
    CanaryInputs,
    UpgradePlan,
    allowed_images,
    plan_upgrade,
    refuse_unknown_images,
)
from r3operator.operator.upgrade_record import (
    PodProgress,
    canary_pods,
    pod_progress,
    read_record,
    surge_pods,
    verdict_from_pods,
)
from r3operator.settings import DEFAULT_CANARY_URL

log = logging.getLogger("r3operator.reconcile")

KUEUE_WORKLOADS = ("kueue.x-k8s.io/v1beta1", "workloads")

# Every child kind the operator may own, by role: prune candidates when desired() drops them. The
# RayJob goes last: its status is the record that the job ended, so a pass killed halfway through
# the TTL deletion still knows on the next run that the rest is to be deleted, not re-created.
_CHILD_KINDS = (
    (meta.ROLE_WORKLOAD, "Workload"),
    (meta.ROLE_METRICS, "PodMonitor"),
    (meta.ROLE_TRAINER, "RoleBinding"),
    (meta.ROLE_TRAINER, "Role"),
    (meta.ROLE_TRAINER, "ServiceAccount"),
    (meta.ROLE_ENGINE, "StatefulSet"),
    (meta.ROLE_ENGINE, "LeaderWorkerSet"),
    (meta.ROLE_ENGINE, "NetworkPolicy"),
    (meta.ROLE_ENGINE, "Service"),
    (names.ROLE_PREFILL, "StatefulSet"),
    (names.ROLE_PREFILL, "Service"),
    (meta.ROLE_CONFIG, "ConfigMap"),
    (meta.ROLE_PROGRESS, "ConfigMap"),
    (meta.ROLE_STORAGE, "PersistentVolumeClaim"),
    (meta.ROLE_MODEL_FETCH, "Job"),
    (meta.ROLE_MODEL_CACHE, "PersistentVolumeClaim"),
    (meta.ROLE_TRAINER, "RayJob"),
    (meta.ROLE_UPGRADE_CANARY, "Job"),
)

_VERIFY_ABSENT: contextvars.ContextVar[bool] = contextvars.ContextVar("r3operator_verify_absent", default=False)
"""This pass reads by GET every child name the cache holds no labelled object under, before any write (see
Reconciler._get): set for an RLJob a create found a name of taken; each pass (one per RLJob at a time, in its
daemon's task) sets its own."""

# A write refused this many passes in a row is reported in status (Progressing/Ready=False, APIError);
# a refusal that retrying cannot fix (bad request, forbidden, not found, invalid) is reported at once.
API_ERROR_PASSES = 3
NAME_CONFLICT_RECHECK_S = 5.0
"""A NameConflict is looked at again this long after the pass that found it: the object holding the name is not
the operator's, so no watch tells when it goes."""
CACHE_SYNC_WAIT_S = 10.0
_PERMANENT_STATUSES = frozenset({400, 403, 404, 422})


@dataclass(frozen=True, slots=True)
class EventSpec:
    type: str
    reason: str
    message: str


@dataclass(slots=True)
class Outcome:
    status: RLJobStatus | None = None
    job: RLJob | None = None
    """The RLJob as this pass read and parsed it (None when it was gone or being deleted)."""
    status_written: bool = False
    events: list[EventSpec] = field(default_factory=list)
    written: list[str] = field(default_factory=list)
    valid: bool = True
    error: KubeError | None = None
    """A write the API server refused: the handler retries after posting the events."""
    marks: dict[str, float] = field(default_factory=dict)
    """When (``time.time()``) the pass reached each step (start, synced, desired, read, written, status): the
    first pass's timeline, which the handler logs and the scale benchmark lines up with the audit log."""
    recheck_s: float | None = None
    """Not None: make another pass this many seconds from now (a NameConflict, which no watch ends)."""


class Capabilities:
    """Which optional APIs the cluster serves, from discovery, cached for ``ttl_s``."""

    def __init__(self, client: KubeClient, ttl_s: float = 15.0) -> None:
        self._client = client
        self._ttl_s = ttl_s
        self._cache: dict[tuple[str, str], tuple[float, bool]] = {}

    async def serves(self, group_version: str, plural: str) -> bool:
        key = (group_version, plural)
        hit = self._cache.get(key)
        if hit is not None and time.monotonic() - hit[0] < self._ttl_s:
            return hit[1]
        value = await self._client.serves(group_version, plural)
        self._cache[key] = (time.monotonic(), value)
        return value


@dataclass(frozen=True, slots=True)
class ReconcilerSettings:
    discovery_ttl_s: float = 15.0
    canary: bool = True
    canary_url_template: str = DEFAULT_CANARY_URL
    """Where the canary is sent; ``{service}``, ``{namespace}``, ``{port}``, ``{name}`` are filled in."""
    canary_retry_s: float = 60.0
    operator_namespace: str | None = None
    """The operator's own namespace (R3OPERATOR_OPERATOR_NAMESPACE), admitted to the engine port for the canary."""
    engine_ingress_namespaces: tuple[str, ...] = ()
    service_account: str | None = None
    """The operator's own ServiceAccount (R3OPERATOR_SERVICE_ACCOUNT), which no pod template in its namespace may
    name."""

    @property
    def operator_account(self) -> tuple[str, str] | None:
        if self.operator_namespace is None or self.service_account is None:
            return None
        return self.operator_namespace, self.service_account


def _bad_polarity(cond_type: str, status: ConditionStatus) -> bool:
    if cond_type in (ConditionType.FAILED.value, ConditionType.UPGRADE_BLOCKED.value):
        return status is ConditionStatus.TRUE
    if cond_type in (ConditionType.SUSPENDED.value, ConditionType.SUCCEEDED.value, ConditionType.PROGRESSING.value):
        return False
    return status is ConditionStatus.FALSE


class Reconciler:
    def __init__(
        self,
        client: KubeClient,
        settings: ReconcilerSettings | None = None,
        *,
        clock: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC),
        cache: ChildCache | None = None,
    ) -> None:
        self.client = client
        self.cache = cache
        """Where children are read (informer.py); None: every read is a GET."""
        self.settings = settings or ReconcilerSettings()
        self.capabilities = Capabilities(client, self.settings.discovery_ttl_s)
        self.clock = clock
        self._locks: dict[str, asyncio.Lock] = {}
        self._canaries: dict[str, tuple[float, CanaryResult]] = {}
        self._failures: dict[str, int] = {}
        self._written: dict[str, tuple[str | None, bytes]] = {}
        """Per RLJob uid, the RLJob as this operator's last write of it returned, until a live body catches up: its
        resourceVersion, and the object as compressed JSON (at rest a live body may never catch up, and a pass
        needs it only while kopf's watch lags behind the write: ~4 KB held rather than ~25 KB of dicts)."""
        self._rendered: dict[str, tuple[bytes, bytes]] = {}
        """Per RLJob uid, the last desired(): a digest of what it was rendered from, and the children as compressed
        JSON (~4 KB rather than ~60 KB of dicts per RLJob; loading them again costs a fifth of a render)."""
        self._taken: set[str] = set()
        self._nonfinite_seen: dict[str, int] = {}
        """Per RLJob uid, progress.nonFiniteSteps as the last pass saw it (status.nonfinite_warning)."""
        self._export_seen: dict[str, ExportSeen] = {}
        """Per RLJob uid, the exports and the failure the last pass reported (export_status.export_events)."""
        self._elsewhere_problem: dict[str, str] = {}
        """Per RLJob uid managed elsewhere (MultiKueue's manager side), the last reason its Workload was not made."""
        """RLJob uids of which a pass found a child's name taken (in the cache, or by a refused create): their passes
        read every name the cache holds nothing under by GET before writing, so a pass that finds any name still
        taken creates nothing (no create and undo)."""
        self._own: dict[str, tuple[str, bytes, str | None]] = {}
        """Per RLJob uid, the status this operator last wrote (or found written as it computed it): a digest of it,
        the status as compressed JSON, and the resourceVersion of its last status write. A pass builds on it rather
        than on the live status, which someone else may have written (startTime, conditions and their times are
        carried over from it), and a later watch event whose status differs from it wakes a pass that writes it
        back (``foreign_status``)."""
        self._writing: dict[str, str] = {}
        """Per RLJob uid, the digest of the status write in flight (its echo may come before its answer)."""
        self._progress_problem: dict[str, str] = {}
        """Per RLJob uid, the last reason a progress report was refused or trimmed: one Event per new reason."""

    def forget(self, uid: str) -> None:
        self._locks.pop(uid, None)
        self._written.pop(uid, None)
        self._rendered.pop(uid, None)
        self._canaries.pop(uid, None)
        self._failures.pop(uid, None)
        self._taken.discard(uid)
        self._nonfinite_seen.pop(uid, None)
        self._export_seen.pop(uid, None)
        self._elsewhere_problem.pop(uid, None)
        self._own.pop(uid, None)
        self._progress_problem.pop(uid, None)

    def foreign_status(self, body: Mapping[str, Any]) -> bool:
        """The RLJob ``body`` (a watch event's) carries a status this operator did not write: someone else's
        write, which its next pass, made now, writes back. False for an RLJob it has not written yet."""
        metadata = body.get("metadata") or {}
        uid = str(metadata.get("uid") or "")
        own = self._own.get(uid)
        if own is None or not _after(metadata.get("resourceVersion"), own[2]):
            return False  # not written yet, or the echo of a write of its own (a later one may have overtaken it)
        digest = status_digest(body.get("status"))
        return digest != own[0] and digest != self._writing.get(uid)  # the echo of a write still awaiting its answer

    async def reconcile(self, body: dict[str, Any], *, live: bool = False) -> Outcome:
        """One pass over the RLJob ``body``. ``live``: the body is kopf's live view of it (a daemon's), as current
        as kopf's watch; the pass takes it, or this operator's own last write of the RLJob where that is newer
        (the watch event of a status write arrives a moment after it), and reads nothing from the API server
        unless a child is missing from the cache. Otherwise the RLJob is read from the API server."""
        uid = str(body.get("metadata", {}).get("uid", ""))
        lock = self._locks.setdefault(uid, asyncio.Lock())
        async with lock:
            marks = {"start": time.time()}
            namespace = body["metadata"].get("namespace")
            if self.cache is not None and namespace:
                self.cache.watch_namespace(namespace)
                # A namespace's first pass after a start waits for its lists rather than GET every child.
                await self.cache.wait_synced(namespace, CACHE_SYNC_WAIT_S)
            marks["synced"] = time.time()
            # The RLJob must include this operator's last status write, which kopf's watch may not have delivered.
            if live:
                fresh: dict[str, Any] | None = self._newest(uid, body)
            else:
                fresh = await self.client.get(KINDS["RLJob"], namespace, body["metadata"]["name"])
            if fresh is None or fresh.get("metadata", {}).get("deletionTimestamp"):
                return Outcome()
            try:
                job = parse_rljob(fresh, source=f"rljob {body['metadata']['name']}")
            except RLJobLoadError as exc:
                return await self._unparsable(fresh, exc)
            # After a restart, a status that says NameConflict is taken as a hint (it only adds reads).
            token = _VERIFY_ABSENT.set(uid in self._taken or _says_name_conflict(fresh))
            try:
                outcome = await self._reconcile(job)
            finally:
                _VERIFY_ABSENT.reset(token)
            outcome.marks = {**marks, **outcome.marks}
            return outcome

    def _desired(self, job: RLJob, facts: Facts) -> list[dict[str, Any]]:
        """desired(), rendered again only when what it reads changed (the spec, the job's name, uid, labels and
        annotations, the facts): most passes are woken by a child's status and would render the same children.
        Each call returns children of its own (a held render is loaded again), so a caller may change them."""
        meta_ = job.metadata
        labels, annotations = json.dumps(meta_.labels, sort_keys=True), json.dumps(meta_.annotations, sort_keys=True)
        key = (
            job.spec.model_dump_json(),
            meta_.name,
            meta_.namespace or "",
            meta_.uid or "",
            labels,
            annotations,
            repr(facts),
        )
        digest = hashlib.sha256(json.dumps(key).encode()).digest()
        held = self._rendered.get(meta_.uid or "")
        if held is not None and held[0] == digest:
            return list(_unpack(held[1]))
        children = desired(job, facts)
        if meta_.uid:
            self._rendered[meta_.uid] = (digest, _pack(children))
        return children

    def _newest(self, uid: str, body: dict[str, Any]) -> dict[str, Any]:
        mine = self._written.get(uid)
        if mine is None or is_newer(body, _at_version(mine[0])):
            self._written.pop(uid, None)  # the live body holds the write now
            return body
        held: dict[str, Any] = _unpack(mine[1])
        return held

    def _wrote(self, uid: str | None, returned: dict[str, Any]) -> None:
        held = self._written.get(uid or "")
        if uid and is_newer(returned, _at_version(held[0]) if held is not None else None):
            # Without the managedFields, which no pass reads (~40 % of an RLJob).
            self._written[uid] = ((returned.get("metadata") or {}).get("resourceVersion"), _pack(slim(KIND, returned)))

    async def _unparsable(self, raw: dict[str, Any], exc: RLJobLoadError) -> Outcome:
        """Valid=False (ParseError) and one Event, written once; nothing else is read or changed."""
        metadata = raw.get("metadata") or {}
        message = "; ".join(f"{p.field}: {p.message}" if p.field else p.message for p in exc.problems)[:32768]
        conditions = ((raw.get("status") or {}).get("conditions")) or []
        current = next((c for c in conditions if c.get("type") == ConditionType.VALID.value), None)
        reason = Reason.PARSE_ERROR.value
        outcome = Outcome(valid=False)
        if current is not None and (current.get("reason"), current.get("message")) == (reason, message):
            return outcome
        stamp = format_time(self.clock())
        generation = metadata.get("generation")
        patch = {
            "status": {
                "observedGeneration": generation,
                "conditions": [
                    {
                        "type": ctype.value,
                        "status": ConditionStatus.FALSE.value,
                        "reason": reason,
                        "message": message,
                        "lastTransitionTime": stamp,
                        "observedGeneration": generation,
                    }
                    for ctype in (ConditionType.READY, ConditionType.VALID)
                ],
            }
        }
        written = await self.client.merge_patch(
            KINDS["RLJob"], metadata.get("namespace"), metadata["name"], patch, subresource="status"
        )
        self._wrote(metadata.get("uid"), written)
        self._own.pop(str(metadata.get("uid") or ""), None)  # this status is not built on the record
        outcome.status_written = True
        outcome.events.append(EventSpec("Warning", reason, f"Valid=False: {message}"[:1024]))
        return outcome

    def _own_status(self, job: RLJob) -> RLJob:
        """The job with the status this operator wrote last in place of the live one, which someone else may have
        written since: what a pass carries over (startTime, conditions' times, a recorded end) comes from the
        operator's own record. The live status stands where there is no record (a new leader's first pass)."""
        own = self._own.get(job.metadata.uid or "")
        if own is None:
            return job
        return job.model_copy(update={"status": RLJobStatus.model_validate(_unpack(own[1]))})

    async def _reconcile(self, job: RLJob) -> Outcome:
        if not managed_here(job):
            return await self._managed_elsewhere(job)
        now = self.clock()
        uid = job.metadata.uid
        live_status = job.status
        job = self._own_status(job)
        engine_kind = _engine_kind(job)
        # Discovery only for a job that needs LeaderWorkerSet; the rules know it is present otherwise.
        lws = engine_kind != "LeaderWorkerSet" or await self.capabilities.serves(LWS_API_VERSION, LWS_PLURAL)
        context = RuleContext.for_spec(job.spec, leader_worker_set=lws)
        rule_errors = tuple(errors(evaluate(job.spec, context=context)))
        kuberay = await self.capabilities.serves("ray.io/v1", "rayjobs")
        queued = job.spec.queue_name is not None
        kueue = await self.capabilities.serves(*KUEUE_WORKLOADS) if queued else True
        outcome = Outcome(job=job, valid=not rule_errors and kuberay and kueue)
        trainer = meta.child_name(job, meta.ROLE_TRAINER)
        raw_ray_job = await self._get("RayJob", job.metadata.namespace, trainer) if kuberay else None
        # Only a RayJob this RLJob controls says when training ended; a foreign one is a NameConflict.
        ray_job = _ours_or_none(raw_ray_job, uid)
        prebuilt = prebuilt_workload(job)
        workload_name = prebuilt or meta.child_name(job, meta.ROLE_WORKLOAD)
        raw_workload = None
        if queued and kueue:
            raw_workload = await self._get(
                "Workload", job.metadata.namespace, workload_name, verify=prebuilt is not None
            )
        # Only a Workload this RLJob controls admits it (a foreign one is a NameConflict), or the one MultiKueue made
        # for it on this worker cluster (managed_by.py).
        ours = raw_workload if prebuilt is not None else _ours_or_none(raw_workload, uid)
        admission = read_admission(job.spec.queue_name, ours)
        finish = observed_finish(ray_job)
        # The end's record goes out beside this pass's child writes, not before them: the pass that sees the
        # RayJob's end writes the status one round trip after it, not two. Only pruning (the RayJob deleted once
        # the TTL ran) and the status wait for it.
        recording: asyncio.Task[None] | None = None
        if finish is not None and ANNOTATION_FINISHED not in job.metadata.annotations:
            job, recording = self._record_finish(job, finish, now)
        recorded = ray_job is None and await self._ended_before(job, engine_kind)
        expired = ttl_expired(job, finish, now)
        observed: dict[str, dict[str, Any] | None] = {"RayJob": ray_job}
        conflict: str | None = None
        missing: tuple[str, ...] = ()
        cache_holder: str | None = None
        upgrade = UpgradePlan(None)
        missing_refs: tuple[str, ...] = ()
        borrowed: tuple[str, ...] = ()
        report: ProgressReport | None = None
        observed_fetch: tuple[str | None, bool] = (None, False)
        if outcome.valid and not recorded:
            pod_monitor = await self.capabilities.serves("monitoring.coreos.com/v1", "podmonitors")
            refs = await check_references(
                self.client,
                job,
                priority_class=priority_class_name(job),
                operator_account=self.settings.operator_account,
            )
            missing_refs = refs.missing if finish is None else ()
            borrowed = refs.borrowed
            fetch_job = await self._read_fetch_job(job)
            fetch_ours = [o for o in fetch_job.values() if o is not None and is_ours(o, uid)]
            fetched = all(model_fetch_complete(o) for o in fetch_ours) and len(fetch_ours) == len(fetch_job)
            if not fetched:
                failed = next((m for o in fetch_ours if (m := model_fetch_failed(o)) is not None), None)
                observed_fetch = (failed or "running", failed is not None)
            engine_name = meta.child_name(job, meta.ROLE_ENGINE)
            raw_engine_set = await self._get(engine_kind, job.metadata.namespace, engine_name)
            prefill_name = meta.child_name(job, names.ROLE_PREFILL)
            raw_prefill_set = (
                await self._get("StatefulSet", job.metadata.namespace, prefill_name) if roles(job.spec) else None
            )
            ours_ray_job = ray_job if finish is None else None  # a finished trainer is never replaced
            own_cache = await self._own_model_cache(job)
            if not missing_refs and not borrowed:  # nothing, the claim included, is made before the references exist
                cache_holder = await self._model_cache_holder(job, outcome, own=own_cache, finished=finish is not None)
            if cache_holder is not None and cache_spec(job).when_held is WhenHeld.OWN_CLAIM:
                # Its own <job>-model-cache instead; the next pass finds it (_own_model_cache) and keeps it.
                own_cache, cache_holder = True, None
            if cache_holder is not None:
                fetched, observed_fetch = False, ("running", False)
            # Engines down while the model cache fills: no upgrade canary can run against them.
            stopped = finish is not None or not fetched
            upgrade = await self._plan_upgrade(
                job, raw_engine_set, ours_ray_job, stopped=stopped, now=now, raw_prefill_set=raw_prefill_set
            )
            facts = Facts(
                model_fetched=fetched,
                own_model_cache=own_cache,
                model_cache_holder=cache_holder,
                pod_monitor_crd=pod_monitor,
                finished=finish is not None,
                expired=expired,
                operator_namespace=self.settings.operator_namespace,
                engine_ingress_namespaces=self.settings.engine_ingress_namespaces,
                engine_rollout=upgrade.rollout,
                upgrade_canary=upgrade.canary,
                trainer_image=upgrade.trainer_image,
                upgrade_record=upgrade.status,
                admitted=admission.runs,
                priority=refs.priority,
            )
            children = self._desired(job, facts)
            outcome.marks["desired"] = time.time()
            known = {
                ("RayJob", trainer): raw_ray_job,
                (engine_kind, engine_name): raw_engine_set,
                ("StatefulSet", prefill_name): raw_prefill_set,
                ("Workload", workload_name): raw_workload,
                **fetch_job,
            }
            read = await self._read(children, known=known)
            plans = [(child, have, plan_action(child, have, job_uid=uid)) for child, have in read]
            report = self._progress_report(job, plans, outcome)
            conflicts = [f"{c['kind']}/{c['metadata']['name']} {a.why}" for c, _, a in plans if a.verb == "conflict"]
            conflict = "; ".join(conflicts) if conflicts else None
            missing = await self._missing_claims(job) if finish is None else ()
            if conflict is not None or missing or missing_refs or borrowed:
                outcome.valid = False
                observed[engine_kind] = next(
                    (h for c, h, a in plans if c["kind"] == engine_kind and a.verb != "conflict"), None
                )
            else:
                outcome.marks["read"] = time.time()
                conflict = await self._write_all(job, plans, finish is not None, expired, observed, outcome, recording)
                outcome.marks["written"] = time.time()
                if conflict is not None:  # a create found a name taken: what this pass created is gone again
                    outcome.valid = False
                    observed[engine_kind] = _ours_or_none(observed.get(engine_kind), uid)
                else:
                    if prebuilt is not None:  # not a child: MultiKueue made it (managed_by.py)
                        observed["Workload"] = ours
                    if queued and outcome.error is None:
                        await self._settle_workload(job, observed, finish, outcome)
                    if outcome.error is None:
                        await self._consume_force(job, upgrade, outcome)
            if conflict is not None:
                # No watch tells when someone else's object goes: look again soon, every name read by GET first.
                self._taken.add(uid or "")
                outcome.recheck_s = NAME_CONFLICT_RECHECK_S
        else:
            # Nothing is created or changed; read what a previous valid spec left, for status only.
            engines = None
            if lws:  # without the CRD there is no LeaderWorkerSet to read
                engines = await self._get(engine_kind, job.metadata.namespace, meta.child_name(job, meta.ROLE_ENGINE))
            observed[engine_kind] = _ours_or_none(engines, uid)
            upgrade = UpgradePlan(read_record(observed[engine_kind]))
        obs = Observed(
            rule_errors=rule_errors,
            kuberay_installed=kuberay,
            engine_set=observed.get(
                f"{engine_kind}/{meta.child_name(job, meta.ROLE_ENGINE)}", observed.get(engine_kind)
            ),
            prefill_set=observed.get(f"StatefulSet/{meta.child_name(job, names.ROLE_PREFILL)}"),
            ray_job=observed.get("RayJob"),
            finish=finish,
            finish_recorded=recorded,
            written=tuple(outcome.written),
            workloads_deleted=expired or recorded,
            name_conflict=conflict,
            missing_claims=missing,
            missing_references=missing_refs,
            borrowed_identities=borrowed,
            progress=report,
            kueue_installed=kueue,
            admission=admission,
            model_fetch=observed_fetch[0],
            model_fetch_failed=observed_fetch[1],
            model_cache_holder=cache_holder,
            namespace_terminating=outcome.error is not None and outcome.error.namespace_terminating,
            api_error=self._reported_error(job, outcome.error),
            upgrade=upgrade.status,
            upgrade_unschedulable=upgrade.unschedulable,
        )
        if outcome.valid and _waiting_for_pods(job, obs):
            # One LIST only while something is not up yet: the scheduler's reason goes into status.
            pods = await self._pods(job)
            obs = _replace(obs, unschedulable=unschedulable_by_role(pods), config_errors=config_errors_by_role(pods))
        if outcome.valid:
            obs = await self._with_canary(job, obs)
        if recording is not None:
            await recording  # refused: the pass fails here, as it did when the record went first
        status = compute_status(job, obs, now)
        await self._write_status(job, status, outcome, live=live_status)
        self._warn_nonfinite(job, status.progress, outcome)
        self._export_events(job, status.progress, outcome)
        outcome.marks["status"] = time.time()
        return outcome

    async def _managed_elsewhere(self, job: RLJob) -> Outcome:
        """A job another controller runs (managed_by.py): nothing is written, but for MultiKueue's manager side, the
        job's Workload, which Kueue dispatches; the status is the worker's, copied by Kueue. A problem that keeps the
        Workload from being made goes out as one Warning event per distinct message (the status is not ours)."""
        outcome = Outcome(job=job)
        uid = job.metadata.uid or ""
        if not dispatched_by_multikueue(job):
            return outcome
        problem: tuple[str, str] | None = None
        findings = errors(evaluate(job.spec, context=RuleContext.for_spec(job.spec, leader_worker_set=True)))
        if findings:
            text = "; ".join(f"{f.rule}: {f.message}" for f in findings)
            problem = (Reason.INCOMPATIBLE_SETTINGS, f"no Workload is made for MultiKueue to dispatch: {text}")
        elif not await self.capabilities.serves(*KUEUE_WORKLOADS):
            problem = (Reason.KUEUE_MISSING, "spec.managedBy is Kueue's MultiKueue, but Kueue is not installed here")
        else:
            want = build_workload(job, priority=await self._priority_value(job))
            have = await self._get("Workload", job.metadata.namespace, want["metadata"]["name"])
            action = plan_action(want, have, job_uid=uid)
            if action.verb == "conflict":
                problem = (Reason.NAME_CONFLICT, f"Workload/{want['metadata']['name']} {action.why}")
            else:
                taken = await self._converge(want, have, action, outcome.written)
                if isinstance(taken, _Taken):
                    problem = (Reason.NAME_CONFLICT, f"Workload/{want['metadata']['name']} is taken")
        outcome.valid = problem is None
        if problem is None:
            self._elsewhere_problem.pop(uid, None)
        elif self._elsewhere_problem.get(uid) != problem[1]:
            self._elsewhere_problem[uid] = problem[1]
            outcome.events.append(EventSpec("Warning", problem[0], problem[1][:1024]))
        return outcome

    async def _priority_value(self, job: RLJob) -> int | None:
        name = priority_class_name(job)
        if name is None:
            return None
        found = await self.client.get(KINDS["PriorityClass"], None, name)
        return int(found["value"]) if found is not None and "value" in found else None

    def _warn_nonfinite(self, job: RLJob, progress: Progress | None, outcome: Outcome) -> None:
        """A Warning event when the trainer's count of non-finite steps rose since this operator last looked."""
        uid = job.metadata.uid or ""
        count, message = nonfinite_warning(job, progress, self._nonfinite_seen.get(uid))
        if count is not None:
            self._nonfinite_seen[uid] = count
        if message is not None:
            outcome.events.append(EventSpec("Warning", Reason.NON_FINITE_STEP, message[:1024]))

    def _export_events(self, job: RLJob, progress: Progress | None, outcome: Outcome) -> None:
        """An Event per new export and per new export failure (operator/export_status.py)."""
        uid = job.metadata.uid or ""
        seen, events = export_events(job, progress, self._export_seen.get(uid))
        if seen is not None:
            self._export_seen[uid] = seen
        outcome.events += [EventSpec(kind, reason, message[:1024]) for kind, reason, message in events]

    def _progress_report(
        self, job: RLJob, plans: list[tuple[dict[str, Any], dict[str, Any] | None, Action]], outcome: Outcome
    ) -> ProgressReport | None:
        """The trainer's report from ``<job>-progress`` as this pass read it (None: not this RLJob's, so the status
        keeps its progress); a new reason it was refused (Warning) or trimmed (Normal) goes out as one Event."""
        name = meta.child_name(job, meta.ROLE_PROGRESS)
        have = next((h for c, h, _ in plans if c["kind"] == "ConfigMap" and c["metadata"]["name"] == name), None)
        if have is not None and not is_ours(have, job.metadata.uid):
            return None
        report = read_report(have)
        uid = job.metadata.uid or ""
        if report.problem is None:
            self._progress_problem.pop(uid, None)
        elif self._progress_problem.get(uid) != report.problem:
            self._progress_problem[uid] = report.problem
            kind, reason = (
                ("Warning", Reason.PROGRESS_REJECTED) if report.refused else ("Normal", Reason.PROGRESS_TRIMMED)
            )
            outcome.events.append(EventSpec(kind, reason, f"ConfigMap/{name}: {report.problem}"[:1024]))
        return report

    async def _consume_force(self, job: RLJob, upgrade: UpgradePlan, outcome: Outcome) -> None:
        """``r3operator.io/upgrade=force`` is one-shot: the pass that finds it removes it once its children are
        written, whether it forced the upgrade under way or found none to force, so it cannot skip a later canary."""
        if job.metadata.annotations.get(ANNOTATION_UPGRADE) != FORCE:
            return
        patch = {"metadata": {"annotations": {ANNOTATION_UPGRADE: None}}}
        written = await self.client.merge_patch(KINDS["RLJob"], job.metadata.namespace, job.metadata.name, patch)
        self._wrote(job.metadata.uid, written)
        outcome.written.append(f"removed the annotation {ANNOTATION_UPGRADE}={FORCE} (one-shot)")
        if upgrade.forced and upgrade.status is not None:
            what = f"{upgrade.status.component} upgrade {upgrade.status.from_image} → {upgrade.status.to}"
            message = f"{ANNOTATION_UPGRADE}={FORCE} used for the {what}, and removed: a later image change is canaried"
            outcome.events.append(EventSpec("Normal", Reason.UPGRADE_FORCED, message))
        else:
            message = (
                f"{ANNOTATION_UPGRADE}={FORCE} removed unused: no upgrade to force (set it with the image change, or "
                "while its canary runs or is blocked)"
            )
            outcome.events.append(EventSpec("Warning", Reason.UPGRADE_FORCED, message))

    async def _plan_upgrade(
        self,
        job: RLJob,
        raw_engine_set: dict[str, Any] | None,
        ray_job: dict[str, Any] | None,
        *,
        stopped: bool,
        now: dt.datetime,
        raw_prefill_set: dict[str, Any] | None = None,
    ) -> UpgradePlan:
        """operator/upgrade.py's plan from the engines (StatefulSet or LeaderWorkerSet) as they are and, while a
        canary runs, its Job."""
        ours = raw_engine_set is not None and is_ours(raw_engine_set, job.metadata.uid)
        engine_set = raw_engine_set if ours else None
        prefill_set = _ours_or_none(raw_prefill_set, job.metadata.uid)
        prev = read_record(engine_set)  # the operator's own record, never status.upgrade
        canary = await self._read_canary(job, prev) if prev is not None and prev.phase == "Canary" else None
        stopped = stopped or is_suspended(job)
        plan = plan_upgrade(
            job,
            engine_set,
            prev=prev,
            canary=canary,
            ray_job=ray_job,
            stopped=stopped,
            now=now,
            prefill_set=prefill_set,
        )
        plan = refuse_unknown_images(plan, allowed_images(job, prev, engine_set, ray_job))
        changed = (
            prev is None or (prev.attempt, prev.phase) != (plan.status.attempt, plan.status.phase)
            if plan.status is not None
            else False
        )
        if plan.status is not None and changed:
            log.info(
                "%s/%s: %s upgrade %s → %s: %s (%s)",
                job.metadata.namespace,
                job.metadata.name,
                plan.status.component,
                plan.status.from_image,
                plan.status.to,
                plan.status.phase,
                plan.status.message,
            )
        return plan

    async def _read_canary(self, job: RLJob, prev: UpgradeStatus) -> CanaryInputs:
        """The canary Job, its verdict (the canary pod's termination message) and whether the canary's pods
        (its pod, and an engine upgrade's surge replica) run: all written by Kubernetes controllers and the
        kubelet, none by the trainer pods."""
        namespace = job.metadata.namespace
        raw = await self._get("Job", namespace, meta.child_name(job, meta.ROLE_UPGRADE_CANARY))
        canary_job = _ours_or_none(raw, job.metadata.uid)
        pods = await self._pods(job)
        canary = canary_pods(pods, prev.attempt)
        verdict = verdict_from_pods(canary, canary_job, container=CANARY_CONTAINER, attempt=prev.attempt)
        progress = pod_progress(canary)
        if prev.component == "engine":
            surging = surge_pods(pods, meta.child_name(job, meta.ROLE_ENGINE), engine_replicas(job.spec))
            if roles(job.spec):  # and the prefill role's surge replica: the canary scores the new pair
                prefill = role_replicas(job.spec, EngineRole.PREFILL)
                name = meta.child_name(job, names.ROLE_PREFILL)
                surging += surge_pods(pods, name, prefill, role=names.ROLE_PREFILL)
            surge = pod_progress(surging)
            progress = PodProgress(progress.running and surge.running, surge.unschedulable or progress.unschedulable)
        return CanaryInputs(job=canary_job, verdict=verdict, pods=progress)

    def _record_finish(self, job: RLJob, finish: Finish, now: dt.datetime) -> tuple[RLJob, asyncio.Task[None]]:
        """Start writing ANNOTATION_FINISHED on the RLJob once the RayJob ended (metadata, which no /status patch
        changes); the job as it is with it, and the write under way."""
        value = finish_annotation(finish, now)
        patch = {"metadata": {"annotations": {ANNOTATION_FINISHED: value}}}

        async def record() -> None:
            written = await self.client.merge_patch(KINDS["RLJob"], job.metadata.namespace, job.metadata.name, patch)
            self._wrote(job.metadata.uid, written)

        task = asyncio.ensure_future(record())
        # A pass that fails before it awaits the record (a refused read) leaves it to finish on its own.
        task.add_done_callback(lambda done: done.cancelled() or done.exception())
        metadata = job.metadata.model_copy(
            update={"annotations": {**job.metadata.annotations, ANNOTATION_FINISHED: value}}
        )
        return job.model_copy(update={"metadata": metadata}), task

    async def _ended_before(self, job: RLJob, engine_kind: str) -> bool:
        """No RayJob: did this job end before? The operator's annotation says so; a job that ended under an
        operator that kept no annotation is known by its status only once its engines are gone too (its TTL
        ran): the trainer pods, who may write that status, can remove neither the RayJob nor the engines."""
        if ANNOTATION_FINISHED in job.metadata.annotations:
            return True
        if not status_says_finished(job):
            return False
        engines = meta.child_name(job, meta.ROLE_ENGINE)
        return await self._get(engine_kind, job.metadata.namespace, engines, verify=True) is None

    async def _read(
        self, children: list[dict[str, Any]], *, known: dict[tuple[str, str], dict[str, Any] | None]
    ) -> list[tuple[dict[str, Any], dict[str, Any] | None]]:
        """Each child as it is under its name (``known``: read earlier in this pass). The reads the cache cannot
        answer (a new RLJob's first pass: one GET per child) go out together, one round trip rather than ten."""

        async def read(child: dict[str, Any]) -> dict[str, Any] | None:
            key = (child["kind"], child["metadata"]["name"])
            if key in known:
                return known[key]
            return await self._get(child["kind"], child["metadata"].get("namespace"), key[1])

        found = await asyncio.gather(*(read(child) for child in children))
        return list(zip(children, found, strict=True))

    async def _get(self, kind: str, namespace: str | None, name: str, *, verify: bool = False) -> dict[str, Any] | None:
        """A child from the cache when it holds it; from the API server when the cache cannot say. None when the
        cache holds no labelled object under the name, without a GET: someone else's object there lacks the
        operator's label, but every use of the answer either takes only objects this RLJob controls (so a foreign
        one reads as absent) or plans a create, which is create-only (apply.create_only): the server refuses it
        when the name is taken, and the pass then reads the name and plans again (``_write_all``). ``verify``
        (and a pass of an RLJob in ``_taken``) reads such a name by GET instead."""
        if self.cache is not None and namespace:
            hit = self.cache.lookup(kind, namespace, name)
            if isinstance(hit, dict):
                return hit
            if hit is None and not (verify or _VERIFY_ABSENT.get()):
                return None
        return await self.client.get(KINDS[kind], namespace, name)

    async def _pods(self, job: RLJob) -> list[dict[str, Any]]:
        namespace = job.metadata.namespace
        cached = self.cache.of_job("Pod", namespace, job.metadata.name) if self.cache and namespace else UNKNOWN
        if isinstance(cached, list):
            return cached
        selector = f"{meta.LABEL_JOB}={job.metadata.name}"
        return await self.client.list(KINDS["Pod"], namespace, label_selector=selector)

    async def _settle_workload(
        self,
        job: RLJob,
        observed: dict[str, dict[str, Any] | None],
        finish: Finish | None,
        outcome: Outcome,
    ) -> None:
        """The job controller's part of Kueue's protocol (operator/admission.py), after the children converged."""
        workload = observed.get("Workload")
        fetch = observed.get(f"Job/{meta.child_name(job, meta.ROLE_MODEL_FETCH)}")
        active = (
            _engines_running(observed.get(_engine_kind(job)))
            or _trainer_running(observed.get("RayJob"))
            or _fetch_running(fetch)
        )
        try:
            done = await settle(self.client, workload, active=active, finish=finish, now=self.clock())
        except KubeError as exc:
            if exc.status != 409:  # 409: Kueue wrote the Workload meanwhile; the next pass reads it again
                outcome.error = exc
            return
        if done is not None and workload is not None:
            outcome.written.append(f"{done} (Workload/{workload['metadata']['name']})")

    async def _read_fetch_job(self, job: RLJob) -> dict[tuple[str, str], dict[str, Any] | None]:
        """The model-fetch Job as it is now (nothing when the model is not fetched), keyed like ``_read``'s known."""
        if not uses_model_cache(job):
            return {}
        name = meta.child_name(job, meta.ROLE_MODEL_FETCH)
        return {("Job", name): await self._get("Job", job.metadata.namespace, name)}

    async def _own_model_cache(self, job: RLJob) -> bool:
        """A job whose model cache is shared by source still has its own ``<job>-model-cache`` (from an operator
        before shared caches, or kept from a deleted RLJob of its name): it keeps reading that copy (Facts)."""
        if not shares_model_cache(job):
            return False
        name = own_claim_name(job)
        have = await self._get("PersistentVolumeClaim", job.metadata.namespace, name)
        return have is not None and is_ours(have, job.metadata.uid) and not have["metadata"].get("deletionTimestamp")

    async def _model_cache_holder(self, job: RLJob, outcome: Outcome, *, own: bool, finished: bool) -> str | None:
        """Another live RLJob that holds this job's kept ReadWriteOnce model cache, which it then waits for
        (operator/model_cache_hold.py); None when this job holds it (taken over now: one Event) or shares none."""
        if finished or own or not held_one_at_a_time(job):
            return None
        hold = await hold_model_cache(self.client, job)
        if hold.taken_from is not None:
            outcome.events.append(
                EventSpec(
                    "Normal",
                    Reason.MODEL_CACHE_TAKEN_OVER,
                    f"mounts the kept model cache PersistentVolumeClaim/{hold.claim}, "
                    f"held until now by RLJob/{hold.taken_from}",
                )
            )
        return hold.holder

    async def _missing_claims(self, job: RLJob) -> tuple[str, ...]:
        """Claims the spec names but the operator does not create: checked before any pod mounts them."""
        claims = [job.spec.storage.existing_claim] if job.spec.storage.existing_claim else []
        if (claim := model_source(job.spec).claim) is not None:
            claims.append(claim)
        if uses_model_cache(job) and job.spec.model.cache is not None and job.spec.model.cache.claim_name:
            claims.append(job.spec.model.cache.claim_name)
        if (claim := export_claim(job)) is not None:
            claims.append(claim)
        kind = KINDS["PersistentVolumeClaim"]
        return tuple(
            [c for c in dict.fromkeys(claims) if await self.client.get(kind, job.metadata.namespace, c) is None]
        )

    async def _write_all(
        self,
        job: RLJob,
        plans: list[tuple[dict[str, Any], dict[str, Any] | None, Action]],
        finished: bool,
        expired: bool,
        observed: dict[str, dict[str, Any] | None],
        outcome: Outcome,
        recording: asyncio.Task[None] | None = None,
    ) -> str | None:
        """The writes of ``plans``, then pruning. The NameConflict a create found, if any: then nothing else is
        written, and what this pass created is deleted again (the RLJob is left as it was, no child made)."""
        # A finished RayJob is the record of the end: never re-run or changed.
        todo = [(c, h, a) for c, h, a in plans if not (c["kind"] == "RayJob" and finished)]
        try:
            conflict = await self._write_wave(job, todo, observed, outcome)
            if conflict is not None:
                return conflict
            if recording is not None:
                await recording  # the record of the end before any child goes (the RayJob's deletion)
            await self._prune(job, plans, expired, outcome)
        except KubeError as exc:
            outcome.error = exc
            return None
        self._failures.pop(job.metadata.uid or "", None)
        return None

    async def _write_wave(
        self,
        job: RLJob,
        todo: list[tuple[dict[str, Any], dict[str, Any] | None, Action]],
        observed: dict[str, dict[str, Any] | None],
        outcome: Outcome,
        *,
        first: bool = True,
    ) -> str | None:
        # One wave, every write at once: each child is its own object and its ownerReference names the RLJob only,
        # so none waits for another's answer. A pod maker may be answered before what its pods mount or run as
        # (its ConfigMap, claim, ServiceAccount): its controller's pod then waits (the kubelet retries the mount,
        # the scheduler the claim) or is refused and retried (no ServiceAccount yet); both are sent together.
        notes: list[list[str]] = [[] for _ in todo]
        results = await asyncio.gather(
            *(self._converge(c, h, a, n) for (c, h, a), n in zip(todo, notes, strict=True)),
            return_exceptions=True,
        )
        taken: list[tuple[dict[str, Any], dict[str, Any] | None]] = []
        failed: BaseException | None = None
        for (child, _, _), result, note in zip(todo, results, notes, strict=True):
            outcome.written += note
            label = f"{child['kind']}/{child['metadata']['name']}"
            if isinstance(result, _Taken) and first:
                taken.append((child, result.have))
            elif isinstance(result, _Taken):  # taken again since this pass read it: the next pass plans it
                failed = failed or KubeError(409, f"{label} was created meanwhile", "Conflict")
            elif isinstance(result, BaseException):
                failed = failed or result
            else:
                observed[child["kind"]] = observed[label] = result
        if taken:
            # Under a name the cache held nothing: planned again from what is there, as a pass that had read it.
            again = [(child, have, plan_action(child, have, job_uid=job.metadata.uid)) for child, have in taken]
            conflicts = [f"{c['kind']}/{c['metadata']['name']} {a.why}" for c, _, a in again if a.verb == "conflict"]
            if conflicts:
                created = [
                    (child, result)
                    for (child, _, action), result in zip(todo, results, strict=True)
                    # A claim shared by source and revision is no child of this RLJob's: other RLJobs may use it.
                    if action.create and isinstance(result, dict) and not _shared_claim(result)
                ]
                await self._undo(job, created, outcome)
                return "; ".join(conflicts)
            # Objects of this RLJob the cache had not seen yet: applied as usual, one more round.
            if (conflict := await self._write_wave(job, again, observed, outcome, first=False)) is not None:
                return conflict
        if failed is not None:
            raise failed
        return None

    async def _undo(self, job: RLJob, created: list[tuple[dict[str, Any], dict[str, Any]]], outcome: Outcome) -> None:
        """Delete what this pass created, by uid: a child's name is taken, and an RLJob with a NameConflict makes
        no child. Its later passes read every name the cache does not hold before writing (``_taken``)."""
        self._taken.add(job.metadata.uid or "")

        async def delete(child: dict[str, Any], obj: dict[str, Any]) -> None:
            name = child["metadata"]["name"]
            uid = (obj.get("metadata") or {}).get("uid")
            await self.client.delete(kind_of(child), job.metadata.namespace, name, uid=uid)
            outcome.written.append(f"deleted {child['kind']}/{name} (created beside a name taken: NameConflict)")

        await asyncio.gather(*(delete(child, obj) for child, obj in created))

    def _reported_error(self, job: RLJob, error: KubeError | None) -> str | None:
        """The API error for status once it persists (see API_ERROR_PASSES); None while it may pass."""
        if error is None or error.namespace_terminating:
            return None
        key = job.metadata.uid or ""
        self._failures[key] = passes = self._failures.get(key, 0) + 1
        if error.status in _PERMANENT_STATUSES or passes >= API_ERROR_PASSES:
            return f"{error} (refused {passes} pass(es) in a row)"
        return None

    async def _write_status(
        self, job: RLJob, new_status: RLJobStatus, outcome: Outcome, *, live: RLJobStatus | None
    ) -> None:
        """Write ``new_status`` when the live status differs from it (another writer's fields are overwritten whole);
        Events for the conditions that flipped since the operator's own last status (``job.status``)."""
        outcome.status = new_status
        uid = job.metadata.uid or ""
        digest, packed = status_digest(new_status), _pack(new_status.model_dump(mode="json", by_alias=True))
        if not status_changed(live, new_status):
            held = self._own.get(uid)
            self._own[uid] = (digest, packed, held[2] if held is not None else None)
            return
        patch = status_patch(new_status)
        # The write's own watch event can arrive before its response: it must not read as someone else's write.
        self._writing[uid] = digest
        try:
            written = await self.client.merge_patch(
                KINDS["RLJob"], job.metadata.namespace, job.metadata.name, patch, subresource="status"
            )
        finally:
            self._writing.pop(uid, None)
        self._wrote(job.metadata.uid, written)
        self._own[uid] = (digest, packed, (written.get("metadata") or {}).get("resourceVersion"))
        outcome.status_written = True
        for cond in transitions(job.status, new_status):
            kind = "Warning" if _bad_polarity(cond.type, cond.status) else "Normal"
            message = f"{cond.type}={cond.status.value}: {cond.message}"[:1024]
            outcome.events.append(EventSpec(kind, cond.reason, message))

    async def _converge(
        self, want: dict[str, Any], have: dict[str, Any] | None, action: Action, written: list[str]
    ) -> dict[str, Any] | _Taken | None:
        kind = kind_of(want)
        namespace, name = want["metadata"].get("namespace"), want["metadata"]["name"]
        label = f"{want['kind']}/{name}"
        if action.verb == "none":
            return have
        if action.verb == "recreate":
            assert have is not None
            await self.client.delete(kind, namespace, name, uid=have["metadata"].get("uid"))
            written.append(f"deleted {label} ({action.why})")
            if await self.client.get(kind, namespace, name) is not None:
                return None  # still finalizing (KubeRay's finalizer); the next pass creates it
            have, action = None, plan_action(want, None, job_uid=None)
        assert action.body is not None
        try:
            applied = await self.client.apply(action.body, force=action.force, field_manager=action.manager)
        except KubeError as exc:
            if not (action.create and exc.status == 409):
                raise
            # Something is under the name after all (not labelled as ours, or not yet in the cache): read it.
            return _Taken(await self.client.get(kind, namespace, name))
        if self.cache is not None and namespace:
            self.cache.remember(want["kind"], namespace, applied)
        unchanged = have is not None and (applied.get("metadata") or {}).get("resourceVersion") == (
            have.get("metadata") or {}
        ).get("resourceVersion")
        if not unchanged:  # an apply the server found equal to what is there writes nothing
            written.append(f"{'created' if have is None else 'updated'} {label}")
        return applied

    async def _prune(
        self,
        job: RLJob,
        plans: list[tuple[dict[str, Any], dict[str, Any] | None, Action]],
        expired: bool,
        outcome: Outcome,
    ) -> None:
        wanted = {(c["kind"], c["metadata"]["name"]) for c, _, _ in plans}
        engine_name = meta.child_name(job, meta.ROLE_ENGINE)
        record = next(
            (
                read_record(c)
                for c, _, _ in plans
                if c["metadata"]["name"] == engine_name and c["kind"] in ("StatefulSet", "LeaderWorkerSet")
            ),
            None,
        )
        upgrade_phase = record.phase if record is not None else None
        for role, kind in _CHILD_KINDS:
            name = meta.child_name(job, role)
            if (kind, name) in wanted:
                continue
            storage = job.spec.storage
            if role in (meta.ROLE_MODEL_CACHE, meta.ROLE_MODEL_FETCH) and not expired:
                continue  # the model copy and its fetch record go with the TTL (or the RLJob); no GET otherwise
            if role == meta.ROLE_STORAGE and not (
                expired and storage.retain_policy is RetainPolicy.DELETE and not storage.existing_claim
            ):
                continue  # data: deleted only by TTL with retainPolicy Delete, never by an edit
            if kind == "RayJob" and not expired:
                continue  # the RayJob is dropped from desired() only after the TTL
            if kind == "PodMonitor" and not await self.capabilities.serves("monitoring.coreos.com/v1", "podmonitors"):
                continue
            if kind == "RayJob" and not await self.capabilities.serves("ray.io/v1", "rayjobs"):
                continue
            if kind == "LeaderWorkerSet" and not await self.capabilities.serves(LWS_API_VERSION, LWS_PLURAL):
                continue
            canary_done = upgrade_phase in ("Rolling", "Blocked", "Cancelled")  # its pod holds a GPU
            if role == meta.ROLE_UPGRADE_CANARY and not (expired or canary_done):
                continue  # the canary Job outlives its verdict only until the next pass; no GET otherwise
            if kind == "Workload" and not await self.capabilities.serves(*KUEUE_WORKLOADS):
                continue
            have = await self._get(kind, job.metadata.namespace, name)
            if have is None or not is_ours(have, job.metadata.uid):
                continue  # absent, or not ours: never delete what this RLJob does not control
            if kind == "PersistentVolumeClaim" and meta.controller_uid(have) != job.metadata.uid:
                continue  # a claim without our controller reference is retained data
            await self.client.delete(KINDS[kind], job.metadata.namespace, name, uid=have["metadata"].get("uid"))
            outcome.written.append(f"deleted {kind}/{name}")

    async def _with_canary(self, job: RLJob, obs: Observed) -> Observed:
        if job.spec.routing_replay.mode is not ReplayMode.R3 or job.spec.model.architecture is None:
            return obs
        uid = job.metadata.uid or job.metadata.name
        engine_hash = engine_spec_hash(job.spec)
        cached = self._canaries.get(uid)
        if cached is not None and cached[1].engine_hash == engine_hash:
            ran_at, result = cached
            if result.ok or time.monotonic() - ran_at < self.settings.canary_retry_s:
                return _replace(obs, canary=result)
        if not self.settings.canary:
            return obs
        engines_ready = compute_conditions(job, obs)[ConditionType.ENGINES_READY].status is ConditionStatus.TRUE
        if not engines_ready:
            return obs
        service = meta.child_name(job, meta.ROLE_ENGINE)
        url = self.settings.canary_url_template.format(
            service=service, namespace=job.metadata.namespace, port=job.spec.inference.port, name=job.metadata.name
        )
        arch = job.spec.model.architecture
        result = await run_canary(url, model=model_path(job.spec), num_layers=arch.num_layers, top_k=arch.top_k)
        result = CanaryResult(result.ok, result.message, engine_hash, result.shape)
        self._canaries[uid] = (time.monotonic(), result)
        log.info("canary for %s/%s: %s", job.metadata.namespace, job.metadata.name, result.message)
        return _replace(obs, canary=result)


@dataclass(frozen=True, slots=True)
class _Taken:
    """A create refused because the name is taken: what the API server holds there (None: gone again since)."""

    have: dict[str, Any] | None


def _shared_claim(obj: dict[str, Any]) -> bool:
    return obj.get("kind") == "PersistentVolumeClaim" and meta.LABEL_MODEL_CACHE in (
        (obj.get("metadata") or {}).get("labels") or {}
    )


def _ours_or_none(obj: dict[str, Any] | None, uid: str | None) -> dict[str, Any] | None:
    return obj if obj is not None and is_ours(obj, uid) else None


def _pack(obj: Any) -> bytes:
    """A JSON object held in memory between passes: compressed, ~1/6 of its dicts' size."""
    return zlib.compress(json.dumps(obj, separators=(",", ":")).encode())


def _unpack(blob: bytes) -> Any:
    return json.loads(zlib.decompress(blob))


def _at_version(version: str | None) -> dict[str, Any]:
    """An object of which only the resourceVersion is known, for ``is_newer``."""
    return {"metadata": {"resourceVersion": version}}


def _engine_kind(job: RLJob) -> str:
    """The kind of the engine child: a LeaderWorkerSet when a replica spans pods (api/engine_layout.py)."""
    return "LeaderWorkerSet" if engine_layout(job.spec).multi_pod else "StatefulSet"


def _engines_running(engine_set: dict[str, Any] | None) -> bool:
    status = (engine_set or {}).get("status") or {}
    return int(status.get("replicas") or 0) > 0 or int(((engine_set or {}).get("spec") or {}).get("replicas") or 0) > 0


def _fetch_running(fetch_job: dict[str, Any] | None) -> bool:
    """The model-fetch Job may hold a pod: not finished, and not suspended or still deleting its pod."""
    if fetch_job is None or model_fetch_complete(fetch_job) or model_fetch_failed(fetch_job) is not None:
        return False
    status = fetch_job.get("status") or {}
    pods = int(status.get("active") or 0) + int(status.get("terminating") or 0)
    return pods > 0 or not (fetch_job.get("spec") or {}).get("suspend")


# KubeRay's jobDeploymentStatus values in which a RayCluster of the job may still hold pods.
_RAY_ACTIVE = frozenset({"Initializing", "Running", "Suspending", "Retrying", "Waiting"})


def _trainer_running(ray_job: dict[str, Any] | None) -> bool:
    if ray_job is None:
        return False
    deployment = str(((ray_job.get("status") or {}).get("jobDeploymentStatus")) or "")
    return deployment in _RAY_ACTIVE or (deployment == "" and not (ray_job.get("spec") or {}).get("suspend"))


def _waiting_for_pods(job: RLJob, obs: Observed) -> bool:
    conditions = compute_conditions(job, obs)
    return any(
        conditions[t].status is not ConditionStatus.TRUE and conditions[t].reason is not Reason.NOT_CREATED
        for t in (ConditionType.ENGINES_READY, ConditionType.TRAINER_READY)
    ) and not is_suspended(job)


def _replace(obs: Observed, **changes: Any) -> Observed:
    return dataclasses.replace(obs, **changes)


def _after(version: Any, than: str | None) -> bool:
    """resourceVersion ``version`` is later than ``than`` (etcd revisions, integers, in every kube-apiserver; were
    one not, or is there none to compare with, it counts as later)."""
    if than is None or not str(version or "").isdigit() or not than.isdigit():
        return True
    return int(str(version)) > int(than)


def _says_name_conflict(raw: dict[str, Any]) -> bool:
    conditions = (raw.get("status") or {}).get("conditions") or []
    return any(
        c.get("type") == ConditionType.VALID.value and c.get("reason") == Reason.NAME_CONFLICT for c in conditions
    )
