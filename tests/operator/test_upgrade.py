"""Engine image upgrades, pure: the plan from spec + StatefulSet + the operator's upgrade record, its
rendering, the canary verdict. The same flow against a real API server is in test_upgrade_cluster.py."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pytest
import yaml

from r3operator.api.v1alpha1 import EngineFidelity, RLJob, UpgradeCanary, UpgradePolicySpec, UpgradeStatus
from r3operator.operator.apply import plan_action
from r3operator.operator.desired import Facts, desired
from r3operator.operator.upgrade import ANNOTATION_UPGRADE, CanaryInputs, plan_upgrade
from r3operator.operator.upgrade_record import PodProgress

REPO = Path(__file__).resolve().parents[2]
OLD, NEW, NEWER = (
    "ghcr.io/r3operator/engine:0.1.0-vllm0.22.1",
    "ghcr.io/r3operator/engine:0.2.0-vllm0.22.1",
    "ghcr.io/r3operator/engine:0.3.0-vllm0.22.1",
)
NOW = dt.datetime(2026, 11, 23, 12, 0, tzinfo=dt.UTC)


def job(
    image: str = NEW,
    *,
    replicas: int = 2,
    generation: int = 7,
    annotations: dict[str, str] | None = None,
    **policy: Any,
) -> RLJob:
    doc = yaml.safe_load((REPO / "examples" / "qwen3-30b-a3b-r3-fsdp.yaml").read_text())
    doc["metadata"].update(uid="uid-1", namespace="ml", generation=generation, annotations=annotations or {})
    doc["spec"]["inference"].update(image=image, replicas=replicas)
    doc["spec"]["upgradePolicy"] = policy
    return RLJob.model_validate(doc)


def rec(upgrade: dict[str, Any]) -> UpgradeStatus:
    """The operator's upgrade record (upgrade_record.read_record) as plan_upgrade gets it."""
    return UpgradeStatus.model_validate(upgrade)


def engines(image: str, *, pods: int = 2, updated: int | None = None, same_revision: bool = True) -> dict[str, Any]:
    """A StatefulSet as the API server returns it."""
    return {
        "metadata": {"generation": 3},
        "spec": {"replicas": pods, "template": {"spec": {"containers": [{"name": "vllm", "image": image}]}}},
        "status": {
            "observedGeneration": 3,
            "replicas": pods,
            "updatedReplicas": pods if updated is None else updated,
            "currentRevision": "a",
            "updateRevision": "a" if same_revision else "b",
        },
    }


def canary_status(**extra: Any) -> dict[str, Any]:
    return {"from": OLD, "to": NEW, "phase": "Canary", "attempt": "7", "startedAt": "2026-11-23T11:55:00Z", **extra}


def said(attempt: str, *, passed: bool) -> CanaryInputs:
    """The canary pod's verdict for ``attempt``, its pods running."""
    verdict = UpgradeCanary(attempt=attempt, passed=passed, message="figures")
    return CanaryInputs(verdict=verdict, pods=PodProgress(running=True))


def statefulset_of(children: list[dict[str, Any]]) -> dict[str, Any]:
    return next(c for c in children if c["kind"] == "StatefulSet")


def test_an_image_change_starts_a_canary_on_one_surge_replica_behind_a_partition() -> None:
    plan = plan_upgrade(job(), engines(OLD), now=NOW)
    assert plan.status is not None
    assert (plan.status.phase, plan.status.from_image, plan.status.to) == ("Canary", OLD, NEW)
    assert plan.canary is not None and (plan.canary.old_replica, plan.canary.new_replica) == (0, 2)
    children = desired(job(), Facts(engine_rollout=plan.rollout, upgrade_canary=plan.canary))
    sts = statefulset_of(children)
    assert sts["spec"]["replicas"] == 3  # two regular replicas and the canary
    assert sts["spec"]["updateStrategy"] == {"type": "RollingUpdate", "rollingUpdate": {"partition": 2}}
    assert sts["spec"]["template"]["spec"]["containers"][0]["image"] == NEW
    (canary,) = [c for c in children if c["metadata"]["name"].endswith("-upgrade-canary")]
    args = canary["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--new") + 1].split("//")[1].split(".")[0].endswith("-engine-2")  # the surge ordinal
    assert args[args.index("--old") + 1].split("//")[1].split(".")[0].endswith("-engine-0")
    assert args[args.index("--attempt") + 1] == "7"
    # The trainer's engine list names only the regular replicas: no rollout ever reaches the canary.
    (config,) = [c for c in children if c["kind"] == "ConfigMap" and "data" in c]
    assert "-engine-2." not in config["data"]["config.json"]


def test_no_upgrade_when_nothing_changed_or_at_creation() -> None:
    assert plan_upgrade(job(), None, now=NOW).rollout is None
    assert plan_upgrade(job(), engines(NEW), now=NOW).status is None


@pytest.mark.parametrize(
    ("kwargs", "why"),
    [({"canary": False}, "upgradePolicy.canary is false"), ({"annotations": {ANNOTATION_UPGRADE: "force"}}, "forced")],
)
def test_no_canary_wanted_or_forced_rolls_every_replica(kwargs: dict[str, Any], why: str) -> None:
    plan = plan_upgrade(job(**kwargs), engines(OLD), now=NOW)
    assert plan.status is not None and plan.status.phase == "Rolling" and why in plan.status.message
    assert plan.canary is None and plan.rollout is not None and plan.rollout.partition == 0


def test_a_passing_verdict_rolls_on_and_completion_is_read_from_the_statefulset() -> None:
    upgrade = canary_status()
    plan = plan_upgrade(
        job(), engines(NEW, pods=3, updated=1), prev=rec(upgrade), canary=said("7", passed=True), now=NOW
    )
    assert plan.status is not None and plan.status.phase == "Rolling" and plan.canary is None
    assert plan.status.canary is not None and plan.status.canary.passed  # the verdict, for status
    sts = statefulset_of(desired(job(), Facts(engine_rollout=plan.rollout)))
    assert sts["spec"]["replicas"] == 2 and "updateStrategy" not in sts["spec"]
    rolling = plan.status.model_dump(mode="json", by_alias=True)
    midway = plan_upgrade(job(), engines(NEW, updated=1, same_revision=False), prev=rec(rolling), now=NOW)
    assert midway.status is not None and (midway.status.phase, midway.status.replicas_updated) == ("Rolling", 1)
    done = plan_upgrade(job(), engines(NEW), prev=rec(rolling), now=NOW)
    assert done.status is not None and (done.status.phase, done.status.replicas_updated) == ("Complete", 2)
    assert done.rollout is None


def test_a_failing_verdict_rolls_back_and_blocks_until_the_image_changes_or_force() -> None:
    upgrade = canary_status()
    plan = plan_upgrade(job(), engines(NEW, pods=3), prev=rec(upgrade), canary=said("7", passed=False), now=NOW)
    assert plan.status is not None and plan.status.phase == "Blocked"
    assert OLD in plan.status.message and "r3operator.io/upgrade=force" in plan.status.message
    sts = statefulset_of(desired(job(), Facts(engine_rollout=plan.rollout)))
    assert sts["spec"]["template"]["spec"]["containers"][0]["image"] == OLD and sts["spec"]["replicas"] == 2
    blocked = plan.status.model_dump(mode="json", by_alias=True)
    again = plan_upgrade(job(), engines(OLD), prev=rec(blocked), now=NOW)
    assert again.status is not None and again.status.phase == "Blocked" and again.rollout.image == OLD  # type: ignore[union-attr]
    forced = plan_upgrade(job(annotations={ANNOTATION_UPGRADE: "force"}), engines(OLD), prev=rec(blocked), now=NOW)
    assert forced.status is not None and forced.status.phase == "Rolling" and forced.rollout.image == NEW  # type: ignore[union-attr]
    retry = plan_upgrade(job(NEWER, generation=9), engines(OLD), prev=rec(blocked), now=NOW)
    assert retry.status is not None and (
        retry.status.phase,
        retry.status.from_image,
        retry.status.to,
        retry.status.attempt,
    ) == ("Canary", OLD, NEWER, "9")


def test_a_verdict_for_another_attempt_is_ignored_and_a_missing_one_times_out() -> None:
    ran = canary_status(canaryStartedAt="2026-11-23T11:58:00Z")
    plan = plan_upgrade(job(), engines(NEW, pods=3), prev=rec(ran), canary=said("6", passed=True), now=NOW)
    assert plan.status is not None and plan.status.phase == "Canary"
    late = plan_upgrade(
        job(timeoutSeconds=60),
        engines(NEW, pods=3),
        prev=rec(ran),
        canary=said("6", passed=True),
        now=NOW + dt.timedelta(minutes=10),
    )
    assert late.status is not None and late.status.phase == "Blocked" and "timed out" in late.status.message
    failed_job = {"status": {"conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}]}}
    crashed = plan_upgrade(
        job(), engines(NEW, pods=3), prev=rec(canary_status()), canary=CanaryInputs(job=failed_job), now=NOW
    )
    assert crashed.status is not None and crashed.status.phase == "Blocked"
    assert "BackoffLimitExceeded" in crashed.status.message


def test_a_second_image_change_supersedes_a_canary_and_reverting_cancels_it() -> None:
    upgrade = canary_status()
    newer = plan_upgrade(job(NEWER, generation=8), engines(NEW, pods=3), prev=rec(upgrade), now=NOW)
    assert newer.status is not None and (newer.status.from_image, newer.status.to, newer.status.attempt) == (
        OLD,
        NEWER,
        "8",
    )
    assert newer.canary is not None and newer.canary.attempt == "8"
    back = plan_upgrade(job(OLD, generation=8), engines(NEW, pods=3), prev=rec(upgrade), now=NOW)
    assert back.status is not None and back.status.phase == "Cancelled" and back.rollout is None


def test_a_canary_job_of_another_attempt_is_replaced_and_partition_changes_are_applied() -> None:
    plan = plan_upgrade(job(), engines(OLD), now=NOW)
    children = desired(job(), Facts(engine_rollout=plan.rollout, upgrade_canary=plan.canary))
    (canary,) = [c for c in children if c["metadata"]["name"].endswith("-upgrade-canary")]
    earlier = {
        **canary,
        "metadata": {
            **canary["metadata"],
            "labels": {**canary["metadata"]["labels"], "r3operator.io/upgrade-attempt": "6"},
        },
    }
    assert plan_action(canary, earlier, job_uid="uid-1").verb == "recreate"
    assert plan_action(canary, canary, job_uid="uid-1").verb == "none"
    sts = statefulset_of(children)
    lifted = statefulset_of(desired(job(), Facts(engine_rollout=plan.rollout.__class__(image=NEW))))  # type: ignore[union-attr]
    applied = plan_action(lifted, sts, job_uid="uid-1")
    assert (applied.verb, applied.force, applied.body) == ("apply", True, lifted)


def test_upgrade_policy_edits_restart_no_engine() -> None:
    from r3operator.operator.hashing import engine_spec_hash

    assert engine_spec_hash(job().spec) == engine_spec_hash(job(maxMismatchFactor=3.0, prompts=4).spec)


def fidelity(image: str, *, mismatch: float, diff: float, agreement: float = 1.0) -> EngineFidelity:
    return EngineFidelity(
        image=image,
        routes_valid=True,
        replay_agreement=agreement,
        natural_mismatch=mismatch,
        logprob_abs_diff_off=diff,
        logprob_abs_diff_r3=diff / 2,
    )


@pytest.mark.parametrize(
    ("new", "passed", "says"),
    [
        (fidelity(NEW, mismatch=0.030, diff=0.0060), True, "new"),
        (fidelity(NEW, mismatch=0.050, diff=0.0060), False, "natural mismatch 0.0500 > 0.0450"),
        (fidelity(NEW, mismatch=0.030, diff=0.0100), False, "mean |Δlogprob| 0.01000 > 0.00750"),
        (fidelity(NEW, mismatch=0.030, diff=0.0060, agreement=0.99), False, "replay agreement 0.9900 < 1"),
        (EngineFidelity(image=NEW, routes_valid=False, message="shape [5, 4, 2]"), False, "unusable"),
    ],
)
def test_the_verdict_compares_the_new_engine_with_the_old_in_the_same_run(
    new: EngineFidelity, passed: bool, says: str
) -> None:
    pytest.importorskip("torch")  # the runtime module imports the trainer's metrics
    from r3operator.runtime.upgrade_canary import verdict

    ok, message = verdict(fidelity(OLD, mismatch=0.030, diff=0.0050), new, UpgradePolicySpec())
    assert ok is passed and says in message and OLD in message
    UpgradeCanary(attempt="7", passed=ok, message=message[:2048], new=new)  # fits the status schema


# ------------------------------------------------------------------------------------- trainer image
T_OLD, T_NEW = "ghcr.io/r3operator/trainer:0.1.0", "ghcr.io/r3operator/trainer:0.2.0"


def trainer_job(image: str = T_NEW, **kwargs: Any) -> RLJob:
    doc = job(**kwargs).model_dump(mode="json", by_alias=True, exclude_none=True)
    doc["spec"]["trainer"]["image"] = image
    doc["spec"]["inference"]["image"] = OLD
    return RLJob.model_validate(doc)


def ray_job(image: str) -> dict[str, Any]:
    return {"spec": {"rayClusterSpec": {"headGroupSpec": {"template": {"spec": {"containers": [{"image": image}]}}}}}}


def rayjob_of(children: list[dict[str, Any]]) -> dict[str, Any]:
    return next(c for c in children if c["kind"] == "RayJob")


def test_a_trainer_image_change_keeps_the_rayjob_while_both_images_score_one_engine() -> None:
    plan = plan_upgrade(trainer_job(), engines(OLD), ray_job=ray_job(T_OLD), now=NOW)
    assert plan.status is not None and (plan.status.component, plan.status.phase) == ("trainer", "Canary")
    assert plan.trainer_image == T_OLD and plan.canary is not None and plan.canary.component == "trainer"
    children = desired(trainer_job(), Facts(upgrade_canary=plan.canary, trainer_image=plan.trainer_image))
    running = rayjob_of(desired(trainer_job(T_OLD), Facts()))
    assert rayjob_of(children)["metadata"]["annotations"] == running["metadata"]["annotations"]  # same hash: kept
    (canary,) = [c for c in children if c["metadata"]["name"].endswith("-upgrade-canary")]
    pod = canary["spec"]["template"]["spec"]
    old, new = pod["initContainers"][-1], pod["containers"][0]
    assert (old["image"], new["image"]) == (T_OLD, T_NEW)
    assert old["args"][old["args"].index("--score-only") + 1] == new["args"][new["args"].index("--baseline") + 1]
    assert old["args"][old["args"].index("--new") + 1] == new["args"][new["args"].index("--new") + 1]  # one engine


def test_a_trainer_canary_verdict_replaces_the_rayjob_or_keeps_the_old_image() -> None:
    canary = {
        "component": "trainer",
        "from": T_OLD,
        "to": T_NEW,
        "phase": "Canary",
        "attempt": "7",
        "startedAt": "2026-11-23T11:55:00Z",
    }
    passed = plan_upgrade(
        trainer_job(), engines(OLD), prev=rec(canary), canary=said("7", passed=True), ray_job=ray_job(T_OLD), now=NOW
    )
    assert passed.status is not None and passed.status.phase == "Rolling" and passed.trainer_image is None
    rolling = passed.status.model_dump(mode="json", by_alias=True)
    done = plan_upgrade(trainer_job(), engines(OLD), prev=rec(rolling), ray_job=ray_job(T_NEW), now=NOW)
    assert done.status is not None and done.status.phase == "Complete"
    failed = plan_upgrade(
        trainer_job(), engines(OLD), prev=rec(canary), canary=said("7", passed=False), ray_job=ray_job(T_OLD), now=NOW
    )
    assert failed.status is not None and failed.status.phase == "Blocked" and failed.trainer_image == T_OLD
    assert "spec.trainer.image still says" in failed.status.message


def test_an_engine_change_waits_for_a_trainer_upgrade_under_way() -> None:
    canary = {
        "component": "trainer",
        "from": T_OLD,
        "to": T_NEW,
        "phase": "Canary",
        "attempt": "7",
        "startedAt": "2026-11-23T11:55:00Z",
    }
    doc = trainer_job().model_dump(mode="json", by_alias=True, exclude_none=True)
    doc["spec"]["inference"]["image"] = NEW
    plan = plan_upgrade(RLJob.model_validate(doc), engines(OLD), prev=rec(canary), ray_job=ray_job(T_OLD), now=NOW)
    assert plan.status is not None and plan.status.component == "trainer"
    assert plan.rollout is not None and plan.rollout.image == OLD  # the engines stay on what they run
