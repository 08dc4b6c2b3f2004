"""Names, labels, annotations and ownerReferences shared by every child of an RLJob.

Names are deterministic (``<job>-<suffix>``) so that a restarted operator, or two reconciles racing,
can only ever find or create the *same* objects: duplicates are impossible by construction.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from r3operator.api import names
from r3operator.api.v1alpha1 import API_VERSION, KIND, RLJob

APP_NAME = "r3operator"
MANAGED_BY = "r3operator"
EVENT_COMPONENT = "r3operator"
"""The Events' reporting component (`From:` in `kubectl describe`)."""
PREFIX = "r3operator.io"
LABEL_JOB = f"{PREFIX}/job"
LABEL_ROLE = f"{PREFIX}/role"
ANNOTATION_SPEC_HASH = f"{PREFIX}/spec-hash"
"""On engine pod templates and on the RayJob: hash of the spec fields that component depends on."""
ANNOTATION_POD_HASH = f"{PREFIX}/pod-hash"
"""On the model-fetch Job: hash of the pod customisation it runs with; a new one replaces a Job not yet complete."""
ANNOTATION_VERIFIED_IMAGE = f"{PREFIX}/verified-image"
"""On the engine StatefulSet (LeaderWorkerSet) and the RayJob: the image the operator rendered for the regular
replicas, the one they are known good on; an upgrade starts from it, never from what a live object carries
(operator/upgrade.py)."""
ANNOTATION_RETAINED_FROM = f"{PREFIX}/retained-from-uid"
"""On a Retain PVC: the uid of the RLJob that created it (the PVC has no ownerReference)."""
ANNOTATION_MODEL_SOURCE = f"{PREFIX}/model-source"
"""On a created model cache claim: the model URI (and @revision) it was made for."""
LABEL_MODEL_CACHE = f"{PREFIX}/model-cache"
"""On a model cache claim shared by source and revision: the hash its name ends with (builders/model_cache.py);
``kubectl get pvc -l r3operator.io/model-cache`` lists them. Their ``r3operator.io/job`` label is empty."""
ANNOTATION_MODEL_CACHE_HOLDER = f"{PREFIX}/model-cache-holder"
"""On a kept ReadWriteOnce model cache claim: the RLJob that mounts it now (``<name>/<uid>``), written by the
operator alone (operator/model_cache_hold.py); another RLJob of that model waits until it is deleted or ends."""
FINALIZER = f"{PREFIX}/finalizer"

# GPU nodes carry the taint nvidia.com/gpu:NoSchedule (the NVIDIA GPU Operator's and the managed clouds'
# convention) so that only pods that asked for GPUs land there. Engine and trainer pods always request
# nvidia.com/gpu, so they tolerate it; without this they stay Pending on a typical GPU cluster.
GPU_TOLERATIONS: tuple[dict[str, str], ...] = ({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},)

ROLE_STORAGE = names.ROLE_STORAGE
ROLE_CONFIG = names.ROLE_CONFIG
ROLE_ENGINE = names.ROLE_ENGINE
ROLE_TRAINER = names.ROLE_TRAINER
ROLE_METRICS = names.ROLE_METRICS
ROLE_UPGRADE_CANARY = names.ROLE_UPGRADE_CANARY
ROLE_WORKLOAD = names.ROLE_WORKLOAD
ROLE_MODEL_CACHE = names.ROLE_MODEL_CACHE
ROLE_MODEL_FETCH = names.ROLE_MODEL_FETCH
ROLE_PROGRESS = names.ROLE_PROGRESS


def routing_claim_name(job: RLJob) -> str:
    """The PVC the routing volume uses: the user's existing claim or ``<job>-routing``."""
    return job.spec.storage.existing_claim or child_name(job, ROLE_STORAGE)


def child_name(job: RLJob, role: str) -> str:
    """``<job>-<suffix>``; the suffixes and the name limits they imply are in ``api/names.py``."""
    return names.child_name(job.metadata.name, role)


def selector_labels(job: RLJob, role: str) -> dict[str, str]:
    """The immutable subset used in StatefulSet selectors and Service selectors."""
    return {LABEL_JOB: job.metadata.name, LABEL_ROLE: role}


def labels(job: RLJob, role: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": APP_NAME,
        "app.kubernetes.io/instance": job.metadata.name,
        "app.kubernetes.io/component": role,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        **selector_labels(job, role),
    }


def owner_reference(job: RLJob) -> dict[str, Any] | None:
    """None when the RLJob has no uid yet (``r3operator render`` of a file)."""
    if not job.metadata.uid:
        return None
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": job.metadata.name,
        "uid": job.metadata.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def object_meta(
    job: RLJob, role: str, *, owned: bool = True, annotations: dict[str, str] | None = None
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": child_name(job, role), "labels": labels(job, role)}
    if job.metadata.namespace:
        meta["namespace"] = job.metadata.namespace
    if annotations:
        meta["annotations"] = dict(annotations)
    ref = owner_reference(job) if owned else None
    if ref is not None:
        meta["ownerReferences"] = [ref]
    return meta


def controller_uid(obj: dict[str, Any]) -> str | None:
    """The uid of the object's controller ownerReference (``controller: true``), if any."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return str(ref.get("uid") or "") or None
    return None


def has_true_condition(obj: Mapping[str, Any], ctype: str) -> bool:
    """The object's ``status.conditions`` hold ``ctype`` with status "True" (a raw object: a child as read, or an
    RLJob's body before it is parsed)."""
    conditions = (obj.get("status") or {}).get("conditions") or []
    return any(c.get("type") == ctype and c.get("status") == "True" for c in conditions)
