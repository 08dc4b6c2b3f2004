"""The model volume of engine and trainer pods, from ``engine.args.model_source`` (one resolver for both).

- ``pvc://claim/path``: the claim, mounted read-only at MODEL_MOUNT;
- ``hf://org/name``: an emptyDir at MODEL_MOUNT, filled by an init container that runs the pod's own image
  (vLLM's or the trainer's; both ship huggingface_hub) with ``snapshot_download(org/name, revision=R,
  local_dir=DIR)``, with ``HF_TOKEN`` from ``model.tokenSecretRef`` when it is set. The Python API, not a
  CLI: ``huggingface-cli`` is gone from huggingface_hub 1.x and ``hf`` is missing before 0.34, while
  ``snapshot_download(local_dir=)`` exists in every release either image ships. The pod's own image keeps an
  engine edit from touching trainer pods and the reverse (operator/hashing.py). Every pod downloads its own
  copy: for large models a pre-filled RWX/ROX claim (``pvc://``) saves the traffic and the start-up time;
- any other scheme: nothing to mount.

The main containers mount the volume read-only; the trainer's also get ``R3OPERATOR_MODEL_DIR``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from r3operator.api.v1alpha1 import RLJob
from r3operator.engine.args import model_source
from r3operator.operator.builders.security import container_security_context
from r3operator.settings import MODEL_MOUNT

MODEL_VOLUME = "model"
FETCH_CONTAINER = "fetch-model"
HF_HOME = f"{MODEL_MOUNT}/.hf-home"
"""huggingface_hub's locks and metadata go to the writable emptyDir, not the image's (read-only) home."""


@dataclass(frozen=True, slots=True)
class ModelMount:
    volumes: list[dict[str, Any]] = field(default_factory=list)
    mounts: list[dict[str, Any]] = field(default_factory=list)
    """For the main container: read-only."""
    init_containers: list[dict[str, Any]] = field(default_factory=list)


FETCH_SCRIPT = (
    "import sys; from huggingface_hub import snapshot_download; "
    "snapshot_download(sys.argv[1], revision=sys.argv[2] or None, local_dir=sys.argv[3])"
)


def _fetch_container(job: RLJob, image: str, repo: str, directory: str) -> dict[str, Any]:
    model = job.spec.model
    command = ["python3", "-c", FETCH_SCRIPT, repo, model.revision or "", directory]
    env: list[dict[str, Any]] = [
        {"name": "HF_HOME", "value": HF_HOME},
        {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"},
    ]
    if model.token_secret_ref is not None:
        ref = model.token_secret_ref
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    return {
        "name": FETCH_CONTAINER,
        "image": image,
        "command": command,
        "env": env,
        "volumeMounts": [{"name": MODEL_VOLUME, "mountPath": MODEL_MOUNT}],
        "securityContext": container_security_context(),
    }


def model_mount(job: RLJob, *, image: str) -> ModelMount:
    """``image``: the pod's main image, which runs the download."""
    source = model_source(job.spec)
    read_only = [{"name": MODEL_VOLUME, "mountPath": MODEL_MOUNT, "readOnly": True}]
    if source.claim is not None:
        volume = {"name": MODEL_VOLUME, "persistentVolumeClaim": {"claimName": source.claim, "readOnly": True}}
        return ModelMount(volumes=[volume], mounts=read_only)
    if source.hf_repo is not None:
        return ModelMount(
            volumes=[{"name": MODEL_VOLUME, "emptyDir": {}}],
            mounts=read_only,
            init_containers=[_fetch_container(job, image, source.hf_repo, source.directory)],
        )
    return ModelMount()
