"""The Kueue ``Workload`` of a queued RLJob (``spec.queueName``): engines and trainer as one unit.

Kueue admits a Workload whole or not at all, so one Workload with a pod set per role makes the RLJob
gang-admitted: the engine pods (``inference.replicas`` × pods per replica: for a LeaderWorkerSet a set of
leaders and a set of workers), the Ray head and the Ray workers. The pod sets carry the same pod templates
the engines and the RayJob get, so Kueue sees the GPUs, node selectors and tolerations the pods will have
and assigns flavors that fit them.

The operator is the Workload's job controller (docs/operator.md, "Queueing with Kueue"): it keeps
engines at 0 and the RayJob suspended until Kueue admits, stops them when Kueue evicts, and then
hands the quota back (operator/admission.py). Kueue's own integrations are not involved: the
StatefulSet (LeaderWorkerSet) and the RayJob carry no queue label.

Pod sets are immutable while quota is reserved, so a changed pod set (another replica count, another
GPU count) re-creates the Workload: the job is queued again as a whole. The spec-hash annotation
covers what Kueue reads of the pod sets (counts, resources, scheduling constraints, priority).
"""

from __future__ import annotations

from typing import Any

from r3operator.api.disaggregation import role_replicas, roles
from r3operator.api.engine_layout import engine_layout
from r3operator.api.enums import EngineRole
from r3operator.api.v1alpha1 import RLJob
from r3operator.operator import meta
from r3operator.operator.builders.engine import build_engine_statefulset
from r3operator.operator.builders.engine_lws import build_engine_leader_worker_set, leader_worker_templates
from r3operator.operator.builders.trainer import build_ray_job
from r3operator.operator.hashing import digest

KUEUE_API_VERSION = "kueue.x-k8s.io/v1beta1"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_CLASS_SOURCE = "scheduling.k8s.io/priorityclass"
POD_SET_ENGINE = "engine"
POD_SET_PREFILL = "prefill"
POD_SET_ENGINE_LEADERS = "engine-leaders"
POD_SET_ENGINE_WORKERS = "engine-workers"
POD_SET_HEAD = "trainer-head"
POD_SET_WORKERS = "trainer-workers"

_SCHEDULING_KEYS = ("nodeSelector", "tolerations", "affinity", "topologySpreadConstraints", "priorityClassName")


def _engine_sets(job: RLJob) -> list[tuple[str, int, dict[str, Any]]]:
    """One pod set of the StatefulSet's pods, or, for a LeaderWorkerSet, one of the leaders (a pod per
    replica) and one of the workers (``podsPerReplica - 1`` per replica): their templates differ. A disaggregated
    job: one pod set per role's StatefulSet (``prefill``, and the decode role as ``engine``)."""
    if roles(job.spec):
        return [
            (
                POD_SET_PREFILL if role is EngineRole.PREFILL else POD_SET_ENGINE,
                role_replicas(job.spec, role),
                build_engine_statefulset(job, replicas=role_replicas(job.spec, role), role=role)["spec"]["template"],
            )
            for role in roles(job.spec)
        ]
    replicas = job.spec.inference.replicas
    layout = engine_layout(job.spec)
    if not layout.multi_pod:
        template = build_engine_statefulset(job, replicas=replicas)["spec"]["template"]
        return [(POD_SET_ENGINE, replicas, template)]
    leader, worker = leader_worker_templates(build_engine_leader_worker_set(job, replicas=replicas))
    return [
        (POD_SET_ENGINE_LEADERS, replicas, leader),
        (POD_SET_ENGINE_WORKERS, replicas * (layout.pods_per_replica - 1), worker),
    ]


def pod_sets(job: RLJob) -> list[dict[str, Any]]:
    """The job's pods by role, at full size (whatever the suspend state of the children)."""
    cluster = build_ray_job(job, suspend=True)["spec"]["rayClusterSpec"]
    [workers] = cluster["workerGroupSpecs"]
    sets = [
        *_engine_sets(job),
        (POD_SET_HEAD, 1, cluster["headGroupSpec"]["template"]),
        (POD_SET_WORKERS, workers["replicas"], workers["template"]),
    ]
    return [{"name": name, "count": count, "template": template} for name, count, template in sets if count > 0]


def _admission_view(sets: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What Kueue reads of the pod sets: counts, per-container resources and where the pods may run."""
    view = []
    for pod_set in sets:
        spec = pod_set["template"]["spec"]
        containers = [c.get("resources", {}) for c in [*spec.get("initContainers", []), *spec["containers"]]]
        scheduling = {k: spec[k] for k in _SCHEDULING_KEYS if k in spec}
        view.append({"name": pod_set["name"], "count": pod_set["count"], "resources": containers, **scheduling})
    return view


def build_workload(job: RLJob, *, priority: int | None) -> dict[str, Any]:
    """``priority``: the value of the pods' PriorityClass, when one is named (read by the reconciler)."""
    assert job.spec.queue_name is not None
    sets = pod_sets(job)
    spec: dict[str, Any] = {"queueName": job.spec.queue_name, "podSets": sets}
    priority_class = _priority_class(sets)
    if priority_class is not None and priority is not None:
        spec |= {
            "priorityClassName": priority_class,
            "priorityClassSource": PRIORITY_CLASS_SOURCE,
            "priority": priority,
        }
    hashed = {"queueName": job.spec.queue_name, "podSets": _admission_view(sets), "priority": priority}
    metadata = meta.object_meta(job, meta.ROLE_WORKLOAD, annotations={meta.ANNOTATION_SPEC_HASH: digest(hashed)})
    metadata["labels"][QUEUE_LABEL] = job.spec.queue_name
    return {"apiVersion": KUEUE_API_VERSION, "kind": "Workload", "metadata": metadata, "spec": spec}


def _priority_class(sets: list[dict[str, Any]]) -> str | None:
    """The PriorityClass of the job: the engines' (they hold most GPUs), else the trainer's."""
    for pod_set in sets:
        name = pod_set["template"]["spec"].get("priorityClassName")
        if name:
            return str(name)
    return None


def priority_class_name(job: RLJob) -> str | None:
    return _priority_class(pod_sets(job)) if job.spec.queue_name is not None else None
