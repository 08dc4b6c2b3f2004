"""The driver's status push (runtime.metrics.StatusPusher) against the real kube-apiserver, with a real
ServiceAccount token whose Role allows exactly one RLJob's status, as the operator grants a trainer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from kubecluster.clients import apply_crd

from r3operator.runtime.metrics import StatusPusher, eval_progress_patch, progress_patch

REPO = Path(__file__).resolve().parents[2]


def _rljob(name: str, namespace: str) -> dict[str, Any]:
    doc = yaml.safe_load((REPO / "examples" / "rljob-local.yaml").read_text())
    doc["metadata"] = {"name": name, "namespace": namespace}
    return doc


@pytest.fixture
def trainer_identity(control_plane: Any, namespace: str, tmp_path: Path) -> Path:
    """A ServiceAccount that may get/patch `mine`'s status only; its token and the CA in a directory laid
    out like the one Kubernetes mounts into pods."""
    apply_crd(control_plane, REPO / "crds" / "rljob.yaml")
    control_plane.wait_established("rljobs.r3operator.io")
    post = control_plane.request
    for name in ("mine", "theirs"):
        post("POST", f"/apis/r3operator.io/v1alpha1/namespaces/{namespace}/rljobs", _rljob(name, namespace))
    post("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts", {"metadata": {"name": "trainer"}})
    rule = {
        "apiGroups": ["r3operator.io"],
        "resources": ["rljobs/status"],
        "resourceNames": ["mine"],
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


def _progress(plane: Any, namespace: str, name: str) -> Any:
    job = plane.request("GET", f"/apis/r3operator.io/v1alpha1/namespaces/{namespace}/rljobs/{name}")
    return (job.get("status") or {}).get("progress")


def test_the_driver_patches_its_own_rljob_progress(
    control_plane: Any, namespace: str, trainer_identity: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _in_cluster(monkeypatch, control_plane)
    pusher = StatusPusher("mine", namespace, account_dir=trainer_identity)
    assert pusher.enabled
    pusher.push({"status": {"progress": {"step": 3, "totalSteps": 12}}})
    assert _progress(control_plane, namespace, "mine") == {"step": 3, "totalSteps": 12}


def test_the_last_evaluation_stays_in_the_status_until_the_next_one(
    control_plane: Any, namespace: str, trainer_identity: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The evaluation before training, a step without an evaluation, a step with one: merge patches the real API
    server applies to the CRD's schema, the eval figures kept between evaluations."""
    _in_cluster(monkeypatch, control_plane)
    pusher = StatusPusher("mine", namespace, account_dir=trainer_identity)
    assert pusher.push(eval_progress_patch(0, 0.25))
    assert pusher.push(progress_patch({"step": 1, "reward_mean": 0.5}, total_steps=2, last_checkpoint_step=None))
    progress = _progress(control_plane, namespace, "mine")
    assert (progress["step"], progress["evalReward"], progress["evalStep"]) == (1, 0.25, 0)
    row = {"step": 2, "reward_mean": 0.5, "eval_reward": 0.375}
    assert pusher.push(progress_patch(row, total_steps=2, last_checkpoint_step=2))
    progress = _progress(control_plane, namespace, "mine")
    assert (progress["step"], progress["evalReward"], progress["evalStep"]) == (2, 0.375, 2)


def test_a_push_to_another_rljob_is_refused_and_only_logged(
    control_plane: Any,
    namespace: str,
    trainer_identity: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    _in_cluster(monkeypatch, control_plane)
    StatusPusher("theirs", namespace, account_dir=trainer_identity).push({"status": {"progress": {"step": 99}}})
    assert _progress(control_plane, namespace, "theirs") is None
    assert "403" in caplog.text and "theirs" in caplog.text


def test_outside_a_cluster_the_pusher_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert not StatusPusher("mine", "rl").enabled
