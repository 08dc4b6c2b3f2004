"""operator/diffbase.py: kopf's diff base of an RLJob, built without copying its managedFields and status."""

from __future__ import annotations

import copy
from typing import Any

import kopf

from r3operator.operator import meta
from r3operator.operator.diffbase import LeanDiffBaseStorage


class NoCopy:
    """A value that refuses to be deep-copied: where kopf's build copies it, the build fails."""

    def __deepcopy__(self, _memo: dict[int, Any]) -> Any:
        raise AssertionError("deep-copied")


def _rljob(status: Any, managed: Any) -> dict[str, Any]:
    return {
        "apiVersion": "r3operator.io/v1alpha1",
        "kind": "RLJob",
        "metadata": {
            "name": "job",
            "namespace": "rl",
            "uid": "u1",
            "generation": 3,
            "labels": {"team": "a"},
            "annotations": {"note": "x", f"{meta.PREFIX}/last-handled-configuration": "{}", "kopf.zalando.org/x": "y"},
            "managedFields": managed,
            "finalizers": [meta.FINALIZER],
        },
        "spec": {"model": {"name": "m"}, "inference": {"replicas": 2}},
        "status": status,
    }


def test_the_essence_is_kopfs_own():
    body = _rljob({"conditions": [{"type": "Ready", "status": "True"}]}, [{"manager": "kubectl", "fieldsV1": {}}])
    stock = kopf.AnnotationsDiffBaseStorage(prefix=meta.PREFIX, key="last-handled-configuration")
    lean = LeanDiffBaseStorage(prefix=meta.PREFIX, key="last-handled-configuration")
    assert lean.build(body=kopf.Body(copy.deepcopy(body))) == stock.build(body=kopf.Body(copy.deepcopy(body)))
    essence = lean.build(body=kopf.Body(body))
    assert essence["spec"] == body["spec"] and essence["spec"] is not body["spec"]  # a copy: later edits stay out
    assert "status" not in essence and essence["metadata"] == {"labels": {"team": "a"}, "annotations": {"note": "x"}}


def test_managed_fields_and_status_are_not_copied():
    body = kopf.Body(_rljob({"conditions": [NoCopy()]}, [NoCopy()]))
    essence = LeanDiffBaseStorage(prefix=meta.PREFIX, key="last-handled-configuration").build(body=body)
    assert essence["spec"]["inference"] == {"replicas": 2}
