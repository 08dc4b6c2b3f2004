"""The operator's own upgrade record and the canary's verdict, pure: where they are read from (the engine
StatefulSet's annotation, the canary pod's termination message), what the canary's clock counts from,
and the last check before an image is rendered. On the real control plane: test_status_is_output_cluster.py."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pytest
from test_upgrade import NEW, NOW, OLD, canary_status, engines, job, rec

from r3operator.api.canary_verdict import TERMINATION_MESSAGE_LIMIT, parse_verdict, termination_message
from r3operator.api.v1alpha1 import EngineFidelity, UpgradeCanary
from r3operator.operator.desired import Facts, desired
from r3operator.operator.upgrade import (
    CanaryInputs,
    EngineRollout,
    UpgradePlan,
    allowed_images,
    plan_upgrade,
    refuse_unknown_images,
)
from r3operator.operator.upgrade_record import (
    ANNOTATION_UPGRADE_STATE,
    PodProgress,
    pod_progress,
    read_record,
    surge_pods,
    verdict_from_pods,
)

EVIL = "evil.example.com/miner:1"
JOB_UID = "canary-job-uid"


def canary_job(attempt: str = "7") -> dict[str, Any]:
    return {"metadata": {"uid": JOB_UID, "labels": {"r3operator.io/upgrade-attempt": attempt}}}


def canary_pod(message: str, *, exit_code: int = 0, owner: str = JOB_UID) -> dict[str, Any]:
    return {
        "metadata": {"name": "j-upgrade-canary-x1", "ownerReferences": [{"controller": True, "uid": owner}]},
        "status": {
            "containerStatuses": [
                {"name": "upgrade-canary", "state": {"terminated": {"exitCode": exit_code, "message": message}}}
            ]
        },
    }


def test_the_record_round_trips_through_the_rendered_statefulset() -> None:
    status = rec(canary_status(canaryStartedAt="2026-11-23T11:58:00Z"))
    children = desired(job(), Facts(engine_rollout=EngineRollout(NEW, 1, 2), upgrade_record=status))
    (sts,) = [c for c in children if c["kind"] == "StatefulSet"]
    assert read_record(sts) == status
    assert read_record({"metadata": {"annotations": {ANNOTATION_UPGRADE_STATE: "{not json"}}}) is None
    assert read_record(None) is None


def test_the_verdict_is_the_termination_message_of_a_pod_the_canary_job_controls() -> None:
    verdict = UpgradeCanary(attempt="7", passed=True, message="figures")
    text = termination_message(verdict)
    assert verdict_from_pods([canary_pod(text)], canary_job(), container="upgrade-canary", attempt="7") == verdict
    # A pod someone else controls, a crashed container, another attempt's Job or verdict: no verdict.
    assert (
        verdict_from_pods([canary_pod(text, owner="x")], canary_job(), container="upgrade-canary", attempt="7") is None
    )
    assert (
        verdict_from_pods([canary_pod(text, exit_code=1)], canary_job(), container="upgrade-canary", attempt="7")
        is None
    )
    assert verdict_from_pods([canary_pod(text)], canary_job("6"), container="upgrade-canary", attempt="7") is None
    assert verdict_from_pods([canary_pod(text)], canary_job(), container="upgrade-canary", attempt="8") is None
    assert verdict_from_pods([canary_pod("not json")], canary_job(), container="upgrade-canary", attempt="7") is None


def test_a_long_verdict_still_fits_the_kubelets_termination_message() -> None:
    side = EngineFidelity(image=NEW, routes_valid=False, message="x" * 1024)
    verdict = UpgradeCanary(attempt="7", passed=False, message="é" * 2048, old=side, new=side)
    text = termination_message(verdict)
    assert len(text.encode()) <= TERMINATION_MESSAGE_LIMIT
    parsed = parse_verdict(text)
    assert parsed is not None and (parsed.attempt, parsed.passed) == ("7", False) and parsed.message
    assert json.loads(text)["new"]["image"] == NEW


def running(name: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": {"r3operator.io/role": "engine"}}, "status": {"phase": "Running"}}


def pending(name: str, why: str) -> dict[str, Any]:
    cond = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": why}
    return {
        "metadata": {"name": name, "labels": {"r3operator.io/role": "engine"}},
        "status": {"phase": "Pending", "conditions": [cond]},
    }


def test_the_surge_replica_is_ordinal_replicas_or_its_leaderworkerset_group() -> None:
    pods = [running("j-engine-1"), running("j-engine-2"), running("j-engine-2-1"), running("j-engine-20")]
    assert [p["metadata"]["name"] for p in surge_pods(pods, "j-engine", 2)] == ["j-engine-2", "j-engine-2-1"]
    assert pod_progress([]) == PodProgress(running=False)
    progress = pod_progress([running("a"), pending("b", "0/3 nodes: Insufficient nvidia.com/gpu")])
    assert not progress.running and progress.unschedulable is not None and "Insufficient" in progress.unschedulable


def test_the_canary_clock_starts_when_its_pods_run_not_when_the_upgrade_starts() -> None:
    started = canary_status()  # startedAt 11:55, limit 60 s: long past at NOW (12:00)
    waiting = plan_upgrade(job(timeoutSeconds=60), engines(NEW, pods=3), prev=rec(started), now=NOW)
    assert waiting.status is not None and waiting.status.phase == "Canary" and waiting.status.canary_started_at is None
    up = CanaryInputs(pods=PodProgress(running=True))
    ran = plan_upgrade(job(timeoutSeconds=60), engines(NEW, pods=3), prev=rec(started), canary=up, now=NOW)
    assert ran.status is not None and ran.status.phase == "Canary"
    assert ran.status.canary_started_at == "2026-11-23T12:00:00Z"
    later = plan_upgrade(
        job(timeoutSeconds=60), engines(NEW, pods=3), prev=ran.status, canary=up, now=NOW + dt.timedelta(seconds=61)
    )
    assert later.status is not None and later.status.phase == "Blocked" and "after its pods ran" in later.status.message


def test_a_canary_that_cannot_be_scheduled_is_reported_at_once_and_rolled_back_after_the_start_timeout() -> None:
    stuck = CanaryInputs(pods=PodProgress(running=False, unschedulable="pod j-engine-2 cannot be scheduled: no GPU"))
    now = dt.datetime(2026, 11, 23, 11, 55, 30, tzinfo=dt.UTC)
    plan = plan_upgrade(
        job(startTimeoutSeconds=60), engines(NEW, pods=3), prev=rec(canary_status()), canary=stuck, now=now
    )
    assert plan.status is not None and plan.status.phase == "Canary" and plan.unschedulable is not None
    assert "no GPU" in plan.status.message and plan.rollout is not None and plan.rollout.surge_replicas == 1
    late = plan_upgrade(
        job(startTimeoutSeconds=60),
        engines(NEW, pods=3),
        prev=rec(canary_status()),
        canary=stuck,
        now=now + dt.timedelta(seconds=31),
    )
    assert late.status is not None and late.status.phase == "Blocked"
    assert "did not start within 60 s" in late.status.message
    assert late.rollout is not None and (late.rollout.image, late.rollout.surge_replicas) == (OLD, 0)  # GPUs released
    assert late.canary is None and "no GPU" in late.status.message


def test_an_image_neither_in_the_spec_nor_the_record_nor_running_is_refused() -> None:
    allowed = allowed_images(job(), rec(canary_status()), engines(NEW), None)
    assert allowed["engine"] == {OLD, NEW}
    evil = UpgradePlan(rec(canary_status()), EngineRollout(EVIL, 1, 2))
    refused = refuse_unknown_images(evil, allowed)
    assert refused.rollout is None and refused.canary is None and refused.blocked_message is not None
    assert EVIL in refused.blocked_message
    fine = UpgradePlan(rec(canary_status()), EngineRollout(OLD))
    assert refuse_unknown_images(fine, allowed) is fine


def test_the_canary_pod_writes_its_verdict_as_its_termination_message_and_has_no_api_token(tmp_path: Any) -> None:
    plan = plan_upgrade(job(), engines(OLD), now=NOW)
    (canary,) = [
        c
        for c in desired(job(), Facts(engine_rollout=plan.rollout, upgrade_canary=plan.canary))
        if c["metadata"]["name"].endswith("-upgrade-canary")
    ]
    pod = canary["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert (container["terminationMessagePath"], container["terminationMessagePolicy"]) == (
        "/dev/termination-log",
        "File",
    )
    assert pod["automountServiceAccountToken"] is False

    pytest.importorskip("torch")  # the runtime module imports the trainer
    from r3operator.runtime.upgrade_canary import publish

    verdict = UpgradeCanary(attempt="7", passed=False, message="figures")
    log = tmp_path / "termination-log"
    log.touch()  # the kubelet creates it in the container
    assert publish(verdict, log) and parse_verdict(log.read_text()) == verdict
    assert publish(verdict, tmp_path / "absent")  # not in a pod: printed only
    (tmp_path / "unwritable").mkdir()
    assert not publish(verdict, tmp_path / "unwritable")  # the Job fails, the upgrade is blocked saying so
