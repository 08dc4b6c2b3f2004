"""Contract of the API-server emulator: behaviour operators rely on, asserted through a base URL and a
kubeconfig only (the real `kubernetes` python client and raw HTTP). The same module runs against a
real cluster with `pytest tests/emulator/test_contract.py --real-cluster` (KUBECONFIG=...); tests
marked `emulator_only` are then skipped. Assertions are on codes, reasons and field paths, never on
human message text (which differs from the real server).
"""

from __future__ import annotations

from typing import Any

import pytest

from .conftest import TABLE_ACCEPT, Cluster, trainjob

pytestmark = pytest.mark.usefixtures("sample_crd")
MERGE = "application/merge-patch+json"


def create(cluster: Cluster, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
    response = cluster.raw("POST", cluster.cr_path(namespace), body)
    assert response.status == 201, response.body
    return response.json()


def patch(cluster: Cluster, namespace: str, name: str, body: Any, subresource: str = "", **kw: Any) -> Any:
    return cluster.raw("PATCH", cluster.cr_path(namespace, name, subresource), body, content_type=MERGE, **kw)


def causes(response: Any) -> list[tuple[str, str]]:
    status = response.json()
    assert status["kind"] == "Status" and status["reason"] == "Invalid", status
    return sorted((c["reason"], c["field"]) for c in status["details"]["causes"])


def test_create_sets_server_fields_and_defaults(cluster: Cluster, namespace: str) -> None:
    obj = create(cluster, namespace, trainjob("a", replicas=2))
    meta = obj["metadata"]
    assert meta["uid"] and meta["creationTimestamp"] and meta["resourceVersion"]
    assert meta["generation"] == 1 and meta["namespace"] == namespace
    assert obj["spec"]["replay"] == {"mode": "none"} and obj["spec"]["kvCacheOffload"] is False  # defaults
    fetched = cluster.custom.get_namespaced_custom_object("example.r3.dev", "v1", namespace, "trainjobs", "a")
    assert fetched["metadata"]["resourceVersion"] == meta["resourceVersion"]
    listed = cluster.custom.list_namespaced_custom_object("example.r3.dev", "v1", namespace, "trainjobs")
    assert [i["metadata"]["name"] for i in listed["items"]] == ["a"]
    assert int(listed["metadata"]["resourceVersion"]) >= int(meta["resourceVersion"])


def test_already_exists_and_not_found_statuses(cluster: Cluster, namespace: str) -> None:
    create(cluster, namespace, trainjob("dup"))
    again = cluster.raw("POST", cluster.cr_path(namespace), trainjob("dup"))
    assert (again.status, again.json()["reason"]) == (409, "AlreadyExists")
    missing = cluster.raw("GET", cluster.cr_path(namespace, "nope"))
    status = missing.json()
    assert (missing.status, status["reason"], status["details"]["name"]) == (404, "NotFound", "nope")
    assert status["details"]["kind"] == "trainjobs"


def test_list_filters_by_label_and_field_selectors(cluster: Cluster, namespace: str) -> None:
    for name, tier in (("x", "gold"), ("y", "silver"), ("z", "gold")):
        create(cluster, namespace, {**trainjob(name), "metadata": {"name": name, "labels": {"tier": tier}}})

    def names(**query: str) -> list[str]:
        body = cluster.raw("GET", cluster.cr_path(namespace), query=query).json()
        return sorted(i["metadata"]["name"] for i in body["items"])

    assert names(labelSelector="tier=gold") == ["x", "z"]
    assert names(labelSelector="tier!=gold") == ["y"]
    assert names(labelSelector="tier in (silver,bronze)") == ["y"]
    assert names(labelSelector="!tier") == []
    assert names(fieldSelector="metadata.name=z") == ["z"]


def test_watch_from_resource_version_replays_later_events_in_order(cluster: Cluster, namespace: str) -> None:
    start = create(cluster, namespace, trainjob("w"))["metadata"]["resourceVersion"]
    patch(cluster, namespace, "w", {"metadata": {"labels": {"step": "1"}}})
    patch(cluster, namespace, "w", {"spec": {"replicas": 4}})
    response = cluster.raw("GET", cluster.cr_path(namespace), query={"watch": "true", "resourceVersion": start,
                                                                       "timeoutSeconds": "1"})  # fmt: skip
    events = [e for e in response.lines() if e["type"] != "BOOKMARK"]
    assert [e["type"] for e in events] == ["MODIFIED", "MODIFIED"]
    assert events[1]["object"]["spec"]["replicas"] == 4
    versions = [int(e["object"]["metadata"]["resourceVersion"]) for e in events]
    assert int(start) < versions[0] < versions[1]


def test_stale_resource_version_is_a_conflict(cluster: Cluster, namespace: str) -> None:
    old = create(cluster, namespace, trainjob("c"))
    patch(cluster, namespace, "c", {"spec": {"replicas": 2}})
    stale = {**old, "spec": {**old["spec"], "replicas": 3}}
    put = cluster.raw("PUT", cluster.cr_path(namespace, "c"), stale)
    assert (put.status, put.json()["reason"]) == (409, "Conflict")
    stale_patch = {"metadata": {"resourceVersion": old["metadata"]["resourceVersion"]}, "spec": {"replicas": 5}}
    patched = patch(cluster, namespace, "c", stale_patch)
    assert (patched.status, patched.json()["reason"]) == (409, "Conflict")


def test_noop_write_does_not_bump_resource_version(cluster: Cluster, namespace: str) -> None:
    obj = create(cluster, namespace, trainjob("n", replicas=2))
    same = patch(cluster, namespace, "n", {"spec": {"replicas": 2}})
    assert same.status == 200
    assert same.json()["metadata"]["resourceVersion"] == obj["metadata"]["resourceVersion"]
    put = cluster.raw("PUT", cluster.cr_path(namespace, "n"), obj)
    assert put.json()["metadata"]["resourceVersion"] == obj["metadata"]["resourceVersion"]


def test_generation_changes_only_with_spec(cluster: Cluster, namespace: str) -> None:
    create(cluster, namespace, trainjob("g"))
    labelled = patch(cluster, namespace, "g", {"metadata": {"labels": {"a": "b"}}}).json()
    assert labelled["metadata"]["generation"] == 1
    status = patch(cluster, namespace, "g", {"status": {"phase": "Running"}}, "status").json()
    assert status["metadata"]["generation"] == 1
    spec = patch(cluster, namespace, "g", {"spec": {"replicas": 3}}).json()
    assert spec["metadata"]["generation"] == 2


def test_status_subresource_isolation_both_ways(cluster: Cluster, namespace: str) -> None:
    create(cluster, namespace, trainjob("s"))
    main = patch(cluster, namespace, "s", {"status": {"phase": "Hacked"}, "spec": {"replicas": 2}}).json()
    assert "status" not in main and main["spec"]["replicas"] == 2
    sub = patch(cluster, namespace, "s", {"status": {"phase": "Running"}, "spec": {"replicas": 9}}, "status").json()
    assert sub["status"] == {"phase": "Running"} and sub["spec"]["replicas"] == 2
    via_client = cluster.custom.patch_namespaced_custom_object_status(
        "example.r3.dev", "v1", namespace, "trainjobs", "s", {"status": {"observedGeneration": 2}}
    )
    assert via_client["status"] == {"phase": "Running", "observedGeneration": 2}


def test_finalizers_make_deletion_two_phase(cluster: Cluster, namespace: str) -> None:
    obj = create(cluster, namespace, {**trainjob("f"), "metadata": {"name": "f", "finalizers": ["r3.dev/cleanup"]}})
    start = obj["metadata"]["resourceVersion"]
    deleting = cluster.raw("DELETE", cluster.cr_path(namespace, "f"), {"propagationPolicy": "Foreground"})
    assert deleting.status in (200, 202)
    pending = cluster.raw("GET", cluster.cr_path(namespace, "f")).json()
    assert pending["metadata"]["deletionTimestamp"]
    released = patch(cluster, namespace, "f", {"metadata": {"finalizers": None}})
    assert released.status == 200
    assert cluster.raw("GET", cluster.cr_path(namespace, "f")).status == 404
    response = cluster.raw("GET", cluster.cr_path(namespace), query={"watch": "true", "resourceVersion": start,
                                                                       "timeoutSeconds": "1"})  # fmt: skip
    types = [e["type"] for e in response.lines() if e["type"] != "BOOKMARK"]
    assert types[0] == "MODIFIED" and types[-1] == "DELETED"


def test_schema_violations_are_422_with_field_paths(cluster: Cluster, namespace: str) -> None:
    bad = trainjob("bad", replicas=0, replay={"mode": "R9"})
    del bad["spec"]["model"]
    response = cluster.raw("POST", cluster.cr_path(namespace), bad)
    assert response.status == 422
    assert causes(response) == [
        ("FieldValueInvalid", "spec.replicas"),
        ("FieldValueNotSupported", "spec.replay.mode"),
        ("FieldValueRequired", "spec.model"),
    ]


def test_cel_violations_are_422_with_rule_reason_and_field_path(cluster: Cluster, namespace: str) -> None:
    response = cluster.raw("POST", cluster.cr_path(namespace), trainjob("cel", replay={"mode": "R3"},
                                                                         kvCacheOffload=True))  # fmt: skip
    assert response.status == 422
    assert causes(response) == [("FieldValueInvalid", "spec")]
    create(cluster, namespace, trainjob("shrink", replicas=3))
    shrunk = patch(cluster, namespace, "shrink", {"spec": {"replicas": 2}})
    assert shrunk.status == 422
    assert causes(shrunk) == [("FieldValueForbidden", "spec.replicas")]  # transition rule with oldSelf


def test_unknown_fields_are_rejected_under_strict_validation(cluster: Cluster, namespace: str) -> None:
    response = cluster.raw("POST", cluster.cr_path(namespace), trainjob("u", bogus=1),
                           query={"fieldValidation": "Strict"})  # fmt: skip
    assert (response.status, response.json()["reason"]) == (400, "BadRequest")


def test_dry_run_does_not_store(cluster: Cluster, namespace: str) -> None:
    response = cluster.raw("POST", cluster.cr_path(namespace), trainjob("dry"), query={"dryRun": "All"})
    assert response.status == 201
    assert cluster.raw("GET", cluster.cr_path(namespace, "dry")).status == 404


def test_table_output_uses_printer_columns(cluster: Cluster, namespace: str) -> None:
    create(cluster, namespace, trainjob("t", replicas=2, replay={"mode": "R3"}))
    ready = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
    patch(cluster, namespace, "t", {"status": ready}, "status")
    table = cluster.raw("GET", cluster.cr_path(namespace), accept=TABLE_ACCEPT).json()
    assert table["kind"] == "Table"
    assert [c["name"] for c in table["columnDefinitions"]] == ["Name", "Mode", "Replicas", "Ready", "Phase", "Age"]
    (row,) = table["rows"]
    assert row["cells"][:5] == ["t", "R3", 2, "True", "Running"]
    assert row["cells"][5].endswith("s")  # humanised date column
    assert row["object"]["metadata"]["name"] == "t"


def test_table_watch_events_are_one_row_tables(cluster: Cluster, namespace: str) -> None:
    start = create(cluster, namespace, trainjob("tw"))["metadata"]["resourceVersion"]
    patch(cluster, namespace, "tw", {"spec": {"replicas": 2}})
    response = cluster.raw("GET", cluster.cr_path(namespace), accept=TABLE_ACCEPT,
                           query={"watch": "true", "resourceVersion": start, "timeoutSeconds": "1"})  # fmt: skip
    (event,) = [e for e in response.lines() if e["type"] != "BOOKMARK"]
    assert event["type"] == "MODIFIED" and event["object"]["kind"] == "Table"
    assert [r["cells"][2] for r in event["object"]["rows"]] == [2]


def test_strategic_merge_patch_is_refused_for_custom_resources(cluster: Cluster, namespace: str) -> None:
    create(cluster, namespace, trainjob("smp"))
    response = cluster.raw("PATCH", cluster.cr_path(namespace, "smp"), {"spec": {"replicas": 2}},
                           content_type="application/strategic-merge-patch+json")  # fmt: skip
    assert response.status == 415


def test_configmap_has_no_generation_and_strategic_merge_merges_maps(cluster: Cluster, namespace: str) -> None:
    cm = cluster.core.create_namespaced_config_map(namespace, {"metadata": {"name": "cm"}, "data": {"a": "1"}})
    assert cm.metadata.generation is None
    patched = cluster.core.patch_namespaced_config_map("cm", namespace, {"data": {"b": "2"}})  # SMP by default
    assert patched.data == {"a": "1", "b": "2"}
    assert int(patched.metadata.resource_version) > int(cm.metadata.resource_version)


@pytest.mark.emulator_only
def test_server_side_apply_is_refused_with_415(cluster: Cluster, namespace: str) -> None:
    response = cluster.raw("PATCH", cluster.cr_path(namespace, "ssa"), "spec: {}",
                           content_type="application/apply-patch+yaml", query={"fieldManager": "t"})  # fmt: skip
    assert response.status == 415


@pytest.mark.emulator_only
def test_request_log_shows_status_written_via_subresource(cluster: Cluster, namespace: str) -> None:
    assert cluster.emulator is not None
    create(cluster, namespace, trainjob("log"))
    patch(cluster, namespace, "log", {"status": {"phase": "Done"}}, "status")
    writes = [r for r in cluster.emulator.requests if r.method == "PATCH" and r.path.endswith("/log/status")]
    assert [(w.content_type, w.status) for w in writes] == [(MERGE, 200)]


@pytest.mark.emulator_only
def test_watch_from_compacted_resource_version_gets_410(cluster: Cluster, namespace: str) -> None:
    assert cluster.emulator is not None
    start = create(cluster, namespace, trainjob("old"))["metadata"]["resourceVersion"]
    patch(cluster, namespace, "old", {"spec": {"replicas": 2}})
    cluster.emulator.compact()
    response = cluster.raw("GET", cluster.cr_path(namespace), query={"watch": "true", "resourceVersion": start})
    (event,) = response.lines()
    assert event["type"] == "ERROR" and event["object"]["code"] == 410
