"""The scheduling picture of an RLJob (``r3operator explain``): what each role asks of the cluster.

Read from the pod templates the builders render (the Workload's pod sets), not recomputed from the spec,
so that what is shown is what the operator would apply: per role the pods and their GPUs, the node
selectors, tolerations, affinity, priority, identity and pull secrets in force (pod templates merged),
then the queue and the model source.
Pure: no cluster access (a PriorityClass or Secret that does not exist is the reconciler's to report).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from r3operator.api.engine_layout import LWS_CRD, engine_layout
from r3operator.api.v1alpha1 import RLJob
from r3operator.api.vllm_args import model_source
from r3operator.operator import meta
from r3operator.operator.builders.model_cache import (
    cache_spec,
    held_one_at_a_time,
    model_cache_claim_name,
    shares_model_cache,
    store,
)
from r3operator.operator.builders.workload import (
    POD_SET_ENGINE,
    POD_SET_ENGINE_LEADERS,
    POD_SET_ENGINE_WORKERS,
    POD_SET_HEAD,
    POD_SET_WORKERS,
    pod_sets,
)

GPU = "nvidia.com/gpu"


@dataclass(frozen=True, slots=True)
class RolePicture:
    role: str
    """engines, trainer head, trainer workers."""
    pods: int
    gpus_per_pod: int
    node_selector: str
    tolerations: str
    affinity: str
    priority_class: str
    service_account: str
    image_pull_secrets: str


@dataclass(frozen=True, slots=True)
class SchedulingPicture:
    roles: tuple[RolePicture, ...]
    queue: str
    model: str
    engines: str
    """The engines' workload: a StatefulSet of one pod per replica, or a LeaderWorkerSet's groups."""

    @property
    def gpus(self) -> int:
        return sum(r.pods * r.gpus_per_pod for r in self.roles)


def _toleration(t: dict[str, Any]) -> str:
    key = t.get("key") or "*"
    value = f"={t['value']}" if t.get("value") else ""
    effect = t.get("effect") or "any effect"
    return f"{key}{value}:{effect} ({t.get('operator', 'Equal')})"


def _affinity(affinity: dict[str, Any] | None, spread: list[dict[str, Any]]) -> str:
    parts = []
    for kind in ("nodeAffinity", "podAffinity", "podAntiAffinity"):
        block = (affinity or {}).get(kind) or {}
        required = block.get("requiredDuringSchedulingIgnoredDuringExecution")
        preferred = block.get("preferredDuringSchedulingIgnoredDuringExecution") or []
        count = len(required.get("nodeSelectorTerms", [])) if isinstance(required, dict) else len(required or [])
        if count or preferred:
            parts.append(f"{kind}: {count} required, {len(preferred)} preferred term(s)")
    parts += [f"spread over {s['topologyKey']} (maxSkew {s['maxSkew']}, {s['whenUnsatisfiable']})" for s in spread]
    return "; ".join(parts) or "none"


def _role(name: str, count: int, template: dict[str, Any]) -> RolePicture:
    spec = template["spec"]
    container = spec["containers"][0]
    selector = spec.get("nodeSelector") or {}
    return RolePicture(
        role=name,
        pods=count,
        gpus_per_pod=int(container["resources"]["limits"].get(GPU, 0)),
        node_selector=", ".join(f"{k}={v}" for k, v in selector.items()) or "none (any node)",
        tolerations=", ".join(_toleration(t) for t in spec.get("tolerations") or []) or "none",
        affinity=_affinity(spec.get("affinity"), spec.get("topologySpreadConstraints") or []),
        priority_class=spec.get("priorityClassName") or "none (the cluster default)",
        service_account=spec.get("serviceAccountName") or "default",
        image_pull_secrets=", ".join(s["name"] for s in spec.get("imagePullSecrets") or []) or "none",
    )


_ROLE_NAMES = {
    POD_SET_ENGINE: "engines",
    POD_SET_ENGINE_LEADERS: "engine leaders",
    POD_SET_ENGINE_WORKERS: "engine workers",
    POD_SET_HEAD: "trainer head",
    POD_SET_WORKERS: "trainer workers",
}


def _model(job: RLJob) -> str:
    model = job.spec.model
    source = model_source(job.spec)
    revision = f" @ {model.revision}" if model.revision else " (revision not pinned)"
    if source.claim is not None:
        return f"{model.uri}: PersistentVolumeClaim {source.claim} mounted read-only, model at {source.directory}"
    if source.fetched:
        credentials = "no token"
        if model.token_secret_ref is not None:
            credentials = f"token from Secret {model.token_secret_ref.name} key {model.token_secret_ref.key}"
        access = store(model.uri, model.s3, model.gcs)
        if access is not None:
            credentials = f"credentials from Secret {access.credentials_secret}"
        claim = f"per-job claim {model_cache_claim_name(job)}"
        if cache_spec(job).claim_name:
            claim = f"shared claim {model_cache_claim_name(job)}"
        elif shares_model_cache(job):
            claim = f"claim {model_cache_claim_name(job)} (kept, shared by source and revision)"
            if held_one_at_a_time(job):
                claim = (
                    f"claim {model_cache_claim_name(job)} (kept, reused by source and revision; ReadWriteOnce: "
                    "one RLJob at a time, the next waits)"
                )
        how = f"fetched once by Job {meta.child_name(job, meta.ROLE_MODEL_FETCH)} into the model cache"
        return f"{model.uri}{revision}: {how} ({credentials}); {claim} mounted read-only at {source.directory}"
    return f"{model.uri}: {source.directory}"


def scheduling_picture(job: RLJob) -> SchedulingPicture:
    sets = pod_sets(job)
    roles = tuple(_role(_ROLE_NAMES[s["name"]], s["count"], s["template"]) for s in sets)
    total = sum(r.pods * r.gpus_per_pod for r in roles)
    if job.spec.queue_name is None:
        queue = "none: no spec.queueName, engine and trainer pods are created at once"
    else:
        counts = ", ".join(f"{s['name']} x{s['count']}" for s in sets)
        name = meta.child_name(job, meta.ROLE_WORKLOAD)
        queue = (
            f"LocalQueue {job.spec.queue_name}: Kueue Workload {name} ({counts}; {total} GPUs) admitted as one "
            "unit; engines at 0 and the RayJob suspended until then"
        )
    return SchedulingPicture(roles, queue, _model(job), _engines(job))


def _engines(job: RLJob) -> str:
    layout = engine_layout(job.spec)
    name = meta.child_name(job, meta.ROLE_ENGINE)
    replicas = job.spec.inference.replicas
    if not layout.multi_pod:
        return f"StatefulSet {name}: {replicas} replica(s) of 1 pod x {layout.gpus_per_pod} GPU"
    workers = layout.pods_per_replica - 1
    return (
        f"LeaderWorkerSet {name}: {replicas} replica(s) of {layout.pods_per_replica} pods x {layout.gpus_per_pod} "
        f"GPU = {layout.pods_per_replica * layout.gpus_per_pod} GPU each (1 leader serving the API + {workers} "
        f"--headless worker(s), {layout.dp_local} DP rank(s) per pod); the cluster must serve {LWS_CRD}"
    )
