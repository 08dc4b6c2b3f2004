"""Every rule: a passing and a failing spec; the failing one yields that rule id, with its values."""

from __future__ import annotations

import pytest

from r3operator.api import RULES, Finding, RLJobSpec, Severity, evaluate
from r3operator.api.context import RuleContext
from r3operator.api.rules import RULES_BY_ID
from tests.api.conftest import build, sets
from tests.api.rule_cases import CASES, FACTS


def _evaluate(rule_id: str, spec: RLJobSpec) -> list[Finding]:
    return evaluate(spec, context=RuleContext.for_spec(spec, **FACTS.get(rule_id, {})))


def test_base_manifest_is_clean() -> None:
    assert evaluate(build().spec) == []


def test_every_rule_has_a_case() -> None:
    assert sorted(CASES) == sorted(r.id for r in RULES)


def test_rule_ids_are_unique_and_sourced() -> None:
    ids = [r.id for r in RULES]
    assert len(ids) == len(set(ids))
    for rule in RULES:
        assert rule.sources, rule.id
        assert rule.field.startswith("spec."), rule.id
        assert rule.reads, rule.id


@pytest.mark.parametrize("rule_id", sorted(CASES))
def test_rule_passes(rule_id: str) -> None:
    passing, _ = CASES[rule_id]
    found = {f.rule for f in _evaluate(rule_id, build(passing).spec)}
    assert rule_id not in found


@pytest.mark.parametrize("rule_id", sorted(CASES))
def test_rule_fails_with_its_id_only(rule_id: str) -> None:
    _, failing = CASES[rule_id]
    findings = _evaluate(rule_id, build(failing).spec)
    hits = [f for f in findings if f.rule == rule_id]
    assert len(hits) == 1, findings
    rule = RULES_BY_ID[rule_id]
    assert hits[0].severity is rule.severity
    assert hits[0].field == rule.field
    # No other *error* fires on a case built for one rule: rules do not overlap by accident.
    others = [f.rule for f in findings if f.rule != rule_id and f.severity is Severity.ERROR]
    assert others == []


def test_messages_quote_actual_values() -> None:
    [f] = [f for f in evaluate(build(sets(**{"inference.pipelineParallelSize": 3})).spec)]
    assert f.rule == "R3-INFERENCE-PP" and "3" in f.message
    mp = build(
        sets(
            **{"inference.tensorParallelSize": 4, "inference.dataParallelSize": 4, "inference.dataParallelSizeLocal": 4}
        )
    )
    [f] = [f for f in evaluate(mp.spec) if f.rule == "MP-SINGLE-NODE"]
    assert "16 GPUs > gpusPerNode 8" in f.message


def test_unknown_version_fails_closed() -> None:
    job = build(sets(**{"inference.image": "vllm/vllm-openai:latest"}))
    rules = {f.rule: f for f in evaluate(job.spec)}
    assert rules["IMAGE-TAG-UNPINNED"].severity is Severity.WARNING
    assert rules["R3-VLLM-MIN-VERSION"].severity is Severity.ERROR
    assert "unknown" in rules["R3-VLLM-MIN-VERSION"].message


def test_our_engine_image_tag_is_read_as_its_vllm_version() -> None:
    job = build(sets(**{"inference.image": "ghcr.io/r3operator/engine:0.1.0-vllm0.30.0"}))
    assert evaluate(job.spec) == []
    old = build(sets(**{"inference.image": "ghcr.io/r3operator/engine:0.1.0-vllm0.13.0"}))
    [f] = [f for f in evaluate(old.spec) if f.rule == "R3-VLLM-MIN-VERSION"]
    assert "got 0.13.0" in f.message


def test_own_version_tag_of_a_non_vllm_image_fails_closed_naming_the_field() -> None:
    job = build(sets(**{"inference.image": "ghcr.io/r3operator/engine:0.1.0"}))
    rules = {f.rule: f for f in evaluate(job.spec)}
    assert "inference.image ghcr.io/r3operator/engine:0.1.0" in rules["R3-VLLM-MIN-VERSION"].message
    assert "-vllm<X.Y.Z>" in rules["IMAGE-TAG-UNPINNED"].message
    assert "inference.vllmVersion" in rules["IMAGE-TAG-UNPINNED"].message


def test_checkpoint_warning_quotes_sizes_and_skips_what_it_cannot_estimate() -> None:
    job = build(sets(**{"checkpoint.keepLast": 2, "storage.size": "500Gi"}))
    [f] = [f for f in evaluate(job.spec) if f.rule == "CHECKPOINT-FITS-STORAGE"]
    assert "storage.size 500Gi (500 GiB)" in f.message and "keepLast 2" in f.message
    assert "~335 GiB each for a 30B-parameter model" in f.message and "1006 GiB at the peak" in f.message
    existing = build(sets(**{"storage.size": "1Gi", "storage.existingClaim": "models"}))
    unnamed = build(sets(**{"storage.size": "1Gi", "model.uri": "hf://org/mystery-moe"}))
    for spec in (existing.spec, unnamed.spec):
        assert "CHECKPOINT-FITS-STORAGE" not in {f.rule for f in evaluate(spec)}


def test_default_checkpoint_settings_fit_the_default_volume_for_a_7b_model() -> None:
    job = build(sets(**{"model.uri": "hf://allenai/OLMoE-1B-7B-0924", "storage": {}}))
    assert job.spec.checkpoint.interval_steps == 50 and job.spec.checkpoint.keep_last == 1
    [f] = [f for f in evaluate(job.spec) if f.rule == "CHECKPOINT-FITS-STORAGE"]  # 2 x 78 GiB > 100Gi
    assert "100Gi" in f.message


def test_errors_sort_before_warnings() -> None:
    job = build(sets(**{"inference.image": "vllm/vllm-openai:latest"}))
    severities = [f.severity for f in evaluate(job.spec)]
    assert severities == sorted(severities, key=lambda s: s is not Severity.ERROR)


@pytest.mark.parametrize(
    ("fsdp", "names"),
    [
        ({"ulyssesSequenceParallelSize": 2}, "ulyssesSequenceParallelSize is 2, not 1"),
        ({"samplePacking": True}, "samplePacking is true"),
    ],
)
def test_fsdp_settings_the_trainer_does_not_implement_are_refused_naming_the_field(fsdp: dict, names: str) -> None:
    [finding] = [f for f in evaluate(build(sets(**{"trainer.fsdp": fsdp})).spec) if f.rule == "FSDP-UNIMPLEMENTED"]
    assert finding.severity is Severity.ERROR and f"trainer.fsdp.{names}" in finding.message
