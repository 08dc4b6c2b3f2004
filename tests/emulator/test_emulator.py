"""Emulator specifics that the contract tests do not cover (skipped with --real-cluster)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from kubernetes import client, watch

from r3operator.testing.apiserver_patch import strategic_merge_patch
from r3operator.testing.apiserver_tables import humanize_age, jsonpath

from .conftest import TABLE_ACCEPT, Cluster, trainjob

pytestmark = pytest.mark.usefixtures("sample_crd")


def test_discovery_lists_crd_group_and_status_subresource(cluster: Cluster) -> None:
    groups = {g["name"] for g in cluster.raw("GET", "/apis").json()["groups"]}
    assert {"apps", "apiextensions.k8s.io", "example.r3.dev"} <= groups
    resources = {r["name"]: r for r in cluster.raw("GET", "/apis/example.r3.dev/v1").json()["resources"]}
    assert resources["trainjobs"]["shortNames"] == ["tj"] and "trainjobs/status" in resources
    assert cluster.raw("GET", "/openapi/v2").status == 404


def test_openapi_v3_has_patch_with_field_validation_and_crd_schema(cluster: Cluster) -> None:
    root = cluster.raw("GET", "/openapi/v3").json()
    document = cluster.raw("GET", root["paths"]["apis/example.r3.dev/v1"]["serverRelativeURL"]).json()
    (operation,) = [p["patch"] for p in document["paths"].values()]
    assert operation["x-kubernetes-group-version-kind"]["kind"] == "TrainJob"
    assert "fieldValidation" in [p["name"] for p in operation["parameters"]]
    schema = document["components"]["schemas"]["dev.r3.example.v1.TrainJob"]
    assert schema["properties"]["spec"]["required"] == ["model"]


def test_crd_with_unsupported_cel_is_refused(cluster: Cluster) -> None:
    crd = {
        "metadata": {"name": "things.bad.r3.dev"},
        "spec": {
            "group": "bad.r3.dev",
            "scope": "Namespaced",
            "names": {"plural": "things", "kind": "Thing"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "x-kubernetes-validations": [{"rule": "self.?spec.hasValue()"}],
                        }
                    },
                }
            ],
        },
    }
    response = cluster.raw("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)
    assert response.status == 422
    assert "optional CEL syntax" in response.json()["message"]


def test_namespace_must_exist_and_unsupported_field_selector_is_400(cluster: Cluster) -> None:
    response = cluster.raw("POST", cluster.cr_path("no-such-ns"), trainjob("x"))
    assert (response.status, response.json()["details"]["name"]) == (404, "no-such-ns")
    bad = cluster.raw("GET", cluster.cr_path("default"), query={"fieldSelector": "spec.model=tiny"})
    assert bad.status == 400


def test_builtin_strict_validation_and_table(cluster: Cluster, namespace: str) -> None:
    path = f"/api/v1/namespaces/{namespace}/configmaps"
    body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}, "data": {"a": 1}}
    assert cluster.raw("POST", path, body).status == 422  # data values must be strings
    typo = {**body, "data": {"a": "1"}, "dat": {}}
    assert cluster.raw("POST", path, typo, query={"fieldValidation": "Strict"}).status == 400
    assert cluster.raw("POST", path, {**body, "data": {"a": "1"}}).status == 201
    table = cluster.raw("GET", path, accept=TABLE_ACCEPT).json()
    assert [c["name"] for c in table["columnDefinitions"]] == ["Name", "Age"]
    assert table["rows"][0]["cells"][0] == "c"


def test_deployment_generation_and_strategic_merge_of_containers(cluster: Cluster, namespace: str) -> None:
    apps = client.AppsV1Api(cluster.api_client)
    container = {"name": "main", "image": "busybox:1", "env": [{"name": "A", "value": "1"}]}
    deployment = {
        "metadata": {"name": "d"},
        "spec": {
            "selector": {"matchLabels": {"app": "d"}},
            "template": {"metadata": {"labels": {"app": "d"}}, "spec": {"containers": [container]}},
        },
    }
    created = apps.create_namespaced_deployment(namespace, deployment)
    assert created.metadata.generation == 1
    patch: dict[str, Any] = {
        "spec": {"template": {"spec": {"containers": [{"name": "main", "env": [{"name": "B", "value": "2"}]}]}}}
    }
    patched = apps.patch_namespaced_deployment("d", namespace, patch)
    (main,) = patched.spec.template.spec.containers
    assert main.image == "busybox:1" and [e.name for e in main.env] == ["A", "B"]
    assert patched.metadata.generation == 2


def test_python_client_watch_streams_live_events(cluster: Cluster, namespace: str) -> None:
    seen: list[tuple[str, str]] = []
    watcher = watch.Watch()

    def consume() -> None:
        for event in watcher.stream(cluster.core.list_namespaced_config_map, namespace, timeout_seconds=5):
            seen.append((event["type"], event["object"].metadata.name))
            if event["type"] == "DELETED":
                watcher.stop()

    thread = threading.Thread(target=consume)
    thread.start()
    cluster.core.create_namespaced_config_map(namespace, {"metadata": {"name": "live"}})
    cluster.core.delete_namespaced_config_map("live", namespace)
    thread.join(timeout=10)
    assert ("ADDED", "live") in seen and seen[-1] == ("DELETED", "live")


def test_send_initial_events_ends_with_bookmark(cluster: Cluster, namespace: str) -> None:
    cluster.core.create_namespaced_config_map(namespace, {"metadata": {"name": "i"}})
    query = {"watch": "true", "sendInitialEvents": "true", "allowWatchBookmarks": "true", "timeoutSeconds": "1"}
    events = cluster.raw("GET", f"/api/v1/namespaces/{namespace}/configmaps", query=query).lines()
    assert [e["type"] for e in events] == ["ADDED", "BOOKMARK"]
    assert events[1]["object"]["metadata"]["annotations"]["k8s.io/initial-events-end"] == "true"


def test_jsonpath_subset_and_age_humanisation() -> None:
    obj = {"status": {"conditions": [{"type": "Ready", "status": "False"}, {"type": "Done", "status": "True"}]}}
    assert jsonpath(obj, '.status.conditions[?(@.type=="Done")].status') == ["True"]
    assert jsonpath(obj, ".status.conditions[0].type") == ["Ready"]
    assert jsonpath(obj, "{.status.conditions[*].type}") == ["Ready", "Done"]
    assert jsonpath(obj, ".status.missing") == []
    import datetime as dt

    now = dt.datetime(2026, 1, 2, tzinfo=dt.UTC)
    assert humanize_age("2026-01-01T23:59:55Z", now) == "5s"
    assert humanize_age("2026-01-01T23:54:00Z", now) == "6m"
    assert humanize_age("2025-12-30T00:00:00Z", now) == "3d"


def test_strategic_merge_subset_directives() -> None:
    current = {"containers": [{"name": "a", "image": "x"}, {"name": "b", "image": "y"}], "keep": 1}
    patched = strategic_merge_patch(current, {"containers": [{"name": "b", "$patch": "delete"}],
                                              "$setElementOrder/containers": [{"name": "a"}]})  # fmt: skip
    assert patched == {"containers": [{"name": "a", "image": "x"}], "keep": 1}
    with pytest.raises(Exception, match="not emulated"):
        strategic_merge_patch(current, {"$retainKeys": ["keep"]})
