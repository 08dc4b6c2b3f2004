"""The generated CRD: committed copy up to date, structural, valid, consistent with pydantic."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from r3operator.api import parse_rljob
from r3operator.api.crd import crd, render_crd_yaml
from r3operator.testing.apiserver_validation import apply_defaults, to_jsonschema, unknown_fields
from tests.api.conftest import base_manifest

ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "crds" / "rljob.yaml"
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
    assert names == ["Ready", "Reason", "Replay", "Engines", "Trainer", "Step", "Age"]
    assert not any("[-1:]" in c["jsonPath"] for c in cols)


def test_names_and_status_subresource() -> None:
    spec = crd()["spec"]
    assert spec["names"]["shortNames"] == ["rlj"] and spec["names"]["categories"] == ["rl"]
    assert spec["versions"][0]["subresources"] == {"status": {}}
    conditions = _schema()["properties"]["status"]["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map" and conditions["x-kubernetes-list-map-keys"] == ["type"]


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_examples_validate_against_crd_schema(example: Path) -> None:
    schema = _schema()
    for doc in yaml.safe_load_all(example.read_text()):
        obj = apply_defaults(schema, copy.deepcopy(doc))
        assert unknown_fields(schema, obj) == []
        body = {k: v for k, v in obj.items() if k != "metadata"}
        jsonschema.Draft7Validator(to_jsonschema(schema)).validate(body)


def test_api_server_defaults_equal_pydantic_defaults() -> None:
    """A minimal manifest defaulted by the CRD equals the pydantic model's defaults, field for field."""
    manifest = base_manifest()
    defaulted = apply_defaults(_schema(), copy.deepcopy(manifest))
    pydantic_dump = parse_rljob(manifest).model_dump(by_alias=True, exclude_none=True, mode="json")
    assert defaulted["spec"] == pydantic_dump["spec"]


def test_pydantic_dump_validates_against_crd_schema() -> None:
    dumped = parse_rljob(base_manifest()).model_dump(by_alias=True, exclude_none=True, mode="json")
    body = {k: v for k, v in dumped.items() if k != "metadata"}
    jsonschema.Draft7Validator(to_jsonschema(_schema())).validate(body)
