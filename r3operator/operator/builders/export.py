"""spec.export in the trainer's head pod, where the driver writes the exports (runtime/export.py).

- ``pvc://claim/path``: the claim, mounted read-write at EXPORT_MOUNT (the driver writes ``path`` under it);
- ``s3://`` and ``gs://``: the credentials of ``export.s3`` or ``export.gcs``, as secretKeyRef env under names of
  their own (``R3OPERATOR_EXPORT_AWS_*``), so they never mix with the AWS_* a pod template may set for something
  else; nothing the operator writes (ConfigMap, status, Events) holds them;
- ``file://``: a path inside the container (the routing volume, say): nothing to add.

The worker pods get none of it: only the driver exports.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from r3operator.api.sources import parse_source_uri
from r3operator.api.v1alpha1 import RLJob, S3Access
from r3operator.operator.builders.model_cache import AWS_KEYS, AWS_OPTIONAL_KEYS, store
from r3operator.settings import EXPORT_MOUNT, RuntimeSettings

EXPORT_VOLUME = "export"


@dataclass(frozen=True, slots=True)
class ExportMount:
    volumes: list[dict[str, Any]] = field(default_factory=list)
    mounts: list[dict[str, Any]] = field(default_factory=list)
    env: list[dict[str, Any]] = field(default_factory=list)


def export_claim(job: RLJob) -> str | None:
    """The claim a pvc:// export destination names (None for the other schemes or without spec.export)."""
    export = job.spec.export
    if export is None:
        return None
    source = parse_source_uri(export.destination)
    return source.location if source.scheme == "pvc" else None


def export_mount(job: RLJob, *, head: bool) -> ExportMount:
    export = job.spec.export
    if export is None or not head:
        return ExportMount()
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    claim = export_claim(job)
    if claim is not None:
        volumes.append({"name": EXPORT_VOLUME, "persistentVolumeClaim": {"claimName": claim}})
        mounts.append({"name": EXPORT_VOLUME, "mountPath": EXPORT_MOUNT})
    access = store(export.destination, export.s3, export.gcs)
    env: list[dict[str, Any]] = []
    if access is not None:
        keys = [(key, False) for key in AWS_KEYS]
        if isinstance(access, S3Access):  # temporary AWS credentials; an HMAC key has no session token
            keys += [(key, True) for key in AWS_OPTIONAL_KEYS]
        for key, optional in keys:
            ref: dict[str, Any] = {"name": access.credentials_secret, "key": key}
            if optional:
                ref["optional"] = True
            name = RuntimeSettings.env_name(f"export_{key.lower()}")
            env.append({"name": name, "valueFrom": {"secretKeyRef": ref}})
    return ExportMount(volumes=volumes, mounts=mounts, env=env)
