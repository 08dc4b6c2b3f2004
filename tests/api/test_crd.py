"""The generated CRD: committed copy up to date, structural, and what the REAL kube-apiserver makes of it:
accepted (from crds/ and from the chart), explained by kubectl, defaulting like pydantic, pruning or
refusing unknown fields, refusing bad input with its own message."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubecluster.clients import CRD_PATH, kubectl

from r3operator.api import RLJobLoadError, parse_rljob
from r3operator.api.crd import ROOT_RULES, crd, render_crd_yaml
from tests.api.conftest import CRD_FILE, ROOT, base_manifest
from tests.api.real_apiserver import RLJobApi, message_pattern

CHART_CRD_FILE = ROOT / "charts" / "r3operator" / "files" / "crds" / "rljob.yaml"
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
MIN_KUBERNETES = "1.30.0"  # CEL messageExpression/reason/fieldPath are GA from 1.30


def _schema() -> dict[str, Any]:
    return crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_committed_crd_is_generated() -> None:
    assert CRD_FILE.read_text() == render_crd_yaml(), "crds/rljob.yaml is stale: run `make crd`"


@pytest.mark.parametrize("version", [MIN_KUBERNETES, "1.35.0"])
def test_crd_passes_kubernetes_validate_strict(version: str) -> None:
    doc = yaml.safe_load(CRD_FILE.read_text())
    kubernetes_validate.validate(doc, version, strict=True)


def _walk(node: dict[str, Any], path: str = ""):
    yield path, node
    for name, sub in (node.get("properties") or {}).items():
        yield from _walk(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{path}[*]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}{{*}}")


def test_schema_is_structural_and_bounded() -> None:
    problems = []
    for path, node in _walk(_schema()):
        free_form = node.get("x-kubernetes-int-or-string") or node.get("x-kubernetes-preserve-unknown-fields")
        if not free_form and "type" not in node:
            problems.append(f"{path}: no type")
        for forbidden in ("$ref", "anyOf", "oneOf", "allOf", "nullable", "title", "const"):
            if forbidden in node:
                problems.append(f"{path}: has {forbidden}")
        if "properties" in node and "additionalProperties" in node:
            problems.append(f"{path}: properties and additionalProperties together")
        if node.get("type") == "string" and path.startswith(".spec") and not ("maxLength" in node or "enum" in node):
            problems.append(f"{path}: unbounded string")
        if node.get("type") == "array" and "maxItems" not in node:
            problems.append(f"{path}: unbounded array")
    assert problems == []
    assert "x-kubernetes-preserve-unknown-fields" not in _schema()


def test_printer_columns_follow_conventions() -> None:
    cols = crd()["spec"]["versions"][0]["additionalPrinterColumns"]
    names = [c["name"] for c in cols if not c.get("priority")]
    assert names == ["Ready", "Reason", "Replay", "Healthy", "Engines", "Trainer", "Step", "Upgrade", "Age"]
    assert not any("[-1:]" in c["jsonPath"] for c in cols)


def test_names_and_status_subresource() -> None:
    spec = crd()["spec"]
    assert spec["names"]["shortNames"] == ["rlj"] and spec["names"]["categories"] == ["rl"]
    assert spec["versions"][0]["subresources"] == {"status": {}}
    conditions = _schema()["properties"]["status"]["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map" and conditions["x-kubernetes-list-map-keys"] == ["type"]


# ----------------------------------------------------------------------------- the real apiserver


def _conditions(obj: dict[str, Any]) -> dict[str, str]:
    return {c["type"]: c["status"] for c in obj.get("status", {}).get("conditions") or []}


@pytest.mark.parametrize("crd_file", [CRD_FILE, CHART_CRD_FILE], ids=["crds", "chart"])
def test_crd_is_accepted_by_the_apiserver(control_plane: Any, crd_file: Path) -> None:
    applied = kubectl(control_plane, "apply", "--server-side", "-f", str(crd_file))
    assert applied.returncode == 0, applied.stderr
    assert "customresourcedefinition.apiextensions.k8s.io/rljobs.r3operator.io serverside-applied" in applied.stdout
    control_plane.wait_established("rljobs.r3operator.io")
    served = control_plane.request("GET", f"{CRD_PATH}/rljobs.r3operator.io")
    assert _conditions(served) | {"Established": "True", "NamesAccepted": "True"} == _conditions(served)
    # Every CEL rule survived (the apiserver compiled each within its cost budget and kept it).
    rules = served["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert rules["x-kubernetes-validations"] == _schema()["properties"]["spec"]["x-kubernetes-validations"]


def _explain(plane: Any, field: str) -> str:
    # The CRD's schema reaches the OpenAPI document a moment after it is Established.
    deadline = time.monotonic() + 30
    while True:
        result = kubectl(plane, "explain", field)
        if result.returncode == 0 or time.monotonic() > deadline:
            assert result.returncode == 0, result.stderr
            return result.stdout
        time.sleep(0.5)


def test_kubectl_explain_lists_spec_fields(rljob_api: RLJobApi) -> None:
    out = _explain(rljob_api.plane, "rlj.spec")
    assert "KIND:       RLJob" in out and "FIELD: spec <Object>" in out
    spec = _schema()["properties"]["spec"]
    for name in spec["properties"]:
        required = " -required-" if name in spec["required"] else ""
        assert re.search(rf"^  {name}\t<\w+>{required}$", out, re.MULTILINE), name


def test_kubectl_explain_shows_a_nested_fields_type_and_description(rljob_api: RLJobApi) -> None:
    out = _explain(rljob_api.plane, "rlj.spec.model.uri")
    assert "FIELD: uri <string>" in out
    description = _schema()["properties"]["spec"]["properties"]["model"]["properties"]["uri"]["description"]
    assert " ".join(description.split()) in " ".join(out.split())


def _examples() -> list[Any]:
    return [
        pytest.param(doc, id=f"{path.name}#{i}")
        for path in EXAMPLES
        for i, doc in enumerate(d for d in yaml.safe_load_all(path.read_text()) if d)
    ]


@pytest.mark.parametrize("doc", _examples())
def test_example_applies_with_server_dry_run(rljob_api: RLJobApi, doc: dict[str, Any]) -> None:
    result = kubectl(rljob_api.plane, "apply", "--dry-run=server", "-f", "-", stdin=yaml.safe_dump(rljob_api.here(doc)))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"rljob.r3operator.io/{doc['metadata']['name']} created (server dry run)"


MINIMAL: dict[str, Any] = {
    "apiVersion": "r3operator.io/v1alpha1",
    "kind": "RLJob",
    "metadata": {"name": "minimal"},
    "spec": {
        "model": {"uri": "hf://Qwen/Qwen3-30B-A3B"},
        "routingReplay": {"mode": "Disabled"},
        "inference": {"image": "vllm/vllm-openai:v0.30.0"},
        "trainer": {"image": "ghcr.io/r3operator/trainer:0.1.0"},
    },
}


def _leaves(node: Any, path: str = "") -> dict[str, Any]:
    """{"inference.tensorParallelSize": 1, ...}: every scalar (and every empty container) by its path."""
    if isinstance(node, dict) and node:
        return {k: v for key, sub in node.items() for k, v in _leaves(sub, f"{path}.{key}" if path else key).items()}
    if isinstance(node, list) and node:
        return {k: v for i, sub in enumerate(node) for k, v in _leaves(sub, f"{path}[{i}]").items()}
    return {path: node}


@pytest.mark.parametrize(
    "manifest", [pytest.param(MINIMAL, id="minimal"), pytest.param(base_manifest(), id="base"), *_examples()]
)
def test_api_server_defaults_equal_pydantic_defaults(rljob_api: RLJobApi, manifest: dict[str, Any]) -> None:
    """The apiserver's defaulting (a dry-run create, read back) equals the pydantic model's, field by field."""
    served = rljob_api.create(manifest)["spec"]
    pydantic = parse_rljob(manifest).model_dump(by_alias=True, exclude_none=True, mode="json")["spec"]
    assert _leaves(served) == _leaves(pydantic)


UNKNOWN_FIELDS = ["spec.zzz", "spec.inference.tensorParalelSize", "spec.rollout.bogusKnob"]


def _with_unknown(dotted: str) -> dict[str, Any]:
    manifest = base_manifest()
    node = manifest
    *parents, leaf = dotted.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = 2
    return manifest


@pytest.mark.parametrize("field", UNKNOWN_FIELDS)
def test_unknown_field_is_refused_with_strict_validation(rljob_api: RLJobApi, field: str) -> None:
    manifest = rljob_api.here(_with_unknown(field))
    result = kubectl(
        rljob_api.plane, "apply", "--dry-run=server", "--validate=strict", "-f", "-", stdin=yaml.safe_dump(manifest)
    )
    assert result.returncode != 0
    assert f'strict decoding error: unknown field "{field}"' in result.stderr


@pytest.mark.parametrize("field", UNKNOWN_FIELDS)
def test_unknown_field_is_pruned_with_a_warning_otherwise(rljob_api: RLJobApi, field: str) -> None:
    manifest = rljob_api.here(_with_unknown(field))
    result = kubectl(
        rljob_api.plane,
        "apply",
        "--dry-run=server",
        "--validate=warn",
        "-o",
        "json",
        "-f",
        "-",
        stdin=yaml.safe_dump(manifest),
    )
    assert result.returncode == 0, result.stderr
    assert f'unknown field "{field}"' in result.stderr
    stored = _leaves(json.loads(result.stdout))
    assert field not in stored and "spec.inference.tensorParallelSize" in stored


def _set(dotted: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(manifest: dict[str, Any]) -> None:
        node = manifest
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node[key]
        node[leaf] = value

    return mutate


MB = 1 << 20
# Any of the CRD's root rules, its message rendered with the name's length.
ROOT_RULE_MESSAGE = re.compile(
    "|".join(f"(?:{message_pattern(r['messageExpression']).pattern})" for r in ROOT_RULES if "messageExpression" in r)
)
BAD_INPUT = [
    pytest.param(
        _set("spec.inference.tensorParallelSize", "two"),
        "FieldValueTypeInvalid",
        "spec.inference.tensorParallelSize",
        "must be of type integer",
        id="string-for-integer",
    ),
    pytest.param(
        _set("spec.routingReplay.replayRef", "maybe"),
        "FieldValueTypeInvalid",
        "spec.routingReplay.replayRef",
        "must be of type boolean",
        id="string-for-boolean",
    ),
    pytest.param(
        _set("spec.model", "Qwen3"),
        "FieldValueTypeInvalid",
        "spec.model",
        "must be of type object",
        id="string-for-object",
    ),
    pytest.param(
        _set("spec.inference.extraArgs", "--enforce-eager"),
        "FieldValueTypeInvalid",
        "spec.inference.extraArgs",
        "must be of type array",
        id="string-for-list",
    ),
    pytest.param(
        _set("spec.model.uri", "hf://org/" + "x" * MB),
        "FieldValueTooLong",
        "spec.model.uri",
        "Too long: may not be more than 1024 bytes",
        id="1MB-string",
    ),
    pytest.param(
        _set("spec.inference.extraArgs", ["--enforce-eager"] * 10_000),
        "FieldValueTooMany",
        "spec.inference.extraArgs",
        "Too many: 10000: must have at most 32 items",
        id="10k-element-list",
    ),
    # Refused by the CRD's root rule (child names append suffixes to the RLJob's, so it is capped below 63);
    # its fieldPath names metadata.name (kubectl showed `<nil>` for a root rule without one).
    pytest.param(
        _set("metadata.name", "a" * 63), "FieldValueInvalid", "metadata.name", ROOT_RULE_MESSAGE, id="63-char-name"
    ),
    # One past the longest name whose RayJob <job>-trainer fits KubeRay's 47 characters.
    pytest.param(
        _set("metadata.name", "a" * 40),
        "FieldValueInvalid",
        "metadata.name",
        "at most 39 characters, got 40: <job>-trainer names a RayJob",
        id="40-char-name",
    ),
    # Not a DNS-1035 label: the engine Service <job>-engine could not be created.
    pytest.param(
        _set("metadata.name", "1job"),
        "FieldValueInvalid",
        "metadata.name",
        "must be a DNS-1035 label",
        id="name-starts-with-a-digit",
    ),
    pytest.param(
        _set("metadata.name", "my.job"),
        "FieldValueInvalid",
        "metadata.name",
        "must be a DNS-1035 label",
        id="name-with-a-dot",
    ),
]


@pytest.mark.parametrize(("mutate", "reason", "field", "message"), BAD_INPUT)
def test_bad_input_is_refused_by_the_apiserver_with_its_message(
    rljob_api: RLJobApi, mutate: Callable[[dict[str, Any]], None], reason: str, field: str, message: str | re.Pattern
) -> None:
    manifest = base_manifest()
    mutate(manifest)
    refused = rljob_api.refusal(manifest)
    assert [(c.reason, c.field) for c in refused] == [(reason, field)], refused
    assert re.search(message, refused[0].message) if isinstance(message, re.Pattern) else message in refused[0].message
    # pydantic refuses the same input (the operator reads RLJobs through it).
    with pytest.raises(RLJobLoadError):
        parse_rljob(manifest)


def test_longest_accepted_name_makes_every_child_within_its_limit() -> None:
    from r3operator.api import names

    longest = "a" * names.MAX_JOB_NAME_LENGTH
    assert len(names.child_name(longest, names.ROLE_TRAINER)) == 47  # KubeRay's RayJob limit binds
    engine = names.child_name(longest, names.ROLE_ENGINE)
    assert len(f"{engine}-0123456789") <= 63  # controller-revision-hash label: <statefulset>-<10-char hash>
    with pytest.raises(RLJobLoadError, match=r"metadata\.name"):
        parse_rljob({**base_manifest(), "metadata": {"name": longest + "a"}})


@pytest.mark.parametrize("section", [("runPolicy",), ("model", "cache")], ids=".".join)
def test_kubectl_explain_has_a_description_for_every_field_of(section: tuple[str, ...]) -> None:
    # `kubectl explain rljob.spec.runPolicy` printed <no description> for fields whose model had no docstring.
    node = _schema()["properties"]["spec"]
    for key in section:
        parent, node = node, node["properties"][key]
    assert parent["properties"][section[-1]].get("description"), section
    undescribed = [name for name, field in node["properties"].items() if not field.get("description")]
    assert undescribed == []
