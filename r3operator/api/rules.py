"""Compatibility rules as data.

Each :class:`Rule` names the spec fields it reads, its severity, the upstream source that shows
why, and a check that returns a message *with the actual values* when the spec breaks it.

Rules that need only the object itself also carry a CEL expression; the generated CRD installs it
as an ``x-kubernetes-validations`` entry on ``.spec`` so the API server refuses the object before
any GPU is spent. The Python check and the CEL expression are tested to agree, by a real
kube-apiserver's verdict, on hand-written and generated specs (tests/api/test_cel_agreement.py). Rules
that need outside facts (the vLLM version matrix) or that only warn exist in Python alone and surface
as ``Valid=False`` / Warning events in the operator.

CEL conventions: ``self`` is ``.spec`` after API-server defaulting (every section has
``default: {}``), so defaulted scalars are always present; optional fields are guarded by
``has()``. Messages render values with ``'…%d'.format([...])``: ``string(int)`` concatenations
exceed the apiserver's CEL cost budget for message expressions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from r3operator.api import checks, source_checks
from r3operator.api.checks import CODE_LOADING_VLLM_FLAGS, DERIVED_VLLM_PATTERN
from r3operator.api.context import RuleContext
from r3operator.api.enums import Severity
from r3operator.api.families import HF_REPLAY_FAMILIES
from r3operator.api.pod_rules import (
    SITES,
    check_derived,
    check_identity,
    check_mounts,
    derived_cel,
    identity_cel,
    mounts_cel,
)
from r3operator.api.v1alpha1 import RLJobSpec


@dataclass(frozen=True, slots=True)
class CelRule:
    rule: str
    """Must hold; written over ``self`` = spec."""
    message_expression: str
    field_path: str
    """Relative to .spec, e.g. ``.inference.executorBackend``."""
    reason: str = "FieldValueForbidden"


Check = Callable[[RuleContext], str | None]


@dataclass(frozen=True, slots=True)
class Rule:
    id: str
    severity: Severity
    field: str
    """The field a finding points at (``spec.…``)."""
    reads: tuple[str, ...]
    summary: str
    sources: tuple[str, ...]
    check: Check = dataclasses.field(repr=False)  # `field` is also an attribute of Rule
    cel: CelRule | None = None


@dataclass(frozen=True, slots=True)
class Finding:
    rule: str
    severity: Severity
    field: str
    message: str
    sources: tuple[str, ...] = ()


_CEL_R3 = "self.routingReplay.mode == 'R3'"
_CEL_REPLAY = "self.routingReplay.mode != 'Disabled'"
# The fewest DP ranks one engine pod holds: dataParallelSizeLocal when set, else one (the operator splits a
# replica wider than a node along DP, api/engine_layout.py).
_CEL_DP_LOCAL_POD = "(has(self.inference.dataParallelSizeLocal) ? self.inference.dataParallelSizeLocal : 1)"
_LWS_READS = (
    "inference.executorBackend",
    "inference.tensorParallelSize",
    "inference.pipelineParallelSize",
    "inference.dataParallelSize",
    "inference.dataParallelSizeLocal",
    "inference.gpusPerNode",
)


def _cel_list(items: list[str]) -> str:
    return "[" + ", ".join(f"'{i}'" for i in items) + "]"


def _cel_string(regex: str) -> str:
    """A CEL raw string literal: backslashes reach RE2 as written."""
    if "'" in regex:
        raise ValueError(f"regex {regex!r} has a quote a CEL raw string cannot hold")
    return f"r'{regex}'"


def _pd_one_pod(role: str) -> Rule:
    """A role's replica fits one pod: the roles are StatefulSets (no LeaderWorkerSet per role)."""
    base = f"self.inference.disaggregation.{role}"
    tp = f"(has({base}.tensorParallelSize) ? {base}.tensorParallelSize : self.inference.tensorParallelSize)"
    dp = f"(has({base}.dataParallelSize) ? {base}.dataParallelSize : self.inference.dataParallelSize)"
    gpus = f"{tp} * self.inference.pipelineParallelSize * {dp}"
    return Rule(
        f"PD-{role.upper()}-ONE-POD",
        Severity.ERROR,
        f"spec.inference.disaggregation.{role}",
        (
            f"inference.disaggregation.{role}",
            "inference.tensorParallelSize",
            "inference.pipelineParallelSize",
            "inference.dataParallelSize",
            "inference.gpusPerNode",
        ),
        f"a {role} replica of a disaggregated job fits one pod",
        ("r3operator: api/disaggregation.py (one StatefulSet per role)",),
        checks.pd_one_pod(role),
        CelRule(
            f"!has(self.inference.disaggregation) || !has({base}) || {gpus} <= self.inference.gpusPerNode",
            f"'a {role} replica of inference.disaggregation needs %d GPUs (tensor x pipeline x data parallel), more "
            "than inference.gpusPerNode %d: each role replica runs in one pod'"
            f".format([{gpus}, self.inference.gpusPerNode])",
            f".inference.disaggregation.{role}",
        ),
    )


def _pod_template_rules() -> tuple[Rule, ...]:
    """Three rules per pod template (api/pod_rules.py), each refusing at that template's own path."""
    rules: list[Rule] = []
    for site in SITES:
        derived, derived_message = derived_cel(site)
        mounts, mounts_message = mounts_cel(site)
        rules.append(
            Rule(
                f"{site.rule_prefix}-DERIVED",
                Severity.ERROR,
                f"spec.{site.path}",
                (site.path,),
                "a pod template may not set the env, volumes, mounts, GPUs or labels r3operator derives",
                ("r3operator: builders/overrides.py (derived fields)",),
                check_derived(site),
                CelRule(derived, derived_message, f".{site.path}"),
            )
        )
        rules.append(
            Rule(
                f"{site.rule_prefix}-MOUNTS",
                Severity.ERROR,
                f"spec.{site.path}.volumeMounts",
                (site.path, "podTemplate.volumes"),
                "every volumeMount of a pod template names a volume it (or spec.podTemplate) defines",
                ("Kubernetes: PodSpec validation (volumeMounts[].name must be a volume)",),
                check_mounts(site),
                CelRule(mounts, mounts_message, f".{site.path}.volumeMounts", "FieldValueInvalid"),
            )
        )
        identity, identity_message = identity_cel(site)
        rules.append(
            Rule(
                f"{site.rule_prefix}-IDENTITY",
                Severity.ERROR,
                f"spec.{site.path}.serviceAccountName",
                (f"{site.path}.serviceAccountName",),
                "a pod template may not run as a ServiceAccount r3operator manages (<job>-trainer)",
                ("r3operator: builders/trainer_rbac.py (the per-RLJob identity)",),
                check_identity(site),
                CelRule(identity, identity_message, f".{site.path}.serviceAccountName"),
            )
        )
    return tuple(rules)


# ----------------------------------------------------------------------------------------- table

E, W = Severity.ERROR, Severity.WARNING

RULES: tuple[Rule, ...] = (
    Rule(
        "R3-EXECUTOR-RAY",
        E,
        "spec.inference.executorBackend",
        ("routingReplay.mode", "inference.executorBackend"),
        "R3 needs the mp executor",
        ("vllm-project/vllm#36237", "NovaSky-AI/SkyRL#1273"),
        checks.r3_executor_ray,
        CelRule(
            f"!({_CEL_R3} && self.inference.executorBackend == 'ray')",
            "'routingReplay.mode R3 needs inference.executorBackend mp, got ' + self.inference.executorBackend",
            ".inference.executorBackend",
        ),
    ),
    Rule(
        "MP-SINGLE-NODE",
        E,
        "spec.inference.tensorParallelSize",
        (
            "inference.executorBackend",
            "inference.tensorParallelSize",
            "inference.pipelineParallelSize",
            "inference.dataParallelSizeLocal",
            "inference.gpusPerNode",
        ),
        "with the mp executor each engine pod fits one node (a wider replica is split along DP only)",
        ("NovaSky-AI/SkyRL#1309", "vllm-project/vllm: docs/serving/data_parallel_deployment.md"),
        checks.mp_single_node,
        CelRule(
            "self.inference.executorBackend != 'mp' || self.inference.tensorParallelSize * "
            f"self.inference.pipelineParallelSize * {_CEL_DP_LOCAL_POD} <= self.inference.gpusPerNode",
            "'executorBackend mp keeps each engine pod on one node: tp x pp x dpLocal = %d GPUs > gpusPerNode "
            "%d'.format([self.inference.tensorParallelSize * self.inference.pipelineParallelSize * "
            f"{_CEL_DP_LOCAL_POD}, self.inference.gpusPerNode])",
            ".inference.tensorParallelSize",
            "FieldValueInvalid",
        ),
    ),
    Rule(
        "ENGINE-LWS",
        E,
        "spec.inference.dataParallelSize",
        _LWS_READS,
        "an engine replica wider than one pod needs LeaderWorkerSet in the cluster",
        ("kubernetes-sigs/lws: docs/concepts", "vllm-project/vllm: docs/serving/data_parallel_deployment.md"),
        checks.engine_lws_missing,
    ),
    Rule(
        "ENGINE-LWS-ASSUMED",
        W,
        "spec.inference.dataParallelSize",
        _LWS_READS,
        "offline (validate, explain, render): a multi-pod engine replica assumes LeaderWorkerSet in the cluster",
        ("kubernetes-sigs/lws: docs/concepts",),
        checks.engine_lws_assumed,
    ),
    Rule(
        "R3-INFERENCE-PP",
        E,
        "spec.inference.pipelineParallelSize",
        ("routingReplay.mode", "inference.pipelineParallelSize"),
        "R3 rejects engine pipeline parallelism",
        ("vllm-project/vllm: VllmConfig.__post_init__",),
        checks.r3_pp,
        CelRule(
            f"!({_CEL_R3} && self.inference.pipelineParallelSize > 1)",
            "'routingReplay.mode R3 is incompatible with inference.pipelineParallelSize "
            "%d'.format([self.inference.pipelineParallelSize])",
            ".inference.pipelineParallelSize",
        ),
    ),
    Rule(
        "R3-CONTEXT-PARALLEL",
        E,
        "spec.inference.decodeContextParallelSize",
        ("routingReplay.mode", "inference.decodeContextParallelSize"),
        "R3 rejects decode context parallelism",
        ("vllm-project/vllm: VllmConfig.__post_init__",),
        checks.r3_dcp,
        CelRule(
            f"!({_CEL_R3} && self.inference.decodeContextParallelSize > 1)",
            "'routingReplay.mode R3 is incompatible with inference.decodeContextParallelSize "
            "%d'.format([self.inference.decodeContextParallelSize])",
            ".inference.decodeContextParallelSize",
        ),
    ),
    Rule(
        "R3-KV-CONNECTOR",
        E,
        "spec.inference.kvConnector",
        ("routingReplay.mode", "inference.kvConnector"),
        "R3 rejects a KV connector on every engine (kv_both); a prefill/decode split is inference.disaggregation",
        ("vllm-project/vllm#39568", "PrimeIntellect-ai/prime-rl#2487"),
        checks.r3_kv_connector,
        CelRule(
            f"!({_CEL_R3} && self.inference.kvConnector != 'none')",
            "'routingReplay.mode R3 is incompatible with inference.kvConnector %s: an engine that loads KV fills its "
            "slots without an MoE forward, so the routes of those rows would be stale; "
            f"{checks.PD_SUPPORTED}'.format([self.inference.kvConnector])",
            ".inference.kvConnector",
        ),
    ),
    Rule(
        "PD-ONE-CONNECTOR",
        E,
        "spec.inference.disaggregation",
        ("inference.disaggregation", "inference.kvConnector", "inference.kvCacheOffload"),
        "a disaggregated job's connector is inference.disaggregation.connector alone",
        ("r3operator: api/disaggregation.py (one --kv-transfer-config per role)",),
        checks.pd_one_connector,
        CelRule(
            "!has(self.inference.disaggregation) || (self.inference.kvConnector == 'none' && "
            "!self.inference.kvCacheOffload)",
            "'inference.disaggregation sets each role KV connector itself: inference.kvConnector must be none and "
            "inference.kvCacheOffload false, got kvConnector %s, kvCacheOffload %s'"
            ".format([self.inference.kvConnector, string(self.inference.kvCacheOffload)])",
            ".inference.disaggregation",
        ),
    ),
    *(_pd_one_pod(role) for role in ("prefill", "decode")),
    Rule(
        "R3-KV-OFFLOAD",
        E,
        "spec.inference.kvCacheOffload",
        ("routingReplay.mode", "inference.kvCacheOffload"),
        "R3 rejects KV-cache offload",
        ("PrimeIntellect-ai/prime-rl: validate_router_replay_without_kv_offload", "vllm-project/vllm#39568"),
        checks.r3_kv_offload,
        CelRule(
            f"!({_CEL_R3} && self.inference.kvCacheOffload)",
            "'routingReplay.mode R3 is incompatible with inference.kvCacheOffload true'",
            ".inference.kvCacheOffload",
        ),
    ),
    Rule(
        "REPLAY-NEEDS-MOE",
        E,
        "spec.model.architecture.numExperts",
        ("routingReplay.mode", "model.architecture.numExperts"),
        "R2/R3 need an MoE model",
        ("vllm-project/vllm#42593",),
        checks.replay_needs_moe,
        CelRule(
            f"!({_CEL_REPLAY} && has(self.model.architecture) && self.model.architecture.numExperts <= 1)",
            "'routingReplay.mode %s needs an MoE model, numExperts is %d'.format([self.routingReplay.mode, "
            "self.model.architecture.numExperts])",
            ".model.architecture.numExperts",
        ),
    ),
    Rule(
        "MODEL-TOPK",
        E,
        "spec.model.architecture.topK",
        ("model.architecture.topK", "model.architecture.numExperts"),
        "topK cannot exceed numExperts",
        ("transformers: num_experts_per_tok <= num_experts",),
        checks.topk_le_experts,
        CelRule(
            "!has(self.model.architecture) || self.model.architecture.topK <= self.model.architecture.numExperts",
            "'model.architecture.topK %d exceeds numExperts %d'.format([self.model.architecture.topK, "
            "self.model.architecture.numExperts])",
            ".model.architecture.topK",
            "FieldValueInvalid",
        ),
    ),
    Rule(
        "MEGATRON-ROUTER-FUSION",
        E,
        "spec.trainer.megatron.routerFusion",
        ("trainer.backend", "routingReplay.mode", "trainer.megatron.routerFusion"),
        "Megatron replay refuses moe_router_fusion",
        ("NovaSky-AI/SkyRL: utils.py validate_megatron_cfg", "NVIDIA/Megatron-LM: moe_utils.py fused top-k"),
        checks.megatron_router_fusion,
        CelRule(
            f"!(self.trainer.backend == 'Megatron' && {_CEL_REPLAY} && has(self.trainer.megatron) && "
            "self.trainer.megatron.routerFusion)",
            "'routingReplay.mode ' + self.routingReplay.mode + ' is incompatible with "
            "trainer.megatron.routerFusion true'",
            ".trainer.megatron.routerFusion",
        ),
    ),
    Rule(
        "R3-RETOKENIZE",
        E,
        "spec.rollout.retokenizeChatHistory",
        ("routingReplay.mode", "rollout.retokenizeChatHistory"),
        "R3 refuses re-tokenised chat history",
        ("NovaSky-AI/SkyRL#1273: skyrl_gym_generator",),
        checks.r3_retokenize,
        CelRule(
            f"!({_CEL_R3} && self.rollout.retokenizeChatHistory)",
            "'routingReplay.mode R3 is incompatible with rollout.retokenizeChatHistory true'",
            ".rollout.retokenizeChatHistory",
        ),
    ),
    Rule(
        "R3-STEPWISE",
        E,
        "spec.rollout.stepWiseTrajectories",
        ("routingReplay.mode", "rollout.stepWiseTrajectories"),
        "R3 refuses step-wise trajectories",
        ("NovaSky-AI/SkyRL#1273: generator _validate_cfg",),
        checks.r3_stepwise,
        CelRule(
            f"!({_CEL_R3} && self.rollout.stepWiseTrajectories)",
            "'routingReplay.mode R3 is incompatible with rollout.stepWiseTrajectories true'",
            ".rollout.stepWiseTrajectories",
        ),
    ),
    Rule(
        "ENGINE-EP-DIVISIBILITY",
        E,
        "spec.inference.enableExpertParallel",
        (
            "inference.enableExpertParallel",
            "inference.tensorParallelSize",
            "inference.dataParallelSize",
            "model.architecture.numExperts",
        ),
        "numExperts divisible by the engine EP size (tp x dp)",
        ("vllm-project/vllm#52435",),
        checks.engine_ep,
        CelRule(
            "!(self.inference.enableExpertParallel && has(self.model.architecture)) || "
            "self.model.architecture.numExperts % (self.inference.tensorParallelSize * "
            "self.inference.dataParallelSize) == 0",
            "'numExperts %d is not divisible by the engine expert-parallel size "
            "%d'.format([self.model.architecture.numExperts, self.inference.tensorParallelSize * "
            "self.inference.dataParallelSize])",
            ".inference.enableExpertParallel",
            "FieldValueInvalid",
        ),
    ),
    Rule(
        "TRAINER-EP-DIVISIBILITY",
        E,
        "spec.trainer.megatron.expertParallelSize",
        ("trainer.backend", "trainer.megatron.expertParallelSize", "model.architecture.numExperts"),
        "numExperts divisible by the trainer EP size",
        ("PrimeIntellect-ai/prime-rl#3094",),
        checks.trainer_ep,
        CelRule(
            "!(self.trainer.backend == 'Megatron' && has(self.trainer.megatron) && "
            "has(self.model.architecture)) || self.model.architecture.numExperts % "
            "self.trainer.megatron.expertParallelSize == 0",
            "'numExperts %d is not divisible by trainer.megatron.expertParallelSize "
            "%d'.format([self.model.architecture.numExperts, self.trainer.megatron.expertParallelSize])",
            ".trainer.megatron.expertParallelSize",
            "FieldValueInvalid",
        ),
    ),
    Rule(
        "TRAINER-PARALLEL-FIT",
        E,
        "spec.trainer.megatron",
        ("trainer.nodes", "trainer.gpusPerNode", "trainer.megatron"),
        "Megatron parallel sizes divide the trainer GPUs",
        ("NVIDIA/Megatron-LM: parallel_state",),
        checks.trainer_fit,
        CelRule(
            "!(self.trainer.backend == 'Megatron' && has(self.trainer.megatron)) || "
            "((self.trainer.nodes * self.trainer.gpusPerNode) % (self.trainer.megatron.tensorParallelSize * "
            "self.trainer.megatron.pipelineParallelSize * self.trainer.megatron.contextParallelSize) == 0 && "
            "(self.trainer.nodes * self.trainer.gpusPerNode) % (self.trainer.megatron.expertParallelSize * "
            "self.trainer.megatron.expertTensorParallelSize * self.trainer.megatron.pipelineParallelSize) == 0)",
            "'trainer GPUs %d must be divisible by tp*pp*cp and by ep*etp*pp'.format([self.trainer.nodes * "
            "self.trainer.gpusPerNode])",
            ".trainer.megatron",
            "FieldValueInvalid",
        ),
    ),
    Rule(
        "MEGATRON-TP-NEEDS-SP",
        E,
        "spec.trainer.megatron.sequenceParallel",
        (
            "trainer.backend",
            "trainer.megatron.tensorParallelSize",
            "trainer.megatron.sequenceParallel",
            "model.architecture.numExperts",
        ),
        "Megatron MoE with tensor parallelism needs sequence parallelism",
        ("NVIDIA/Megatron-LM: TransformerConfig.__post_init__ (MoE + TP without SP)",),
        checks.megatron_tp_needs_sp,
        CelRule(
            "!(self.trainer.backend == 'Megatron' && has(self.trainer.megatron) && "
            "self.trainer.megatron.tensorParallelSize > 1 && !self.trainer.megatron.sequenceParallel && "
            "(!has(self.model.architecture) || self.model.architecture.numExperts > 1))",
            "'trainer.megatron.tensorParallelSize %d on an MoE model needs trainer.megatron.sequenceParallel "
            "true'.format([self.trainer.megatron.tensorParallelSize])",
            ".trainer.megatron.sequenceParallel",
            "FieldValueRequired",
        ),
    ),
    Rule(
        "MEGATRON-MICRO-BATCH-EP",
        E,
        "spec.trainer.megatron.microBatchSize",
        (
            "trainer.backend",
            "trainer.megatron.microBatchSize",
            "trainer.megatron.expertParallelSize",
            "trainer.nodes",
            "trainer.gpusPerNode",
        ),
        "Megatron micro-batches cannot be used when the expert group spans data-parallel replicas",
        ("r3operator: trainer/megatron/trainer.py build_megatron_trainer",),
        checks.megatron_micro_batch_ep,
    ),
    Rule(
        "TRAINER-BACKEND-UNION",
        E,
        "spec.trainer",
        ("trainer.backend", "trainer.fsdp", "trainer.megatron"),
        "only the block matching trainer.backend may be set",
        ("Kubernetes API conventions: unions",),
        checks.backend_union,
        CelRule(
            "(self.trainer.backend == 'FSDP' && !has(self.trainer.megatron)) || "
            "(self.trainer.backend == 'Megatron' && !has(self.trainer.fsdp))",
            "'trainer.backend ' + self.trainer.backend + ' allows only its own block (fsdp or megatron)'",
            ".trainer",
            "FieldValueInvalid",
        ),
    ),
    Rule(
        "FSDP-UNIMPLEMENTED",
        E,
        "spec.trainer.fsdp",
        ("trainer.fsdp.ulyssesSequenceParallelSize", "trainer.fsdp.samplePacking"),
        "FSDP settings the trainer does not implement are refused, not ignored",
        ("r3operator: trainer/hf_policy.py (padded micro-batches, no sequence parallelism)",),
        checks.fsdp_unimplemented,
        CelRule(
            "!has(self.trainer.fsdp) || ((!has(self.trainer.fsdp.ulyssesSequenceParallelSize) || "
            "self.trainer.fsdp.ulyssesSequenceParallelSize == 1) && (!has(self.trainer.fsdp.samplePacking) || "
            "!self.trainer.fsdp.samplePacking))",
            "'trainer.fsdp.' + (self.trainer.fsdp.ulyssesSequenceParallelSize != 1 ? "
            "'ulyssesSequenceParallelSize is not 1, but the FSDP trainer has no Ulysses sequence parallelism: set "
            "it to 1, or use trainer.backend Megatron' : 'samplePacking is true, but the FSDP trainer does not "
            "pack samples (it pads each micro-batch to its longest row): set it to false')",
            ".trainer.fsdp",
        ),
    ),
    Rule(
        "FSDP-ROUTER-FAMILY",
        E,
        "spec.model.architecture.family",
        (
            "trainer.backend",
            "routingReplay.mode",
            "model.architecture.routerType",
            "model.architecture.family",
        ),
        "FSDP replay only for softmax TopKRouter families",
        ("NovaSky-AI/SkyRL#1772",),
        checks.fsdp_family,
        CelRule(
            f"!(self.trainer.backend == 'FSDP' && {_CEL_REPLAY} && has(self.model.architecture)) || "
            "(self.model.architecture.routerType == 'softmax' && (!has(self.model.architecture.family) || "
            f"self.model.architecture.family in {_cel_list(sorted(HF_REPLAY_FAMILIES))}))",
            "'FSDP replay does not support this router family/type (' + self.model.architecture.routerType + "
            "'): use trainer.backend Megatron'",
            ".model.architecture.family",
        ),
    ),
    Rule(
        "EXTRA-ARGS-DERIVED",
        E,
        "spec.inference.extraArgs",
        ("inference.extraArgs",),
        "extraArgs may not override derived vLLM flags",
        ("r3operator: derived flags; vLLM's own parser (api/vllm_cli_tables, scripts/gen-vllm-cli-table.py)",),
        checks.extra_args_derived,
        CelRule(
            f"self.inference.extraArgs.all(a, !a.matches({_cel_string(DERIVED_VLLM_PATTERN)}))",
            "'inference.extraArgs sets vLLM arguments r3operator derives from the spec (any spelling vLLM accepts: "
            "short options, underscores, prefixes, --no- forms)'",
            ".inference.extraArgs",
        ),
    ),
    Rule(
        "EXTRA-ARGS-CODE-LOADING",
        E,
        "spec.inference.extraArgs",
        ("inference.extraArgs", "model.trustRemoteCode"),
        "code-loading vLLM flags need model.trustRemoteCode",
        ("r3operator: security model (docs/operator.md)",),
        checks.extra_args_code_loading,
        CelRule(
            "self.model.trustRemoteCode || self.inference.extraArgs.all(a, "
            + " && ".join(f"a != '{f}' && !a.startsWith('{f}=')" for f in CODE_LOADING_VLLM_FLAGS)
            + ")",
            "'inference.extraArgs loads code but model.trustRemoteCode is false: "
            "set model.trustRemoteCode: true to allow it'",
            ".inference.extraArgs",
            # Invalid, not Forbidden: EXTRA-ARGS-DERIVED refuses the same field, and a cause must name
            # one rule by reason and field.
            "FieldValueInvalid",
        ),
    ),
    Rule(
        "MODEL-GCS-CREDENTIALS",
        E,
        "spec.model.gcs",
        ("model.uri", "model.gcs"),
        "a gs:// model needs an HMAC key Secret",
        ("r3operator: docs/models.md", "Cloud Storage: simple migration from Amazon S3 (HMAC keys)"),
        source_checks.model_gcs_credentials,
        CelRule(
            "!self.model.uri.startsWith('gs://') || has(self.model.gcs)",
            "'model.uri ' + self.model.uri + ' needs model.gcs.credentialsSecret: a Secret with an HMAC key (access "
            "ID as AWS_ACCESS_KEY_ID, secret as AWS_SECRET_ACCESS_KEY)'",
            ".model.gcs",
            "FieldValueRequired",
        ),
    ),
    Rule(
        "TASK-DATASET-PATH",
        E,
        "spec.task.datasetPath",
        ("task.name", "task.datasetPath"),
        "task.name dataset reads task.datasetPath, and only it does",
        ("r3operator: tasks/dataset_task.py",),
        checks.dataset_path,
        CelRule(
            "(self.task.name == 'dataset') == has(self.task.datasetPath)",
            "'task.name ' + self.task.name + (self.task.name == 'dataset' ? ' needs task.datasetPath: a JSONL or "
            "Parquet file of prompt/messages + answer rows' : ' reads no task.datasetPath (only task.name dataset "
            "does)')",
            ".task.datasetPath",
            "FieldValueInvalid",
        ),
    ),
    Rule(
        "TASK-REWARD",
        E,
        "spec.task.reward",
        ("task.name", "task.reward"),
        "built-in tasks score token ids (exact-match, prefix-match); a dataset scores text",
        ("r3operator: tasks/rewards.py",),
        checks.reward_fits_task,
        CelRule(
            "self.task.name == 'dataset' ? self.task.reward != 'prefix-match' : "
            "self.task.reward in ['exact-match', 'prefix-match']",
            "'task.reward ' + self.task.reward + (self.task.name == 'dataset' ? ' compares token ids of the built-in "
            "tasks; a dataset task scores text with exact-match, function, http or math' : ' scores dataset text; "
            "the built-in task ' + self.task.name + ' scores with exact-match or prefix-match')",
            ".task.reward",
            "FieldValueInvalid",
        ),
    ),
    Rule(
        "TASK-REWARD-FUNCTION",
        E,
        "spec.task.rewardFunction",
        ("task.reward", "task.rewardFunction"),
        "task.reward function reads task.rewardFunction, and only it does",
        ("r3operator: tasks/rewards.py",),
        checks.reward_function_ref,
        CelRule(
            "(self.task.reward == 'function') == has(self.task.rewardFunction)",
            "'task.reward ' + self.task.reward + (self.task.reward == 'function' ? ' needs task.rewardFunction "
            "(module:function, importable in the trainer image)' : ' reads no task.rewardFunction (only task.reward "
            "function does)')",
            ".task.rewardFunction",
            "FieldValueInvalid",
        ),
    ),
    Rule(
        "TASK-REWARD-URL",
        E,
        "spec.task.rewardURL",
        ("task.reward", "task.rewardURL"),
        "task.reward http reads task.rewardURL, and only it does",
        ("r3operator: tasks/http_reward.py",),
        checks.reward_url,
        CelRule(
            "(self.task.reward == 'http') == has(self.task.rewardURL)",
            "'task.reward ' + self.task.reward + (self.task.reward == 'http' ? ' needs task.rewardURL (the endpoint "
            "the samples are POSTed to)' : ' reads no task.rewardURL (only task.reward http does)')",
            ".task.rewardURL",
            "FieldValueInvalid",
        ),
    ),
    *_pod_template_rules(),
    Rule(
        "MODEL-S3-CREDENTIALS",
        E,
        "spec.model.s3",
        ("model.uri", "model.s3"),
        "an s3:// model needs a credentials Secret",
        ("r3operator: docs/models.md",),
        source_checks.model_s3_credentials,
        CelRule(
            "!self.model.uri.startsWith('s3://') || has(self.model.s3)",
            "'model.uri ' + self.model.uri + ' needs model.s3.credentialsSecret: a Secret with AWS_ACCESS_KEY_ID "
            "and AWS_SECRET_ACCESS_KEY (model.s3.endpointURL for an S3-compatible store)'",
            ".model.s3",
            "FieldValueRequired",
        ),
    ),
    Rule(
        "DATASET-URI-SCHEME",
        E,
        "spec.task.datasetPath",
        ("task.datasetPath",),
        "a dataset is a path, s3:// or gs://",
        ("r3operator: docs/models.md",),
        source_checks.dataset_uri_scheme,
        CelRule(
            "!has(self.task.datasetPath) || !self.task.datasetPath.contains('://') || "
            "self.task.datasetPath.startsWith('s3://') || self.task.datasetPath.startsWith('gs://') || "
            "self.task.datasetPath.startsWith('file://')",
            "'task.datasetPath ' + self.task.datasetPath + ': use a path (on the routing volume or in the image), "
            "s3://bucket/key or gs://bucket/key'",
            ".task.datasetPath",
        ),
    ),
    Rule(
        "DATASET-S3-CREDENTIALS",
        E,
        "spec.task.s3",
        ("task.datasetPath", "task.s3"),
        "an s3:// dataset needs a credentials Secret",
        ("r3operator: docs/models.md",),
        source_checks.dataset_s3_credentials,
        CelRule(
            "!has(self.task.datasetPath) || !self.task.datasetPath.startsWith('s3://') || has(self.task.s3)",
            "'task.datasetPath ' + self.task.datasetPath + ' needs task.s3.credentialsSecret: a Secret with "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (task.s3.endpointURL for an S3-compatible store)'",
            ".task.s3",
            "FieldValueRequired",
        ),
    ),
    Rule(
        "DATASET-GCS-CREDENTIALS",
        E,
        "spec.task.gcs",
        ("task.datasetPath", "task.gcs"),
        "a gs:// dataset needs an HMAC key Secret",
        ("r3operator: docs/models.md", "Cloud Storage: simple migration from Amazon S3 (HMAC keys)"),
        source_checks.dataset_gcs_credentials,
        CelRule(
            "!has(self.task.datasetPath) || !self.task.datasetPath.startsWith('gs://') || has(self.task.gcs)",
            "'task.datasetPath ' + self.task.datasetPath + ' needs task.gcs.credentialsSecret: a Secret with an "
            "HMAC key (access ID as AWS_ACCESS_KEY_ID, secret as AWS_SECRET_ACCESS_KEY)'",
            ".task.gcs",
            "FieldValueRequired",
        ),
    ),
    Rule(
        "EVAL-TASK-DATASET",
        E,
        "spec.evaluation",
        ("evaluation", "task.name"),
        "held-out evaluation reads a dataset with the task's reader and reward: task.name dataset",
        ("r3operator: runtime/evaluation.py",),
        checks.evaluation_task,
        CelRule(
            "!has(self.evaluation) || self.task.name == 'dataset'",
            "'evaluation needs task.name dataset (its rows are read with the task reader and scored by the task "
            "reward), got task.name ' + self.task.name",
            ".evaluation",
            "FieldValueInvalid",
        ),
    ),
    Rule(
        "EVAL-DATASET-URI-SCHEME",
        E,
        "spec.evaluation.datasetPath",
        ("evaluation.datasetPath",),
        "an eval dataset is a path, s3:// or gs://",
        ("r3operator: docs/models.md",),
        source_checks.eval_dataset_uri_scheme,
        CelRule(
            "!has(self.evaluation) || !self.evaluation.datasetPath.contains('://') || "
            "self.evaluation.datasetPath.startsWith('s3://') || self.evaluation.datasetPath.startsWith('gs://') || "
            "self.evaluation.datasetPath.startsWith('file://')",
            "'evaluation.datasetPath ' + self.evaluation.datasetPath + ': use a path (on the routing volume or in the "
            "image), s3://bucket/key or gs://bucket/key'",
            ".evaluation.datasetPath",
        ),
    ),
    Rule(
        "EVAL-DATASET-CREDENTIALS",
        E,
        "spec.evaluation.datasetPath",
        ("evaluation.datasetPath", "task.s3", "task.gcs"),
        "an s3:// or gs:// eval dataset is fetched with task.s3 or task.gcs",
        ("r3operator: docs/models.md", "Cloud Storage: simple migration from Amazon S3 (HMAC keys)"),
        source_checks.eval_dataset_credentials,
        CelRule(
            "!has(self.evaluation) || (self.evaluation.datasetPath.startsWith('s3://') ? has(self.task.s3) : "
            "(!self.evaluation.datasetPath.startsWith('gs://') || has(self.task.gcs)))",
            "'evaluation.datasetPath ' + self.evaluation.datasetPath + "
            "(self.evaluation.datasetPath.startsWith('s3://') ? ' needs task.s3.credentialsSecret: a Secret with "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (task.s3.endpointURL for an S3-compatible store)' : "
            "' needs task.gcs.credentialsSecret: a Secret with an HMAC key (access ID as AWS_ACCESS_KEY_ID, secret as "
            "AWS_SECRET_ACCESS_KEY)')",
            ".evaluation.datasetPath",
            "FieldValueRequired",
        ),
    ),
    Rule(
        "EXPORT-S3-CREDENTIALS",
        E,
        "spec.export.s3",
        ("export.destination", "export.s3"),
        "an s3:// export destination needs a credentials Secret",
        ("r3operator: docs/runtime.md",),
        source_checks.export_s3_credentials,
        CelRule(
            "!has(self.export) || !self.export.destination.startsWith('s3://') || has(self.export.s3)",
            "'export.destination ' + self.export.destination + ' needs export.s3.credentialsSecret: a Secret with "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (export.s3.endpointURL for an S3-compatible store)'",
            ".export.s3",
            "FieldValueRequired",
        ),
    ),
    Rule(
        "EXPORT-GCS-CREDENTIALS",
        E,
        "spec.export.gcs",
        ("export.destination", "export.gcs"),
        "a gs:// export destination needs an HMAC key Secret",
        ("r3operator: docs/runtime.md", "Cloud Storage: simple migration from Amazon S3 (HMAC keys)"),
        source_checks.export_gcs_credentials,
        CelRule(
            "!has(self.export) || !self.export.destination.startsWith('gs://') || has(self.export.gcs)",
            "'export.destination ' + self.export.destination + ' needs export.gcs.credentialsSecret: a Secret with an "
            "HMAC key (access ID as AWS_ACCESS_KEY_ID, secret as AWS_SECRET_ACCESS_KEY)'",
            ".export.gcs",
            "FieldValueRequired",
        ),
    ),
    Rule(
        "EXPORT-WHEN",
        E,
        "spec.export",
        ("export.intervalSteps", "export.atEnd"),
        "an export section exports at some step: intervalSteps, atEnd or both",
        ("r3operator: docs/runtime.md",),
        checks.export_when,
        CelRule(
            "!has(self.export) || has(self.export.intervalSteps) || self.export.atEnd",
            "'export sets neither intervalSteps nor atEnd: nothing would ever be exported; set one of them'",
            ".export",
            "FieldValueRequired",
        ),
    ),
    Rule(
        "MANAGED-BY-QUEUE",
        E,
        "spec.managedBy",
        ("managedBy", "queueName"),
        "MultiKueue dispatches only a queued RLJob",
        ("Kueue: Run External Framework Jobs in Multi-Cluster (MultiKueue)",),
        checks.managed_by_queue,
        CelRule(
            "!has(self.managedBy) || self.managedBy != 'kueue.x-k8s.io/multikueue' || has(self.queueName)",
            "'managedBy ' + self.managedBy + ' needs queueName: MultiKueue dispatches the Workload of a LocalQueue "
            "whose ClusterQueue has a MultiKueue admission check'",
            ".queueName",
            "FieldValueRequired",
        ),
    ),
    # Python-only: the resolver's own parse (api/sources.py), which CEL cannot repeat.
    Rule(
        "EXPORT-URI-FORM",
        E,
        "spec.export.destination",
        ("export.destination",),
        "the export destination parses: pvc://claim/path, s3://bucket/prefix, gs://bucket/prefix, file:///path",
        ("r3operator: api/sources.py",),
        source_checks.export_uri_form,
    ),
    # Python-only: the resolver's own parse (api/sources.py), which CEL cannot repeat.
    Rule(
        "MODEL-URI-FORM",
        E,
        "spec.model.uri",
        ("model.uri", "model.revision"),
        "the model URI parses, with one revision",
        ("r3operator: api/sources.py",),
        source_checks.model_uri_form,
    ),
    # Python-only: need the vLLM version matrix (outside facts).
    Rule(
        "R3-VLLM-MIN-VERSION",
        E,
        "spec.inference.image",
        ("routingReplay.mode", "inference.image", "inference.vllmVersion"),
        "R3 needs a vLLM with routed-experts return",
        ("vllm-project/vllm#28284",),
        checks.r3_min_version,
    ),
    Rule(
        "R3-HYBRID-VLLM",
        E,
        "spec.inference.image",
        (
            "routingReplay.mode",
            "model.architecture.hybridAttention",
            "inference.image",
            "inference.vllmVersion",
        ),
        "R3 on hybrid-attention models needs vLLM >= 0.22.0",
        ("vllm-project/vllm#40692", "vllm-project/vllm#35744", "verl-project/verl#6922"),
        checks.r3_hybrid,
    ),
    Rule(
        "R3-SPEC-DECODE-VLLM",
        E,
        "spec.inference.speculativeDecoding",
        ("routingReplay.mode", "inference.speculativeDecoding", "inference.image", "inference.vllmVersion"),
        "R3 + speculative decoding needs the draft-router fix",
        ("vllm-project/vllm#48622",),
        checks.r3_spec_decode,
    ),
    Rule(
        "R3-MRV2-VLLM",
        E,
        "spec.inference.modelRunnerV2",
        ("routingReplay.mode", "inference.modelRunnerV2", "inference.image", "inference.vllmVersion"),
        "R3 under Model Runner V2 needs MRV2 capture",
        ("vllm-project/vllm#50721",),
        checks.r3_mrv2,
    ),
    Rule(
        "R3-EPLB-VLLM",
        E,
        "spec.inference.extraArgs",
        ("routingReplay.mode", "inference.extraArgs", "inference.image", "inference.vllmVersion"),
        "R3 with EPLB needs a vLLM that captures logical expert ids",
        ("vllm-project/vllm#33013",),
        checks.r3_eplb,
    ),
    Rule(
        "R3-PREFIX-CACHING-VLLM",
        E,
        "spec.inference.extraArgs",
        ("routingReplay.mode", "inference.extraArgs", "inference.image", "inference.vllmVersion"),
        "R3 on vLLM >= 0.31 needs prefix caching on (the AuxOutput connector that captures routes)",
        ("vllm-project/vllm#45635", "vLLM 0.33.0 config/vllm.py _verify_aux_output_compatibility"),
        checks.r3_prefix_caching,
    ),
    Rule(
        "R3-PD-NIXL-VLLM",
        E,
        "spec.inference.disaggregation.connector",
        ("routingReplay.mode", "inference.disaggregation", "inference.image", "inference.vllmVersion"),
        "R3 over NixlConnector needs a vLLM before 0.31 (later ones refuse routed experts beside it)",
        ("vLLM 0.33.0 config/vllm.py _verify_aux_output_compatibility", "vllm-project/vllm#45635"),
        checks.r3_pd_nixl_version,
    ),
    Rule(
        "R3-MOE-BACKEND",
        E,
        "spec.inference.extraArgs",
        ("routingReplay.mode", "inference.extraArgs", "inference.image", "inference.vllmVersion"),
        "R3 before vLLM 0.30.0 runs the Triton MoE kernel (the operator pins --moe-backend triton)",
        ("vllm-project/vllm#44116", "vllm-project/vllm#44115"),
        checks.r3_moe_backend,
    ),
    Rule(
        "PARTIAL-ROLLOUT-SYNC",
        E,
        "spec.rollout.partialRollout",
        ("rollout.partialRollout", "algorithm.mode"),
        "partial rollouts exist only in the asynchronous mode",
        ("r3operator: runtime/async_loop.py (a synchronous step has no rollout in flight at a weight update)",),
        checks.partial_rollout_sync,
        CelRule(
            "!self.rollout.partialRollout || self.algorithm.mode == 'async'",
            "'rollout.partialRollout needs algorithm.mode async, got ' + self.algorithm.mode",
            ".rollout.partialRollout",
        ),
    ),
    Rule(
        "KL-REFERENCE-UNSUPPORTED",
        E,
        "spec.algorithm.useKLLoss",
        ("algorithm.useKLLoss", "algorithm.klInReward"),
        "no KL to a reference policy: the trainer keeps no reference weights",
        ("r3operator: docs/runtime.md (what the loss is)", "NovaSky-AI/SkyRL#1772 (a reference must replay too)"),
        checks.kl_to_reference,
        CelRule(
            "!self.algorithm.useKLLoss && !self.algorithm.klInReward",
            "'algorithm.' + (self.algorithm.useKLLoss ? 'useKLLoss' : 'klInReward') + ' is true, but the trainer "
            "keeps no reference policy (KL to a reference is not implemented); set algorithm.useKLLoss and "
            "algorithm.klInReward to false'",
            ".algorithm.useKLLoss",
        ),
    ),
    Rule(
        "WEIGHT-SYNC-KERNEL-LAYOUT",
        E,
        "spec.weightSync.layout",
        (
            "weightSync.layout",
            "inference.image",
            "inference.vllmVersion",
            "inference.tensorParallelSize",
            "inference.pipelineParallelSize",
            "inference.decodeContextParallelSize",
            "inference.enableExpertParallel",
            "inference.extraArgs",
        ),
        "an explicit kernel sync layout needs vLLM 0.22.x or >= 0.30, unquantized parameters, no pipeline or context "
        "parallelism, and on a tensor- or expert-parallel engine vLLM >= 0.30 without EPLB (auto falls back to "
        "checkpoint instead)",
        (
            "r3operator: wire/kernel_layout.py",
            "r3operator: engine/shards.py (each engine rank's part, read off vLLM >= 0.30's layers)",
            "vLLM 0.22.1 Worker.start_weight_update(is_checkpoint_format)",
            "r3operator: engine/worker.py (the kernel bracket of vLLM >= 0.30)",
        ),
        checks.weight_sync_kernel_layout,
    ),
    # Warnings: legal but risky.
    Rule(
        "R3-PARTIAL-ROLLOUT",
        W,
        "spec.rollout.partialRollout",
        ("routingReplay.mode", "rollout.partialRollout"),
        "partial rollouts use tail-append route semantics",
        ("verl-project/verl#6046", "verl-project/verl#6029"),
        checks.partial_rollout,
    ),
    Rule(
        "GROUP-SIZE-ONE",
        W,
        "spec.rollout.groupSize",
        ("rollout.groupSize",),
        "a group of one trains on raw rewards (no group baseline)",
        ("verl: verl/trainer/ppo/core_algos.py compute_grpo_outcome_advantage",),
        checks.group_of_one,
    ),
    Rule(
        "IMAGE-TAG-UNPINNED",
        W,
        "spec.inference.image",
        ("inference.image", "inference.vllmVersion"),
        "the engine image tag is not a version",
        ("r3operator: version-gated rules",),
        checks.unpinned_image,
    ),
    Rule(
        "ENGINE-IMAGE-PLUGIN",
        W,
        "spec.inference.image",
        ("inference.image",),
        "the stock vLLM image lacks the r3operator plugin and worker extension",
        ("r3operator: images/engine/Dockerfile", "r3operator: api/vllm_args.py WORKER_EXTENSION_CLS"),
        checks.stock_engine_image,
    ),
    Rule(
        "CHECKPOINT-FITS-STORAGE",
        W,
        "spec.storage.size",
        ("model.uri", "checkpoint.keepLast", "storage.size", "storage.existingClaim"),
        "keepLast checkpoints (+1 being written) must fit the routing volume",
        ("r3operator: runtime/checkpoint.py (fp32 weights + AdamW, pruned after the new one is written)",),
        checks.checkpoints_fit_storage,
    ),
    Rule(
        "MODEL-ARCH-UNRESOLVED",
        W,
        "spec.model.architecture",
        ("routingReplay.mode", "model.architecture"),
        "replay without architecture facts",
        ("r3operator: route shape checks",),
        checks.arch_unresolved,
    ),
    Rule(
        "R3-ASYNC-SCHEDULING",
        W,
        "spec.inference.asyncScheduling",
        ("routingReplay.mode", "inference.asyncScheduling"),
        "R3 with async scheduling is vLLM-version dependent",
        ("vllm-project/vllm#28284", "vllm-project/vllm#39917", "PrimeIntellect-ai/prime-rl#2487"),
        checks.r3_async_scheduling,
    ),
)

RULES_BY_ID: dict[str, Rule] = {r.id: r for r in RULES}


def evaluate(spec: RLJobSpec, *, context: RuleContext | None = None) -> list[Finding]:
    """Run every rule; errors first, then warnings, each in table order."""
    ctx = context or RuleContext.for_spec(spec)
    findings = []
    for rule in RULES:
        message = rule.check(ctx)
        if message is not None:
            findings.append(Finding(rule.id, rule.severity, rule.field, message, rule.sources))
    return sorted(findings, key=lambda f: f.severity is not Severity.ERROR)


def errors(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.severity is Severity.ERROR]
