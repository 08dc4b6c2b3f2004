"""Generate the RLJob CustomResourceDefinition from the pydantic models and the rules table.

The pydantic JSON schema is turned into a Kubernetes *structural* schema: ``$ref`` inlined,
``anyOf: [X, null]`` turned into ``X`` + ``nullable``, numeric bounds in OpenAPI v3.0 form,
``additionalProperties: false`` dropped (unknown fields are rejected by the API server's strict
field validation instead, and Kubernetes forbids it next to ``properties``), ``default: {}`` on
every always-present section so nested defaults apply, and the rules' CEL expressions installed
as ``x-kubernetes-validations`` on ``.spec``.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml

from r3operator import __version__
from r3operator.api import names
from r3operator.api import v1alpha1 as api
from r3operator.api.rules import RULES

JSON = dict[str, Any]
_OPTIONAL = "x-r3operator-optional"  # internal marker, removed before output

PRINTER_COLUMNS: list[JSON] = [
    {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
    {"name": "Reason", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].reason'},
    {"name": "Replay", "type": "string", "jsonPath": ".spec.routingReplay.mode"},
    {"name": "Healthy", "type": "string", "jsonPath": '.status.conditions[?(@.type=="ReplayHealthy")].status'},
    {"name": "Engines", "type": "string", "jsonPath": ".status.enginesReady"},
    {"name": "Trainer", "type": "string", "jsonPath": ".spec.trainer.backend"},
    {"name": "Step", "type": "integer", "jsonPath": ".status.progress.step"},
    {"name": "Upgrade", "type": "string", "jsonPath": ".status.upgrade.phase"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    {"name": "vLLM", "type": "string", "jsonPath": ".status.resolved.vllmVersion", "priority": 1},
    {"name": "GPUs", "type": "integer", "jsonPath": ".status.resolved.engineGpusTotal", "priority": 1},
    {"name": "Image", "type": "string", "jsonPath": ".spec.inference.image", "priority": 1},
    {"name": "Eval", "type": "number", "jsonPath": ".status.progress.evalReward", "priority": 1},
    {"name": "LogprobDiff", "type": "number", "jsonPath": ".status.progress.logprobAbsDiffMean", "priority": 1},
    {"name": "SyncSeconds", "type": "number", "jsonPath": ".status.progress.weightSyncSeconds", "priority": 1},
    {"name": "Exported", "type": "integer", "jsonPath": ".status.progress.lastExportStep", "priority": 1},
]

# Transition rules (need oldSelf): settings that cannot change under a running job.
TRANSITION_RULES: dict[tuple[str, ...], JSON] = {
    ("spec", "trainer", "backend"): {
        "rule": "self == oldSelf",
        "message": "trainer.backend is immutable: create a new RLJob to switch trainer backends",
        "reason": "FieldValueForbidden",
    },
    ("spec",): {
        "rule": "has(self.managedBy) == has(oldSelf.managedBy) && (!has(self.managedBy) || self.managedBy == "
        "oldSelf.managedBy)",
        "message": "managedBy is immutable: create a new RLJob to hand it to another controller",
        "fieldPath": ".managedBy",
        "reason": "FieldValueForbidden",
    },
    ("spec", "storage", "accessMode"): {
        "rule": "self == oldSelf",
        "message": "storage.accessMode is immutable (a PVC's access mode cannot change)",
        "reason": "FieldValueForbidden",
    },
}


def _limits_text() -> str:
    """The children whose limits bind the name length (the others leave room)."""
    binding = [c for c in names.CHILD_NAMES if c.limit - len(c.suffix) - 1 == names.MAX_JOB_NAME_LENGTH]
    return ", ".join(f"<job>-{c.suffix} names a {c.why} and must be at most {c.limit}" for c in binding)


# metadata.name prefixes every child's name (api/names.py): refuse, at admission, a name that cannot
# make every child, with the reason, rather than let the operator meet it half-way through.
ROOT_RULES: list[JSON] = [
    {
        "rule": f"self.metadata.name.matches('{names.DNS1035_LABEL_PATTERN}')",
        "messageExpression": "'metadata.name %s must be a DNS-1035 label (lower-case letters, digits and dashes, "
        "starting with a letter): it names the engine Service <job>-engine'.format([self.metadata.name])",
        # fieldPath must name a property the schema declares: openapi_schema() declares metadata.name (the one
        # metadata field a CRD may), so the refusal names the field instead of `<nil>`.
        "fieldPath": ".metadata.name",
        "reason": "FieldValueInvalid",
    },
    {
        "rule": f"self.metadata.name.size() <= {names.MAX_JOB_NAME_LENGTH}",
        "messageExpression": f"'metadata.name must be at most {names.MAX_JOB_NAME_LENGTH} characters, got %d: "
        f"{_limits_text()}'.format([self.metadata.name.size()])",
        "fieldPath": ".metadata.name",
        "reason": "FieldValueInvalid",
    },
    {
        "rule": f"!self.metadata.name.startsWith('{names.RESERVED_NAME_PREFIX}')",
        "messageExpression": f"'metadata.name %s starts with {names.RESERVED_NAME_PREFIX}, which Kubernetes "
        "reserves for its own components: its children (<job>-trainer, <job>-engine and the rest) would read as "
        "system objects; choose another name'.format([self.metadata.name])",
        "fieldPath": ".metadata.name",
        "reason": "FieldValueForbidden",
    },
]


def _inline(node: Any, defs: JSON) -> Any:
    if isinstance(node, dict):
        if "$ref" in node:
            target = defs[node["$ref"].rsplit("/", 1)[-1]]
            merged = {**copy.deepcopy(target), **{k: v for k, v in node.items() if k != "$ref"}}
            return _inline(merged, defs)
        return {k: _inline(v, defs) for k, v in node.items()}
    if isinstance(node, list):
        return [_inline(v, defs) for v in node]
    return node


def _structural(node: JSON) -> JSON:
    """Rewrite one (inlined) pydantic schema node into Kubernetes structural form."""
    node = dict(node)
    node.pop("title", None)
    any_of = node.pop("anyOf", None)
    if any_of is not None:
        non_null = [s for s in any_of if s.get("type") != "null"]
        if len(non_null) != 1:
            raise ValueError(f"unsupported union in schema: {any_of}")
        inner = dict(non_null[0])
        # Outer keys (description, default) win over the member's.
        inner.update(node)
        node = inner
        # Optional (X | None) fields are simply not required. They are not marked nullable: the API
        # server then prunes an explicit null, which matches pydantic treating null as "unset".
        node.pop("title", None)
        node[_OPTIONAL] = True
        if node.get("default", "absent") is None:
            del node["default"]
    if "const" in node:
        node["enum"] = [node.pop("const")]
        node.setdefault("type", "string")
    for bound, plain in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if bound in node and not isinstance(node[bound], bool):
            node[plain] = node.pop(bound)
            node[bound] = True
    if "properties" in node:
        node.pop("additionalProperties", None)
    if node.get("type") == "object" and "properties" in node:
        required = set(node.get("required", []))
        props = {}
        for name, sub in node["properties"].items():
            s = _structural(sub)
            optional = s.pop(_OPTIONAL, False)
            if name not in required and "default" not in s and not optional:
                if s.get("type") == "object":
                    s["default"] = {}
                elif s.get("type") == "array":
                    s["default"] = []
            props[name] = s
        node["properties"] = props
    if node.get("type") == "array" and "items" in node:
        node["items"] = _structural(node["items"])
        node["items"].pop(_OPTIONAL, None)
    if (
        node.get("type") == "object"
        and "additionalProperties" in node
        and isinstance(node["additionalProperties"], dict)
    ):
        node["additionalProperties"] = _structural(node["additionalProperties"])
    return node


def _at(schema: JSON, path: tuple[str, ...]) -> JSON:
    node = schema
    for part in path:
        node = node["properties"][part]
    return node


def openapi_schema() -> JSON:
    raw = api.RLJob.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    schema = _structural(_inline(raw, defs))
    schema.pop(_OPTIONAL, None)
    schema["properties"]["metadata"] = {"type": "object", "properties": {"name": {"type": "string"}}}
    schema["properties"]["apiVersion"] = {"type": "string"}
    schema["properties"]["kind"] = {"type": "string"}
    schema["required"] = ["spec"]
    spec = schema["properties"]["spec"]
    spec["x-kubernetes-validations"] = [
        {
            "rule": r.cel.rule,
            "messageExpression": r.cel.message_expression,
            "reason": r.cel.reason,
            "fieldPath": r.cel.field_path,
        }
        for r in RULES
        if r.cel is not None
    ]
    for path, rule in TRANSITION_RULES.items():
        _at(schema, path).setdefault("x-kubernetes-validations", []).append(dict(rule))
    _at(schema, ("spec", "inference", "extraArgs"))["x-kubernetes-list-type"] = "atomic"
    conditions = _at(schema, ("status", "conditions"))
    conditions["x-kubernetes-list-type"] = "map"
    conditions["x-kubernetes-list-map-keys"] = ["type"]
    conditions["items"]["required"] = ["type", "status", "reason", "lastTransitionTime"]
    schema["x-kubernetes-validations"] = list(ROOT_RULES)
    return schema


def crd() -> JSON:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{api.PLURAL}.{api.GROUP}",
            "labels": {"app.kubernetes.io/name": "r3operator", "app.kubernetes.io/part-of": "r3operator"},
            "annotations": {"r3operator.io/generated-by": f"r3operator crd {__version__}"},
        },
        "spec": {
            "group": api.GROUP,
            "names": {
                "kind": api.KIND,
                "listKind": f"{api.KIND}List",
                "plural": api.PLURAL,
                "singular": api.SINGULAR,
                "shortNames": list(api.SHORT_NAMES),
                "categories": list(api.CATEGORIES),
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": api.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {"openAPIV3Schema": openapi_schema()},
                }
            ],
        },
    }


def render_crd_yaml() -> str:
    header = "# Generated by `r3operator crd` from r3operator/api/v1alpha1.py and rules.py. Do not edit.\n"
    return header + yaml.safe_dump(crd(), sort_keys=False, width=120, allow_unicode=True)
