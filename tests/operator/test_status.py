"""compute_status / status_changed / transitions and the canary client: pure or local HTTP only."""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from aiohttp import web
from spec_edits import apply_edits

from r3operator.api.load import parse_rljob
from r3operator.api.rules import errors, evaluate
from r3operator.api.v1alpha1 import Condition, Progress, RLJob, RLJobStatus
from r3operator.operator.admission import read_admission
from r3operator.operator.canary import CanaryResult, check_routed_experts, run_canary
from r3operator.operator.desired import desired
from r3operator.operator.hashing import engine_spec_hash
from r3operator.operator.lifecycle import observed_finish
from r3operator.operator.observed import Observed
from r3operator.operator.progress import ProgressReport
from r3operator.operator.status import compute_status, status_changed, status_patch, transitions

QWEN = Path(__file__).resolve().parents[2] / "examples" / "qwen3-30b-a3b-r3-fsdp.yaml"
T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
T1 = T0 + dt.timedelta(minutes=5)


def _job(generation: int = 1, **edits: Any) -> RLJob:
    doc = yaml.safe_load(QWEN.read_text())
    doc["metadata"].update(uid="u", generation=generation)
    apply_edits(doc, edits)
    return parse_rljob(doc)


def _ready_sts(job: RLJob) -> dict[str, Any]:
    sts = next(c for c in desired(job) if c["kind"] == "StatefulSet")
    sts["metadata"]["generation"] = 2
    n = sts["spec"]["replicas"]
    sts["status"] = {"observedGeneration": 2, "replicas": n, "readyReplicas": n, "updatedReplicas": n}
    return sts


def _running_rayjob() -> dict[str, Any]:
    return {"spec": {"suspend": False}, "status": {"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"}}


def _conds(status: Any) -> dict[str, Any]:
    return {c.type: c for c in status.conditions}


def _with(job: RLJob, status: Any) -> RLJob:
    return job.model_copy(update={"status": status})


def test_python_rule_error_is_valid_false_incompatible_settings_and_ready_carries_it():
    job = _job(**{"inference.image": "vllm/vllm-openai:v0.13.0"})
    obs = Observed(rule_errors=tuple(errors(evaluate(job.spec))))
    c = _conds(compute_status(job, obs, T0))
    assert (c["Valid"].status, c["Valid"].reason) == ("False", "IncompatibleSettings")
    assert "R3-VLLM-MIN-VERSION" in c["Valid"].message
    assert (c["Ready"].status, c["Ready"].reason) == ("False", "IncompatibleSettings")
    assert all(cond.observed_generation == 1 for cond in c.values())


def test_kuberay_missing_reason():
    c = _conds(compute_status(_job(), Observed(kuberay_installed=False), T0))
    assert (c["Valid"].status, c["Valid"].reason) == ("False", "KubeRayMissing")
    assert c["Ready"].reason == "KubeRayMissing"


def test_r3_is_ready_only_after_a_canary_for_the_current_engine_hash():
    job = _job()
    running = Observed(engine_set=_ready_sts(job), ray_job=_running_rayjob())
    c = _conds(compute_status(job, running, T0))
    assert c["EnginesReady"].status == "True" and c["TrainerReady"].status == "True"
    assert (c["RoutingReplayActive"].status, c["RoutingReplayActive"].reason) == ("Unknown", "CanaryPending")
    assert (c["Ready"].status, c["Ready"].reason) == ("False", "CanaryPending")
    stale = CanaryResult(True, "ok", engine_hash="old")
    assert _conds(compute_status(job, _obs(running, canary=stale), T0))["Ready"].status == "False"
    passed = CanaryResult(True, "shape ok", engine_hash=engine_spec_hash(job.spec), shape=(5, 48, 8))
    c = _conds(compute_status(job, _obs(running, canary=passed), T0))
    assert (c["RoutingReplayActive"].status, c["Ready"].status, c["Ready"].reason) == ("True", "True", "Ready")


def _obs(base: Observed, **changes: Any) -> Observed:
    return dataclasses.replace(base, **changes)


def test_without_engines_routing_replay_stays_unknown_with_a_reason_and_r2_does_not_need_it():
    c = _conds(compute_status(_job(), Observed(), T0))
    assert (c["RoutingReplayActive"].status, c["RoutingReplayActive"].reason) == ("Unknown", "EnginesNotReady")
    r2 = _job(**{"routingReplay.mode": "R2"})
    c = _conds(compute_status(r2, Observed(engine_set=_ready_sts(r2), ray_job=_running_rayjob()), T0))
    assert (c["RoutingReplayActive"].status, c["RoutingReplayActive"].reason) == ("False", "TrainerSideReplay")
    assert c["Ready"].status == "True"


def _finished(ray_status: dict[str, Any]) -> Observed:
    ray_job = {"spec": {}, "status": ray_status}
    return Observed(ray_job=ray_job, finish=observed_finish(ray_job))


def test_last_transition_time_changes_only_on_flips_and_a_recorded_end_is_sticky_once_the_rayjob_is_gone():
    job = _job()
    first = compute_status(job, Observed(), T0)
    again = compute_status(_with(job, first), Observed(), T1)
    assert _conds(again)["Valid"].last_transition_time == _conds(first)["Valid"].last_transition_time
    assert not status_changed(first, again)
    done = _finished({"jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED"})
    succeeded = compute_status(_with(job, again), done, T1)
    assert _conds(succeeded)["Succeeded"].status == "True"
    assert _conds(succeeded)["Succeeded"].last_transition_time == "2026-01-01T00:05:00Z"
    assert succeeded.completion_time == "2026-01-01T00:05:00Z"
    gone = Observed(workloads_deleted=True, finish_recorded=True)
    after = compute_status(_with(job, succeeded), gone, T1 + dt.timedelta(hours=1))
    assert _conds(after)["Succeeded"].status == "True"  # the RayJob is gone; the verdict stays
    assert _conds(after)["Progressing"].reason == "WorkloadsDeleted"


def test_completion_time_is_the_rayjobs_end_time():
    ended = _finished({"jobDeploymentStatus": "Failed", "jobStatus": "FAILED", "endTime": "2026-01-01T00:01:02Z"})
    status = compute_status(_job(), ended, T1)
    assert _conds(status)["Failed"].status == "True"
    assert status.completion_time == "2026-01-01T00:01:02Z"


def test_a_terminal_status_written_while_the_rayjob_runs_is_overwritten():
    job = _job()
    forged = RLJobStatus(
        conditions=[Condition(type="Succeeded", status="True", reason="TrainerSucceeded", last_transition_time="x")],
        completion_time="2020-01-01T00:00:00Z",
    )
    running = Observed(engine_set=_ready_sts(job), ray_job=_running_rayjob())
    status = compute_status(_with(job, forged), running, T1)
    conds = _conds(status)
    assert (conds["Succeeded"].status, conds["Succeeded"].reason) == ("False", "NotFinished")
    assert status.completion_time is None
    assert conds["Progressing"].status == "True"


@pytest.mark.parametrize(
    ("observed", "ctype", "reason", "named"),
    [
        (
            Observed(name_conflict="ConfigMap/team-config not controlled by this RLJob"),
            "Valid",
            "NameConflict",
            "ConfigMap/team-config",
        ),
        (Observed(missing_claims=("shared",)), "Valid", "ClaimNotFound", "PersistentVolumeClaim/shared"),
        (Observed(namespace_terminating=True), "Progressing", "NamespaceTerminating", "namespace"),
        (Observed(api_error="HTTP 403 Forbidden: no"), "Progressing", "APIError", "HTTP 403 Forbidden"),
    ],
)
def test_every_failure_the_operator_meets_is_a_condition_and_rolls_up_to_ready(
    observed: Observed, ctype: str, reason: str, named: str
):
    conds = _conds(compute_status(_job(), observed, T0))
    assert (conds[ctype].status, conds[ctype].reason) == ("False", reason)
    assert named in conds[ctype].message
    assert (conds["Ready"].status, conds["Ready"].reason) == ("False", reason)


def test_progress_is_the_trainers_report_as_taken_and_kept_when_there_is_none_to_take():
    job = _job()
    # The status a pass wrote when it took a report of step 42 (ReplayHealthy is computed from it too).
    with_progress = compute_status(job, Observed(progress=ProgressReport(Progress(step=42))), T0)
    # No report read (an invalid spec, a foreign progress ConfigMap) or a refused one: the progress stays.
    for obs in (Observed(), Observed(progress=ProgressReport(None, "NaN is not a finite number", refused=True))):
        kept = compute_status(_with(job, with_progress), obs, T1)
        assert kept.progress == Progress(step=42) and not status_changed(with_progress, kept)
    # A report taken replaces it whole; none yet clears it.
    reported = compute_status(_with(job, with_progress), Observed(progress=ProgressReport(Progress(step=43))), T1)
    assert reported.progress == Progress(step=43) and status_changed(with_progress, reported)
    assert compute_status(_with(job, with_progress), Observed(progress=ProgressReport(None)), T1).progress is None


def test_the_status_patch_overwrites_every_field_another_writer_put_there():
    """A merge patch of the whole status, unset fields as null: applied over a forged status (RFC 7386 written out
    here), it leaves exactly the operator's."""

    def merge(target: Any, patch: Any) -> Any:
        if not isinstance(patch, dict):
            return patch
        out = dict(target) if isinstance(target, dict) else {}
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            else:
                out[key] = merge(out.get(key), value)
        return out

    ours = compute_status(_job(), Observed(progress=ProgressReport(Progress(step=3, reward_mean=0.5))), T0)
    forged = {
        "startTime": "2000-01-01T00:00:00Z",
        "completionTime": "2000-01-01T00:00:00Z",
        "observedGeneration": 999,
        "conditions": [{"type": "Succeeded", "status": "True", "reason": "Forged", "lastTransitionTime": "x"}],
        "resolved": {"vllmVersion": "0.1.0", "engineGpusTotal": 9999},
        "progress": {"step": 10_000, "klK3": 7.0},
        "upgrade": {"component": "engine", "from": "evil", "to": "x", "phase": "Blocked", "attempt": "1"},
    }
    after = RLJobStatus.model_validate(merge(forged, status_patch(ours)["status"]))
    assert not status_changed(after, ours)
    assert after.start_time == ours.start_time and after.completion_time is None and after.upgrade is None


def test_a_settled_progress_report_writes_nothing_again() -> None:
    """ReplayHealthy, computed from the progress the pass takes, is settled: the next pass with the same report
    writes nothing."""
    job = _job()
    report = Observed(progress=ProgressReport(Progress(step=42)))
    new = compute_status(job, report, T1)
    assert new.progress is not None and new.progress.step == 42
    again = compute_status(_with(job, new), report, T1)
    assert not status_changed(new, again)


def test_transitions_fire_once_per_flip_and_once_for_an_invalid_spec():
    job = _job(**{"inference.image": "vllm/vllm-openai:v0.13.0"})
    obs = Observed(rule_errors=tuple(errors(evaluate(job.spec))))
    first = compute_status(job, obs, T0)
    assert [(c.type, c.reason) for c in transitions(None, first) if c.type == "Valid"] == [
        ("Valid", "IncompatibleSettings")
    ]
    again = compute_status(_with(job, first), obs, T1)
    assert transitions(first, again) == []
    fixed = compute_status(_with(_job(generation=2), again), Observed(), T1)
    assert ("Valid", "True") in [(c.type, c.status.value) for c in transitions(again, fixed)]


def test_engines_ready_counts_replicas_and_reports_updates():
    job = _job()
    sts = _ready_sts(job)
    sts["status"]["updatedReplicas"] = 2
    status = compute_status(job, Observed(engine_set=sts, ray_job=_running_rayjob()), T0)
    assert (_conds(status)["EnginesReady"].reason, status.engines_ready) == ("Updating", "4/4")


def _npy(array: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, array)
    return base64.b64encode(buf.getvalue()).decode()


def test_check_routed_experts_decodes_and_checks_the_shape():
    assert check_routed_experts(_npy(np.zeros((5, 48, 8), np.uint8)), num_layers=48, top_k=8).ok
    wrong = check_routed_experts(_npy(np.zeros((5, 47, 8), np.uint8)), num_layers=48, top_k=8)
    assert not wrong.ok and "[5, 47, 8]" in wrong.message
    assert "no routed_experts" in check_routed_experts(None, num_layers=48, top_k=8).message
    assert not check_routed_experts("not base64!", num_layers=48, top_k=8).ok


@pytest.mark.parametrize(("layers", "ok"), [(4, True), (3, False)])
async def test_canary_client_against_a_local_openai_server(layers: int, ok: bool, aiohttp_free_port: int):
    seen: list[dict[str, Any]] = []

    async def completions(request: web.Request) -> web.Response:
        seen.append(await request.json())
        routes = _npy(np.zeros((6, layers, 2), np.uint8))
        return web.json_response({"choices": [{"index": 0, "text": " 5", "routed_experts": routes}]})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", aiohttp_free_port).start()
    try:
        result = await run_canary(f"http://127.0.0.1:{aiohttp_free_port}", model="m", num_layers=4, top_k=2)
    finally:
        await runner.cleanup()
    assert result.ok is ok
    assert seen[0]["model"] == "m" and seen[0]["max_tokens"] == 2
    refused = await run_canary(f"http://127.0.0.1:{aiohttp_free_port}", model="m", num_layers=4, top_k=2, timeout_s=2)
    assert not refused.ok and "POST" in refused.message


@pytest.fixture
def aiohttp_free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_filling_model_cache_is_progress_and_a_failed_fetch_stops_the_job_naming_the_job_to_look_at():
    filling = _conds(compute_status(_job(), Observed(model_fetch="running"), T0))
    assert (filling["Progressing"].status, filling["Progressing"].reason) == ("True", "FetchingModel")
    assert "Job/qwen3-30b-a3b-r3-model-fetch" in filling["Progressing"].message
    assert (filling["EnginesReady"].status, filling["EnginesReady"].reason) == ("False", "FetchingModel")
    assert (filling["Ready"].status, filling["Ready"].reason) == ("False", "FetchingModel")
    failed = _conds(compute_status(_job(), Observed(model_fetch="BackoffLimitExceeded", model_fetch_failed=True), T0))
    assert (failed["Progressing"].status, failed["Progressing"].reason) == ("False", "ModelFetchFailed")
    assert "kubectl logs job/qwen3-30b-a3b-r3-model-fetch" in failed["Progressing"].message
    assert "BackoffLimitExceeded" in failed["Progressing"].message
    assert (failed["TrainerReady"].status, failed["Ready"].reason) == ("False", "ModelFetchFailed")


def test_a_job_waiting_for_a_read_write_once_cache_another_job_holds_names_the_claim_and_the_holder():
    job = _job(**{"model.cache": {"accessMode": "ReadWriteOnce"}})
    c = _conds(compute_status(job, Observed(model_fetch="running", model_cache_holder="first-job"), T0))
    assert (c["Progressing"].status, c["Progressing"].reason) == ("False", "ModelCacheHeld")
    message = c["Progressing"].message
    assert "RLJob/first-job" in message and "PersistentVolumeClaim/model-cache-" in message
    assert (c["EnginesReady"].status, c["Ready"].status, c["Ready"].reason) == ("False", "False", "ModelCacheHeld")
    # One Event when a new job starts out waiting (absent -> False is otherwise no transition), none after.
    status = compute_status(job, Observed(model_fetch="running", model_cache_holder="first-job"), T0)
    held = [t.reason for t in transitions(None, status) if t.status.value == "False"]
    assert held == ["ModelCacheHeld"]  # Valid, Admitted and the like are True
    assert transitions(status, status) == []


def test_a_queued_job_without_kueue_says_kueue_missing_and_neither_waiting_nor_suspended():
    job = _job(**{"queueName": "gpu-research"})
    obs = Observed(kueue_installed=False, admission=read_admission("gpu-research", None))
    c = _conds(compute_status(job, obs, T0))
    assert (c["Valid"].status, c["Valid"].reason) == ("False", "KueueMissing")
    assert (c["Admitted"].status, c["Admitted"].reason) == ("False", "KueueMissing")
    assert c["Suspended"].status == "False" and c["Suspended"].reason != "WaitingForAdmission"
    assert not [name for name, cond in c.items() if cond.reason == "WaitingForAdmission"]
    assert c["Ready"].reason == "KueueMissing"


def test_trainer_ready_says_when_the_ray_job_has_no_status_yet_instead_of_empty_brackets():
    job = _job()
    no_status = {"spec": {"suspend": False}, "status": {"jobDeploymentStatus": "Running"}}
    message = _conds(compute_status(job, Observed(engine_set=_ready_sts(job), ray_job=no_status), T0))[
        "TrainerReady"
    ].message
    assert "()" not in message and "( " not in message and "jobStatus )" not in message
    assert message == "RayJob running (the Ray job has reported no jobStatus yet)"
    running = _conds(compute_status(job, Observed(engine_set=_ready_sts(job), ray_job=_running_rayjob()), T0))
    assert running["TrainerReady"].message == "RayJob running (jobStatus RUNNING)"


def test_the_rayjob_on_its_way_up_is_one_status_not_one_per_step():
    """KubeRay moves a new RayJob unset → Initializing seconds apart; each step written would be one more RLJob
    status write (a watch event to every RLJob watcher) that tells a user nothing the RayJob does not show."""
    job = _job()
    first = compute_status(job, Observed(engine_set=_ready_sts(job), ray_job={"spec": {}, "status": {}}), T0)
    job = _with(job, first)
    for deployment in ("New", "Initializing"):
        ray_job = {"spec": {"suspend": False}, "status": {"jobDeploymentStatus": deployment}}
        again = compute_status(job, Observed(engine_set=_ready_sts(job), ray_job=ray_job), T1)
        assert not status_changed(job.status, again), deployment
        assert _conds(again)["TrainerReady"].reason == "TrainerStarting"
    # A RayJob held (suspended) or retrying is another state, and so is Running.
    for deployment, reason in (
        ("Suspended", "TrainerStarting"),
        ("Retrying", "TrainerStarting"),
        ("Running", "Running"),
    ):
        ray_job = {"spec": {"suspend": False}, "status": {"jobDeploymentStatus": deployment}}
        other = compute_status(job, Observed(engine_set=_ready_sts(job), ray_job=ray_job), T1)
        assert status_changed(job.status, other), deployment
        assert _conds(other)["TrainerReady"].reason == reason
