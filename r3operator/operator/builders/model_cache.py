"""The model cache: hf:// and s3:// models are fetched ONCE into a claim that every engine and trainer pod
then mounts read-only, instead of each pod downloading its own copy.

- the claim: ``model.cache.claimName`` (the user's, shared by RLJobs) or ``<job>-model-cache`` (created here);
- the fill: the Job ``<job>-model-fetch``, one pod running ``r3operator fetch <uri> MODEL_MOUNT`` in the
  trainer image (it ships huggingface_hub and boto3) with the claim mounted read-write. The fetch writes
  a complete copy with a ready marker or nothing (runtime/fetch.py); a copy already in a shared claim is
  verified and not fetched again;
- the gate: until that Job has completed, desired() keeps the engines at 0 replicas and the RayJob
  suspended, so no engine or trainer pod exists while the cache fills, and none ever downloads;
- the readers: each engine and trainer pod first runs ``r3operator fetch --verify`` (its own image,
  the claim read-only), which refuses a copy whose marker or file sizes do not check out.

Credentials reach only the fetch container, as ``valueFrom.secretKeyRef`` env (HF_TOKEN, AWS_*): the
operator never reads a Secret, and nothing it writes (ConfigMap, status, Events, logs) holds one.
"""

from __future__ import annotations

from typing import Any

from r3operator.api.v1alpha1 import ModelCacheSpec, RLJob, S3Access, SecretKeyRef
from r3operator.engine.args import model_source
from r3operator.operator import meta
from r3operator.operator.builders.security import TRAINER_UID, container_security_context, pod_security_context
from r3operator.operator.hashing import model_fetch_hash
from r3operator.settings import MODEL_MOUNT

FETCH_CONTAINER = "fetch-model"
VERIFY_CONTAINER = "verify-model"
HF_HOME = f"{MODEL_MOUNT}/.hf-home"
"""huggingface_hub's locks and metadata go to the writable cache claim, not the image's (read-only) home."""
AWS_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
AWS_OPTIONAL_KEYS = ("AWS_SESSION_TOKEN",)
FETCH_RESOURCES: dict[str, dict[str, str]] = {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "4Gi"}}
"""One process streaming files to disk; s3transfer's and the Hub client's buffers stay well under 1 GiB."""


def uses_model_cache(job: RLJob) -> bool:
    return model_source(job.spec).fetched


def cache_spec(job: RLJob) -> ModelCacheSpec:
    return job.spec.model.cache or ModelCacheSpec()


def model_cache_claim_name(job: RLJob) -> str:
    return cache_spec(job).claim_name or meta.child_name(job, meta.ROLE_MODEL_CACHE)


def build_model_cache_claim(job: RLJob) -> dict[str, Any] | None:
    """``<job>-model-cache``, or None when the model is not fetched or the user names a shared claim."""
    cache = cache_spec(job)
    if not uses_model_cache(job) or cache.claim_name:
        return None
    spec: dict[str, Any] = {
        "accessModes": [cache.access_mode.value],
        "resources": {"requests": {"storage": cache.size}},
    }
    if cache.storage_class_name:
        spec["storageClassName"] = cache.storage_class_name
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": meta.object_meta(job, meta.ROLE_MODEL_CACHE),
        "spec": spec,
    }


def secret_env(token: SecretKeyRef | None, s3: S3Access | None) -> list[dict[str, Any]]:
    """The credentials of one fetch, by reference only."""
    env: list[dict[str, Any]] = []
    if token is not None:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": token.name, "key": token.key}}})
    if s3 is not None:
        for key in AWS_KEYS:
            env.append({"name": key, "valueFrom": {"secretKeyRef": {"name": s3.credentials_secret, "key": key}}})
        for key in AWS_OPTIONAL_KEYS:
            ref = {"name": s3.credentials_secret, "key": key, "optional": True}
            env.append({"name": key, "valueFrom": {"secretKeyRef": ref}})
    return env


def fetch_command(
    uri: str, root: str, *, revision: str | None = None, s3: S3Access | None = None, verify: bool = False
) -> list[str]:
    """``r3operator fetch`` (cli/fetch_cmd.py) with what it needs to find the same directory everywhere."""
    command = ["r3operator", "fetch", uri, root]
    if revision:
        command += ["--revision", revision]
    if verify:
        return [*command, "--verify"]
    if s3 is not None and s3.endpoint_url:
        command += ["--endpoint-url", s3.endpoint_url]
    if s3 is not None and s3.region:
        command += ["--region", s3.region]
    return command


def verify_container(job: RLJob, image: str) -> dict[str, Any]:
    """An engine's or trainer's first step: the copy in the cache is complete (runs in the pod's own image)."""
    model = job.spec.model
    return {
        "name": VERIFY_CONTAINER,
        "image": image,
        "command": fetch_command(model.uri, MODEL_MOUNT, revision=model.revision, verify=True),
        "volumeMounts": [{"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True}],
        "securityContext": container_security_context(),
    }


def build_model_fetch_job(job: RLJob) -> dict[str, Any] | None:
    """``<job>-model-fetch``, or None when the model is not fetched."""
    if not uses_model_cache(job):
        return None
    model = job.spec.model
    env = [
        {"name": "HF_HOME", "value": HF_HOME},
        {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"},
        *secret_env(model.token_secret_ref, model.s3),
    ]
    container = {
        "name": FETCH_CONTAINER,
        "image": job.spec.trainer.image,
        "command": fetch_command(model.uri, MODEL_MOUNT, revision=model.revision, s3=model.s3),
        "env": env,
        "resources": FETCH_RESOURCES,
        "volumeMounts": [{"name": "model", "mountPath": MODEL_MOUNT}],
        "securityContext": container_security_context(),
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta.object_meta(
            job, meta.ROLE_MODEL_FETCH, annotations={meta.ANNOTATION_SPEC_HASH: model_fetch_hash(job.spec)}
        ),
        "spec": {
            "backoffLimit": job.spec.run_policy.backoff_limit,
            "template": {
                "metadata": {"labels": meta.labels(job, meta.ROLE_MODEL_FETCH)},
                "spec": {
                    "restartPolicy": "Never",
                    # The fetch talks to the Hub or the object store, never to the Kubernetes API.
                    "automountServiceAccountToken": False,
                    "securityContext": pod_security_context(TRAINER_UID),
                    "containers": [container],
                    "volumes": [{"name": "model", "persistentVolumeClaim": {"claimName": model_cache_claim_name(job)}}],
                },
            },
        },
    }


def model_fetch_complete(fetch_job: dict[str, Any] | None) -> bool:
    """The Job reports Complete: the cache holds a verified copy (the fetch exits 0 only then)."""
    conditions = ((fetch_job or {}).get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Complete" and c.get("status") == "True" for c in conditions)


def model_fetch_failed(fetch_job: dict[str, Any] | None) -> str | None:
    """The Job's Failed message (its backoffLimit is spent), or None."""
    for c in ((fetch_job or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == "Failed" and c.get("status") == "True":
            return str(c.get("message") or c.get("reason") or "failed")
    return None
