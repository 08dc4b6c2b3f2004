"""vLLM engines: one StatefulSet + one headless Service per engine group.

An engine replica is one vLLM server (its own KV cache). When ``dataParallelSize`` spans more pods
than one (``dataParallelSize > dataParallelSizeLocal``), a replica is ``podsPerReplica`` consecutive
StatefulSet ordinals: the first is the DP leader that serves the API, the others run ``--headless``
and join it by its stable DNS name.
"""

from __future__ import annotations

import math
import shlex
from typing import Any

from r3operator.api.plan import plan
from r3operator.api.sizing import model_params_billions
from r3operator.api.v1alpha1 import RLJob
from r3operator.engine.args import model_path, vllm_env, vllm_serve_args
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


def _leader_health_check(job: RLJob, pods_per_replica: int, timeout_s: int) -> dict[str, Any]:
    """An exec probe for multi-pod replicas: the DP leader's /health, and success on a ``--headless`` pod.

    One StatefulSet template serves leaders and followers alike, and a headless pod serves no HTTP at all,
    so an httpGet probe would restart every follower forever. A follower has nothing to ask: its engine
    cores exit when they lose the leader, which restarts the container; the leader's /health answers only
    once every DP rank of the replica has joined, so the leader's readiness stands for the replica.
    ``python3 -S`` (the vLLM image's Python, without site-packages) keeps the check to a fraction of a second.
    """
    port = job.spec.inference.port
    fetch = f"import urllib.request; urllib.request.urlopen('http://127.0.0.1:{port}/health', timeout={timeout_s - 1})"
    script = (
        'HOST="${HOSTNAME:-$(cat /etc/hostname)}"; ORD="${HOST##*-}"; '
        f'if [ "$((ORD % {pods_per_replica}))" -ne 0 ]; then exit 0; fi; '
        f'exec python3 -S -c "{fetch}"'
    )
    return {"exec": {"command": ["/bin/sh", "-c", script]}}


def probes(job: RLJob) -> dict[str, Any]:
    pods = plan(job).engine_pods_per_replica

    def check(timeout_s: int) -> dict[str, Any]:
        if pods > 1:
            return _leader_health_check(job, pods, timeout_s)
        return {"httpGet": {"path": "/health", "port": "http"}}

    return {
        # /health answers only once the engine is up; the startup probe holds liveness off until then.
        "startupProbe": {
            **check(5),
            "periodSeconds": PROBE_PERIOD_S,
            "timeoutSeconds": 5,
            "failureThreshold": math.ceil(startup_budget_seconds(job) / PROBE_PERIOD_S),
        },
        "readinessProbe": {**check(5), "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {**check(10), "periodSeconds": 20, "timeoutSeconds": 10, "failureThreshold": 6},
    }


def gpus_per_pod(job: RLJob) -> int:
    inf = job.spec.inference
    dp_local = inf.data_parallel_size_local or inf.data_parallel_size
    return inf.tensor_parallel_size * inf.pipeline_parallel_size * dp_local


def engine_pod_count(job: RLJob, *, replicas: int) -> int:
    return replicas * plan(job).engine_pods_per_replica


def _command(job: RLJob) -> list[str]:
    args = vllm_serve_args(job.spec, model_path=model_path(job.spec))
    pods = plan(job).engine_pods_per_replica
    if pods == 1:
        return args
    inf = job.spec.inference
    dp_local = inf.data_parallel_size_local or inf.data_parallel_size
    service = meta.child_name(job, meta.ROLE_ENGINE)
    # Rank arithmetic on the StatefulSet ordinal: replica r owns ordinals [r*pods, (r+1)*pods).
    script = (
        f"ORD=${{HOSTNAME##*-}}; LOCAL=$((ORD % {pods})); LEADER=$((ORD - LOCAL)); "
        f"EXTRA=\"--data-parallel-start-rank $((LOCAL * {dp_local})) "
        f"--data-parallel-address {service}-$LEADER.{service} --data-parallel-rpc-port {DP_RPC_PORT}\"; "
        f"if [ \"$LOCAL\" -ne 0 ]; then EXTRA=\"$EXTRA --headless\"; fi; "
        f"exec {shlex.join(args)} $EXTRA"
    )
    return ["/bin/sh", "-c", script]


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


def build_engine_statefulset(job: RLJob, *, replicas: int) -> dict[str, Any]:
    """``replicas`` are engine replicas (0 when suspended or finished); pods = replicas × podsPerReplica."""
    inf = job.spec.inference
    model = model_mount(job, image=inf.image)
    volumes, mounts = _volumes(job, model)
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": inf.image,
        "command": _command(job),
        "ports": [{"name": "http", "containerPort": inf.port}],
        "env": [{"name": k, "value": v} for k, v in vllm_env(job.spec).items()],
        "resources": _resources(job),
        "volumeMounts": mounts,
        "securityContext": container_security_context(),
        **probes(job),
    }
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
            "containers": [container],
            "volumes": volumes,
            "tolerations": [dict(t) for t in meta.GPU_TOLERATIONS],
            "terminationGracePeriodSeconds": 60,
        },
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": meta.object_meta(job, meta.ROLE_ENGINE),
        "spec": {
            "serviceName": meta.child_name(job, meta.ROLE_ENGINE),
            "replicas": engine_pod_count(job, replicas=replicas),
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": meta.selector_labels(job, meta.ROLE_ENGINE)},
            "template": apply_template(pod, CONTAINER_NAME, role_template(job, meta.ROLE_ENGINE)),
        },
    }
