"""The ConfigMap with the resolved runtime config that engines and the trainer driver both read.

``config.json`` is an `api.runtime_config.RuntimeConfig`: the RLJob spec (camelCase, defaults filled) + the
resolved plan + the names of the other children, so no process has to talk to the Kubernetes API to find
its peers. It is mounted as a volume at /etc/r3operator; an edit updates the file in place and never
restarts a pod by itself.
"""

from __future__ import annotations

from typing import Any

from r3operator.api.disaggregation import engine_replicas, engine_role_name, role_replicas, roles
from r3operator.api.enums import EngineRole
from r3operator.api.plan import plan
from r3operator.api.runtime_config import JobName, RuntimeBlock, RuntimeConfig, WeightTransferConfig
from r3operator.api.v1alpha1 import RLJob
from r3operator.api.weight_transfer import cluster_transfer
from r3operator.operator import meta
from r3operator.settings import CONFIG_KEY, CONFIG_PATH, ROUTING_MOUNT


def runtime_config(job: RLJob) -> RuntimeConfig:
    engine_service = meta.child_name(job, meta.ROLE_ENGINE)
    transfer = cluster_transfer(job.spec)
    return RuntimeConfig(
        metadata=JobName(name=job.metadata.name, namespace=job.metadata.namespace or "default", uid=job.metadata.uid),
        spec=job.spec,
        resolved=plan(job).to_resolved(),
        runtime=RuntimeBlock(
            config_path=CONFIG_PATH,
            routing_dir=ROUTING_MOUNT,
            routing_claim=meta.routing_claim_name(job),
            engine_service=engine_service,
            engine_stateful_set=engine_service,  # the LeaderWorkerSet's name too, when a replica spans pods
            engine_urls=[engine_replica_url(job, i) for i in range(engine_replicas(job.spec))],
            prefill_engine_urls=[
                engine_replica_url(job, i, role=EngineRole.PREFILL)
                for i in range(role_replicas(job.spec, EngineRole.PREFILL) if roles(job.spec) else 0)
            ],
            trainer_ray_job=meta.child_name(job, meta.ROLE_TRAINER),
            weight_transfer=WeightTransferConfig(
                method=transfer.method, reason=transfer.reason, fallback=transfer.fallback
            ),
        ),
    )


def engine_replica_url(job: RLJob, replica: int, *, role: EngineRole | None = None) -> str:
    """The API of engine replica ``replica``: pod ``<job>-engine-<replica>``, the StatefulSet's ordinal or the
    LeaderWorkerSet group's leader (the DP leader), by its DNS name under the engine Service; a prefill replica's
    pod is ``<job>-prefill-<replica>`` under its own Service."""
    service = meta.child_name(job, engine_role_name(role))
    namespace = job.metadata.namespace or "default"
    return f"http://{service}-{replica}.{service}.{namespace}.svc:{job.spec.inference.port}"


def build_config_map(job: RLJob) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta.object_meta(job, meta.ROLE_CONFIG),
        "data": {CONFIG_KEY: runtime_config(job).to_json()},
    }
