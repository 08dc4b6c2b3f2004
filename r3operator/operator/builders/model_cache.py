"""The model cache: hf://, s3:// and gs:// models are fetched ONCE into a claim that every engine and trainer pod
then mounts read-only, instead of each pod downloading its own copy.

- the claim: ``model.cache.claimName`` (the user's, shared by RLJobs), or one created here: with
  ``retainPolicy: Retain`` (the default) ``model-cache-<hash of source and revision>`` (``…-rwo`` for
  ``accessMode: ReadWriteOnce``), kept and reused by every RLJob of the namespace that fetches the same model
  (see ``build_model_cache_claim``): a ReadWriteMany one by all at once, a ReadWriteOnce one by one RLJob at a
  time (operator/model_cache_hold.py: the next waits, ``ModelCacheHeld``); with ``Delete``
  ``<job>-model-cache``, this RLJob's own;
- the fill: the Job ``<job>-model-fetch``, one pod running ``r3operator fetch <uri> MODEL_MOUNT`` in the
  trainer image (it ships huggingface_hub and boto3) with the claim mounted read-write. The fetch writes
  a complete copy with a ready marker or nothing (runtime/fetch.py); a copy already in a shared claim is
  verified and not fetched again;
- the gate: until that Job has completed, desired() keeps the engines at 0 replicas and the RayJob
  suspended, so no engine or trainer pod exists while the cache fills, and none ever downloads;
- the readers: each engine and trainer pod first runs ``r3operator fetch --verify`` (its own image,
  the claim read-only), which refuses a copy whose marker or file sizes do not check out.

Credentials reach only the fetch container, as ``valueFrom.secretKeyRef`` env (HF_TOKEN, AWS_*): nothing the
operator writes (ConfigMap, status, Events, logs) holds one.

The fetch pod runs the trainer image, so it gets the trainer's effective pod template (``trainer.podTemplate``
over ``spec.podTemplate``, builders/overrides.py): imagePullSecrets to pull that image, nodeSelector,
tolerations and affinity to land on the node pool of the pods that read the cache (a zonal claim binds in
the zone of its first pod, which is this one), priorityClassName, labels, annotations, serviceAccountName
(workload identity for the store), securityContext, env (a proxy, ``HF_ENDPOINT``, a CA bundle) and extra
volumes with their mounts. Precedence, highest first: what the fetch derives (its command, the model volume,
its own env: a template variable of the same name is dropped, so ``model.s3``/``model.tokenSecretRef`` win),
then the template, then the defaults (restricted securityContext, the ``nvidia.com/gpu`` toleration the
trainer pods have). Not the template's ``resources``: those size a training pod, the fetch has its own.

Kueue: the Job is created suspended and runs only while the job's Workload is admitted (and
``runPolicy.suspend`` is false); on eviction it is suspended again, its pod deleted, before the quota is
released (operator/admission.py). It is not a pod set: it runs before any engine or trainer pod exists,
inside the reservation made for them, and a pod set of its own would hold its CPU for the job's whole life.
"""

from __future__ import annotations

from typing import Any

from r3operator.api.enums import AccessMode, RetainPolicy
from r3operator.api.pods import PodTemplate
from r3operator.api.sources import DEFAULT_HF_REVISION, parse_source_uri
from r3operator.api.v1alpha1 import GCSAccess, ModelCacheSpec, RLJob, S3Access, SecretKeyRef
from r3operator.api.vllm_args import model_source
from r3operator.operator import meta
from r3operator.operator.builders.overrides import apply_template, role_template
from r3operator.operator.builders.security import TRAINER_UID, container_security_context, pod_security_context
from r3operator.operator.hashing import digest, model_fetch_hash
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


SHARED_CLAIM_PREFIX = "model-cache-"
"""A shared model cache claim is ``model-cache-<model_cache_key>``: no RLJob child is named so (theirs end in a
role suffix), and two RLJobs of the same model applied at once both name, so create or find, this one claim."""


def shares_model_cache(job: RLJob) -> bool:
    """The created claim is kept (``Retain``) and named by source and revision, so the next RLJob of that model
    finds the copy. ReadWriteMany: every RLJob of the model mounts it at once. ReadWriteOnce mounts on one node,
    so the pods of two RLJobs on different nodes could not both use it: ``held_one_at_a_time``."""
    cache = cache_spec(job)
    return uses_model_cache(job) and not cache.claim_name and cache.retain_policy is RetainPolicy.RETAIN


def held_one_at_a_time(job: RLJob) -> bool:
    """A kept ReadWriteOnce cache: one live RLJob at a time mounts it (its holder, operator/model_cache_hold.py)."""
    return shares_model_cache(job) and cache_spec(job).access_mode is AccessMode.READ_WRITE_ONCE


def model_cache_key(job: RLJob) -> str:
    """What the copy in the cache is: its directory (runtime/fetch.py's, which names the source and the revision,
    ``main`` when unpinned) and, for an object store, the endpoint that serves the bucket. Not the credentials,
    the size or the class: the same files, reached with another token, are the same copy."""
    model = job.spec.model
    access = store(model.uri, model.s3, model.gcs)
    return digest({"source": model_source(job.spec).source.cache_key, "endpoint": access and access.endpoint_url})


def own_claim_name(job: RLJob) -> str:
    """``<job>-model-cache``: the claim of this RLJob alone (ReadWriteOnce, ``Delete``, or made by an operator
    from before shared caches)."""
    return meta.child_name(job, meta.ROLE_MODEL_CACHE)


def model_cache_claim_name(job: RLJob) -> str:
    if cache_spec(job).claim_name:
        return str(cache_spec(job).claim_name)
    if shares_model_cache(job):
        return shared_claim_name(job)
    return own_claim_name(job)


def shared_claim_name(job: RLJob) -> str:
    """``model-cache-<key>``; ``model-cache-<key>-rwo`` for a ReadWriteOnce one: the access mode of a claim is
    fixed, and an RLJob that asked for ReadWriteMany must not wait for (or get) a one-node claim."""
    suffix = "-rwo" if cache_spec(job).access_mode is AccessMode.READ_WRITE_ONCE else ""
    return SHARED_CLAIM_PREFIX + model_cache_key(job) + suffix


def build_model_cache_claim(job: RLJob, *, own: bool = False) -> dict[str, Any] | None:
    """The model cache claim to create, or None when the model is not fetched or the user names a claim.

    Shared (``shares_model_cache``): ``model-cache-<key>`` (``-rwo`` appended for ReadWriteOnce, whose holder
    is recorded apart, operator/model_cache_hold.py), with no ownerReference and nothing of any one RLJob
    in its metadata (the label ``r3operator.io/model-cache: <key>``, ``r3operator.io/job`` empty, the model in
    ``r3operator.io/model-source``),
    so RLJobs of the same model in the namespace all find it by name, none rewrites it, and deleting any of them
    (or its TTL) never deletes it: the garbage collector has no owner to follow, the reconciler prunes only
    names of its own. Their fetch Jobs each verify the copy, and the first one fills it (runtime/fetch.py
    publishes a complete copy with one rename; a concurrent fetch keeps the copy that is there).

    Otherwise (or ``own``: this RLJob already has ``<job>-model-cache``, kept from an operator before shared
    caches) ``<job>-model-cache``. With ``retainPolicy: Retain`` it works as the routing claim
    (builders/storage.py): no ownerReference, the creating RLJob's uid in an annotation, adopted by an RLJob
    applied again under the same name, whose fetch finds the verified copy and downloads nothing.
    """
    cache = cache_spec(job)
    if not uses_model_cache(job) or cache.claim_name:
        return None
    retain = cache.retain_policy is RetainPolicy.RETAIN
    annotations = {meta.ANNOTATION_MODEL_SOURCE: model_source_annotation(job)}
    spec: dict[str, Any] = {
        "accessModes": [cache.access_mode.value],
        "resources": {"requests": {"storage": cache.size}},
    }
    if storage_class := cache_storage_class(job):
        spec["storageClassName"] = storage_class
    if shares_model_cache(job) and not own:
        key = meta.LABEL_MODEL_CACHE
        hashed = model_cache_key(job)
        labels = {k: v for k, v in meta.labels(job, meta.ROLE_MODEL_CACHE).items() if k != "app.kubernetes.io/instance"}
        # r3operator.io/job is there, empty (no one RLJob's): the operator's labelled watch holds the claim, so
        # the passes of the jobs that mount it read it from the cache (operator/informer.py), and it wakes none.
        metadata: dict[str, Any] = {
            "name": shared_claim_name(job),
            "labels": {**labels, meta.LABEL_JOB: "", key: hashed},
            "annotations": annotations,
        }
        if job.metadata.namespace:
            metadata["namespace"] = job.metadata.namespace
        return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": metadata, "spec": spec}
    if retain and job.metadata.uid:
        annotations[meta.ANNOTATION_RETAINED_FROM] = job.metadata.uid
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": meta.object_meta(job, meta.ROLE_MODEL_CACHE, owned=not retain, annotations=annotations),
        "spec": spec,
    }


def model_source_annotation(job: RLJob) -> str:
    """The model a cache claim holds, in one form whatever the spec's spelling: ``hf://org/name@revision`` (``main``
    when unpinned, the copy an unpinned URI fills; ``uri: hf://org/name`` with ``revision: r`` and
    ``hf://org/name@r`` alike), ``s3://bucket/prefix``, ``gs://bucket/prefix``. RLJobs sharing a claim all render
    the same value, so none rewrites it."""
    source = model_source(job.spec).source
    if source.scheme == "hf":
        return f"hf://{source.location}@{source.revision or DEFAULT_HF_REVISION}"
    return f"{source.scheme}://" + "/".join(p for p in (source.location, source.path) if p)


def cache_storage_class(job: RLJob) -> str | None:
    """``model.cache.storageClassName``, else the job's own ``storage.storageClassName`` (the class it chose for its
    volumes), else None: the cluster's default."""
    return cache_spec(job).storage_class_name or job.spec.storage.storage_class_name


def store(uri: str, s3: S3Access | None, gcs: GCSAccess | None) -> S3Access | GCSAccess | None:
    """The spec block of the object store ``uri`` names: ``s3`` for s3://, ``gcs`` for gs:// (whose HMAC key
    the S3 client reads under the same AWS_* names), None otherwise."""
    scheme = parse_source_uri(uri).scheme
    return s3 if scheme == "s3" else gcs if scheme == "gs" else None


def secret_env(token: SecretKeyRef | None, access: S3Access | GCSAccess | None) -> list[dict[str, Any]]:
    """The credentials of one fetch, by reference only."""
    env: list[dict[str, Any]] = []
    if token is not None:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": token.name, "key": token.key}}})
    if access is not None:
        for key in AWS_KEYS:
            env.append({"name": key, "valueFrom": {"secretKeyRef": {"name": access.credentials_secret, "key": key}}})
    if isinstance(access, S3Access):  # temporary AWS credentials; an HMAC key has no session token
        for key in AWS_OPTIONAL_KEYS:
            ref = {"name": access.credentials_secret, "key": key, "optional": True}
            env.append({"name": key, "valueFrom": {"secretKeyRef": ref}})
    return env


def credential_keys(uri: str, s3: S3Access | None, gcs: GCSAccess | None, where: str) -> list[tuple[str, str, str]]:
    """(Secret, key, field) of each required key the fetch of ``uri`` reads (``where``: ``model`` or ``task``):
    what references.py checks before any pod is made."""
    access = store(uri, s3, gcs)
    if access is None:
        return []
    field = f"{where}.{'s3' if isinstance(access, S3Access) else 'gcs'}.credentialsSecret"
    return [(access.credentials_secret, key, field) for key in AWS_KEYS]


def fetch_command(
    uri: str,
    root: str,
    *,
    revision: str | None = None,
    access: S3Access | GCSAccess | None = None,
    verify: bool = False,
) -> list[str]:
    """``r3operator fetch`` (cli/fetch_cmd.py) with what it needs to find the same directory everywhere.
    ``access``: the store's spec block (``store()``); an unset gcs endpoint is Cloud Storage's own."""
    command = ["r3operator", "fetch", uri, root]
    if revision:
        command += ["--revision", revision]
    if verify:
        return [*command, "--verify"]
    if access is not None and access.endpoint_url:
        command += ["--endpoint-url", access.endpoint_url]
    if isinstance(access, S3Access) and access.region:
        command += ["--region", access.region]
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


def fetch_pod_template(job: RLJob, own_env: list[dict[str, Any]]) -> PodTemplate | None:
    """The trainer's effective template as the fetch pod takes it: no ``resources``, no env the fetch sets."""
    template = role_template(job, meta.ROLE_TRAINER)
    if template is None:
        return None
    own = {e["name"] for e in own_env}
    return template.model_copy(update={"resources": None, "env": [e for e in template.env if e.name not in own]})


def fetch_pod_hash(template: PodTemplate | None) -> str:
    """What the fetch pod runs with besides the source: a change replaces a Job that has not completed yet
    (one stuck Pending for want of a toleration or a pull secret), never a completed one."""
    return digest(None if template is None else template.model_dump(mode="json", by_alias=True, exclude_defaults=True))


def build_model_fetch_job(job: RLJob, *, suspend: bool = False) -> dict[str, Any] | None:
    """``<job>-model-fetch``, or None when the model is not fetched. ``suspend``: no pod may run now (not
    admitted by Kueue, or ``runPolicy.suspend``)."""
    if not uses_model_cache(job):
        return None
    model = job.spec.model
    env = [
        {"name": "HF_HOME", "value": HF_HOME},
        {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"},
        *secret_env(model.token_secret_ref, store(model.uri, model.s3, model.gcs)),
    ]
    access = store(model.uri, model.s3, model.gcs)
    container = {
        "name": FETCH_CONTAINER,
        "image": job.spec.trainer.image,
        "command": fetch_command(model.uri, MODEL_MOUNT, revision=model.revision, access=access),
        "env": env,
        "resources": FETCH_RESOURCES,
        "volumeMounts": [{"name": "model", "mountPath": MODEL_MOUNT}],
        "securityContext": container_security_context(),
    }
    pod = {
        "metadata": {"labels": meta.labels(job, meta.ROLE_MODEL_FETCH)},
        "spec": {
            "restartPolicy": "Never",
            # The fetch talks to the Hub or the object store, never to the Kubernetes API.
            "automountServiceAccountToken": False,
            "securityContext": pod_security_context(TRAINER_UID),
            "containers": [container],
            "tolerations": [dict(t) for t in meta.GPU_TOLERATIONS],
            "volumes": [{"name": "model", "persistentVolumeClaim": {"claimName": model_cache_claim_name(job)}}],
        },
    }
    template = fetch_pod_template(job, env)
    annotations = {
        meta.ANNOTATION_SPEC_HASH: model_fetch_hash(job.spec),
        meta.ANNOTATION_POD_HASH: fetch_pod_hash(template),
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta.object_meta(job, meta.ROLE_MODEL_FETCH, annotations=annotations),
        "spec": {
            "backoffLimit": job.spec.run_policy.backoff_limit,
            "suspend": suspend,
            "template": apply_template(pod, FETCH_CONTAINER, template),
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
