"""Who holds a kept ReadWriteOnce model cache (operator/model_cache_hold.py), against a fake API server that
checks the resourceVersion of a merge patch as the real one does: the live holder keeps it, a deleted,
re-created or finished one loses it, and of two RLJobs that take it at once only one gets it."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

from operator_harness import example

from r3operator.api.load import parse_rljob
from r3operator.api.v1alpha1 import RLJob
from r3operator.operator.builders.model_cache import build_model_cache_claim
from r3operator.operator.kube import Kind, KubeError
from r3operator.operator.model_cache_hold import Hold, hold_model_cache

HOLDER = "r3operator.io/model-cache-holder"
RWO = {"model.cache": {"accessMode": "ReadWriteOnce"}}


class Server:
    """Objects by (plural, name) in one namespace; a merge patch naming a stale resourceVersion is a 409."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.patches: list[str] = []
        self.before_patch: Any = None
        self._rv = 0

    def put(self, obj: dict[str, Any]) -> dict[str, Any]:
        self._rv += 1
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(self._rv)
        plural = {"PersistentVolumeClaim": "persistentvolumeclaims", "RLJob": "rljobs"}[obj["kind"]]
        self.objects[(plural, obj["metadata"]["name"])] = obj
        return copy.deepcopy(obj)

    async def get(self, kind: Kind, namespace: str | None, name: str) -> dict[str, Any] | None:
        found = self.objects.get((kind.plural, name))
        return copy.deepcopy(found) if found is not None else None

    async def apply(self, obj: dict[str, Any], *, force: bool, field_manager: str = "r3operator") -> dict[str, Any]:
        return self.put(obj)

    async def merge_patch(
        self, kind: Kind, namespace: str | None, name: str, patch: dict[str, Any], *, subresource: str | None = None
    ) -> dict[str, Any]:
        if self.before_patch is not None:
            self.before_patch()
        have = self.objects[(kind.plural, name)]
        if patch["metadata"].get("resourceVersion") not in (None, have["metadata"]["resourceVersion"]):
            raise KubeError(409, "the object has been modified", "Conflict")
        self.patches.append(name)
        have["metadata"].setdefault("annotations", {}).update(patch["metadata"].get("annotations") or {})
        return self.put(have)


def _job(name: str, uid: str) -> RLJob:
    doc = example(name, "rl", **RWO)
    doc["metadata"]["uid"] = uid
    return parse_rljob(doc)


def _rljob(server: Server, name: str, uid: str, **annotations: str) -> None:
    server.put({"kind": "RLJob", "metadata": {"name": name, "uid": uid, "annotations": annotations}})


def _claim_held_by(server: Server, job: RLJob, holder: str) -> str:
    claim = build_model_cache_claim(job)
    assert claim is not None
    claim["metadata"]["annotations"][HOLDER] = holder
    return str(server.put(claim)["metadata"]["name"])


def _hold(server: Server, job: RLJob) -> Hold:
    return asyncio.run(hold_model_cache(server, job))  # type: ignore[arg-type]


def test_the_first_job_creates_the_claim_and_holds_it_and_a_second_waits_while_it_lives() -> None:
    server = Server()
    first, second = _job("first", "uid-a"), _job("second", "uid-b")
    _rljob(server, "first", "uid-a")
    hold = _hold(server, first)
    assert hold.holder is None and hold.taken_from is None and hold.claim.endswith("-rwo")
    assert server.objects[("persistentvolumeclaims", hold.claim)]["metadata"]["annotations"][HOLDER] == "first/uid-a"
    assert _hold(server, first) == Hold(hold.claim) and server.patches == [hold.claim]  # no second write
    assert _hold(server, second) == Hold(hold.claim, holder="first")
    assert server.patches == [hold.claim]


def test_a_deleted_re_created_or_finished_holder_loses_the_claim_to_the_next_job() -> None:
    job = _job("next", "uid-n")
    for case in ("deleted", "re-created", "finished", "being deleted"):
        server = Server()
        claim = _claim_held_by(server, job, "old/uid-o")
        if case == "re-created":
            _rljob(server, "old", "uid-other")  # the same name, another RLJob: not the one that mounted it
        elif case == "finished":
            _rljob(server, "old", "uid-o", **{"r3operator.io/finished": "Succeeded 2026-01-01T00:00:00Z"})
        elif case == "being deleted":
            _rljob(server, "old", "uid-o")
            server.objects[("rljobs", "old")]["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
        assert _hold(server, job) == Hold(claim, taken_from="old"), case
        assert server.objects[("persistentvolumeclaims", claim)]["metadata"]["annotations"][HOLDER] == "next/uid-n"


def test_of_two_jobs_taking_a_free_claim_at_once_one_gets_it_and_the_other_waits_naming_it() -> None:
    server = Server()
    b = _job("b", "uid-b")
    _rljob(server, "b", "uid-b")
    _rljob(server, "c", "uid-c")
    claim = _claim_held_by(server, b, "gone/uid-g")

    def c_wins() -> None:  # c's patch lands between b's read of the claim and b's own patch
        server.before_patch = None
        have = server.objects[("persistentvolumeclaims", claim)]
        have["metadata"]["annotations"][HOLDER] = "c/uid-c"
        server.put(have)

    server.before_patch = c_wins
    assert _hold(server, b) == Hold(claim, holder="c")  # b's resourceVersion was stale: 409, then it reads c
    assert server.objects[("persistentvolumeclaims", claim)]["metadata"]["annotations"][HOLDER] == "c/uid-c"
    assert server.patches == []
