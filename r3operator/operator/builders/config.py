"""The ConfigMap with the resolved runtime config that engines and the trainer driver both read.

``config.json`` = the RLJob spec (camelCase, defaults filled) + the resolved plan + the names of the
other children, so no process has to talk to the Kubernetes API to find its peers. It is mounted as a
volume at /etc/r3operator; an edit updates the file in place and never restarts a pod by itself.
"""

from __future__ import annotations

import json
from typing import Any

from r3operator.api.plan import plan
from r3operator.api.v1alpha1 import API_VERSION, KIND, RLJob
from r3operator.api.weight_transfer import cluster_transfer
from r3operator.operator import meta
from r3operator.settings import CONFIG_KEY, CONFIG_PATH, ENGINE_URLS_KEY, ROUTING_DIR_KEY, ROUTING_MOUNT, RUNTIME_KEY


def runtime_config(job: RLJob) -> dict[str, Any]:
    engine_service = meta.child_name(job, meta.ROLE_ENGINE)
    inf = job.spec.inference
    transfer = cluster_transfer(job.spec)
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": job.metadata.name, "namespace": job.metadata.namespace or "default"},
        "spec": job.spec.model_dump(mode="json", by_alias=True),
        "resolved": plan(job).to_resolved().model_dump(mode="json", by_alias=True, exclude_none=True),
        RUNTIME_KEY: {
            "configPath": CONFIG_PATH,
            ROUTING_DIR_KEY: ROUTING_MOUNT,
            "routingClaim": meta.routing_claim_name(job),
            "engineService": engine_service,
            "engineStatefulSet": engine_service,  # the LeaderWorkerSet's name too, when a replica spans pods
            # One URL per engine replica: the DP leader pod of each replica serves the API.
            ENGINE_URLS_KEY: [engine_replica_url(job, i) for i in range(inf.replicas)],
            "trainerRayJob": meta.child_name(job, meta.ROLE_TRAINER),
            # The transport the engines were rendered for (their --weight-transfer-config); the driver
            # re-checks it against the running engines and its own vLLM (weightsync/sync.py).
            "weightTransfer": {
                "method": transfer.method.value,
                "reason": transfer.reason,
                "fallback": transfer.fallback,
            },
        },
    }


def engine_replica_url(job: RLJob, replica: int) -> str:
    """The API of engine replica ``replica``: pod ``<job>-engine-<replica>``, the StatefulSet's ordinal or the
    LeaderWorkerSet group's leader (the DP leader), by its DNS name under the engine Service."""
    service = meta.child_name(job, meta.ROLE_ENGINE)
    namespace = job.metadata.namespace or "default"
    return f"http://{service}-{replica}.{service}.{namespace}.svc:{job.spec.inference.port}"


def build_config_map(job: RLJob) -> dict[str, Any]:
    text = json.dumps(runtime_config(job), indent=2, sort_keys=True)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta.object_meta(job, meta.ROLE_CONFIG),
        "data": {CONFIG_KEY: text + "\n"},
    }
