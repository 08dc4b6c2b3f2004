"""RLJobs through the real kube-apiserver of the session's control plane, and its verdicts as rule ids.

A refusal is a 422 `Invalid` Status whose `details.causes[]` carry `reason`, `field` and the rendered
message; a CEL rule of the CRD is recognised by its (reason, fieldPath) pair, which is unique per rule.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from typing import Any

from kubecluster.controlplane import ApiError, ControlPlane

from r3operator.api import RULES
from r3operator.api.rules import Rule
from r3operator.api.v1alpha1 import GROUP, PLURAL, VERSION


@dataclass(frozen=True)
class Cause:
    reason: str
    field: str
    message: str


def _cel_rules_by_cause() -> dict[tuple[str, str], Rule]:
    table: dict[tuple[str, str], Rule] = {}
    for rule in RULES:
        if rule.cel is None:
            continue
        key = (rule.cel.reason, "spec" + rule.cel.field_path)
        if key in table:
            raise AssertionError(f"{rule.id} and {table[key].id} share reason+fieldPath {key}: causes are ambiguous")
        table[key] = rule
    return table


CEL_RULES_BY_CAUSE = _cel_rules_by_cause()
CEL_RULE_IDS = frozenset(rule.id for rule in CEL_RULES_BY_CAUSE.values())


def rule_ids(causes: list[Cause]) -> set[str]:
    """The table rules behind the causes; any other cause (schema, a non-table rule) fails the test."""
    unknown = [c for c in causes if (c.reason, c.field) not in CEL_RULES_BY_CAUSE]
    assert unknown == [], f"refused for a reason that is no table CEL rule: {unknown}"
    return {CEL_RULES_BY_CAUSE[(c.reason, c.field)].id for c in causes}


def message_pattern(message_expression: str) -> re.Pattern[str]:
    """The first string literal of a messageExpression with `%d`/`%s` as the values they render to:
    a message that matches came from the expression, with its values filled in."""
    literal = re.match(r"'((?:[^'\\]|\\.)*)'", message_expression)
    assert literal is not None, f"messageExpression does not start with a string literal: {message_expression}"
    parts = re.split(r"(%d|%s)", literal.group(1))
    return re.compile("".join({"%d": r"-?\d+", "%s": r"[^\s%]+"}.get(p, re.escape(p)) for p in parts))


class RLJobApi:
    """RLJobs in one namespace, written with the admin's token; every write is a dry run unless told."""

    def __init__(self, plane: ControlPlane, namespace: str) -> None:
        self.plane = plane
        self.namespace = namespace
        self.path = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}"

    def here(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """A copy of `manifest` placed in this namespace (the URL's namespace and the body's must agree)."""
        obj = copy.deepcopy(manifest)
        obj.setdefault("metadata", {})["namespace"] = self.namespace
        return obj

    def create(self, manifest: dict[str, Any], *, dry_run: bool = True, strict: bool = False) -> dict[str, Any]:
        query = _query(dry_run=dry_run, strict=strict)
        return dict(self.plane.request("POST", self.path + query, self.here(manifest)))

    def merge_patch(self, name: str, patch: dict[str, Any], *, dry_run: bool = True) -> dict[str, Any]:
        query = _query(dry_run=dry_run, strict=False)
        path = f"{self.path}/{name}{query}"
        return dict(self.plane.request("PATCH", path, patch, content_type="application/merge-patch+json"))

    def refusal(self, manifest: dict[str, Any], *, strict: bool = False) -> list[Cause]:
        """[] when a dry-run create is accepted, else the apiserver's causes."""
        try:
            self.create(manifest, strict=strict)
        except ApiError as exc:
            return causes(exc)
        return []

    def patch_refusal(self, name: str, patch: dict[str, Any]) -> list[Cause]:
        try:
            self.merge_patch(name, patch)
        except ApiError as exc:
            return causes(exc)
        return []


def causes(exc: ApiError) -> list[Cause]:
    """The causes of a refusal; a Status without causes (400 BadRequest, strict decoding) is one cause."""
    status = json.loads(exc.body)
    listed = (status.get("details") or {}).get("causes") or []
    if not listed:
        return [Cause(str(status.get("reason", exc.code)), "", str(status.get("message", "")))]
    # The apiserver adds this marker when schema errors stopped the CEL rules from running.
    return [
        Cause(c.get("reason", ""), c.get("field", ""), c.get("message", ""))
        for c in listed
        if "some validation rules were not checked" not in c.get("message", "")
    ]


def _query(*, dry_run: bool, strict: bool) -> str:
    params = (["dryRun=All"] if dry_run else []) + (["fieldValidation=Strict"] if strict else [])
    return "?" + "&".join(params) if params else ""
