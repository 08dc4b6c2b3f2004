"""For every rule: a spec that passes and a spec that fails it (mutations of the base manifest).

Each failing case must be flagged by exactly the rule under test among errors, so the cases also
pin that rules do not overlap by accident. tests/api/test_rules.py fails if a rule has no case.
"""

from __future__ import annotations

from typing import Any

from tests.api.conftest import Mutation, sets


def _chain(*mutations: Mutation) -> Mutation:
    def mutate(m: dict) -> None:
        for fn in mutations:
            fn(m)

    return mutate


DATASET = {"name": "dataset", "datasetPath": "/data/math/train.jsonl"}
MEGATRON = sets(**{"trainer.backend": "Megatron", "trainer.megatron": {"expertParallelSize": 8}})

_POD_TEMPLATES = (
    ("POD-TEMPLATE", "podTemplate"),
    ("ENGINE-POD-TEMPLATE", "inference.podTemplate"),
    ("TRAINER-POD-TEMPLATE", "trainer.podTemplate"),
)

_DATA_VOLUME = {"name": "data", "emptyDir": {}}
_DATA_MOUNT = {"name": "data", "mountPath": "/data"}

# rule id -> (passing mutation, failing mutation)
CASES: dict[str, tuple[Mutation, Mutation]] = {
    "R3-EXECUTOR-RAY": (
        sets(**{"routingReplay.mode": "R2", "inference.executorBackend": "ray"}),
        sets(**{"inference.executorBackend": "ray"}),
    ),
    "MP-SINGLE-NODE": (
        # 16 GPUs a replica, 8 a node: split along DP into two pods (a LeaderWorkerSet), not refused.
        sets(**{"inference.tensorParallelSize": 4, "inference.dataParallelSize": 4, "inference.gpusPerNode": 8}),
        sets(
            **{
                "inference.tensorParallelSize": 4,
                "inference.dataParallelSize": 4,
                "inference.dataParallelSizeLocal": 4,
                "inference.gpusPerNode": 8,
            }
        ),
    ),
    "ENGINE-LWS": (
        sets(**{"inference.tensorParallelSize": 8, "inference.gpusPerNode": 8}),
        sets(**{"inference.tensorParallelSize": 4, "inference.dataParallelSize": 4, "inference.gpusPerNode": 8}),
    ),
    "ENGINE-LWS-ASSUMED": (
        sets(**{"inference.tensorParallelSize": 8, "inference.gpusPerNode": 8}),
        sets(**{"inference.tensorParallelSize": 4, "inference.dataParallelSize": 4, "inference.gpusPerNode": 8}),
    ),
    "R3-INFERENCE-PP": (
        sets(**{"routingReplay.mode": "Disabled", "inference.pipelineParallelSize": 2}),
        sets(**{"inference.pipelineParallelSize": 2}),
    ),
    "R3-CONTEXT-PARALLEL": (
        sets(**{"routingReplay.mode": "R2", "inference.decodeContextParallelSize": 2}),
        sets(**{"inference.decodeContextParallelSize": 2}),
    ),
    "PD-ONE-CONNECTOR": (
        sets(**{"inference.disaggregation": {"connector": "storage"}, "inference.kvCacheOffload": False}),
        sets(**{"routingReplay.mode": "R2", "inference.disaggregation": {}, "inference.kvConnector": "nixl"}),
    ),
    "PD-PREFILL-ONE-POD": (
        sets(**{"inference.disaggregation": {"prefill": {"tensorParallelSize": 8}}, "inference.gpusPerNode": 8}),
        sets(
            **{
                "inference.disaggregation": {"prefill": {"dataParallelSize": 4}, "decode": {"dataParallelSize": 1}},
                "inference.tensorParallelSize": 4,
                "inference.gpusPerNode": 8,
            }
        ),
    ),
    "PD-DECODE-ONE-POD": (
        sets(
            **{
                "inference.disaggregation": {"decode": {"replicas": 4, "tensorParallelSize": 1, "dataParallelSize": 2}},
                "inference.gpusPerNode": 2,
            }
        ),
        sets(**{"inference.disaggregation": {"decode": {"tensorParallelSize": 16}}, "inference.gpusPerNode": 8}),
    ),
    "R3-KV-CONNECTOR": (
        sets(**{"routingReplay.mode": "R2", "inference.kvConnector": "nixl"}),
        sets(**{"inference.kvConnector": "lmcache"}),
    ),
    "R3-KV-OFFLOAD": (
        sets(**{"routingReplay.mode": "Disabled", "inference.kvCacheOffload": True}),
        sets(**{"inference.kvCacheOffload": True}),
    ),
    "REPLAY-NEEDS-MOE": (
        sets(**{"routingReplay.mode": "Disabled", "model.architecture.numExperts": 1, "model.architecture.topK": 1}),
        sets(**{"model.architecture.numExperts": 1, "model.architecture.topK": 1}),
    ),
    "MODEL-TOPK": (
        sets(**{"model.architecture.topK": 8, "model.architecture.numExperts": 8}),
        sets(**{"model.architecture.topK": 9, "model.architecture.numExperts": 8}),
    ),
    "MEGATRON-ROUTER-FUSION": (
        _chain(MEGATRON, sets(**{"routingReplay.mode": "Disabled", "trainer.megatron.routerFusion": True})),
        _chain(MEGATRON, sets(**{"trainer.megatron.routerFusion": True})),
    ),
    "R3-RETOKENIZE": (
        sets(**{"routingReplay.mode": "R2", "rollout.retokenizeChatHistory": True}),
        sets(**{"rollout.retokenizeChatHistory": True}),
    ),
    "R3-STEPWISE": (
        sets(**{"routingReplay.mode": "R2", "rollout.stepWiseTrajectories": True}),
        sets(**{"rollout.stepWiseTrajectories": True}),
    ),
    "ENGINE-EP-DIVISIBILITY": (
        sets(**{"inference.enableExpertParallel": True, "inference.dataParallelSize": 4}),
        sets(
            **{
                "inference.enableExpertParallel": True,
                "inference.tensorParallelSize": 2,
                "inference.dataParallelSize": 3,
            }
        ),
    ),
    "TRAINER-EP-DIVISIBILITY": (
        MEGATRON,
        _chain(
            MEGATRON,
            sets(**{"model.architecture.numExperts": 60, "trainer.megatron.expertParallelSize": 8, "trainer.nodes": 3}),
        ),
    ),
    "TRAINER-PARALLEL-FIT": (
        _chain(
            MEGATRON,
            sets(
                **{
                    "trainer.megatron.tensorParallelSize": 2,
                    "trainer.megatron.pipelineParallelSize": 2,
                    "trainer.megatron.expertParallelSize": 4,
                }
            ),
        ),
        _chain(MEGATRON, sets(**{"trainer.megatron.tensorParallelSize": 3, "trainer.megatron.sequenceParallel": True})),
    ),
    "MEGATRON-TP-NEEDS-SP": (
        _chain(MEGATRON, sets(**{"trainer.megatron.tensorParallelSize": 2, "trainer.megatron.sequenceParallel": True})),
        _chain(MEGATRON, sets(**{"trainer.megatron.tensorParallelSize": 2})),
    ),
    "MEGATRON-MICRO-BATCH-EP": (
        _chain(MEGATRON, sets(**{"trainer.megatron.expertParallelSize": 1, "trainer.megatron.microBatchSize": 4})),
        _chain(MEGATRON, sets(**{"trainer.megatron.microBatchSize": 4})),
    ),
    "TRAINER-BACKEND-UNION": (
        sets(**{"trainer.fsdp": {"samplePacking": False}}),
        sets(**{"trainer.megatron": {"tensorParallelSize": 1}}),
    ),
    "FSDP-ROUTER-FAMILY": (
        sets(**{"model.architecture.family": "olmoe"}),
        sets(**{"model.architecture.family": "deepseek_v3", "model.architecture.routerType": "sigmoid-bias"}),
    ),
    "EXTRA-ARGS-DERIVED": (
        sets(**{"inference.extraArgs": ["--enable-prefix-caching", "--max-num-seqs=256", "-O3", "-dpa=10.0.0.1"]}),
        sets(**{"inference.extraArgs": ["--max-num-seqs", "256", "--kv_transfer_config.kv_connector=X"]}),
    ),
    "EXTRA-ARGS-CODE-LOADING": (
        sets(**{"model.trustRemoteCode": True, "inference.extraArgs": ["--trust-remote-code", "--worker-cls=x.W"]}),
        sets(**{"inference.extraArgs": ["--max-num-seqs", "256", "--trust-remote-code"]}),
    ),
    "R3-VLLM-MIN-VERSION": (
        sets(**{"inference.image": "vllm/vllm-openai:v0.14.0"}),
        sets(**{"inference.image": "vllm/vllm-openai:v0.13.0"}),
    ),
    "R3-HYBRID-VLLM": (
        sets(**{"inference.image": "vllm/vllm-openai:v0.22.0", "model.architecture.hybridAttention": True}),
        sets(**{"inference.image": "vllm/vllm-openai:v0.20.2", "model.architecture.hybridAttention": True}),
    ),
    "R3-SPEC-DECODE-VLLM": (
        sets(**{"inference.speculativeDecoding": {"method": "mtp", "numSpeculativeTokens": 1}}),
        sets(
            **{
                "inference.image": "vllm/vllm-openai:v0.22.1",
                "inference.speculativeDecoding": {"method": "mtp", "numSpeculativeTokens": 1},
            }
        ),
    ),
    "R3-MRV2-VLLM": (
        sets(**{"inference.modelRunnerV2": True}),
        sets(**{"inference.image": "vllm/vllm-openai:v0.22.1", "inference.modelRunnerV2": True}),
    ),
    "FSDP-UNIMPLEMENTED": (
        sets(**{"trainer.fsdp": {"samplePacking": False, "ulyssesSequenceParallelSize": 1}}),
        sets(**{"trainer.fsdp": {"samplePacking": True}}),
    ),
    "KL-REFERENCE-UNSUPPORTED": (
        sets(**{"algorithm.useKLLoss": False, "algorithm.klCoef": 0.001}),
        sets(**{"algorithm.klInReward": True}),
    ),
    "R3-PARTIAL-ROLLOUT": (
        sets(**{"routingReplay.mode": "R2", "rollout.partialRollout": True, "algorithm.mode": "async"}),
        sets(**{"rollout.partialRollout": True, "algorithm.mode": "async"}),
    ),
    "PARTIAL-ROLLOUT-SYNC": (
        sets(**{"rollout.partialRollout": True, "algorithm.mode": "async"}),
        sets(**{"rollout.partialRollout": True}),
    ),
    "IMAGE-TAG-UNPINNED": (
        sets(**{"inference.image": "vllm/vllm-openai:latest", "inference.vllmVersion": "0.30.0"}),
        sets(**{"routingReplay.mode": "Disabled", "inference.image": "vllm/vllm-openai:latest"}),
    ),
    "MODEL-GCS-CREDENTIALS": (
        sets(**{"model.uri": "gs://bucket/Qwen3-30B-A3B", "model.gcs": {"credentialsSecret": "hmac"}}),
        sets(**{"model.uri": "gs://bucket/Qwen3-30B-A3B"}),
    ),
    "MODEL-S3-CREDENTIALS": (
        sets(**{"model.uri": "s3://bucket/Qwen3-30B-A3B", "model.s3": {"credentialsSecret": "store"}}),
        sets(**{"model.uri": "s3://bucket/Qwen3-30B-A3B"}),
    ),
    "TASK-DATASET-PATH": (
        sets(task={**DATASET, "reward": "math"}),
        sets(task={"name": "dataset", "reward": "math"}),
    ),
    "TASK-REWARD": (
        sets(task={"name": "next", "reward": "prefix-match"}),
        sets(task={**DATASET, "reward": "prefix-match"}),
    ),
    "TASK-REWARD-FUNCTION": (
        sets(task={**DATASET, "reward": "function", "rewardFunction": "my_rewards.score:judge"}),
        sets(task={**DATASET, "reward": "function"}),
    ),
    "TASK-REWARD-URL": (
        sets(task={**DATASET, "reward": "http", "rewardURL": "http://reward.rl.svc:8080/score"}),
        sets(task={**DATASET, "reward": "exact-match", "rewardURL": "http://reward.rl.svc:8080/score"}),
    ),
    "EXPORT-S3-CREDENTIALS": (
        sets(export={"destination": "s3://models/rl/qwen3", "s3": {"credentialsSecret": "store"}}),
        sets(export={"destination": "s3://models/rl/qwen3", "gcs": {"credentialsSecret": "store"}}),
    ),
    "EXPORT-GCS-CREDENTIALS": (
        sets(export={"destination": "gs://models/rl/qwen3", "gcs": {"credentialsSecret": "store"}}),
        sets(export={"destination": "gs://models/rl/qwen3"}),
    ),
    "EXPORT-WHEN": (
        sets(export={"destination": "pvc://models/rl", "intervalSteps": 100, "atEnd": False}),
        sets(export={"destination": "pvc://models/rl", "atEnd": False}),
    ),
    "EXPORT-URI-FORM": (
        sets(export={"destination": "pvc://models"}),
        sets(export={"destination": "pvc://models/rl/../other"}),
    ),
    "MANAGED-BY-QUEUE": (
        sets(managedBy="kueue.x-k8s.io/multikueue", queueName="gpu"),
        sets(managedBy="kueue.x-k8s.io/multikueue"),
    ),
    "MODEL-URI-FORM": (
        sets(**{"model.uri": "hf://Qwen/Qwen3-30B-A3B@abc123", "model.revision": "abc123"}),
        sets(**{"model.uri": "hf://Qwen/Qwen3-30B-A3B@abc123", "model.revision": "def456"}),
    ),
    "DATASET-URI-SCHEME": (
        sets(task={**DATASET, "reward": "math", "datasetPath": "/var/lib/r3operator/data/train.jsonl"}),
        sets(task={**DATASET, "reward": "math", "datasetPath": "hdfs://data/train.jsonl"}),
    ),
    "DATASET-S3-CREDENTIALS": (
        sets(task={**DATASET, "reward": "math", "datasetPath": "s3://d/train.jsonl", "s3": {"credentialsSecret": "s"}}),
        sets(task={**DATASET, "reward": "math", "datasetPath": "s3://data/train.jsonl"}),
    ),
    "DATASET-GCS-CREDENTIALS": (
        sets(task={**DATASET, "reward": "math", "datasetPath": "gs://d/t.jsonl", "gcs": {"credentialsSecret": "s"}}),
        sets(task={**DATASET, "reward": "math", "datasetPath": "gs://data/train.jsonl"}),
    ),
    "EVAL-TASK-DATASET": (
        sets(task={**DATASET, "reward": "math"}, evaluation={"datasetPath": "/data/math/test.jsonl"}),
        sets(evaluation={"datasetPath": "/data/math/test.jsonl"}),
    ),
    "EVAL-DATASET-URI-SCHEME": (
        sets(task={**DATASET, "reward": "math"}, evaluation={"datasetPath": "file:///data/math/test.jsonl"}),
        sets(task={**DATASET, "reward": "math"}, evaluation={"datasetPath": "hdfs://data/test.jsonl"}),
    ),
    "EVAL-DATASET-CREDENTIALS": (
        sets(
            task={**DATASET, "reward": "math", "gcs": {"credentialsSecret": "s"}},
            evaluation={"datasetPath": "gs://data/test.jsonl"},
        ),
        sets(
            task={**DATASET, "reward": "math", "gcs": {"credentialsSecret": "s"}},
            evaluation={"datasetPath": "s3://data/test.jsonl"},
        ),
    ),
    "ENGINE-IMAGE-PLUGIN": (
        sets(**{"inference.image": "registry.example.com/vllm/vllm-openai:v0.30.0"}),  # a mirror of our build
        sets(**{"inference.image": "docker.io/vllm/vllm-openai:v0.30.0"}),
    ),
    "CHECKPOINT-FITS-STORAGE": (
        # Qwen3-30B-A3B: ~335 GiB per checkpoint; keepLast 1 peaks at 2 of them (670 GiB).
        sets(**{"checkpoint.keepLast": 1, "storage.size": "700Gi"}),
        sets(**{"checkpoint.keepLast": 2, "storage.size": "1000Gi"}),
    ),
    "MODEL-ARCH-UNRESOLVED": (
        sets(**{"routingReplay.mode": "Disabled", "model.architecture": None}),
        sets(**{"model.architecture": None}),
    ),
    "WEIGHT-SYNC-KERNEL-LAYOUT": (
        sets(
            **{
                "weightSync.layout": "kernel",
                "inference.image": "ghcr.io/r3operator/engine:0.1.0-vllm0.22.1",
                "inference.tensorParallelSize": 1,
            }
        ),
        # vLLM 0.26.0: neither 0.22's is_checkpoint_format=False nor 0.30's trainer factory (checked in its wheel)
        sets(**{"weightSync.layout": "kernel", "inference.image": "ghcr.io/r3operator/engine:0.1.0-vllm0.26.0"}),
    ),
    "GROUP-SIZE-ONE": (sets(**{"rollout.groupSize": 2}), sets(**{"rollout.groupSize": 1})),
    "R3-EPLB-VLLM": (
        sets(**{"inference.extraArgs": ["--enable-eplb"]}),  # 0.30.0 captures logical ids
        sets(**{"inference.image": "vllm/vllm-openai:v0.21.0", "inference.extraArgs": ["--enable-eplb"]}),
    ),
    "R3-PREFIX-CACHING-VLLM": (
        sets(**{"inference.extraArgs": ["--no-enable-prefix-caching"]}),  # 0.30.0: capture without prefix caching
        sets(
            **{
                "inference.image": "ghcr.io/r3operator/engine:0.1.0-vllm0.33.0",
                "inference.extraArgs": ["--disable-prefix-caching"],
            }
        ),
    ),
    "R3-PD-NIXL-VLLM": (
        sets(**{"inference.disaggregation": {"connector": "nixl"}}),  # 0.30.0: the plugin lets the pair through
        sets(
            **{
                "inference.image": "ghcr.io/r3operator/engine:0.1.0-vllm0.33.0",
                "inference.disaggregation": {"connector": "nixl"},
            }
        ),
    ),
    "R3-MOE-BACKEND": (
        sets(**{"inference.extraArgs": ["--moe-backend", "flashinfer_trtllm"]}),  # 0.30.0: capture or refusal
        sets(
            **{
                "inference.image": "vllm/vllm-openai:v0.22.1",
                "inference.extraArgs": ["--moe-backend=flashinfer_trtllm"],
            }
        ),
    ),
    "R3-ASYNC-SCHEDULING": (
        sets(**{"routingReplay.mode": "Disabled", "inference.asyncScheduling": True}),
        sets(**{"inference.asyncScheduling": True}),
    ),
    **{
        f"{prefix}-DERIVED": (
            sets(**{path: {"env": [{"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}], "labels": {"team": "rl"}}}),
            sets(**{path: {"env": [{"name": "VLLM_PLUGINS", "value": "x"}], "labels": {"r3operator.io/role": "x"}}}),
        )
        for prefix, path in _POD_TEMPLATES
    },
    **{
        f"{prefix}-MOUNTS": (
            sets(**{path: {"volumes": [_DATA_VOLUME], "volumeMounts": [_DATA_MOUNT]}}),
            sets(**{path: {"volumeMounts": [_DATA_MOUNT]}}),
        )
        for prefix, path in _POD_TEMPLATES
    },
    **{
        f"{prefix}-IDENTITY": (
            sets(**{path: {"serviceAccountName": "trainer-identity"}}),
            sets(**{path: {"serviceAccountName": "other-job-trainer"}}),
        )
        for prefix, path in _POD_TEMPLATES
    },
}


# Rules that read an outside fact: the facts each case is evaluated with (api/context.py RuleContext).
FACTS: dict[str, dict[str, Any]] = {
    "ENGINE-LWS": {"leader_worker_set": False},  # the operator saw no LeaderWorkerSet CRD
}
