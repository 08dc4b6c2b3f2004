"""Nobody but the operator steers or paints a job (issue #45), on the real control plane: kube-apiserver with RBAC,
the StatefulSet and Job controllers, KubeRay, kwok nodes, and ``r3operator operator`` as its own process with a
resync of 10 minutes, so whatever happens within a test's seconds was the operator's reaction to a watch event
(or its NameConflict re-check), never its timer.

- the status: the trainer's identity may not write it; the trainer's progress (reported the way the driver does,
  runtime.metrics.StatusPusher) reaches it, checked; a user who may write status forges every field the issue
  forged, and every one is the operator's again within seconds;
- identities: a pod template naming another job's ``<job>-trainer`` is refused at apply; one naming an account
  another RLJob controls, or the operator's own, is ``Valid=False`` with nothing created;
- hand edits: the engine StatefulSet's and the RayJob's image edited by hand are taken back, start no upgrade,
  and a failed canary after them goes back to the verified image;
- ``r3operator.io/upgrade=force`` is removed once used: the next image change is canaried;
- NameConflict: a pass that finds any name taken creates nothing, and the condition clears within seconds of the
  last foreign object going;
- the model cache claim takes the job's StorageClass and one model-source form (no rewrites between a job that
  pins ``revision: main`` and one that does not); a ``kube-`` name is refused.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from canary_ending import canary_verdict, end_canary
from operator_harness import (
    WRITE_VERBS,
    Cluster,
    OperatorProcess,
    condition,
    example,
    paths,
    wait_condition,
    wait_for,
)
from records import step_record

from r3operator.runtime.metrics import StatusPusher, progress_patch

NS = "ownership"
RESYNC_S = "600"
REACT_S = 10.0
"""Seconds a test allows for a reaction (the 2-core CI box is shared with the control plane); the resync is sixty
times longer."""
START_S = 120.0
OPERATOR_SA = "r3operator"
WRITER = "status-writer"
"""A user granted patch on rljobs/status: what the trainer could do before, and a namespace admin still may."""
OLD, NEW, NEWER = (f"ghcr.io/r3operator/engine:0.{i}.0-vllm0.22.1" for i in (1, 2, 3))
EVIL = "evil.example.com/miner:1"


@pytest.fixture(scope="module")
def operator(cluster: Cluster) -> Iterator[OperatorProcess]:
    cluster.namespace(NS)
    cluster.kubectl("-n", NS, "create", "serviceaccount", OPERATOR_SA)
    cluster.kubectl("-n", NS, "create", "role", WRITER, "--verb=get,patch", "--resource=rljobs.r3operator.io/status")
    cluster.kubectl("-n", NS, "create", "rolebinding", WRITER, f"--role={WRITER}", f"--user={WRITER}")
    env = {
        "R3OPERATOR_RESYNC_SECONDS": RESYNC_S,
        "R3OPERATOR_CANARY": "false",  # kwok runs no vLLM to send the routed-experts canary to
        # As the chart sets them: the operator runs as OPERATOR_SA in NS.
        "R3OPERATOR_OPERATOR_NAMESPACE": NS,
        "R3OPERATOR_SERVICE_ACCOUNT": OPERATOR_SA,
    }
    op = OperatorProcess(cluster, NS, "--liveness", "", env=env)
    yield op
    op.stop()
    assert "Traceback" not in op.log(), op.log(80)


def _job(name: str, **edits: Any) -> dict[str, Any]:
    return example(name, NS, **{"inference.image": OLD, "inference.replicas": 2, **edits})


def _started(cluster: Cluster, op: OperatorProcess, name: str, **edits: Any) -> None:
    cluster.apply(_job(name, **edits))
    try:
        wait_condition(cluster, NS, name, "EnginesReady", "True", timeout=START_S)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{op.log(60)}") from None


def _done(cluster: Cluster, name: str) -> None:
    """Frees the job's GPUs for the next tests of the session."""
    cluster.kubectl("-n", NS, "delete", "rlj", name, "--wait=false")


def _rljob(cluster: Cluster, name: str) -> dict[str, Any]:
    return cluster.get(paths(NS, name)["rljob"]) or {}


def _status(cluster: Cluster, name: str) -> dict[str, Any]:
    return _rljob(cluster, name).get("status") or {}


def _event(cluster: Cluster, name: str, reason: str) -> dict[str, Any] | None:
    events = (cluster.get(f"/api/v1/namespaces/{NS}/events") or {}).get("items") or []
    return next((e for e in events if e["involvedObject"]["name"] == name and e["reason"] == reason), None)


def _patch(cluster: Cluster, *args: str, body: Any, who: str | None = None, check: bool = True) -> Any:
    user = [f"--as={who}"] if who else []
    return cluster.kubectl("-n", NS, "patch", *args, *user, "-p", json.dumps(body), check=check)


# ----------------------------------------------------------------------------------------------- status


def _forged_fields_restored(before: dict[str, Any], now: dict[str, Any]) -> bool:
    """Every field the forgery wrote is the operator's again (a condition may have moved on for its own reasons
    meanwhile, a RayJob ending under kwok, but none carries the forger's reason)."""
    same = ("startTime", "observedGeneration", "resolved", "progress", "upgrade", "completionTime", "enginesReady")
    return all(now.get(k) == before.get(k) for k in same) and all(
        c["reason"] != "Forged" for c in now.get("conditions") or []
    )


def test_the_status_is_written_by_the_operator_alone(
    cluster: Cluster, operator: OperatorProcess, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    job = "paint"
    _started(cluster, operator, job)
    trainer = f"system:serviceaccount:{NS}:{job}-trainer"

    # 1. The trainer's identity has no right on its RLJob's status (nor on the RLJob).
    refused = _patch(
        cluster, "rlj", job, "--subresource=status", "--type=merge", who=trainer, check=False,
        body={"status": {"startTime": "2000-01-01T00:00:00Z"}},
    )  # fmt: skip
    assert refused.returncode != 0 and "forbidden" in refused.stderr.lower(), refused.stderr

    # 2. Its progress, reported as the driver reports it (its own token, its one ConfigMap), reaches the status.
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "token").write_text(cluster.api.token_for(NS, f"{job}-trainer"))
    (account / "ca.crt").write_bytes(Path(cluster.api.ca).read_bytes())
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(cluster.api.api_port))
    pusher = StatusPusher(job, NS, account_dir=account)
    assert pusher.push(progress_patch(step_record(3, reward_mean=0.25), total_steps=10, last_checkpoint_step=None))
    wait_for(
        lambda: (_status(cluster, job).get("progress") or {}).get("rewardMean") == 0.25,
        timeout=REACT_S,
        what=f"the report in status.progress\n{operator.log(30)}",
    )
    out = cluster.kubectl("-n", NS, "get", "rlj", job).stdout.splitlines()
    assert out[1].split()[out[0].split().index("STEP")] == "3"  # the STEP column

    # 3. A report the status cannot hold is refused with the reason; the status keeps the last one taken.
    nan = {"data": {"progress": '{"step": 4, "rewardMean": NaN}'}}
    _patch(cluster, "configmap", f"{job}-progress", "--type=merge", who=trainer, body=nan)
    event = wait_for(lambda: _event(cluster, job, "ProgressRejected"), timeout=REACT_S, what="ProgressRejected")
    assert event["type"] == "Warning" and "NaN is not a finite number" in event["message"], event
    assert _status(cluster, job)["progress"]["step"] == 3

    # 4. The forgeries, by whoever may still write status: every field is the operator's within seconds.
    foreign = "status written by someone else"
    assert foreign not in operator.log()  # the echoes of the operator's own writes woke nothing
    before = _status(cluster, job)
    stamp = "2000-01-01T00:00:00Z"
    forged_condition = {"status": "True", "reason": "Forged", "message": "forged", "lastTransitionTime": stamp}
    forged = {
        "conditions": [{"type": t, **forged_condition} for t in ("Ready", "Succeeded", "Failed", "Suspended")],
        "observedGeneration": 999,
        "progress": {"step": 10_000, "totalSteps": 10_000},
        "resolved": {"vllmVersion": "0.1.0", "engineGpusTotal": 9999},
        "startTime": "2000-01-01T00:00:00Z",
        "completionTime": "2000-01-01T00:00:00Z",
        "enginesReady": "9/9",
        "upgrade": {"component": "engine", "from": EVIL, "to": OLD, "phase": "Canary", "attempt": "1"},
    }
    as_writer = ("rlj", job, "--subresource=status", "--type=merge", "-o", "json")
    took = _patch(cluster, *as_writer, who=WRITER, body={"status": forged})
    assert json.loads(took.stdout)["status"]["startTime"] == "2000-01-01T00:00:00Z"  # the forgery was written
    wait_for(
        lambda: _forged_fields_restored(before, _status(cluster, job)),
        timeout=REACT_S,
        what=f"the operator's status written back\n{operator.log(30)}",
    )
    assert foreign in operator.log()
    _done(cluster, job)


# ------------------------------------------------------------------------------------------- identities


def test_no_job_runs_as_another_jobs_identity_or_the_operators(cluster: Cluster, operator: OperatorProcess) -> None:
    # Every <job>-trainer name is refused at apply (CEL), the field named.
    for site in ("trainer.podTemplate", "podTemplate"):
        borrowed = _job("borrow", **{site: {"serviceAccountName": "paint-trainer"}})
        refused = cluster.apply(borrowed, check=False)
        assert refused.returncode != 0, refused.stdout
        assert f"spec.{site}.serviceAccountName" in refused.stderr, refused.stderr
        assert "paint-trainer ends in -trainer" in refused.stderr

    # What the object alone cannot show: an account another RLJob controls, the operator's own.
    cluster.apply(_job("owner", **{"runPolicy.suspend": True}))
    owner = wait_for(lambda: _rljob(cluster, "owner").get("metadata"), what="RLJob owner")
    ref = {"apiVersion": "r3operator.io/v1alpha1", "kind": "RLJob", "name": "owner", "uid": owner["uid"]}
    ref["controller"] = True
    account = {"metadata": {"name": "shared-identity", "ownerReferences": [ref]}}
    cluster.http("POST", f"/api/v1/namespaces/{NS}/serviceaccounts", account)
    for name, account_name, why in (
        ("borrow-owned", "shared-identity", "is controlled by RLJob/owner"),
        ("borrow-operator", OPERATOR_SA, "is the operator's own ServiceAccount"),
    ):
        cluster.apply(_job(name, **{"trainer.podTemplate": {"serviceAccountName": account_name}}))
        valid = wait_condition(cluster, NS, name, "Valid", "False", "ForeignServiceAccount")
        assert f"spec.trainer.podTemplate.serviceAccountName {account_name} {why}" in valid["message"], valid
        assert cluster.get(paths(NS, name)["rayjob"]) is None and cluster.get(paths(NS, name)["sts"]) is None
    for name in ("owner", "borrow-owned", "borrow-operator"):
        _done(cluster, name)


# ------------------------------------------------------------------------------------------- hand edits


def _engine_image(cluster: Cluster, job: str) -> str:
    sts = cluster.get(paths(NS, job)["sts"]) or {}
    return str(sts["spec"]["template"]["spec"]["containers"][0]["image"])


def _head_image(ray_job: dict[str, Any] | None) -> str:
    return str((ray_job or {})["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["image"])


def _canary_job(cluster: Cluster, job: str) -> dict[str, Any] | None:
    return cluster.get(f"/apis/batch/v1/namespaces/{NS}/jobs/{job}-upgrade-canary")


def test_hand_edits_are_taken_back_and_a_failed_canary_never_goes_back_to_one(
    cluster: Cluster, operator: OperatorProcess
) -> None:
    job = "edit"
    _started(cluster, operator, job, upgradePolicy={"timeoutSeconds": 600})
    ray_job = cluster.get(paths(NS, job)["rayjob"])
    trainer_image = _head_image(ray_job)
    image = "/spec/template/spec/containers/0/image"
    _patch(cluster, "sts", f"{job}-engine", "--type=json", body=[{"op": "replace", "path": image, "value": EVIL}])
    head = "/spec/rayClusterSpec/headGroupSpec/template/spec/containers/0/image"
    _patch(cluster, "rayjob", f"{job}-trainer", "--type=json", body=[{"op": "replace", "path": head, "value": EVIL}])

    def taken_back() -> bool:
        return (
            _engine_image(cluster, job) == OLD and _head_image(cluster.get(paths(NS, job)["rayjob"])) == trainer_image
        )

    wait_for(taken_back, timeout=REACT_S, what=f"both hand edits taken back\n{operator.log(30)}")
    # Neither edit was taken for an upgrade: no canary, no surge replica, the trainer not replaced.
    assert "upgrade" not in _status(cluster, job), _status(cluster, job)["upgrade"]
    assert (cluster.get(paths(NS, job)["sts"]) or {})["spec"]["replicas"] == 2 and _canary_job(cluster, job) is None
    assert (cluster.get(paths(NS, job)["rayjob"]) or {})["metadata"]["uid"] == ray_job["metadata"]["uid"]

    # The next real upgrade starts from the verified image, and its failed canary goes back to it.
    _patch(cluster, "rlj", job, "--type=merge", body={"spec": {"inference": {"image": NEW}}})
    upgrade = wait_for(
        lambda: (u := _status(cluster, job).get("upgrade") or {}).get("phase") == "Canary" and u, what="the canary"
    )
    assert (upgrade["from"], upgrade["to"]) == (OLD, NEW)
    end_canary(cluster, NS, job, canary_verdict(upgrade["attempt"], OLD, NEW, passed=False))
    blocked = wait_condition(cluster, NS, job, "UpgradeBlocked", "True", "CanaryFailed")
    assert f"back on {OLD}" in blocked["message"] and EVIL not in json.dumps(_status(cluster, job))
    wait_for(
        lambda: (
            _engine_image(cluster, job) == OLD and (cluster.get(paths(NS, job)["sts"]) or {})["spec"]["replicas"] == 2
        ),
        what="the engines back on the verified image",
    )
    _done(cluster, job)


def test_the_force_annotation_is_one_shot(cluster: Cluster, operator: OperatorProcess) -> None:
    job = "forced"
    _started(cluster, operator, job)
    forced = {"metadata": {"annotations": {"r3operator.io/upgrade": "force"}}, "spec": {"inference": {"image": NEW}}}
    _patch(cluster, "rlj", job, "--type=merge", body=forced)
    wait_for(
        lambda: "r3operator.io/upgrade" not in (_rljob(cluster, job)["metadata"].get("annotations") or {}),
        timeout=REACT_S,
        what=f"the force annotation removed\n{operator.log(30)}",
    )
    event = wait_for(lambda: _event(cluster, job, "UpgradeForced"), timeout=REACT_S, what="UpgradeForced")
    assert f"used for the engine upgrade {OLD} → {NEW}" in event["message"], event
    assert _canary_job(cluster, job) is None
    wait_for(lambda: (_status(cluster, job).get("upgrade") or {}).get("phase") == "Complete", timeout=START_S)

    # The next image change is canaried: the annotation cannot skip it.
    _patch(cluster, "rlj", job, "--type=merge", body={"spec": {"inference": {"image": NEWER}}})
    upgrade = wait_for(lambda: (u := _status(cluster, job).get("upgrade") or {}).get("to") == NEWER and u)
    assert upgrade["phase"] == "Canary", upgrade
    wait_for(lambda: _canary_job(cluster, job), what="the canary Job")
    _done(cluster, job)


# ----------------------------------------------------------------------------------------- NameConflict


def _operator_writes_to(cluster: Cluster, since: int, job: str) -> list[Any]:
    """The operator's writes since ``since`` to objects named after ``job`` (its children), the RLJob left out."""
    return [
        r
        for r in cluster.requests()[since:]
        if r.verb in WRITE_VERBS
        and r.user_agent.startswith(("r3operator/", "kopf/"))
        and f"/namespaces/{NS}/" in r.path
        and f"/{job}-" in r.path
        and "/rljobs/" not in r.path
    ]


def test_a_name_conflict_creates_nothing_and_clears_within_seconds(cluster: Cluster, operator: OperatorProcess) -> None:
    job = "nc"
    # One foreign object the operator's labelled watch sees, one it cannot.
    labelled = {"metadata": {"name": f"{job}-config", "labels": {"r3operator.io/job": job}}}
    cluster.http("POST", f"/api/v1/namespaces/{NS}/configmaps", labelled)
    unlabelled = {"metadata": {"name": f"{job}-engine"}, "spec": {"ports": [{"port": 80}]}}
    cluster.http("POST", f"/api/v1/namespaces/{NS}/services", unlabelled)
    since = len(cluster.requests())
    cluster.apply(_job(job))
    both = wait_for(
        lambda: (c := condition(_rljob(cluster, job), "Valid")) and "Service/nc-engine" in c["message"] and c,
        timeout=30,
        what=f"both names found taken\n{operator.log(30)}",
    )
    assert both["reason"] == "NameConflict" and "ConfigMap/nc-config" in both["message"]
    assert _operator_writes_to(cluster, since, job) == []

    # The object the watch saw goes: the pass it wakes finds the other name still taken and creates nothing.
    since = len(cluster.requests())
    cluster.kubectl("-n", NS, "delete", "configmap", f"{job}-config")
    wait_for(
        lambda: "ConfigMap/nc-config" not in (condition(_rljob(cluster, job), "Valid") or {}).get("message", "x"),
        timeout=REACT_S,
        what="the NameConflict without the ConfigMap",
    )
    assert _operator_writes_to(cluster, since, job) == []
    assert wait_condition(cluster, NS, job, "Valid", "False")["reason"] == "NameConflict"

    # The last one goes, which no watch of the operator's shows: Valid within seconds, and the children.
    cluster.kubectl("-n", NS, "delete", "service", f"{job}-engine")
    wait_condition(cluster, NS, job, "Valid", "True", timeout=REACT_S)
    wait_for(lambda: cluster.get(paths(NS, job)["sts"]) and cluster.get(paths(NS, job)["cm"]), what="the children")
    _done(cluster, job)


# ------------------------------------------------------------------------------------------- first hour


def test_the_model_cache_claim_takes_the_jobs_class_and_one_model_source_form(
    cluster: Cluster, operator: OperatorProcess
) -> None:
    refused = cluster.apply(_job("kube-system"), check=False)
    assert refused.returncode != 0 and "metadata.name kube-system starts with kube-" in refused.stderr, refused.stderr

    small = {"inference.replicas": 1, "trainer.nodes": 1, "storage.storageClassName": "rwx-nfs"}
    _started(cluster, operator, "cache-pinned", **small)  # the example pins revision main
    [claim] = [
        c
        for c in (cluster.get(f"/api/v1/namespaces/{NS}/persistentvolumeclaims") or {})["items"]
        if c["metadata"]["name"].startswith("model-cache-")
    ]
    assert claim["spec"]["storageClassName"] == "rwx-nfs"  # the job's, not the cluster's default (standard)
    assert claim["metadata"]["annotations"]["r3operator.io/model-source"] == "hf://Qwen/Qwen3-30B-A3B@main"
    claim_path = f"/api/v1/namespaces/{NS}/persistentvolumeclaims/{claim['metadata']['name']}"
    since = len(cluster.requests())
    _started(cluster, operator, "cache-unpinned", **small, **{"model.revision": None})
    rewrites = [
        r
        for r in cluster.requests()[since:]
        if r.path == claim_path and r.verb in WRITE_VERBS and r.user_agent.startswith("r3operator/") and r.code == 200
    ]
    assert rewrites == [], rewrites
    for name in ("cache-pinned", "cache-unpinned"):
        _done(cluster, name)
