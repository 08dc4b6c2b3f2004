"""CEL rule evaluation (r3operator.testing.cel) in both engines, on a small hand-written schema."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from r3operator.testing import cel

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "spec": {
            "type": "object",
            "x-kubernetes-validations": [
                {
                    "rule": "!(self.mode == 'R3' && self.offload)",
                    "message": "R3 replay cannot be combined with offload",
                },
                {
                    "rule": "self.replicas >= oldSelf.replicas",
                    "messageExpression": "'replicas may not shrink below ' + string(oldSelf.replicas)",
                    "reason": "FieldValueForbidden",
                    "fieldPath": ".replicas",
                },
                {"rule": "self.mode.lowerAscii() != 'forbidden'", "message": "mode is forbidden"},
            ],
            "properties": {
                "mode": {"type": "string"},
                "offload": {"type": "boolean"},
                "replicas": {"type": "integer"},
                "ratio": {
                    "type": "number",
                    "x-kubernetes-validations": [{"rule": "self == 1.0 || self < 1.0"}],
                },
                "workers": {
                    "type": "array",
                    "x-kubernetes-list-type": "map",
                    "x-kubernetes-list-map-keys": ["name"],
                    "items": {
                        "type": "object",
                        "properties": {"name": {"type": "string"}, "gpus": {"type": "integer"}},
                        "x-kubernetes-validations": [
                            {"rule": "self.gpus > 0", "message": "a worker needs a GPU"},
                            {"rule": "self.gpus == oldSelf.gpus", "message": "gpus is immutable"},
                        ],
                    },
                },
                "labels": {
                    "type": "object",
                    "additionalProperties": {
                        "type": "string",
                        "x-kubernetes-validations": [{"rule": "self.size() <= 5", "message": "too long"}],
                    },
                },
            },
        }
    },
}


def spec(**fields: Any) -> dict[str, Any]:
    return {"spec": {"mode": "GRPO", "offload": False, "replicas": 2, **fields}}


ENGINES = ["cel", "celpy"]


def test_collect_rules_walks_properties_items_and_additional_properties() -> None:
    rules = cel.collect_rules(SCHEMA)
    assert [(r.path, r.rule[:12]) for r in rules] == [
        (".spec", "!(self.mode "),
        (".spec", "self.replica"),
        (".spec", "self.mode.lo"),
        (".spec.ratio", "self == 1.0 "),
        (".spec.workers[*]", "self.gpus > "),
        (".spec.workers[*]", "self.gpus =="),
        (".spec.labels[*]", "self.size() "),
    ]
    transition = [r.rule for r in rules if r.is_transition]
    assert transition == ["self.replicas >= oldSelf.replicas", "self.gpus == oldSelf.gpus"]
    assert rules[1].reason == "FieldValueForbidden" and rules[1].fieldPath == ".replicas"


@pytest.mark.parametrize("engine", ENGINES)
def test_valid_object_has_no_violations(engine: cel.Engine) -> None:
    obj = spec(ratio=1, workers=[{"name": "a", "gpus": 1}], labels={"team": "rl"})
    assert cel.evaluate(SCHEMA, obj, engine=engine) == []


@pytest.mark.parametrize("engine", ENGINES)
def test_failing_rule_reports_path_message_and_default_reason(engine: cel.Engine) -> None:
    (violation,) = cel.evaluate(SCHEMA, spec(mode="R3", offload=True), engine=engine)
    assert violation.path == ".spec"
    assert violation.field_path == "spec"
    assert violation.reason == "FieldValueInvalid"
    assert violation.message == "R3 replay cannot be combined with offload"


@pytest.mark.parametrize("engine", ENGINES)
def test_transition_rule_needs_old_object_and_uses_message_expression(engine: cel.Engine) -> None:
    shrunk = spec(replicas=1)
    assert cel.evaluate(SCHEMA, shrunk, engine=engine) == []  # create: transition rules skipped
    (violation,) = cel.evaluate(SCHEMA, shrunk, old_obj=spec(replicas=4), engine=engine)
    assert violation.message == "replicas may not shrink below 4"
    assert violation.reason == "FieldValueForbidden"
    assert violation.field_path == "spec.replicas"


@pytest.mark.parametrize("engine", ENGINES)
def test_list_items_correlate_by_map_key_for_old_self(engine: cel.Engine) -> None:
    old = spec(workers=[{"name": "a", "gpus": 1}, {"name": "b", "gpus": 1}])
    new = spec(workers=[{"name": "b", "gpus": 2}, {"name": "c", "gpus": 0}])
    violations = cel.evaluate(SCHEMA, new, old_obj=old, engine=engine)
    assert sorted((v.field_path, v.message) for v in violations) == [
        ("spec.workers[0]", "gpus is immutable"),  # b changed; correlated by name despite moving
        ("spec.workers[1]", "a worker needs a GPU"),  # c is new: only the non-transition rule runs
    ]


@pytest.mark.parametrize("engine", ENGINES)
def test_additional_properties_values_are_validated_with_their_key(engine: cel.Engine) -> None:
    (violation,) = cel.evaluate(SCHEMA, spec(labels={"ok": "x", "bad": "toolong"}), engine=engine)
    assert violation.field_path == "spec.labels[bad]"


@pytest.mark.parametrize("engine", ENGINES)
def test_number_fields_are_doubles_even_when_json_has_an_int(engine: cel.Engine) -> None:
    # cel-python is type-strict: `self == 1.0` on an int would be a no-overload error.
    assert cel.evaluate(SCHEMA, spec(ratio=1), engine=engine) == []
    (violation,) = cel.evaluate(SCHEMA, spec(ratio=2), engine=engine)
    assert violation.field_path == "spec.ratio"


@pytest.mark.parametrize("engine", ENGINES)
def test_missing_field_without_has_is_an_error_violation(engine: cel.Engine) -> None:
    obj = {"spec": {"offload": False, "replicas": 1}}  # no mode: `self.mode` errors, as in k8s
    violations = cel.evaluate(SCHEMA, obj, engine=engine)
    assert {v.field_path for v in violations} == {"spec"}
    assert all("evaluating rule" in v.message for v in violations)


def test_absent_nodes_are_skipped() -> None:
    assert cel.evaluate(SCHEMA, {"metadata": {"name": "x"}}) == []


def test_cross_check_agrees_on_valid_and_invalid_objects() -> None:
    assert cel.cross_check(SCHEMA, spec(ratio=0.5)) == []
    assert len(cel.cross_check(SCHEMA, spec(mode="R3", offload=True, replicas=1), spec(replicas=3))) == 2


def test_cross_check_raises_on_dialect_drift() -> None:
    # The Rust engine compares int and double leniently; cel-python (like cel-go) refuses.
    schema = {"type": "object", "x-kubernetes-validations": [{"rule": "self.n == 3.0"}]}
    with pytest.raises(cel.CelDisagreement, match="cel-python says error"):
        cel.cross_check(schema, {"n": 3})


@pytest.mark.parametrize(
    "rule",
    [
        "self.?mode.orValue('x') == 'x'",
        "self[?'mode'].hasValue()",
        "quantity(self.memory).isGreaterThan(quantity('1Gi'))",
        "self.workers.map(w, w.name).isSorted()",
        "url(self.endpoint).getScheme() == 'https'",
    ],
)
def test_unsupported_syntax_and_kubernetes_libraries_raise_clearly(rule: str) -> None:
    schema = {"type": "object", "x-kubernetes-validations": [{"rule": rule}]}
    with pytest.raises(cel.UnsupportedCel):
        cel.evaluate(schema, {"mode": "a"})
    with pytest.raises(cel.UnsupportedCel):
        cel.check_rule(rule)


def test_syntax_error_is_a_compile_error() -> None:
    with pytest.raises(cel.CelCompileError, match="does not compile"):
        cel.check_rule("self.replicas >")


def test_message_expression_falls_back_to_message_on_error() -> None:
    schema = {
        "type": "object",
        "x-kubernetes-validations": [{"rule": "false", "message": "static", "messageExpression": "self.missing + 'x'"}],
    }
    (violation,) = cel.evaluate(schema, {})
    assert violation.message == "static"


def test_date_time_and_duration_formats_bind_as_timestamp_and_duration() -> None:
    schema = {
        "type": "object",
        "properties": {
            "at": {"type": "string", "format": "date-time"},
            "timeout": {"type": "string", "format": "duration"},
        },
        "x-kubernetes-validations": [
            {"rule": "self.at < timestamp('2030-01-01T00:00:00Z') && self.timeout > duration('90s')"}
        ],
    }
    ok = {"at": "2026-11-21T10:00:00Z", "timeout": "1m45s"}
    assert cel.cross_check(schema, ok) == []
    assert len(cel.cross_check(schema, {**ok, "timeout": "1m"})) == 1


PROJECT_CRD = Path(__file__).resolve().parents[2] / "crds" / "rljob.yaml"


@pytest.mark.skipif(not PROJECT_CRD.exists(), reason="crds/rljob.yaml not generated yet")
def test_every_rule_of_the_project_crd_parses_in_both_engines() -> None:
    documents = [d for d in yaml.safe_load_all(PROJECT_CRD.read_text()) if d]
    rules = [
        rule
        for crd in documents
        for version in crd["spec"]["versions"]
        for rule in cel.collect_rules(version["schema"]["openAPIV3Schema"])
    ]
    for rule in rules:
        cel.check_rule(rule)  # raises CelCompileError / UnsupportedCel naming the rule
