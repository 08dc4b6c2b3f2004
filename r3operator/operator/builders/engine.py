"""vLLM engines: one headless Service + one StatefulSet (or LeaderWorkerSet) per engine group.

A disaggregated job (`spec.inference.disaggregation`) has two groups: the decode engines under the names above and
the prefill engines as `<job>-prefill` (Service and StatefulSet, one pod per replica), each rendered from the
role's spec (api/disaggregation.py) with its `--kv-transfer-config`. NixlConnector's prefill pods advertise their
pod IP on the side-channel port (the decode engines' handshake); R3StorageConnector's engines mount the routing
volume's `kv-transfer` folder writable (the prefill engine writes a transfer there, the decode engine deletes it).

An engine replica is one vLLM server (its own KV cache). A replica that fits one pod (api/engine_layout.py)
is one StatefulSet ordinal; a replica of several pods is one LeaderWorkerSet group (builders/engine_lws.py),
which shares this module's container and pod template. Either way replica ``i`` serves its API from the pod
``<job>-engine-<i>`` (StatefulSet ordinal, LWS leader), reached through the Service's per-pod DNS.
"""

from __future__ import annotations

import math
from typing import Any

from r3operator.api.disaggregation import (
    NIXL_PORT_ENV,
    NIXL_SIDE_CHANNEL_PORT,
    STORAGE_SUBDIR,
    engine_role_name,
    role_spec,
    storage_path,
)
from r3operator.api.engine_layout import engine_layout
from r3operator.api.enums import EngineRole, PDConnector
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
KV_TRANSFER_VOLUME = "kv-transfer"
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


def role_job(job: RLJob, role: EngineRole) -> RLJob:
    """The job as one role's engines run it (api/disaggregation.role_spec)."""
    return job.model_copy(update={"spec": role_spec(job.spec, role)})


def _side_channel(job: RLJob, role: EngineRole | None) -> bool:
    """A NixlConnector prefill engine: the decode engines reach its side channel."""
    pd = job.spec.inference.disaggregation
    return role is EngineRole.PREFILL and pd is not None and pd.connector is PDConnector.NIXL


def _kv_storage(job: RLJob, role: EngineRole | None) -> bool:
    pd = job.spec.inference.disaggregation
    return role is not None and pd is not None and pd.connector is PDConnector.STORAGE


def build_engine_service(job: RLJob, *, role: EngineRole | None = None) -> dict[str, Any]:
    """Headless: stable per-pod DNS for DP leaders and for the trainer's engine URLs."""
    name = engine_role_name(role)
    ports: list[dict[str, Any]] = [{"name": "http", "port": job.spec.inference.port, "targetPort": "http"}]
    if _side_channel(job, role):
        ports.append({"name": "nixl", "port": NIXL_SIDE_CHANNEL_PORT, "targetPort": "nixl"})
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta.object_meta(job, name),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": meta.selector_labels(job, name),
            "ports": ports,
        },
    }


def _engine_container(
    job: RLJob,
    model: ModelMount,
    *,
    command: list[str],
    args: list[str] | None,
    serves_api: bool,
    role: EngineRole | None = None,
) -> dict[str, Any]:
    """The vLLM container; ``serves_api`` False for a ``--headless`` DP follower, which has no HTTP to probe
    (its engine cores exit when they lose the leader, which restarts the container)."""
    inf = job.spec.inference
    _, mounts = _volumes(job, model)
    ports: list[dict[str, Any]] = [{"name": "http", "containerPort": inf.port}]
    env: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in vllm_env(job.spec).items()]
    if _side_channel(job, role):
        ports.append({"name": "nixl", "containerPort": NIXL_SIDE_CHANNEL_PORT})
        # NixlConnector hands the decode engine this host in kv_transfer_params (its default is localhost).
        env += [
            {"name": "VLLM_NIXL_SIDE_CHANNEL_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": NIXL_PORT_ENV, "value": str(NIXL_SIDE_CHANNEL_PORT)},
        ]
    if _kv_storage(job, role):
        mounts.append({"name": KV_TRANSFER_VOLUME, "mountPath": storage_path(), "subPath": STORAGE_SUBDIR})
    return {
        "name": CONTAINER_NAME,
        "image": inf.image,
        "command": command,
        **({"args": args} if args else {}),
        "ports": ports,
        "env": env,
        "resources": _resources(job),
        "volumeMounts": mounts,
        "securityContext": container_security_context(),
        **(probes(job) if serves_api else {}),
    }


def engine_pod_template(
    job: RLJob,
    *,
    command: list[str],
    args: list[str] | None = None,
    serves_api: bool = True,
    role: EngineRole | None = None,
) -> dict[str, Any]:
    """The engine pod template with the user's pod templates merged (builders/overrides.py)."""
    model = model_mount(job, image=job.spec.inference.image)
    volumes, _ = _volumes(job, model)
    container = _engine_container(job, model, command=command, args=args, serves_api=serves_api, role=role)
    if _kv_storage(job, role):
        # The routing claim again, writable, for the kv-transfer folder alone (the volume above is read-only).
        volumes.append(
            {"name": KV_TRANSFER_VOLUME, "persistentVolumeClaim": {"claimName": meta.routing_claim_name(job)}}
        )
    pod: dict[str, Any] = {
        "metadata": {
            "labels": meta.labels(job, engine_role_name(role)),
            "annotations": {meta.ANNOTATION_SPEC_HASH: engine_spec_hash(job.spec)},
        },
        "spec": {
            # vLLM never calls the Kubernetes API: no token in the engine pods.
            "automountServiceAccountToken": False,
            "securityContext": pod_security_context(ENGINE_UID),
            **({"initContainers": model.init_containers} if model.init_containers else {}),
            "containers": [container],
            "volumes": volumes,
            "tolerations": [dict(t) for t in meta.GPU_TOLERATIONS],
            "terminationGracePeriodSeconds": 60,
        },
    }
    return apply_template(pod, CONTAINER_NAME, role_template(job, meta.ROLE_ENGINE))


def build_engine_statefulset(job: RLJob, *, replicas: int, role: EngineRole | None = None) -> dict[str, Any]:
    """Engines whose replica is one pod: ``replicas`` pods (0 when suspended or finished). A replica of
    several pods is a LeaderWorkerSet group instead (builders/engine_lws.py). ``role``: one role of a
    disaggregated job, ``job`` as a whole (its role's replicas and parallel sizes are taken here)."""
    if role is not None:
        job = role_job(job, role)
    name = engine_role_name(role)
    command = vllm_serve_args(job.spec, model_path=model_path(job.spec), role=role)
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": meta.object_meta(job, name),
        "spec": {
            "serviceName": meta.child_name(job, name),
            "replicas": replicas,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": meta.selector_labels(job, name)},
            "template": engine_pod_template(job, command=command, role=role),
        },
    }
