"""The CRD's CEL rules and the Python rules agree: two CEL engines and Python, same objects.

For every object, the set of CEL-capable rule ids that Python reports as errors must equal the set
of rules whose CEL expression fails, under both common-expression-language and cel-python
(`cross_check` raises if the two engines disagree). Objects are the hand-written rule cases plus
hypothesis-generated specs over every field a rule reads.
"""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from r3operator.api import RULES, Severity, evaluate, parse_rljob
from r3operator.api.crd import crd
from r3operator.api.families import HF_REPLAY_FAMILIES
from r3operator.testing.apiserver_validation import apply_defaults
from r3operator.testing.cel import collect_rules, cross_check
from tests.api.conftest import base_manifest, set_path
from tests.api.rule_cases import CASES

SCHEMA = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
RULE_ID_BY_CEL = {r.cel.rule: r.id for r in RULES if r.cel is not None}
CEL_RULE_IDS = set(RULE_ID_BY_CEL.values())


def verdicts(manifest: dict[str, Any]) -> tuple[set[str], set[str]]:
    """(python error rule ids among CEL-capable rules, CEL-violated rule ids)."""
    job = parse_rljob(copy.deepcopy(manifest))
    python = {f.rule for f in evaluate(job.spec) if f.severity is Severity.ERROR and f.rule in CEL_RULE_IDS}
    obj = apply_defaults(SCHEMA, copy.deepcopy(manifest))  # what the API server evaluates CEL on
    violations = cross_check(SCHEMA, obj)
    unknown = [v.rule for v in violations if v.rule not in RULE_ID_BY_CEL]
    assert unknown == [], f"non-table CEL rule failed: {unknown}"
    return python, {RULE_ID_BY_CEL[v.rule] for v in violations}


def test_every_crd_rule_compiles_in_both_engines() -> None:
    rules = collect_rules(SCHEMA)
    assert {r.rule for r in rules} >= set(RULE_ID_BY_CEL)
    from r3operator.testing.cel import check_rule

    for rule in rules:
        check_rule(rule)


def test_rule_cases_agree() -> None:
    for rule_id, (passing, failing) in CASES.items():
        for mutate in (passing, failing):
            manifest = base_manifest()
            mutate(manifest)
            python, cel = verdicts(manifest)
            assert python == cel, (rule_id, python, cel)


def test_cel_message_expressions_render_values() -> None:
    manifest = base_manifest()
    set_path(manifest, "inference.pipelineParallelSize", 4)
    obj = apply_defaults(SCHEMA, manifest)
    [violation] = cross_check(SCHEMA, obj)
    assert violation.field_path == "spec.inference.pipelineParallelSize"
    assert violation.reason == "FieldValueForbidden"
    assert violation.message.endswith("pipelineParallelSize 4")


def test_transition_rule_blocks_backend_change() -> None:
    old = apply_defaults(SCHEMA, base_manifest())
    new = base_manifest()
    set_path(new, "trainer.backend", "Megatron")
    new = apply_defaults(SCHEMA, new)
    fields = {v.field_path for v in cross_check(SCHEMA, new, old)}
    assert "spec.trainer.backend" in fields


# ----------------------------------------------------------------------------- property-based

_FLAGS = [
    "--enable-prefix-caching",
    "--max-num-seqs=64",
    "--tensor-parallel-size=2",
    "--port",
    "--seed=1",
    "--kv-transfer-config={}",
    "--enforce-eager",
]


@st.composite
def specs(draw: st.DrawFn) -> dict[str, Any]:
    m = base_manifest()
    s = m["spec"]
    s["routingReplay"] = {"mode": draw(st.sampled_from(["Disabled", "R2", "R3"])), "replayRef": draw(st.booleans())}
    experts = draw(st.integers(1, 300))
    arch = {
        "numLayers": draw(st.integers(1, 64)),
        "numExperts": experts,
        "topK": draw(st.integers(1, 10)),
        "routerType": draw(st.sampled_from(["softmax", "sigmoid-bias"])),
        "hybridAttention": draw(st.booleans()),
    }
    family = draw(st.sampled_from([None, "deepseek_v3", "glm4_moe", *sorted(HF_REPLAY_FAMILIES)]))
    if family is not None:
        arch["family"] = family
    s["model"]["architecture"] = draw(st.sampled_from([arch, None])) if draw(st.booleans()) else arch
    inf = s["inference"]
    inf.update(
        {
            "image": draw(
                st.sampled_from(
                    [
                        "vllm/vllm-openai:v0.13.0",
                        "vllm/vllm-openai:v0.20.2",
                        "vllm/vllm-openai:v0.22.1",
                        "vllm/vllm-openai:v0.30.0",
                        "vllm/vllm-openai:latest",
                        "vllm/vllm-openai@sha256:" + "a" * 64,
                    ]
                )
            ),
            "executorBackend": draw(st.sampled_from(["mp", "ray"])),
            "tensorParallelSize": draw(st.integers(1, 8)),
            "pipelineParallelSize": draw(st.integers(1, 3)),
            "dataParallelSize": draw(st.integers(1, 4)),
            "decodeContextParallelSize": draw(st.integers(1, 2)),
            "enableExpertParallel": draw(st.booleans()),
            "gpusPerNode": draw(st.integers(1, 8)),
            "kvCacheOffload": draw(st.booleans()),
            "kvConnector": draw(st.sampled_from(["none", "nixl", "lmcache", "offloading"])),
            "asyncScheduling": draw(st.booleans()),
            "modelRunnerV2": draw(st.booleans()),
            "extraArgs": draw(st.lists(st.sampled_from(_FLAGS), max_size=3)),
        }
    )
    if draw(st.booleans()):
        inf["dataParallelSizeLocal"] = draw(st.integers(1, 4))
    if draw(st.booleans()):
        inf["speculativeDecoding"] = {"method": "mtp", "numSpeculativeTokens": draw(st.integers(1, 3))}
    tr = s["trainer"]
    tr["backend"] = draw(st.sampled_from(["FSDP", "Megatron"]))
    tr["nodes"] = draw(st.integers(1, 3))
    tr["gpusPerNode"] = draw(st.sampled_from([1, 2, 4, 8]))
    blocks = draw(st.sampled_from(["none", "fsdp", "megatron", "both"]))
    if blocks in ("fsdp", "both"):
        tr["fsdp"] = {"samplePacking": draw(st.booleans())}
    if blocks in ("megatron", "both"):
        tr["megatron"] = {
            k: draw(st.integers(1, 4))
            for k in ("tensorParallelSize", "pipelineParallelSize", "contextParallelSize", "expertTensorParallelSize")
        }
        tr["megatron"]["expertParallelSize"] = draw(st.sampled_from([1, 2, 4, 8, 16]))
        tr["megatron"]["routerFusion"] = draw(st.booleans())
    s["rollout"] = {
        k: draw(st.booleans()) for k in ("retokenizeChatHistory", "stepWiseTrajectories", "partialRollout", "multiTurn")
    }
    s["algorithm"] = {"useKLLoss": draw(st.booleans()), "klInReward": draw(st.booleans())}
    return m


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs())
def test_generated_specs_never_crash_and_cel_agrees(manifest: dict[str, Any]) -> None:
    python, cel = verdicts(manifest)
    assert python == cel
