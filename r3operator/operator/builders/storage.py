"""The routing-data PVC shared by engines and trainer (routes, checkpoints, run outputs)."""

from __future__ import annotations

from typing import Any

from r3operator.api.enums import RetainPolicy
from r3operator.api.v1alpha1 import RLJob
from r3operator.operator import meta


def build_routing_claim(job: RLJob) -> dict[str, Any] | None:
    """``<job>-routing``, or None when ``storage.existingClaim`` names a claim the user owns.

    A ``Retain`` claim carries **no ownerReference**: the garbage collector would otherwise delete it
    with the RLJob no matter what the operator does (and the operator may be down at that moment).
    It records the creating RLJob's uid in an annotation instead, and an RLJob re-created under the
    same name adopts it again (same deterministic name, same labels).
    """
    storage = job.spec.storage
    if storage.existing_claim:
        return None
    retain = storage.retain_policy is RetainPolicy.RETAIN
    annotations = {meta.ANNOTATION_RETAINED_FROM: job.metadata.uid} if retain and job.metadata.uid else None
    spec: dict[str, Any] = {
        "accessModes": [storage.access_mode.value],
        "resources": {"requests": {"storage": storage.size}},
    }
    if storage.storage_class_name:
        spec["storageClassName"] = storage.storage_class_name
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": meta.object_meta(job, meta.ROLE_STORAGE, owned=not retain, annotations=annotations),
        "spec": spec,
    }
