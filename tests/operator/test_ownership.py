"""Nobody but the operator steers or paints a job, pure parts (issue #45). The same on the real control plane is in
test_ownership_cluster.py.

- the desired state comes from the spec and the operator's own record (the verified-image annotation), never
  from an image edited by hand into a live StatefulSet or RayJob;
- ``r3operator.io/upgrade=force`` says when it decided a plan (the reconciler then removes it);
- the trainer's progress report is checked against ``Progress`` before it reaches the status;
- a status patch over a forged status, and a watch event of the operator's own write, compare as the operator's;
- no borrowed identity, no ``kube-`` name; the model cache claim's class and its one model-source form.
"""

from __future__ import annotations

import asyncio
import copy
import json
from typing import Any

import pytest
from operator_harness import example
from test_upgrade import NEW, NOW, OLD, engines, job, said, statefulset_of

from r3operator.api import parse_rljob
from r3operator.api.load import RLJobLoadError
from r3operator.api.v1alpha1 import Progress, RLJob
from r3operator.operator.apply import plan_action
from r3operator.operator.builders.model_cache import build_model_cache_claim
from r3operator.operator.desired import Facts, desired
from r3operator.operator.kube import Kind
from r3operator.operator.observed import Observed
from r3operator.operator.progress import read_report
from r3operator.operator.references import check_references
from r3operator.operator.status import compute_status, status_digest, status_patch
from r3operator.operator.upgrade import (
    ANNOTATION_UPGRADE,
    ANNOTATION_VERIFIED_IMAGE,
    UpgradePlan,
    allowed_images,
    plan_upgrade,
    refuse_unknown_images,
)

EVIL = "evil.example.com/miner:1"


def _verified(obj: dict[str, Any], image: str) -> dict[str, Any]:
    out = copy.deepcopy(obj)
    out.setdefault("metadata", {}).setdefault("annotations", {})[ANNOTATION_VERIFIED_IMAGE] = image
    return out


def _edited_engines(image: str) -> dict[str, Any]:
    """Engines the operator rendered on OLD (its annotation says so), their template's image edited by hand."""
    return _verified(engines(image), OLD)


def test_a_hand_edited_engine_image_starts_no_upgrade_and_is_taken_back() -> None:
    edited = _edited_engines(EVIL)
    plan = plan_upgrade(job(OLD), edited, now=NOW)
    assert plan.status is None and plan.rollout is None and plan.canary is None
    [want] = [c for c in desired(job(OLD)) if c["kind"] == "StatefulSet"]
    assert want["spec"]["template"]["spec"]["containers"][0]["image"] == OLD
    have = {**copy.deepcopy(want), "spec": {**want["spec"], "template": copy.deepcopy(want["spec"]["template"])}}
    have["spec"]["template"]["spec"]["containers"][0]["image"] = EVIL
    action = plan_action(want, have, job_uid="uid-1")
    assert (action.verb, action.force) == ("apply", True) and "image" in action.why
    # No approval either: a plan that would render the edited image is refused.
    assert EVIL not in allowed_images(job(OLD), None, edited, None)["engine"]


def test_an_upgrade_after_a_hand_edit_starts_from_and_falls_back_to_the_verified_image() -> None:
    edited = _edited_engines(EVIL)
    canary = plan_upgrade(job(NEW), edited, now=NOW)
    assert canary.status is not None and (canary.status.phase, canary.status.from_image) == ("Canary", OLD)
    blocked = plan_upgrade(job(NEW), edited, prev=canary.status, canary=said("7", passed=False), now=NOW)
    assert blocked.status is not None and blocked.status.phase == "Blocked"
    assert blocked.rollout is not None and blocked.rollout.image == OLD
    assert f"back on {OLD}" in blocked.status.message and EVIL not in blocked.status.message


def test_the_verified_image_annotation_follows_what_the_regular_replicas_are_known_good_on() -> None:
    def annotated(plan: UpgradePlan, spec: RLJob) -> str:
        sts = statefulset_of(desired(spec, Facts(engine_rollout=plan.rollout, upgrade_record=plan.status)))
        return str(sts["metadata"]["annotations"][ANNOTATION_VERIFIED_IMAGE])

    assert annotated(UpgradePlan(None), job(OLD)) == OLD
    canary = plan_upgrade(job(NEW), _verified(engines(OLD), OLD), now=NOW)
    assert annotated(canary, job(NEW)) == OLD  # the partition keeps the regular replicas on it
    rolling = plan_upgrade(
        job(NEW), _verified(engines(OLD), OLD), prev=canary.status, canary=said("7", passed=True), now=NOW
    )
    assert annotated(rolling, job(NEW)) == NEW
    blocked = plan_upgrade(
        job(NEW), _verified(engines(OLD), OLD), prev=canary.status, canary=said("7", passed=False), now=NOW
    )
    assert annotated(blocked, job(NEW)) == OLD


def test_a_hand_edited_rayjob_image_starts_no_trainer_upgrade_and_is_applied_back_in_place() -> None:
    spec = job(OLD)
    [want] = [c for c in desired(spec) if c["kind"] == "RayJob"]
    assert want["metadata"]["annotations"][ANNOTATION_VERIFIED_IMAGE] == spec.spec.trainer.image
    have = copy.deepcopy(want)
    have["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["image"] = EVIL
    plan = plan_upgrade(spec, _verified(engines(OLD), OLD), ray_job=have, now=NOW)
    assert plan.status is None and plan.trainer_image is None and plan.canary is None
    action = plan_action(want, have, job_uid="uid-1")
    assert (action.verb, action.force, action.body) == ("apply", True, want)  # not re-created: training goes on
    assert EVIL not in allowed_images(spec, None, None, have)["trainer"]
    assert (
        refuse_unknown_images(
            UpgradePlan(None, trainer_image=EVIL), allowed_images(spec, None, None, have)
        ).trainer_image
        is None
    )


@pytest.mark.parametrize("forced", [True, False])
def test_a_plan_says_when_the_force_annotation_decided_it(forced: bool) -> None:
    annotations = {ANNOTATION_UPGRADE: "force"} if forced else {}
    fresh = plan_upgrade(job(NEW, annotations=annotations), _verified(engines(OLD), OLD), now=NOW)
    assert fresh.status is not None and fresh.status.phase == ("Rolling" if forced else "Canary")
    assert fresh.forced is forced
    canary = plan_upgrade(job(NEW), _verified(engines(OLD), OLD), now=NOW).status
    blocked = plan_upgrade(job(NEW), engines(OLD), prev=canary, canary=said("7", passed=False), now=NOW).status
    lifted = plan_upgrade(job(NEW, annotations=annotations), engines(OLD), prev=blocked, now=NOW)
    assert lifted.forced is forced and lifted.status is not None
    assert lifted.status.phase == ("Rolling" if forced else "Blocked")
    # Nothing to force: the plan does not say it was forced (the annotation is removed unused).
    idle = plan_upgrade(job(OLD, annotations=annotations), _verified(engines(OLD), OLD), now=NOW)
    assert idle.forced is False


def _report(text: str) -> Any:
    return read_report({"data": {"progress": text}})


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ('{"step": NaN}', "NaN is not a finite number"),
        ('{"step": 3, "rewardMean": Infinity}', "Infinity is not a finite number"),
        ('{"step": 3, "klK3": 1e999}', "1e999 is not a finite number"),
        ('{"step": 3, "rewardMean": "nan"}', "rewardMean is not a finite number"),
        ('{"step": 99999999999999999999}', "step is beyond a 64-bit integer"),
        ('{"step": "three"}', "step: Input should be a valid integer"),
        ('{"step": 3, "weightSync": "' + "x" * 600 + '"}', "weightSync"),
        ("[3]", "a JSON list, not an object"),
        ("step 3", "not JSON"),
        ('{"step": 3, "pad": "' + "x" * 20_000 + '"}', "more than 16384"),
    ],
)
def test_a_progress_report_the_status_cannot_hold_is_refused_with_the_reason(text: str, why: str) -> None:
    report = _report(text)
    assert report.refused and report.progress is None and report.problem is not None and why in report.problem


def test_a_progress_report_is_taken_through_progress_and_unknown_keys_are_left_out_with_a_note() -> None:
    assert read_report(None).progress is None and not read_report(None).refused
    report = _report(json.dumps({"step": 3, "totalSteps": 10, "rewardMean": 0.5, "fromTheFuture": 1}))
    assert report.progress == Progress(step=3, total_steps=10, reward_mean=0.5) and not report.refused
    assert report.problem == "left out the unknown keys fromTheFuture"


def _qwen(**edits: Any) -> RLJob:
    doc = example("job", "rl", **edits)
    doc["metadata"]["uid"] = "uid-1"
    return parse_rljob(doc)


def test_the_status_as_written_and_as_its_watch_event_carries_it_have_one_digest() -> None:
    status = compute_status(_qwen(), Observed(progress=read_report({"data": {"progress": '{"step": 2}'}})), NOW)
    echoed = json.loads(json.dumps(status_patch(status)["status"]))
    echoed = {k: v for k, v in echoed.items() if v is not None}  # a merge patch's nulls are absent after it
    assert status_digest(echoed) == status_digest(status)
    forged = {**echoed, "startTime": "2000-01-01T00:00:00Z"}
    assert status_digest(forged) != status_digest(status)
    assert status_digest({"conditions": "garbage"}) != status_digest(status)


class Accounts:
    """A read-only client that holds ServiceAccounts."""

    def __init__(self, accounts: dict[str, dict[str, Any]]) -> None:
        self.accounts = accounts

    async def get(self, kind: Kind, namespace: str | None, name: str) -> dict[str, Any] | None:
        assert kind.plural == "serviceaccounts"
        return self.accounts.get(name)


def _owned_by(kind: str, name: str, uid: str) -> dict[str, Any]:
    ref = {"apiVersion": "x", "kind": kind, "name": name, "uid": uid, "controller": True}
    return {"metadata": {"ownerReferences": [ref]}}


@pytest.mark.parametrize("site", ["podTemplate", "trainer.podTemplate", "inference.podTemplate"])
def test_a_pod_template_may_not_name_another_jobs_identity_or_the_operators(site: str) -> None:
    accounts = {
        "shared": _owned_by("RLJob", "other", "uid-2"),
        "own": _owned_by("Deployment", "tooling", "uid-3"),
        "r3operator": {"metadata": {}},
    }
    client = Accounts(accounts)

    def borrowed(name: str, operator: tuple[str, str] | None = None) -> tuple[str, ...]:
        spec = _qwen(**{site: {"serviceAccountName": name}})
        check = asyncio.run(check_references(client, spec, priority_class=None, operator_account=operator))  # type: ignore[arg-type]
        return check.borrowed

    [message] = borrowed("shared")
    assert message.startswith(f"spec.{site}.serviceAccountName shared is controlled by RLJob/other")
    assert borrowed("own") == ()
    assert borrowed("r3operator", ("other-namespace", "r3operator")) == ()
    [own] = borrowed("r3operator", ("rl", "r3operator"))
    assert own.startswith(f"spec.{site}.serviceAccountName r3operator is the operator's own ServiceAccount")


def test_an_rljob_name_kubernetes_reserves_is_refused_with_the_field() -> None:
    with pytest.raises(RLJobLoadError, match=r"metadata\.name.*kube-system starts with kube-"):
        parse_rljob(example("kube-system", "rl"))
    assert parse_rljob(example("kubeflow-job", "rl")).metadata.name == "kubeflow-job"


def test_the_model_cache_claim_takes_the_jobs_storage_class_and_one_model_source_form() -> None:
    uri = "hf://Qwen/Qwen3-30B-A3B"

    def claim(**edits: Any) -> dict[str, Any]:
        built = build_model_cache_claim(_qwen(**{"model.uri": uri, **edits}))
        assert built is not None
        return built

    assert claim(**{"storage.storageClassName": "rwx-nfs"})["spec"]["storageClassName"] == "rwx-nfs"
    own = claim(**{"storage.storageClassName": "rwx-nfs", "model.cache": {"storageClassName": "fast"}})
    assert own["spec"]["storageClassName"] == "fast"
    assert "storageClassName" not in claim(**{"storage.storageClassName": None})["spec"]
    # Unpinned, pinned to main in the field or in the URI: one claim, one annotation, so none rewrites it.
    spellings = [
        claim(**{"model.revision": None}),
        claim(**{"model.revision": "main"}),
        claim(**{"model.uri": f"{uri}@main", "model.revision": None}),
    ]
    assert {c["metadata"]["name"] for c in spellings} == {spellings[0]["metadata"]["name"]}
    assert {c["metadata"]["annotations"]["r3operator.io/model-source"] for c in spellings} == {f"{uri}@main"}
    s3 = claim(**{"model.uri": "s3://models/qwen3/", "model.revision": None, "model.s3": {"credentialsSecret": "s"}})
    assert s3["metadata"]["annotations"]["r3operator.io/model-source"] == "s3://models/qwen3"
