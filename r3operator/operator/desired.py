"""desired(job, facts) → the children an RLJob should have right now. Pure: same input, same output.

Level-based reconciliation compares this list with what exists. The output depends on the spec and
on outside facts the reconciler observed (:class:`Facts`: is the PodMonitor CRD installed, did the
trainer RayJob finish, has the TTL after that passed) — never on the RLJob's status, which is output.

Lifecycle:
- running: PVC, ConfigMap, the trainer's progress ConfigMap (operator/progress.py), engine Service +
  StatefulSet (a LeaderWorkerSet when an engine replica spans pods, api/engine_layout.py) + NetworkPolicy,
  trainer ServiceAccount + Role + RoleBinding, RayJob, PodMonitor; for an hf://, s3:// or gs:// model also the
  model cache claim (shared by the namespace's RLJobs of the same source and revision, builders/model_cache.py)
  and its fetch Job;
- filling the model cache (the fetch Job has not completed): engines at 0 replicas, RayJob ``suspend: true``;
- suspended: same children, engines at 0 replicas, RayJob ``suspend: true``;
- queued (``spec.queueName``): one more child, the Kueue Workload of the whole job; until Kueue admits
  it (and again when Kueue evicts it) the children are those of a suspended job;
- suspended or not admitted: the model-fetch Job too is ``suspend: true`` (no fetch pod runs);
- finished (the RayJob says so): engines at 0 replicas (free the GPUs now), the RayJob is kept;
- an engine image upgrade under way (``Facts.engine_rollout``, from operator/upgrade.py): the engine
  StatefulSet (or LeaderWorkerSet) on the rollout's image, with a surge canary replica and a partition,
  plus the canary Job;
- finished and ``ttlSecondsAfterFinished`` elapsed: only a Retain PVC remains desired; the
  reconciler deletes every other child it owns (the RLJob itself stays).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from r3operator.api import names
from r3operator.api.disaggregation import role_replicas, roles
from r3operator.api.engine_layout import engine_layout
from r3operator.api.enums import EngineRole, RetainPolicy
from r3operator.api.v1alpha1 import RLJob, UpgradeStatus
from r3operator.operator import meta
from r3operator.operator.builders.config import build_config_map
from r3operator.operator.builders.engine import build_engine_service, build_engine_statefulset
from r3operator.operator.builders.engine_lws import build_engine_leader_worker_set
from r3operator.operator.builders.model_cache import (
    build_model_cache_claim,
    build_model_fetch_job,
    model_cache_claim_name,
    own_claim_name,
    shares_model_cache,
)
from r3operator.operator.builders.monitoring import build_pod_monitor, wants_pod_monitor
from r3operator.operator.builders.network import build_engine_network_policy
from r3operator.operator.builders.storage import build_routing_claim
from r3operator.operator.builders.trainer import build_ray_job
from r3operator.operator.builders.trainer_rbac import (
    build_trainer_role,
    build_trainer_role_binding,
    build_trainer_service_account,
    chosen_service_account,
)
from r3operator.operator.builders.upgrade_canary import CanaryTarget, build_upgrade_canary_job
from r3operator.operator.builders.workload import build_workload
from r3operator.operator.lifecycle import is_suspended
from r3operator.operator.managed_by import prebuilt_workload
from r3operator.operator.progress import build_progress_config_map
from r3operator.operator.upgrade import EngineRollout
from r3operator.operator.upgrade_record import ANNOTATION_UPGRADE_STATE, record_annotation


@dataclass(frozen=True, slots=True)
class Facts:
    """Outside facts desired() depends on, as the reconciler observed them."""

    pod_monitor_crd: bool = True
    """monitoring.coreos.com/v1 PodMonitor is served (Prometheus Operator installed)."""
    finished: bool = False
    """The trainer RayJob reached Succeeded or Failed (lifecycle.observed_finish)."""
    expired: bool = False
    """ttlSecondsAfterFinished elapsed since the RayJob's end (lifecycle.ttl_expired)."""
    operator_namespace: str | None = None
    """Where the operator runs (its canary reaches the engines from there); None outside a cluster."""
    engine_ingress_namespaces: tuple[str, ...] = ()
    """Further namespaces admitted to the engine port (R3OPERATOR_ENGINE_INGRESS_NAMESPACES)."""
    engine_rollout: EngineRollout | None = None
    """An engine image upgrade under way (operator/upgrade.py): the image, surge replica and partition."""
    upgrade_canary: CanaryTarget | None = None
    """The upgrade's canary Job to run (operator/upgrade.py)."""
    trainer_image: str | None = None
    """The trainer image the RayJob keeps while a new one is canaried (operator/upgrade.py)."""
    upgrade_record: UpgradeStatus | None = None
    """The upgrade state to keep on the engine StatefulSet (LeaderWorkerSet), operator/upgrade_record.py."""
    admitted: bool = True
    """Kueue admitted the job's Workload and has not evicted it (always true without spec.queueName)."""
    priority: int | None = None
    """The value of the PriorityClass the pods name, for the Workload's priority."""
    model_fetched: bool = True
    """The model-fetch Job completed (builders/model_cache.py); only read when the model is fetched.
    Until then engines stay at 0 replicas and the RayJob suspended: nothing reads a cache being filled."""
    model_cache_holder: str | None = None
    """Another live RLJob holds this job's kept ReadWriteOnce model cache (operator/model_cache_hold.py): no
    claim or fetch Job is written, the engines stay at 0 replicas and the RayJob suspended until it is free."""
    own_model_cache: bool = False
    """The RLJob's own ``<job>-model-cache`` exists (made by an operator before model caches were shared by source
    and revision, or kept from a deleted RLJob of this name): it keeps that claim, with its copy, instead of the
    shared one, so an operator upgrade neither empties a running job's cache nor fetches the model again."""


def desired(job: RLJob, facts: Facts | None = None) -> list[dict[str, Any]]:
    facts = facts or Facts()
    claim = build_routing_claim(job)
    if facts.expired:
        keep = claim is not None and job.spec.storage.retain_policy is RetainPolicy.RETAIN
        return [claim] if keep and claim is not None else []
    # Created suspended like every job Kueue gates: its pod runs only while the job may run.
    held = facts.model_cache_holder is not None
    fetch = None if held else build_model_fetch_job(job, suspend=is_suspended(job) or not facts.admitted)
    filling = held or (fetch is not None and not facts.model_fetched)
    stopped = is_suspended(job) or facts.finished or not facts.admitted or filling
    children: list[dict[str, Any]] = []
    if claim is not None:
        children.append(claim)
    cache = None if held else build_model_cache_claim(job, own=facts.own_model_cache)
    if cache is not None:
        children.append(cache)
    if fetch is not None:
        children.append(fetch)
    children.append(build_config_map(job))
    children.append(build_progress_config_map(job))
    children.append(build_engine_service(job))
    for role in roles(job.spec)[:1]:  # the prefill role; the decode role is the engines below
        children.append(build_engine_service(job, role=role))
        children.append(_engines(job, stopped=stopped, rollout=facts.engine_rollout, role=role))
    engines = _engines(
        job, stopped=stopped, rollout=facts.engine_rollout, role=EngineRole.DECODE if roles(job.spec) else None
    )
    annotations = engines["metadata"].setdefault("annotations", {})
    # What the regular replicas are known good on (upgrade.py): the next upgrade starts from it.
    verified = facts.engine_rollout.verified if facts.engine_rollout is not None else job.spec.inference.image
    annotations[meta.ANNOTATION_VERIFIED_IMAGE] = verified
    if facts.upgrade_record is not None:
        annotations[ANNOTATION_UPGRADE_STATE] = record_annotation(facts.upgrade_record)
    children.append(engines)
    children.append(
        build_engine_network_policy(
            job, operator_namespace=facts.operator_namespace, admitted_namespaces=facts.engine_ingress_namespaces
        )
    )
    if chosen_service_account(job) is None:
        children.append(build_trainer_service_account(job))
    children.append(build_trainer_role(job))
    children.append(build_trainer_role_binding(job))
    children.append(
        build_ray_job(
            _with_trainer_image(job, facts.trainer_image), suspend=is_suspended(job) or not facts.admitted or filling
        )
    )
    if job.spec.queue_name is not None and prebuilt_workload(job) is None:  # MultiKueue's worker: it exists
        children.append(build_workload(job, priority=facts.priority))
    if facts.pod_monitor_crd and wants_pod_monitor(job):
        children.append(build_pod_monitor(job))
    if facts.upgrade_canary is not None and not stopped:
        children.append(build_upgrade_canary_job(job, facts.upgrade_canary))
    if facts.own_model_cache and shares_model_cache(job):
        for child in children:
            _rename_claim(child, model_cache_claim_name(job), own_claim_name(job))
    return children


def standing_children(job_name: str) -> tuple[tuple[tuple[str, ...], str], ...]:
    """The children desired() renders for every job whose TTL has not expired, whatever its spec and facts, as
    (the kinds it may be, name): what a new leader can check in its cache without parsing or rendering the RLJob
    (operator/takeover.py). The engines are a StatefulSet or a LeaderWorkerSet by layout."""
    engine = names.child_name(job_name, names.ROLE_ENGINE)
    trainer = names.child_name(job_name, names.ROLE_TRAINER)
    return (
        (("ConfigMap",), names.child_name(job_name, names.ROLE_CONFIG)),
        (("Service",), engine),
        (("StatefulSet", "LeaderWorkerSet"), engine),
        (("NetworkPolicy",), engine),
        (("Role",), trainer),
        (("RoleBinding",), trainer),
        (("RayJob",), trainer),
    )


def _rename_claim(node: Any, old: str, new: str) -> None:
    """Every pod volume of ``node`` that mounts the claim ``old`` mounts ``new`` instead. The claim name is no
    input of the spec hashes, so the pods of a running job keep their template."""
    if isinstance(node, dict):
        claim = node.get("persistentVolumeClaim")
        if isinstance(claim, dict) and claim.get("claimName") == old:
            claim["claimName"] = new
        for value in node.values():
            _rename_claim(value, old, new)
    elif isinstance(node, list):
        for item in node:
            _rename_claim(item, old, new)


def _with_trainer_image(job: RLJob, image: str | None) -> RLJob:
    """The job as the RayJob should run it: the old trainer image while a new one is canaried, so that
    the trainer hash stays the same and the running RayJob is not replaced."""
    if image is None or image == job.spec.trainer.image:
        return job
    trainer = job.spec.trainer.model_copy(update={"image": image})
    return job.model_copy(update={"spec": job.spec.model_copy(update={"trainer": trainer})})


def _engines(
    job: RLJob, *, stopped: bool, rollout: EngineRollout | None, role: EngineRole | None = None
) -> dict[str, Any]:
    """The spec's engines (a StatefulSet, or a LeaderWorkerSet when a replica spans pods), or, during an
    upgrade, the engines on the rollout's image plus its surge replica, with a partition that keeps the
    existing replicas where they are. ``role``: one role of a disaggregated job, a StatefulSet (rule PD-*-ONE-POD);
    an upgrade moves both roles alike (a surge replica each during the canary, its partition the role's replicas)."""
    want = role_replicas(job.spec, role) if role is not None else job.spec.inference.replicas
    replicas = 0 if stopped else want
    multi_pod = role is None and engine_layout(job.spec).multi_pod
    if rollout is None:
        if multi_pod:
            return build_engine_leader_worker_set(job, replicas=replicas)
        return build_engine_statefulset(job, replicas=replicas, role=role)
    inference = job.spec.inference.model_copy(update={"image": rollout.image})
    effective = job.model_copy(update={"spec": job.spec.model_copy(update={"inference": inference})})
    surge = 0 if stopped else rollout.surge_replicas
    partition = 0 if stopped or not rollout.partition else want
    if multi_pod:
        return build_engine_leader_worker_set(effective, replicas=replicas + surge, partition=partition)
    statefulset = build_engine_statefulset(effective, replicas=replicas + surge, role=role)
    if partition:
        statefulset["spec"]["updateStrategy"] = {"type": "RollingUpdate", "rollingUpdate": {"partition": partition}}
    return statefulset
