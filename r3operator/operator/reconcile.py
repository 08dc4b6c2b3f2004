"""One reconcile pass: observe → validate → desired → diff → apply → status (via /status only).

Level-based and idempotent: every handler (create, update, resume, the timer) calls
:meth:`Reconciler.reconcile` with the current object, which converges the children to ``desired()``
whatever happened before — including an operator killed halfway through a previous pass (names are
deterministic, a create that meets 409 AlreadyExists reads the object and diffs it instead).

Validation comes first: an RLJob that breaks a compatibility rule (``api.rules``), or whose cluster
lacks KubeRay, gets ``Valid=False`` and **no child is created or changed**. Existing children of a
previously valid spec are left exactly as they are (an invalid upgrade changes nothing).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from r3operator.api.enums import ConditionStatus, ConditionType, ReplayMode, RetainPolicy
from r3operator.api.load import parse_rljob
from r3operator.api.rules import errors, evaluate
from r3operator.api.v1alpha1 import RLJob, RLJobStatus
from r3operator.engine.args import model_path
from r3operator.operator import meta
from r3operator.operator.apply import plan_action
from r3operator.operator.canary import CanaryResult, run_canary
from r3operator.operator.conditions import Reason
from r3operator.operator.desired import Facts, desired
from r3operator.operator.hashing import engine_spec_hash
from r3operator.operator.kube import KINDS, KubeClient, KubeError, kind_of
from r3operator.operator.lifecycle import is_suspended, ttl_expired
from r3operator.operator.observed import Observed
from r3operator.operator.scheduling import unschedulable_by_role
from r3operator.operator.status import compute_conditions, compute_status, status_changed, status_patch, transitions
from r3operator.settings import DEFAULT_CANARY_URL, DEFAULT_TRAINER_CLUSTER_ROLE

log = logging.getLogger("r3operator.reconcile")

# Every child kind the operator may own, by role: prune candidates when desired() drops them.
_CHILD_KINDS = (
    (meta.ROLE_METRICS, "PodMonitor"),
    (meta.ROLE_TRAINER, "RayJob"),
    (meta.ROLE_TRAINER, "RoleBinding"),
    (meta.ROLE_TRAINER, "ServiceAccount"),
    (meta.ROLE_ENGINE, "StatefulSet"),
    (meta.ROLE_ENGINE, "Service"),
    (meta.ROLE_CONFIG, "ConfigMap"),
    (meta.ROLE_STORAGE, "PersistentVolumeClaim"),
)


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
    trainer_cluster_role: str = DEFAULT_TRAINER_CLUSTER_ROLE
    """The ClusterRole each RLJob's trainer RoleBinding refers to (the chart's ``<release>-trainer``)."""


def _bad_polarity(cond_type: str, status: ConditionStatus) -> bool:
    if cond_type == ConditionType.FAILED.value:
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
    ) -> None:
        self.client = client
        self.settings = settings or ReconcilerSettings()
        self.capabilities = Capabilities(client, self.settings.discovery_ttl_s)
        self.clock = clock
        self._locks: dict[str, asyncio.Lock] = {}
        self._canaries: dict[str, tuple[float, CanaryResult]] = {}

    def forget(self, uid: str) -> None:
        self._locks.pop(uid, None)
        self._canaries.pop(uid, None)

    async def reconcile(self, body: dict[str, Any]) -> Outcome:
        uid = str(body.get("metadata", {}).get("uid", ""))
        lock = self._locks.setdefault(uid, asyncio.Lock())
        async with lock:
            # Re-read: a timer and a change handler may have queued on the lock with stale bodies.
            fresh = await self.client.get(KINDS["RLJob"], body["metadata"].get("namespace"), body["metadata"]["name"])
            if fresh is None or fresh.get("metadata", {}).get("deletionTimestamp"):
                return Outcome()
            return await self._reconcile(parse_rljob(fresh, source=f"rljob {body['metadata']['name']}"))

    async def _reconcile(self, job: RLJob) -> Outcome:
        now = self.clock()
        namespace = job.metadata.namespace
        rule_errors = tuple(errors(evaluate(job.spec)))
        kuberay = await self.capabilities.serves("ray.io/v1", "rayjobs")
        outcome = Outcome(job=job, valid=not rule_errors and kuberay)
        observed: dict[str, dict[str, Any] | None] = {}
        if outcome.valid:
            pod_monitor = await self.capabilities.serves("monitoring.coreos.com/v1", "podmonitors")
            facts = Facts(pod_monitor_crd=pod_monitor, now=now, trainer_cluster_role=self.settings.trainer_cluster_role)
            children = desired(job, facts)
            for child in children:
                observed[child["kind"]] = await self._converge(child, outcome)
            await self._prune(job, children, outcome, now)
        else:
            # Nothing is created or changed; read what a previous valid spec left, for status only.
            for role, kind in ((meta.ROLE_ENGINE, "StatefulSet"), (meta.ROLE_TRAINER, "RayJob")):
                if kind == "RayJob" and not kuberay:
                    continue
                observed[kind] = await self.client.get(KINDS[kind], namespace, meta.child_name(job, role))
        obs = Observed(
            rule_errors=rule_errors,
            kuberay_installed=kuberay,
            engine_set=observed.get("StatefulSet"),
            ray_job=observed.get("RayJob"),
            written=tuple(outcome.written),
            workloads_deleted=ttl_expired(job, now),
        )
        if _waiting_for_pods(job, obs):
            # One LIST only while something is not up yet: the scheduler's reason goes into status.
            selector = f"{meta.LABEL_JOB}={job.metadata.name}"
            pods = await self.client.list(KINDS["Pod"], namespace, label_selector=selector)
            obs = _replace(obs, unschedulable=unschedulable_by_role(pods))
        obs = await self._with_canary(job, obs)
        new_status = compute_status(job, obs, now)
        outcome.status = new_status
        if status_changed(job.status, new_status):
            patch = status_patch(new_status)
            await self.client.merge_patch(KINDS["RLJob"], namespace, job.metadata.name, patch, subresource="status")
            outcome.status_written = True
            for cond in transitions(job.status, new_status):
                kind = "Warning" if _bad_polarity(cond.type, cond.status) else "Normal"
                message = f"{cond.type}={cond.status.value}: {cond.message}"[:1024]
                outcome.events.append(EventSpec(kind, cond.reason, message))
        return outcome

    async def _converge(self, want: dict[str, Any], outcome: Outcome) -> dict[str, Any] | None:
        kind = kind_of(want)
        namespace, name = want["metadata"].get("namespace"), want["metadata"]["name"]
        have = await self.client.get(kind, namespace, name)
        action = plan_action(want, have)
        label = f"{want['kind']}/{name}"
        if action.verb == "none":
            return have
        if action.verb == "create":
            try:
                created = await self.client.create(want)
            except KubeError as exc:
                if exc.status != 409:
                    raise
                # Created by a pass we did not see finish (operator restart): diff it instead.
                return await self._converge(want, outcome)
            outcome.written.append(f"created {label}")
            return created
        if action.verb == "recreate":
            await self.client.delete(kind, namespace, name)
            outcome.written.append(f"deleted {label} (spec changed)")
            if await self.client.get(kind, namespace, name) is None:
                created = await self.client.create(want)
                outcome.written.append(f"created {label}")
                return created
            return None  # still finalizing (KubeRay's finalizer); the next pass creates it
        assert action.patch is not None
        patched = await self.client.merge_patch(kind, namespace, name, action.patch)
        outcome.written.append(f"updated {label}")
        return patched

    async def _prune(self, job: RLJob, children: list[dict[str, Any]], outcome: Outcome, now: dt.datetime) -> None:
        wanted = {(c["kind"], c["metadata"]["name"]) for c in children}
        expired = ttl_expired(job, now)
        for role, kind in _CHILD_KINDS:
            name = meta.child_name(job, role)
            if (kind, name) in wanted:
                continue
            storage = job.spec.storage
            if kind == "PersistentVolumeClaim" and not (
                expired and storage.retain_policy is RetainPolicy.DELETE and not storage.existing_claim
            ):
                continue  # data: deleted only by TTL with retainPolicy Delete, never by an edit
            if kind == "PodMonitor" and not await self.capabilities.serves("monitoring.coreos.com/v1", "podmonitors"):
                continue
            if kind == "RayJob" and not await self.capabilities.serves("ray.io/v1", "rayjobs"):
                continue
            have = await self.client.get(KINDS[kind], job.metadata.namespace, name)
            if have is None or (have["metadata"].get("labels") or {}).get(meta.LABEL_JOB) != job.metadata.name:
                continue  # absent, or not ours: never delete what we did not create
            await self.client.delete(KINDS[kind], job.metadata.namespace, name)
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


def _waiting_for_pods(job: RLJob, obs: Observed) -> bool:
    conditions = compute_conditions(job, obs)
    return any(
        conditions[t].status is not ConditionStatus.TRUE and conditions[t].reason is not Reason.NOT_CREATED
        for t in (ConditionType.ENGINES_READY, ConditionType.TRAINER_READY)
    ) and not is_suspended(job)


def _replace(obs: Observed, **changes: Any) -> Observed:
    return dataclasses.replace(obs, **changes)
