"""Spec hashes: which edits restart which component.

Each hash covers only the *spec fields* a component's pods depend on, never the rendered manifest:
a new operator version that renders a template slightly differently keeps the same hash, so an
operator upgrade never rolls pods (KubeRay's ``ray.io/kuberay-version`` lesson). The reconciler
rewrites a pod template only when its hash annotation differs.

- engine hash: model, replay mode (route capture), every inference field except ``replicas``
  (scaling is not a restart), and the routing claim name;
- trainer hash: everything the runtime driver reads at start except inference and runPolicy, so an
  engine-only edit (image tag, parallelism) never restarts the trainer and vice versa.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from r3operator.api.v1alpha1 import RLJobSpec

HASH_LENGTH = 16


def digest(payload: Any) -> str:
    """A short stable hash of a JSON-able payload."""
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:HASH_LENGTH]


def _dump(model: Any) -> Any:
    # Fields at their default are left out: a field added to the API later (with a default that keeps
    # today's behaviour) then changes no existing job's hash, so an operator upgrade restarts nothing.
    return model.model_dump(mode="json", by_alias=True, exclude_defaults=True) if model is not None else None


def _model(spec: RLJobSpec) -> dict[str, Any]:
    return dict(_dump(spec.model))


def _job_template(spec: RLJobSpec) -> dict[str, Any]:
    """spec.podTemplate shapes every pod, so it joins both hashes (only when set: see _dump)."""
    return {"podTemplate": _dump(spec.pod_template)} if spec.pod_template is not None else {}


def engine_hash_input(spec: RLJobSpec) -> dict[str, Any]:
    inference = _dump(spec.inference)
    inference.pop("replicas", None)
    return {
        "model": _model(spec),
        "replayMode": spec.routing_replay.mode.value,
        "inference": inference,
        "existingClaim": spec.storage.existing_claim,
        **_job_template(spec),
    }


def trainer_hash_input(spec: RLJobSpec) -> dict[str, Any]:
    # Only what the driver reads; size/class/retainPolicy concern the PVC, not how the trainer runs.
    storage = {"existingClaim": spec.storage.existing_claim, "retentionSteps": spec.storage.retention_steps}
    return {
        "model": _model(spec),
        "routingReplay": _dump(spec.routing_replay),
        "trainer": _dump(spec.trainer),
        "rollout": _dump(spec.rollout),
        "algorithm": _dump(spec.algorithm),
        "task": _dump(spec.task),
        "weightSync": _dump(spec.weight_sync),
        "checkpoint": _dump(spec.checkpoint),
        "storage": storage,
        "monitoring": _dump(spec.monitoring),
        "seed": spec.seed,
        **_job_template(spec),
        # Only when set: a job without an export keeps the hash it had before there were exports.
        **({"export": _dump(spec.export)} if spec.export is not None else {}),
    }


def engine_spec_hash(spec: RLJobSpec) -> str:
    return digest(engine_hash_input(spec))


def trainer_spec_hash(spec: RLJobSpec) -> str:
    return digest(trainer_hash_input(spec))


def model_fetch_hash(spec: RLJobSpec) -> str:
    """What the model-fetch Job fetches: a change re-creates the Job (a Job's template is immutable). Not the
    trainer image it runs in: a new trainer image changes nothing about the cached model, and re-fetching
    would stop the engines while the trainer's own upgrade is canaried."""
    model = spec.model
    fetched = {
        "uri": model.uri,
        "revision": model.revision,
        "tokenSecretRef": _dump(model.token_secret_ref),
        "s3": _dump(model.s3),
        "cache": _dump(model.cache),
    }
    if model.gcs is not None:  # only when set: the hash of every job without it stays as it was
        fetched["gcs"] = _dump(model.gcs)
    return digest(fetched)
