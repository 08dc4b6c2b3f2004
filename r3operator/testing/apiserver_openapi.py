"""Discovery documents and OpenAPI v3 of the API-server emulator.

The OpenAPI v3 trick (see docs/testing.md): every kind gets one PATCH operation carrying
`x-kubernetes-group-version-kind` and a `fieldValidation` query parameter, so kubectl concludes that
the server validates (`fieldValidation=Strict`) instead of falling back to `/openapi/v2`.
`components.schemas` holds the CRD `openAPIV3Schema` (plus ObjectMeta), which `kubectl explain` reads.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any

from r3operator.testing.apiserver_store import ALL_VERBS, ResourceType

SERVER_VERSION = {
    "major": "1",
    "minor": "35",
    "gitVersion": "v1.35.0-r3operator-emulator",
    "gitCommit": "0000000000000000000000000000000000000000",
    "gitTreeState": "clean",
    "buildDate": "2026-01-01T00:00:00Z",
    "goVersion": "go1.25.0",
    "compiler": "gc",
    "platform": "linux/amd64",
}


def api_versions(server_address: str) -> dict[str, Any]:
    return {
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": server_address}],
    }


def _groups(types: Iterable[ResourceType]) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for rtype in types:
        if rtype.group and rtype.version not in groups.setdefault(rtype.group, []):
            groups[rtype.group].append(rtype.version)
    return groups


def _preferred(group: str, versions: list[str], types: Iterable[ResourceType]) -> str:
    storage = [t.storage_version for t in types if t.group == group and t.storage_version]
    return storage[0] if storage else versions[0]


def api_group(group: str, versions: list[str], types: list[ResourceType]) -> dict[str, Any]:
    preferred = _preferred(group, versions, types)
    return {
        "kind": "APIGroup",
        "apiVersion": "v1",
        "name": group,
        "versions": [{"groupVersion": f"{group}/{v}", "version": v} for v in versions],
        "preferredVersion": {"groupVersion": f"{group}/{preferred}", "version": preferred},
    }


def api_group_list(types: list[ResourceType]) -> dict[str, Any]:
    return {
        "kind": "APIGroupList",
        "apiVersion": "v1",
        "groups": [api_group(g, vs, types) for g, vs in _groups(types).items()],
    }


def api_resource_list(group_version: str, types: list[ResourceType]) -> dict[str, Any]:
    resources: list[dict[str, Any]] = []
    for rtype in types:
        resources.append(
            {
                "name": rtype.plural,
                "singularName": rtype.singular,
                "namespaced": rtype.namespaced,
                "kind": rtype.kind,
                "verbs": list(ALL_VERBS),
                **({"shortNames": list(rtype.short_names)} if rtype.short_names else {}),
                **({"categories": list(rtype.categories)} if rtype.categories else {}),
                "storageVersionHash": hashlib.sha256(rtype.qualified.encode()).hexdigest()[:11],
            }
        )
        if rtype.has_status:
            resources.append(
                {
                    "name": f"{rtype.plural}/status",
                    "singularName": "",
                    "namespaced": rtype.namespaced,
                    "kind": rtype.kind,
                    "verbs": ["get", "patch", "update"],
                }
            )
    return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": group_version, "resources": resources}


# ------------------------------------------------------------------------------------ OpenAPI v3


def _url_key(rtype: ResourceType) -> str:
    return f"apis/{rtype.group}/{rtype.version}" if rtype.group else "api/v1"


def openapi_root(types: list[ResourceType]) -> dict[str, Any]:
    paths: dict[str, Any] = {}
    for key in sorted({_url_key(t) for t in types}):
        members = [t for t in types if _url_key(t) == key]
        digest = hashlib.sha256(json.dumps(openapi_group_version(members), sort_keys=True).encode()).hexdigest()
        paths[key] = {"serverRelativeURL": f"/openapi/v3/{key}?hash={digest[:32].upper()}"}
    return {"paths": paths}


def schema_name(rtype: ResourceType) -> str:
    reversed_group = ".".join(reversed(rtype.group.split("."))) if rtype.group else "io.k8s.api.core"
    return f"{reversed_group}.{rtype.version}.{rtype.kind}"


_OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"


def _component(rtype: ResourceType) -> dict[str, Any]:
    gvk = [{"group": rtype.group, "version": rtype.version, "kind": rtype.kind}]
    if rtype.schema:
        schema = json.loads(json.dumps(rtype.schema))
        schema.setdefault("properties", {})
        schema["properties"]["metadata"] = {
            "allOf": [{"$ref": f"#/components/schemas/{_OBJECT_META}"}],
            "description": "Standard object's metadata.",
        }
        schema["properties"].setdefault("apiVersion", {"type": "string", "description": "APIVersion"})
        schema["properties"].setdefault("kind", {"type": "string", "description": "Kind"})
    else:
        schema = {
            "type": "object",
            "description": f"{rtype.kind} (built-in; schema not served by the emulator)",
            "x-kubernetes-preserve-unknown-fields": True,
        }
    schema["x-kubernetes-group-version-kind"] = gvk
    return schema


def _patch_operation(rtype: ResourceType) -> dict[str, Any]:
    return {
        "patch": {
            "operationId": f"patch{rtype.kind}",
            "x-kubernetes-action": "patch",
            "x-kubernetes-group-version-kind": {
                "group": rtype.group,
                "version": rtype.version,
                "kind": rtype.kind,
            },
            "parameters": [
                {"name": "dryRun", "in": "query", "schema": {"type": "string", "uniqueItems": True}},
                {"name": "fieldManager", "in": "query", "schema": {"type": "string", "uniqueItems": True}},
                {"name": "fieldValidation", "in": "query", "schema": {"type": "string", "uniqueItems": True}},
            ],
            "requestBody": {"content": {"application/merge-patch+json": {"schema": {"type": "object"}}}},
            "responses": {
                "200": {
                    "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema_name(rtype)}"}}}
                }
            },
        }
    }


def openapi_group_version(types: list[ResourceType]) -> dict[str, Any]:
    paths: dict[str, Any] = {}
    schemas: dict[str, Any] = {
        _OBJECT_META: {
            "type": "object",
            "description": "ObjectMeta is metadata that all persisted resources must have.",
            "properties": {
                "name": {"type": "string"},
                "namespace": {"type": "string"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
            },
        }
    }
    for rtype in types:
        prefix = f"/apis/{rtype.group}/{rtype.version}" if rtype.group else "/api/v1"
        scope = "/namespaces/{namespace}" if rtype.namespaced else ""
        paths[f"{prefix}{scope}/{rtype.plural}/{{name}}"] = _patch_operation(rtype)
        schemas[schema_name(rtype)] = _component(rtype)
    return {
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes (r3operator emulator)", "version": SERVER_VERSION["gitVersion"]},
        "paths": paths,
        "components": {"schemas": schemas},
    }
