"""How one engine replica is laid out on pods: DP ranks per pod, pods per replica, GPUs per pod.

vLLM's ``mp`` executor keeps every process of a pod on that pod's node, so a replica whose GPUs
(tensorParallelSize × pipelineParallelSize × dataParallelSize) exceed ``gpusPerNode`` is split along data
parallelism: each pod runs ``dataParallelSizeLocal`` DP ranks, the first pod (the DP leader) serves the API
and the others run ``--headless`` and join it. When ``dataParallelSizeLocal`` is not set, the operator picks
it: the whole replica on one pod when it fits a node, otherwise the largest divisor of dataParallelSize
whose ranks fit a node, so every pod of the replica holds the same number of ranks (one pod template).
A replica of more than one pod is rendered as a LeaderWorkerSet (operator/builders/engine_lws.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from r3operator.api.enums import ExecutorBackend
from r3operator.api.v1alpha1 import InferenceSpec, RLJobSpec

LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
LWS_PLURAL = "leaderworkersets"
LWS_CRD = f"{LWS_PLURAL}.leaderworkerset.x-k8s.io"


@dataclass(frozen=True, slots=True)
class EngineLayout:
    dp_local: int
    """DP ranks per pod (vLLM --data-parallel-size-local)."""
    pods_per_replica: int
    gpus_per_pod: int

    @property
    def multi_pod(self) -> bool:
        """The replica spans pods: a LeaderWorkerSet group (leader + pods_per_replica - 1 workers)."""
        return self.pods_per_replica > 1


def derived_dp_local(inf: InferenceSpec) -> int:
    """DP ranks per pod when the spec does not say: all of them when the replica fits a node; with the mp
    executor otherwise the largest divisor of dataParallelSize whose ranks fit a node. Where no rank fits a
    node (tp × pp > gpusPerNode) the replica stays one pod and rule MP-SINGLE-NODE refuses it."""
    per_rank = inf.tensor_parallel_size * inf.pipeline_parallel_size
    dp = inf.data_parallel_size
    if per_rank * dp <= inf.gpus_per_node or inf.executor_backend is not ExecutorBackend.MP:
        return dp
    fitting = [d for d in range(1, dp + 1) if dp % d == 0 and per_rank * d <= inf.gpus_per_node]
    return max(fitting) if fitting else dp


def engine_layout(spec: RLJobSpec) -> EngineLayout:
    inf = spec.inference
    dp_local = inf.data_parallel_size_local if inf.data_parallel_size_local is not None else derived_dp_local(inf)
    return EngineLayout(
        dp_local=dp_local,
        pods_per_replica=max(1, -(-inf.data_parallel_size // dp_local)),
        gpus_per_pod=inf.tensor_parallel_size * inf.pipeline_parallel_size * dp_local,
    )
