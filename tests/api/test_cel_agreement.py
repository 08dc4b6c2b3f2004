"""The CRD's CEL rules and the Python rules agree, judged by the REAL kube-apiserver.

For every object, the set of CEL-capable rule ids that Python reports as errors must equal the set of
rules the apiserver refuses the object for (a dry-run create; its causes mapped back to rule ids by
reason and fieldPath, see real_apiserver.py). Objects are the hand-written rule cases plus
hypothesis-generated specs over every field a rule reads. The apiserver defaults the object before
it runs CEL, exactly as it will in a user's cluster.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kubecluster.clients import kubectl

from r3operator.api import Severity, evaluate, parse_rljob
from r3operator.api.families import HF_REPLAY_FAMILIES
from r3operator.api.rules import RULES_BY_ID
from tests.api.conftest import base_manifest, set_path
from tests.api.real_apiserver import CEL_RULE_IDS, RLJobApi, message_pattern, rule_ids
from tests.api.rule_cases import CASES


def verdicts(api: RLJobApi, manifest: dict[str, Any]) -> tuple[set[str], set[str]]:
    """(Python's error rule ids among the CEL-capable rules, the rule ids the apiserver refused it for)."""
    job = parse_rljob(copy.deepcopy(manifest))
    python = {f.rule for f in evaluate(job.spec) if f.severity is Severity.ERROR and f.rule in CEL_RULE_IDS}
    return python, rule_ids(api.refusal(manifest))


def case(rule_id: str, which: int) -> dict[str, Any]:
    manifest = base_manifest()
    CASES[rule_id][which](manifest)
    return manifest


@pytest.mark.parametrize("rule_id", sorted(CASES))
def test_rule_cases_agree(rljob_api: RLJobApi, rule_id: str) -> None:
    for which in (0, 1):
        python, server = verdicts(rljob_api, case(rule_id, which))
        assert python == server, (rule_id, "passing" if which == 0 else "failing", python, server)


def test_every_cel_rule_is_enforced_by_the_apiserver(rljob_api: RLJobApi) -> None:
    refused = {rule_id for rule_id in CEL_RULE_IDS if rule_id in rule_ids(rljob_api.refusal(case(rule_id, 1)))}
    assert refused == set(CEL_RULE_IDS)


@pytest.mark.parametrize("rule_id", sorted(CEL_RULE_IDS))
def test_cel_message_expressions_render_values(rljob_api: RLJobApi, rule_id: str) -> None:
    [cause] = [c for c in rljob_api.refusal(case(rule_id, 1)) if rule_ids([c]) == {rule_id}]
    cel = RULES_BY_ID[rule_id].cel
    assert cel is not None
    assert message_pattern(cel.message_expression).search(cause.message), cause.message
    assert "%" not in cause.message and "failed rule" not in cause.message, cause.message


def test_rendered_message_carries_the_offending_value(rljob_api: RLJobApi) -> None:
    manifest = base_manifest()
    set_path(manifest, "inference.pipelineParallelSize", 4)
    [cause] = rljob_api.refusal(manifest)
    assert cause.field == "spec.inference.pipelineParallelSize"
    assert cause.reason == "FieldValueForbidden"
    assert cause.message == "Forbidden: routingReplay.mode R3 is incompatible with inference.pipelineParallelSize 4"


def test_kubectl_apply_reports_the_rule_message_and_field(rljob_api: RLJobApi) -> None:
    manifest = rljob_api.here(case("MP-SINGLE-NODE", 1))
    result = kubectl(rljob_api.plane, "apply", "--dry-run=server", "-f", "-", stdin=yaml.safe_dump(manifest))
    assert result.returncode != 0
    assert 'The RLJob "base" is invalid' in result.stderr
    assert (
        "spec.inference.tensorParallelSize: Invalid value: executorBackend mp keeps each engine pod on one node: "
        "tp x pp x dpLocal = 16 GPUs > gpusPerNode 8"
    ) in result.stderr


def test_transition_rule_blocks_backend_change(rljob_api: RLJobApi) -> None:
    manifest = base_manifest()
    manifest["metadata"]["name"] = "transition"
    rljob_api.create(manifest, dry_run=False)
    change = {"spec": {"trainer": {"backend": "Megatron", "megatron": {"expertParallelSize": 8}}}}
    causes = rljob_api.patch_refusal("transition", change)
    immutable = [c for c in causes if c.field == "spec.trainer.backend" and "trainer.backend is immutable" in c.message]
    assert immutable, causes
    # The same object under a new name is no transition: Megatron is accepted.
    manifest["metadata"]["name"] = "fresh-megatron"
    set_path(manifest, "trainer", {**manifest["spec"]["trainer"], **change["spec"]["trainer"]})
    assert rljob_api.refusal(manifest) == []


# ----------------------------------------------------------------------------- property-based

_FLAGS = [
    "--enable-prefix-caching",
    "--max-num-seqs=64",
    "--tensor-parallel-size=2",
    "--port",
    "--seed=1",
    "--kv-transfer-config={}",
    "--enforce-eager",
    # other spellings of derived flags (api/vllm_cli.py), and near misses that set other arguments
    "-tp4",
    "--served_model_name=m",
    "--no-async-scheduling",
    "--speculative-config.method=ngram",
    "--max-model",
    "-dpa=10.0.0.1",
    "--max-num-batched-tokens=8192",
    "-O3",
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
        role = st.fixed_dictionaries(
            {}, optional={"tensorParallelSize": st.integers(1, 8), "dataParallelSize": st.integers(1, 4)}
        )
        inf["disaggregation"] = {"connector": draw(st.sampled_from(["nixl", "storage"])), "prefill": draw(role)}
        if draw(st.booleans()):
            inf["disaggregation"]["decode"] = draw(role)
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
    s["algorithm"] = {
        "useKLLoss": draw(st.booleans()),
        "klInReward": draw(st.booleans()),
        "mode": draw(st.sampled_from(["sync", "async"])),
    }
    task: dict[str, Any] = {
        "name": draw(st.sampled_from(["count", "guess", "dataset"])),
        "reward": draw(st.sampled_from(["exact-match", "prefix-match", "math", "function", "http"])),
    }
    if draw(st.booleans()):
        task["datasetPath"] = "/data/math/train.jsonl"
    if draw(st.booleans()):
        task["rewardFunction"] = "my_rewards.score:judge"
    if draw(st.booleans()):
        task["rewardURL"] = "http://reward.rl.svc:8080/score"
    for store in ("s3", "gcs"):
        if draw(st.booleans()):
            task[store] = {"credentialsSecret": "store"}
    s["task"] = task
    if draw(st.booleans()):
        path = draw(st.sampled_from(["/data/math/test.jsonl", "file:///d/t.jsonl", "s3://d/t.jsonl", "gs://d/t.jsonl"]))
        s["evaluation"] = {"datasetPath": draw(st.sampled_from([path, "hdfs://d/t.jsonl"]))}
    if draw(st.booleans()):
        export: dict[str, Any] = {
            "destination": draw(st.sampled_from(["pvc://models/rl", "s3://b/rl", "gs://b/rl", "file:///x/rl"])),
            "atEnd": draw(st.booleans()),
        }
        if draw(st.booleans()):
            export["intervalSteps"] = draw(st.integers(1, 100))
        for store in ("s3", "gcs"):
            if draw(st.booleans()):
                export[store] = {"credentialsSecret": "store"}
        s["export"] = export
    if draw(st.booleans()):
        s["managedBy"] = draw(st.sampled_from(["kueue.x-k8s.io/multikueue", "r3operator.io/operator"]))
    if draw(st.booleans()):
        s["queueName"] = "gpu"
    return m


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(manifest=specs())
def test_generated_specs_agree_with_the_apiserver(rljob_api: RLJobApi, manifest: dict[str, Any]) -> None:
    python, server = verdicts(rljob_api, manifest)
    assert python == server
