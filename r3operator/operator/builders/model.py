"""The model volume of engine and trainer pods, from ``api.vllm_args.model_source`` (one resolver for both).

- ``hf://`` and ``s3://``: the model cache claim (builders/model_cache.py), filled once by the model-fetch
  Job before any engine or trainer pod exists, mounted read-only at MODEL_MOUNT; an init container in the
  pod's own image verifies the copy (ready marker, file sizes) before the main container starts;
- ``pvc://claim/path``: the claim, mounted read-only at MODEL_MOUNT;
- any other scheme: nothing to mount.

The trainer's main container also gets ``R3OPERATOR_MODEL_DIR`` (builders/trainer.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from r3operator.api.v1alpha1 import RLJob
from r3operator.api.vllm_args import model_source
from r3operator.operator.builders.model_cache import model_cache_claim_name, verify_container
from r3operator.settings import MODEL_MOUNT

MODEL_VOLUME = "model"


@dataclass(frozen=True, slots=True)
class ModelMount:
    volumes: list[dict[str, Any]] = field(default_factory=list)
    mounts: list[dict[str, Any]] = field(default_factory=list)
    """For the main container: read-only."""
    init_containers: list[dict[str, Any]] = field(default_factory=list)


def model_mount(job: RLJob, *, image: str) -> ModelMount:
    """``image``: the pod's main image, which runs the verify step."""
    source = model_source(job.spec)
    read_only = [{"name": MODEL_VOLUME, "mountPath": MODEL_MOUNT, "readOnly": True}]
    if source.claim is not None:
        volume = {"name": MODEL_VOLUME, "persistentVolumeClaim": {"claimName": source.claim, "readOnly": True}}
        return ModelMount(volumes=[volume], mounts=read_only)
    if source.fetched:
        claim = {"claimName": model_cache_claim_name(job), "readOnly": True}
        return ModelMount(
            volumes=[{"name": MODEL_VOLUME, "persistentVolumeClaim": claim}],
            mounts=read_only,
            init_containers=[verify_container(job, image)],
        )
    return ModelMount()
