"""`r3operator explain`: the resolved plan of each RLJob in a file, as text, JSON or YAML."""

from __future__ import annotations

from typing import Any

from r3operator.api import Finding, Plan, RLJob
from r3operator.api.engine_layout import engine_layout
from r3operator.api.enums import ReplayMode


def routed_experts_needed(job: RLJob) -> bool:
    """Only R3 has the engines capture routes; under R2 and Disabled the vLLM routed-experts features
    play no part, so showing their gates would only invite a question with no bearing on the job."""
    return job.spec.routing_replay.mode is ReplayMode.R3


def finding_json(f: Finding) -> dict[str, str]:
    return {"rule": f.rule, "severity": f.severity.value, "field": f.field, "message": f.message}


def plan_json(source: str, job: RLJob, plan: Plan, findings: list[Finding]) -> dict[str, Any]:
    """One RLJob's plan with camelCase keys, as in the RLJob's own `status.resolved`."""
    inf, tr = job.spec.inference, job.spec.trainer
    replay: dict[str, Any] = {"mode": job.spec.routing_replay.mode.value, "path": plan.replay_path}
    if routed_experts_needed(job):
        replay |= {
            "routingBytesPerToken": plan.routing_bytes_per_token,
            "routeDtype": plan.route_dtype,
            "vllmFeatures": dict(plan.features),
        }
    version = plan.engine_version
    layout = engine_layout(job.spec)
    return {
        "file": source,
        "name": job.metadata.name,
        "namespace": job.metadata.namespace,
        "vllmVersion": {"version": str(version) if version.known else None, "source": version.source.value},
        "engines": {
            "replicas": inf.replicas,
            "tensorParallelSize": inf.tensor_parallel_size,
            "pipelineParallelSize": inf.pipeline_parallel_size,
            "dataParallelSize": inf.data_parallel_size,
            "executor": inf.executor_backend.value,
            "gpusPerReplica": plan.engine_gpus_per_replica,
            "podsPerReplica": plan.engine_pods_per_replica,
            # A replica of several pods is a LeaderWorkerSet group: a leader serving the API + headless workers.
            "workload": "LeaderWorkerSet" if layout.multi_pod else "StatefulSet",
            "dataParallelSizeLocal": layout.dp_local,
            "gpusPerPod": layout.gpus_per_pod,
            "gpusTotal": plan.engine_gpus_total,
            "expertParallelSize": plan.engine_expert_parallel_size,
        },
        "trainer": {
            "backend": tr.backend.value,
            "nodes": tr.nodes,
            "gpusPerNode": tr.gpus_per_node,
            "gpusTotal": plan.trainer_gpus_total,
            "expertParallelSize": plan.trainer_expert_parallel_size,
        },
        "replay": replay,
        "weightSync": {
            "method": plan.weight_transfer.method.value,
            "methodReason": plan.weight_transfer.reason,
            "layout": plan.weight_sync_layout.layout.value,
            "layoutReason": plan.weight_sync_layout.describe(),
        },
        "findings": [finding_json(f) for f in findings],
    }
