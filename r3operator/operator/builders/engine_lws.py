"""Engines whose replica spans several pods: one LeaderWorkerSet (sigs.k8s.io/lws), a group per replica.

vLLM's multi-node data parallelism with the ``mp`` executor runs one ``vllm serve`` per node: the leader
holds DP ranks ``[0, dpLocal)`` and serves the API, each worker ``w`` runs ``--headless`` with ranks
``[w × dpLocal, (w+1) × dpLocal)`` and joins the leader's DP RPC port. A LeaderWorkerSet group is that shape:
the leader template and the worker template differ (only the leader has HTTP to probe), the LWS webhook
gives every pod ``LWS_LEADER_ADDRESS`` (the leader's DNS name under this job's engine Service, which the LWS
controller adopts as the group's subdomain since it carries the LWS's name) and ``LWS_WORKER_INDEX``.

- ``startupPolicy: LeaderCreated``: the leader's /health answers only once every DP rank joined, so
  ``LeaderReady`` would never start the workers.
- ``restartPolicy: RecreateGroupOnPodRestart``: a DP rank that dies takes the replica's collective with it;
  the group restarts whole, as vLLM needs.
- ``rolloutStrategy`` ``partition``: groups below it keep the current template, as a StatefulSet's
  partition does, which is what an engine upgrade's canary needs (operator/upgrade.py).
- No suspend field in LWS v0.7: a stopped or not-yet-admitted job has ``replicas: 0``, as the StatefulSet.
"""

from __future__ import annotations

from typing import Any

from r3operator.api.engine_layout import LWS_API_VERSION, engine_layout
from r3operator.api.v1alpha1 import RLJob
from r3operator.api.vllm_args import model_path, vllm_serve_args
from r3operator.operator import meta
from r3operator.operator.builders.engine import DP_RPC_PORT, engine_pod_template

LEADER_ADDRESS_ENV = "LWS_LEADER_ADDRESS"
WORKER_INDEX_ENV = "LWS_WORKER_INDEX"


def _command(job: RLJob, *, leader: bool) -> list[str]:
    """A shell for the values only the pod knows: the leader's address and a worker's first DP rank (from its
    worker index). vLLM's own argv is the container's ``args`` (``$0 "$@"``), one flag per item, as the
    StatefulSet's engines have it.

    The leader names no ``--data-parallel-start-rank``: vLLM 0.30 reads any start rank on a pod that serves
    the API (0 included; 0.22 only a non-zero one) as hybrid load balancing, where every node runs its own API
    server, and then refuses the ``--headless`` workers ("must not use --headless in external or hybrid dp lb
    mode"). Without it the leader's API server balances over every rank of the replica, as the trainer needs:
    it reaches a replica through its leader only."""
    dp_local = engine_layout(job.spec).dp_local
    start = "" if leader else f"--data-parallel-start-rank $(({WORKER_INDEX_ENV} * {dp_local})) "
    return ["/bin/sh", "-c", f'exec "$0" "$@" {start}--data-parallel-address "${LEADER_ADDRESS_ENV}"']


def _args(job: RLJob, *, leader: bool) -> list[str]:
    """``vllm serve`` with the replica's DP shape; a worker runs ``--headless`` (no API server)."""
    args = vllm_serve_args(job.spec, model_path=model_path(job.spec))
    return [*args, "--data-parallel-rpc-port", str(DP_RPC_PORT), *([] if leader else ["--headless"])]


def build_engine_leader_worker_set(job: RLJob, *, replicas: int, partition: int = 0) -> dict[str, Any]:
    """``replicas`` groups (engine replicas), each ``podsPerReplica`` pods; ``partition``: groups below it
    stay on the current revision (an upgrade's canary)."""
    layout = engine_layout(job.spec)
    return {
        "apiVersion": LWS_API_VERSION,
        "kind": "LeaderWorkerSet",
        "metadata": meta.object_meta(job, meta.ROLE_ENGINE),
        "spec": {
            "replicas": replicas,
            "startupPolicy": "LeaderCreated",
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {"partition": partition, "maxUnavailable": 1, "maxSurge": 0},
            },
            "networkConfig": {"subdomainPolicy": "Shared"},
            "leaderWorkerTemplate": {
                "size": layout.pods_per_replica,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": engine_pod_template(
                    job, command=_command(job, leader=True), args=_args(job, leader=True)
                ),
                "workerTemplate": engine_pod_template(
                    job, command=_command(job, leader=False), args=_args(job, leader=False), serves_api=False
                ),
            },
        },
    }


def leader_worker_templates(lws: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(leader template, worker template) of a LeaderWorkerSet as rendered or as the cluster has it."""
    template = ((lws.get("spec") or {}).get("leaderWorkerTemplate")) or {}
    worker = template.get("workerTemplate") or {}
    return template.get("leaderTemplate") or worker, worker
