"""vLLM engines: one headless Service + one StatefulSet (or LeaderWorkerSet) per engine group.

An engine replica is one vLLM server (its own KV cache). A replica that fits one pod (api/engine_layout.py)
is one StatefulSet ordinal; a replica of several pods is one LeaderWorkerSet group (builders/engine_lws.py),
which shares this module's container and pod template. Either way replica ``i`` serves its API from the pod
``<job>-engine-<i>`` (StatefulSet ordinal, LWS leader), reached through the Service's per-pod DNS.
"""

from __future__ import annotations

import math
from typing import Any

from r3operator.api.engine_layout import engine_layout
from r3operator.api.sizing import model_params_billions
from r3operator.api.v1alpha1 import RLJob
from r3operator.api.vllm_args import model_path, vllm_env, vllm_serve_args
from r3operator.operator import meta
from r3operator.operator.builders.model import ModelMount, model_mount
from r3operator.operator.builders.overrides import apply_template, role_template
from r3operator.operator.builders.security import ENGINE_UID, container_security_context, pod_security_context
from r3operator.operator.hashing import engine_spec_hash
from r3operator.settings import CONFIG_DIR, ROUTING_MOUNT

CONTAINER_NAME = "vllm"
DP_RPC_PORT = 13345

# Startup budget heuristic (see docs/operator.md, "Probes"): a fixed 300 s for process start, CUDA
# graph capture and torch.compile warm-up, plus 6 s per GB of bf16 weights (≈170 MB/s, a
# pessimistic read from a network volume or HF cache), capped at 3 h. Unknown size: 900 s.
STARTUP_BASE_S = 300
STARTUP_S_PER_GB = 6
STARTUP_UNKNOWN_S = 900
STARTUP_MAX_S = 3 * 3600
PROBE_PERIOD_S = 10


def startup_budget_seconds(job: RLJob) -> int:
    params = model_params_billions(job.spec.model.uri)
    if params is None:
        return STARTUP_UNKNOWN_S
    weight_gb = params * 2  # bf16
    return int(min(STARTUP_MAX_S, STARTUP_BASE_S + STARTUP_S_PER_GB * weight_gb))


def probes(job: RLJob) -> dict[str, Any]:
    """The probes of a pod that serves the API: a one-pod replica, or the leader of a multi-pod one."""
    health = {"httpGet": {"path": "/health", "port": "http"}}
    return {
        # /health answers only once the engine is up; the startup probe holds liveness off until then.
        "startupProbe": {
            **health,
            "periodSeconds": PROBE_PERIOD_S,
            "timeoutSeconds": 5,
            "failureThreshold": math.ceil(startup_budget_seconds(job) / PROBE_PERIOD_S),
        },
        "readinessProbe": {**health, "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {**health, "periodSeconds": 20, "timeoutSeconds": 10, "failureThreshold": 6},
    }


def gpus_per_pod(job: RLJob) -> int:
    return engine_layout(job.spec).gpus_per_pod


def _resources(job: RLJob) -> dict[str, Any]:
    res = job.spec.inference.resources
    gpus = str(gpus_per_pod(job))
    requests: dict[str, str] = {"nvidia.com/gpu": gpus}
    limits: dict[str, str] = {"nvidia.com/gpu": gpus}
    if res.cpu:
        requests["cpu"] = res.cpu
    if res.memory:
        requests["memory"] = res.memory
        limits["memory"] = res.memory
    return {"requests": requests, "limits": limits}


def _volumes(job: RLJob, model: ModelMount) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    # Engines only read the routing volume (weights for a sync, reference models); the trainer driver
    # writes it. Read-only here keeps an engine from changing data of a claim it shares.
    routing_claim = {"claimName": meta.routing_claim_name(job), "readOnly": True}
    volumes: list[dict[str, Any]] = [
        {"name": "routing", "persistentVolumeClaim": routing_claim},
        {"name": "config", "configMap": {"name": meta.child_name(job, meta.ROLE_CONFIG)}},
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "routing", "mountPath": ROUTING_MOUNT, "readOnly": True},
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    return volumes + model.volumes, mounts + model.mounts


def build_engine_service(job: RLJob) -> dict[str, Any]:
    """Headless: stable per-pod DNS for DP leaders and for the trainer's engine URLs."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta.object_meta(job, meta.ROLE_ENGINE),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": meta.selector_labels(job, meta.ROLE_ENGINE),
            "ports": [{"name": "http", "port": job.spec.inference.port, "targetPort": "http"}],
        },
    }


def _engine_container(
    job: RLJob, model: ModelMount, *, command: list[str], args: list[str] | None, serves_api: bool
) -> dict[str, Any]:
    """The vLLM container; ``serves_api`` False for a ``--headless`` DP follower, which has no HTTP to probe
    (its engine cores exit when they lose the leader, which restarts the container)."""
    inf = job.spec.inference
    _, mounts = _volumes(job, model)
    return {
        "name": CONTAINER_NAME,
        "image": inf.image,
        "command": command,
        **({"args": args} if args else {}),
        "ports": [{"name": "http", "containerPort": inf.port}],
        "env": [{"name": k, "value": v} for k, v in vllm_env(job.spec).items()],
        "resources": _resources(job),
        "volumeMounts": mounts,
        "securityContext": container_security_context(),
        **(probes(job) if serves_api else {}),
    }


def engine_pod_template(
    job: RLJob, *, command: list[str], args: list[str] | None = None, serves_api: bool = True
) -> dict[str, Any]:
    """The engine pod template with the user's pod templates merged (builders/overrides.py)."""
    model = model_mount(job, image=job.spec.inference.image)
    volumes, _ = _volumes(job, model)
    pod: dict[str, Any] = {
        "metadata": {
            "labels": meta.labels(job, meta.ROLE_ENGINE),
            "annotations": {meta.ANNOTATION_SPEC_HASH: engine_spec_hash(job.spec)},
        },
        "spec": {
            # vLLM never calls the Kubernetes API: no token in the engine pods.
            "automountServiceAccountToken": False,
            "securityContext": pod_security_context(ENGINE_UID),
            **({"initContainers": model.init_containers} if model.init_containers else {}),
            "containers": [_engine_container(job, model, command=command, args=args, serves_api=serves_api)],
            "volumes": volumes,
            "tolerations": [dict(t) for t in meta.GPU_TOLERATIONS],
            "terminationGracePeriodSeconds": 60,
        },
    }
    return apply_template(pod, CONTAINER_NAME, role_template(job, meta.ROLE_ENGINE))


def build_engine_statefulset(job: RLJob, *, replicas: int) -> dict[str, Any]:
    """Engines whose replica is one pod: ``replicas`` pods (0 when suspended or finished). A replica of
    several pods is a LeaderWorkerSet group instead (builders/engine_lws.py)."""
    command = vllm_serve_args(job.spec, model_path=model_path(job.spec))
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": meta.object_meta(job, meta.ROLE_ENGINE),
        "spec": {
            "serviceName": meta.child_name(job, meta.ROLE_ENGINE),
            "replicas": replicas,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": meta.selector_labels(job, meta.ROLE_ENGINE)},
            "template": engine_pod_template(job, command=command),
        },
    }
