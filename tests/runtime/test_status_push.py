"""The driver's progress report (runtime.metrics.StatusPusher) against the real kube-apiserver, with a real
ServiceAccount token whose Role allows exactly one job's progress ConfigMap, as the operator grants a trainer
(builders/trainer_rbac.py); the operator copies the report into the RLJob's status (operator/progress.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from records import step_record

from r3operator.runtime.metrics import StatusPusher, eval_progress_patch, merged_report, progress_patch


@pytest.fixture
def trainer_identity(control_plane: Any, namespace: str, tmp_path: Path) -> Path:
    """A ServiceAccount that may get/patch `mine-progress` only; its token and the CA in a directory laid
    out like the one Kubernetes mounts into pods."""
    post = control_plane.request
    for name in ("mine", "theirs"):
        post("POST", f"/api/v1/namespaces/{namespace}/configmaps", {"metadata": {"name": f"{name}-progress"}})
    post("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts", {"metadata": {"name": "trainer"}})
    rule = {
        "apiGroups": [""],
        "resources": ["configmaps"],
        "resourceNames": ["mine-progress"],
        "verbs": ["get", "patch"],
    }
    rbac = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}"
    post("POST", f"{rbac}/roles", {"metadata": {"name": "trainer"}, "rules": [rule]})
    post(
        "POST",
        f"{rbac}/rolebindings",
        {
            "metadata": {"name": "trainer"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "trainer"},
            "subjects": [{"kind": "ServiceAccount", "name": "trainer", "namespace": namespace}],
        },
    )
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "token").write_text(control_plane.token_for(namespace, "trainer"))
    (account / "ca.crt").write_bytes(control_plane.ca.read_bytes())
    return account


def _in_cluster(monkeypatch: pytest.MonkeyPatch, plane: Any) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(plane.api_port))


def _report(plane: Any, namespace: str, name: str) -> Any:
    cm = plane.request("GET", f"/api/v1/namespaces/{namespace}/configmaps/{name}-progress")
    text = (cm.get("data") or {}).get("progress")
    return json.loads(text) if text else None


def test_the_driver_reports_its_own_progress_merged_over_the_last_report(
    control_plane: Any, namespace: str, trainer_identity: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _in_cluster(monkeypatch, control_plane)
    pusher = StatusPusher("mine", namespace, account_dir=trainer_identity)
    assert pusher.enabled
    assert pusher.push({"status": {"progress": {"step": 3, "totalSteps": 12, "weightSync": "nccl"}}})
    assert _report(control_plane, namespace, "mine") == {"step": 3, "totalSteps": 12, "weightSync": "nccl"}
    # A merge patch's meaning: a null clears the last figure, a key left out keeps it.
    assert pusher.push({"status": {"progress": {"step": 4, "totalSteps": None}}})
    assert _report(control_plane, namespace, "mine") == {"step": 4, "weightSync": "nccl"}


def test_the_last_evaluation_stays_in_the_report_until_the_next_one(
    control_plane: Any, namespace: str, trainer_identity: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The evaluation before training, a step without an evaluation, a step with one: the eval figures kept between
    evaluations."""
    _in_cluster(monkeypatch, control_plane)
    pusher = StatusPusher("mine", namespace, account_dir=trainer_identity)
    assert pusher.push(eval_progress_patch(0, 0.25))
    assert pusher.push(progress_patch(step_record(1, reward_mean=0.5), total_steps=2, last_checkpoint_step=None))
    report = _report(control_plane, namespace, "mine")
    assert (report["step"], report["evalReward"], report["evalStep"]) == (1, 0.25, 0)
    row = step_record(2, reward_mean=0.5, eval_reward=0.375)
    assert pusher.push(progress_patch(row, total_steps=2, last_checkpoint_step=2))
    report = _report(control_plane, namespace, "mine")
    assert (report["step"], report["evalReward"], report["evalStep"]) == (2, 0.375, 2)


def test_a_report_for_another_job_or_with_a_nan_is_refused_and_only_logged(
    control_plane: Any,
    namespace: str,
    trainer_identity: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    _in_cluster(monkeypatch, control_plane)
    assert not StatusPusher("theirs", namespace, account_dir=trainer_identity).push(
        {"status": {"progress": {"step": 9}}}
    )
    assert _report(control_plane, namespace, "theirs") is None
    assert "403" in caplog.text and "theirs" in caplog.text
    # JSON has no NaN: the report is not sent at all (the operator would refuse it too).
    assert not StatusPusher("mine", namespace, account_dir=trainer_identity).push(
        {"status": {"progress": {"step": 1, "rewardMean": float("nan")}}}
    )
    assert _report(control_plane, namespace, "mine") is None


def test_outside_a_cluster_the_pusher_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert not StatusPusher("mine", "rl").enabled


def test_merged_report_is_a_json_merge_patch() -> None:
    assert merged_report({"a": 1, "b": 2}, {"b": None, "c": 3}) == {"a": 1, "c": 3}
