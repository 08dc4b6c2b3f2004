"""The trainer: a KubeRay ``RayJob`` (ray.io/v1) whose entrypoint is the r3operator runtime driver.

The head pod is trainer node 0 (it gets ``gpusPerNode`` GPUs and runs the driver); the worker group
has ``nodes - 1`` replicas. Every pod runs as the ServiceAccount ``<job>-trainer`` or the one a pod
template names (builders/trainer_rbac.py) and mounts the routing volume and the runtime config. ``spec.suspend``
mirrors ``runPolicy.suspend``; the spec hash annotation tells the reconciler when the trainer spec
changed (KubeRay fixes a RayJob's cluster per run, so a changed trainer is re-created, not patched).
"""

from __future__ import annotations

from typing import Any

from r3operator.api.v1alpha1 import RLJob
from r3operator.api.vllm_args import model_source
from r3operator.operator import meta
from r3operator.operator.builders.dataset import dataset_mount
from r3operator.operator.builders.export import export_mount
from r3operator.operator.builders.model import model_mount
from r3operator.operator.builders.overrides import apply_template, role_template
from r3operator.operator.builders.security import TRAINER_UID, container_security_context, pod_security_context
from r3operator.operator.builders.trainer_rbac import trainer_service_account_name
from r3operator.operator.hashing import trainer_spec_hash
from r3operator.settings import CONFIG_DIR, CONFIG_PATH, ROUTING_MOUNT, RuntimeSettings

RAY_API_VERSION = "ray.io/v1"
RAY_VERSION = "2.60.0"
"""The Ray the trainer image ships (images/trainer/Dockerfile ``RAY_VERSION``; a test pins them equal).
KubeRay (v1.6) injects httpGet probes on the dashboard agent's ``/api/healthz`` for Ray >= 2.53 and
``wget`` exec probes otherwise, and an unset ``rayVersion`` counts as otherwise; the slim trainer image
has no wget, so without this every trainer pod would fail its probes."""
ENTRYPOINT = f"r3operator run --config {CONFIG_PATH}"
WORKER_GROUP = "trainer"


def _resources(job: RLJob) -> dict[str, Any]:
    t = job.spec.trainer
    gpus = str(t.gpus_per_node)
    requests: dict[str, str] = {"nvidia.com/gpu": gpus}
    limits: dict[str, str] = {"nvidia.com/gpu": gpus}
    if t.resources.cpu:
        requests["cpu"] = t.resources.cpu
    if t.resources.memory:
        requests["memory"] = t.resources.memory
        limits["memory"] = t.resources.memory
    return {"requests": requests, "limits": limits}


RAY_HEAD_PORTS: tuple[dict[str, Any], ...] = (
    {"name": "gcs-server", "containerPort": 6379},
    {"name": "dashboard", "containerPort": 8265},
    {"name": "client", "containerPort": 10001},
    # Ray's own metrics export; KubeRay's head Service and its Prometheus guides select it by this name.
    {"name": "metrics", "containerPort": 8080},
)
DRIVER_METRICS_PORT_NAME = "r3-metrics"
"""The trainer driver's port (spec.monitoring.port): not `metrics`, which is Ray's own on a KubeRay head."""


def trainer_pod_template(job: RLJob, container_name: str, *, head: bool) -> dict[str, Any]:
    env = [
        # The driver merge-patches status.progress of this RLJob (runtime.metrics.StatusPusher).
        {"name": RuntimeSettings.env_name("rljob_name"), "value": job.metadata.name},
        {"name": RuntimeSettings.env_name("rljob_namespace"), "value": job.metadata.namespace or "default"},
    ]
    model = model_mount(job, image=job.spec.trainer.image)
    data = dataset_mount(job, image=job.spec.trainer.image, head=head)
    export = export_mount(job, head=head)
    env += export.env
    init_containers = model.init_containers + data.init_containers
    if model.volumes:
        env.append({"name": RuntimeSettings.env_name("model_dir"), "value": model_source(job.spec).directory})
    # KubeRay adds Ray's ports only to a head container that declares none; ours declares the driver's
    # metrics port, so it must also name Ray's own: without `dashboard` KubeRay cannot find the job-submission
    # endpoint and the RayJob never leaves Initializing ("dashboard port is not found").
    driver_port = {"name": DRIVER_METRICS_PORT_NAME, "containerPort": job.spec.monitoring.port}
    ports = [*map(dict, RAY_HEAD_PORTS), driver_port] if head else []
    container: dict[str, Any] = {
        "name": container_name,
        "image": job.spec.trainer.image,
        "env": env,
        "resources": _resources(job),
        "volumeMounts": [
            {"name": "routing", "mountPath": ROUTING_MOUNT},
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "dshm", "mountPath": "/dev/shm"},
            *model.mounts,
            *data.mounts,
            *export.mounts,
        ],
        "securityContext": container_security_context(),
    }
    if ports:
        container["ports"] = ports
    pod = {
        "metadata": {"labels": meta.labels(job, meta.ROLE_TRAINER)},
        "spec": {
            # <job>-trainer may patch this RLJob's status, and no other RLJob's (builders/trainer_rbac.py).
            "serviceAccountName": trainer_service_account_name(job),
            "securityContext": pod_security_context(TRAINER_UID),
            **({"initContainers": init_containers} if init_containers else {}),
            "containers": [container],
            "tolerations": [dict(t) for t in meta.GPU_TOLERATIONS],
            "volumes": [
                {"name": "routing", "persistentVolumeClaim": {"claimName": meta.routing_claim_name(job)}},
                {"name": "config", "configMap": {"name": meta.child_name(job, meta.ROLE_CONFIG)}},
                {"name": "dshm", "emptyDir": {"medium": "Memory"}},
                *model.volumes,
                *data.volumes,
                *export.volumes,
            ],
        },
    }
    return apply_template(pod, container_name, role_template(job, meta.ROLE_TRAINER))


def build_ray_job(job: RLJob, *, suspend: bool) -> dict[str, Any]:
    t, run = job.spec.trainer, job.spec.run_policy
    workers = t.nodes - 1
    spec: dict[str, Any] = {
        "entrypoint": ENTRYPOINT,
        "suspend": suspend,
        "shutdownAfterJobFinishes": True,
        "backoffLimit": run.backoff_limit,
        "rayClusterSpec": {
            "rayVersion": RAY_VERSION,
            "headGroupSpec": {
                "rayStartParams": {"dashboard-host": "0.0.0.0", "num-gpus": str(t.gpus_per_node)},
                "template": trainer_pod_template(job, "ray-head", head=True),
            },
            "workerGroupSpecs": [
                {
                    "groupName": WORKER_GROUP,
                    "replicas": workers,
                    "minReplicas": workers,
                    "maxReplicas": workers,
                    "rayStartParams": {"num-gpus": str(t.gpus_per_node)},
                    "template": trainer_pod_template(job, "ray-worker", head=False),
                }
            ],
        },
    }
    if run.active_deadline_seconds is not None:
        spec["activeDeadlineSeconds"] = run.active_deadline_seconds
    return {
        "apiVersion": RAY_API_VERSION,
        "kind": "RayJob",
        "metadata": meta.object_meta(
            job,
            meta.ROLE_TRAINER,
            # The image this RayJob is rendered with is the one the trainer is known good on (upgrade.py).
            annotations={
                meta.ANNOTATION_SPEC_HASH: trainer_spec_hash(job.spec),
                meta.ANNOTATION_VERIFIED_IMAGE: t.image,
            },
        ),
        "spec": spec,
    }
