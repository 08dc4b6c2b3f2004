"""spec.export's writer (runtime/export.py) with a real trainer on the tiny reference model: a local directory, S3
(moto's server, real HTTP and SigV4 through boto3, behind a relay that can take the store away mid-upload), a claim
that fills up (a real 40 MB tmpfs in a user namespace), wrong credentials (moto with IAM authentication on), a NaN
weight, onFailure Fail, and a newer export giving up an older one. In every failure the last complete export stays
byte for byte as it was, and nothing without a manifest is taken for an export."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from runtime_test_helpers import small_job_manifest
from store_proxy import StoreProxy, served_store

from r3operator.api.load import parse_rljob
from r3operator.api.v1alpha1 import RLJob
from r3operator.runtime import export as export_module
from r3operator.runtime.evaluation import EvalResult
from r3operator.runtime.export import MANIFEST, Exporter, ExportError, local_exports, verify_export
from r3operator.runtime.metrics import merged_report
from r3operator.settings import RuntimeSettings

torch = pytest.importorskip("torch")
boto3 = pytest.importorskip("boto3")
pytest.importorskip("moto.server", reason="moto[server] (the dev extra) serves S3 in these tests")

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
BUCKET = "exports"
ADMIN = ("admin-key", "admin-secret")
FAST = {"export_retry_base_s": 0.01, "export_retry_cap_s": 0.02}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from r3operator.models import ensure_reference_model

    return ensure_reference_model("tiny", cache_dir=tmp_path_factory.mktemp("reference"))


@pytest.fixture(scope="module")
def trainer(model_dir: Path) -> Any:
    from r3operator.trainer.hf_policy import PolicyTrainer

    return PolicyTrainer(model_dir, device="cpu", learning_rate=1e-2, seed=0, compute_dtype="float32")


@pytest.fixture(scope="module")
def store() -> Iterator[tuple[str, StoreProxy]]:
    with served_store(lambda endpoint: _client(endpoint).create_bucket(Bucket=BUCKET)) as served:
        yield served


def _client(endpoint: str, keys: tuple[str, str] = ADMIN) -> Any:
    return boto3.client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=keys[0], aws_secret_access_key=keys[1]
    )


def _job(**export: Any) -> RLJob:
    manifest = small_job_manifest(export=export)
    manifest["metadata"].update(namespace="rl", uid="6b1f3c1e-0000-4000-8000-000000000049")
    return parse_rljob(manifest)


def _exporter(
    tmp_path: Path,
    model_dir: Path,
    *,
    last_step: int = 5,
    keys: tuple[str, str] | None = ADMIN,
    backoff: dict[str, float] = FAST,
    **export: Any,
) -> Exporter:
    job = _job(**export)
    assert job.spec.export is not None
    env: dict[str, Any] = dict(backoff)
    if keys is not None:
        env |= {"export_aws_access_key_id": keys[0], "export_aws_secret_access_key": keys[1]}
    return Exporter(
        job.spec.export,
        job=job,
        run_dir=tmp_path / "run",
        model_dir=model_dir,
        last_step=last_step,
        engine_dtype="float32",
        chunk_size_mb=64,
        env=RuntimeSettings(**env),
    )


class Reports:
    """What the driver pushes, merged as the progress ConfigMap holds it."""

    def __init__(self) -> None:
        self.progress: dict[str, Any] = {}

    def __call__(self, body: dict[str, Any]) -> None:
        self.progress = merged_report(self.progress, body["status"]["progress"])


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _tree(directory: Path) -> dict[str, str]:
    return {p.name: _sha(p) for p in sorted(directory.iterdir())}


def _objects(endpoint: str, prefix: str) -> dict[str, bytes]:
    client = _client(endpoint)
    listed = client.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])
    return {o["Key"][len(prefix) :]: client.get_object(Bucket=BUCKET, Key=o["Key"])["Body"].read() for o in listed}


def _complete_remote(objects: dict[str, bytes]) -> dict[str, Any]:
    """The manifest of an export read as objects, every file checked against it (what a reader does)."""
    manifest: dict[str, Any] = json.loads(objects[MANIFEST])
    for name, facts in manifest["files"].items():
        assert hashlib.sha256(objects[name]).hexdigest() == facts["sha256"], name
    return manifest


def _step(trainer: Any) -> None:
    trainer.sft_step([[5, 6, 7]], [[20, 21]])


def test_exports_are_due_every_interval_and_after_the_last_step(tmp_path: Path, model_dir: Path) -> None:
    def due(**export: Any) -> list[int]:
        exporter = _exporter(tmp_path, model_dir, destination=f"file://{tmp_path}/x", **export)
        return [step for step in range(1, 6) if exporter.due(step)]

    assert due(intervalSteps=2) == [2, 4, 5]
    assert due() == [5]
    assert due(intervalSteps=2, atEnd=False) == [2, 4]
    assert due(intervalSteps=5) == [5]


def test_a_claim_outside_a_pod_is_refused_naming_the_field_unless_mapped(tmp_path: Path) -> None:
    spec = _job(destination="pvc://models/rl/tiny").spec.export
    assert spec is not None
    with pytest.raises(ValueError, match=r"spec.export.destination pvc://models/rl/tiny: a claim is mounted at /mnt/"):
        export_module.destination(spec, RuntimeSettings())
    mapped = export_module.destination(spec, RuntimeSettings(mounts=f"/mnt/export={tmp_path}"))
    assert mapped.local_root == tmp_path / "rl" / "tiny"


def test_a_local_export_is_a_complete_hf_directory_with_its_manifest(
    tmp_path: Path, model_dir: Path, trainer: Any
) -> None:
    from transformers import AutoTokenizer, GenerationConfig

    root = tmp_path / "exports"
    exporter = _exporter(tmp_path, model_dir, destination=f"file://{root}", intervalSteps=2)
    reports = Reports()
    _step(trainer)
    evaluation = EvalResult(
        step=2,
        policy_version=7,
        reward_mean=0.375,
        reward_std=0.1,
        prompts=4,
        samples=4,
        response_tokens_mean=3.0,
        seconds=1.0,
    )
    exporter.after_step(2, trainer, 7, evaluation=evaluation, push=reports)
    exporter.finish(reports)

    export = root / "step-000002"
    manifest = verify_export(export)
    assert (manifest["evalReward"], manifest["evalStep"]) == (0.375, 2)
    assert {k: manifest[k] for k in ("format", "step", "policyVersion", "dtype", "trainerBackend")} == {
        "format": 1,
        "step": 2,
        "policyVersion": 7,
        "dtype": "float32",
        "trainerBackend": "FSDP",
    }
    assert manifest["rljob"] == {
        "name": "tiny-count-r3",
        "namespace": "rl",
        "uid": "6b1f3c1e-0000-4000-8000-000000000049",
    }
    assert manifest["model"]["uri"].startswith("r3operator://")
    assert set(manifest["files"]) == {p.name for p in export.iterdir()} - {MANIFEST}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"} <= set(manifest["files"])
    assert "r3_reference_spec.json" not in manifest["files"]  # describes the reference's weights, not these
    assert json.loads((export / "config.json").read_text())["dtype"] == "float32"
    assert AutoTokenizer.from_pretrained(export).encode("1 + 1") == AutoTokenizer.from_pretrained(model_dir).encode(
        "1 + 1"
    )
    assert GenerationConfig.from_pretrained(export).eos_token_id == 2
    assert local_exports(root) == [2] and not list(root.glob(".tmp-*"))
    assert not list((tmp_path / "run" / "export-staging").iterdir())  # renamed into place: nothing copied
    finished = reports.progress["exports"][0]["finishedAt"]
    assert reports.progress == {
        "exports": [{"step": 2, "uri": f"file://{root}/step-000002", "evalReward": 0.375, "finishedAt": finished}],
        "lastExportStep": 2,
    }

    # A driver that starts again reports this RLJob's exports already there (its progress report starts empty),
    # not another RLJob's under the same destination.
    other = root / "step-000001"
    shutil.copytree(export, other)
    stranger = json.loads((other / MANIFEST).read_text())
    (other / MANIFEST).write_text(json.dumps({**stranger, "step": 1, "rljob": {**stranger["rljob"], "uid": "other"}}))
    restarted, again = _exporter(tmp_path, model_dir, destination=f"file://{root}", intervalSteps=2), Reports()
    restarted.finish(again)
    assert [(r["step"], r["uri"]) for r in again.progress["exports"]] == [(2, f"file://{root}/step-000002")]
    assert again.progress["lastExportStep"] == 2

    # A changed file, or a manifest missing, is not an export.
    (export / "tokenizer.json").write_text("{}")
    with pytest.raises(export_module.ExportNotComplete, match=r"tokenizer\.json does not match"):
        verify_export(export)
    (export / MANIFEST).unlink()
    assert local_exports(root) == [1]  # only the one whose manifest is there


def test_the_manifest_goes_last_a_failed_publish_is_never_an_export_and_the_retry_completes(
    tmp_path: Path, model_dir: Path, trainer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "exports"
    exporter = _exporter(tmp_path, model_dir, destination=f"file://{root}", intervalSteps=1, maxAttempts=3)
    reports = Reports()
    exporter.after_step(1, trainer, 1, evaluation=None, push=reports)
    exporter.finish(reports)
    first = _tree(root / "step-000001")

    real = export_module._write_manifest_file
    seen: list[list[str]] = []

    def broken_once(directory: Path, manifest: dict[str, Any]) -> None:
        seen.append(sorted(p.name for p in root.iterdir()))
        if len(seen) == 1:
            raise OSError(28, "No space left on device")
        real(directory, manifest)

    monkeypatch.setattr(export_module, "_write_manifest_file", broken_once)
    _step(trainer)
    exporter.after_step(2, trainer, 2, evaluation=None, push=reports)
    exporter.finish(reports)
    # While its files were being written, the export was a hidden directory beside the complete one.
    assert all(names[0].startswith(".tmp-step-000002-") and names[1:] == ["step-000001"] for names in seen), seen
    assert len(seen) == 2  # the failed try, then the retry: the staged files were still there for it
    assert local_exports(root) == [1, 2] and _tree(root / "step-000001") == first
    assert reports.progress["lastExportStep"] == 2 and "exportFailure" not in reports.progress


FULL_CLAIM = textwrap.dedent(
    """
    import json, sys
    sys.path[:0] = [{here!r}, {tests!r}]  # this module, and the tests' shared helpers
    from test_export import _exporter, Reports
    from pathlib import Path
    from r3operator.trainer.hf_policy import PolicyTrainer
    from r3operator.runtime.export import verify_export
    claim, tmp, model_dir = Path({claim!r}), Path({tmp!r}), Path({model!r})
    trainer = PolicyTrainer(model_dir, device="cpu", learning_rate=1e-2, seed=0, compute_dtype="float32")
    exporter = _exporter(tmp, model_dir, destination="file://" + str(claim / "models"), intervalSteps=1,
                         maxAttempts=2, dtype="bfloat16")
    reports = Reports()
    exporter.after_step(1, trainer, 1, evaluation=None, push=reports)
    exporter.finish(reports)
    first = verify_export(claim / "models" / "step-000001")
    trainer.sft_step([[5, 6, 7]], [[20, 21]])
    exporter.after_step(2, trainer, 2, evaluation=None, push=reports)
    exporter.finish(reports)
    print(json.dumps({{"progress": reports.progress, "first": first["files"],
                      "after": verify_export(claim / "models" / "step-000001")["files"],
                      "left": sorted(p.name for p in (claim / "models").iterdir())}}))
    """
)


def test_a_full_claim_fails_the_export_with_no_space_and_keeps_the_last_one(tmp_path: Path, model_dir: Path) -> None:
    """The claim is a real 40 MB tmpfs (one bf16 export of the tiny model is 27 MB), mounted in a user namespace of
    this user's: no root needed. The driver stages on its own volume (the run dir) and publishes into the claim."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) (util-linux) for a user namespace with a small tmpfs")
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"user namespaces are not available here: {probe.stderr.strip()}")
    claim = tmp_path / "claim"
    claim.mkdir()
    script = FULL_CLAIM.format(
        here=str(Path(__file__).parent),
        tests=str(Path(__file__).parents[1]),
        claim=str(claim),
        tmp=str(tmp_path),
        model=str(model_dir),
    )
    mount = f'mount -t tmpfs -o size=40m tmpfs {claim} && exec {sys.executable} -c "$0"'
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(
        ["unshare", "-rm", "sh", "-c", mount, script], capture_output=True, text=True, env=env, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    failure = result["progress"]["exportFailure"]
    assert failure["reason"] == "NoSpace" and failure["step"] == 2 and failure["attempts"] == 2, failure
    assert failure["retrying"] is False and "No space left on device" in failure["message"]
    assert result["progress"]["lastExportStep"] == 1
    assert result["after"] == result["first"]  # checked against its manifest, file by file
    assert result["left"] == ["step-000001"]  # the half-copied export went with its failed try


def test_s3_exports_survive_a_store_lost_mid_upload_and_never_show_a_partial_export(
    tmp_path: Path, model_dir: Path, trainer: Any, store: tuple[str, StoreProxy]
) -> None:
    endpoint, proxy = store
    s3 = {"credentialsSecret": "store", "endpointURL": proxy.endpoint, "region": "us-east-1"}
    exporter = _exporter(
        tmp_path,
        model_dir,
        dtype="bfloat16",
        destination=f"s3://{BUCKET}/lost/job",
        s3=s3,
        intervalSteps=1,
        maxAttempts=3,
    )
    reports = Reports()
    exporter.after_step(1, trainer, 1, evaluation=None, push=reports)
    exporter.finish(reports)
    first = _objects(endpoint, "lost/job/step-000001/")
    assert _complete_remote(first)["step"] == 1

    _step(trainer)
    proxy.cut_after(3 << 20)  # the store goes away 3 MB into the next upload (the bf16 weights are 27 MB)
    try:
        exporter.after_step(2, trainer, 2, evaluation=None, push=reports)
        exporter.finish(reports)
    finally:
        proxy.up()
    failure = reports.progress["exportFailure"]
    assert failure["reason"] == "StoreUnreachable" and failure["attempts"] == 3 and not failure["retrying"], failure
    assert reports.progress["lastExportStep"] == 1
    partial = _objects(endpoint, "lost/job/step-000002/")
    assert MANIFEST not in partial  # whatever got there is not an export
    assert _objects(endpoint, "lost/job/step-000001/") == first

    _step(trainer)
    exporter.after_step(3, trainer, 3, evaluation=None, push=reports)
    exporter.finish(reports)
    assert _complete_remote(_objects(endpoint, "lost/job/step-000003/"))["step"] == 3
    assert "exportFailure" not in reports.progress and reports.progress["lastExportStep"] == 3
    assert [r["step"] for r in reports.progress["exports"]] == [1, 3]
    # A driver that starts again finds them in the store (a manifest each; step 2's has none).
    restarted, again = (
        _exporter(tmp_path, model_dir, dtype="bfloat16", destination=f"s3://{BUCKET}/lost/job", s3=s3, intervalSteps=1),
        Reports(),
    )
    restarted.finish(again)
    assert [r["step"] for r in again.progress["exports"]] == [1, 3]


def test_an_unreachable_store_under_on_failure_fail_stops_the_run(
    tmp_path: Path, model_dir: Path, trainer: Any, store: tuple[str, StoreProxy]
) -> None:
    _, proxy = store
    s3 = {"credentialsSecret": "store", "endpointURL": proxy.endpoint, "region": "us-east-1"}
    reports = Reports()
    proxy.down()
    try:
        going_on = _exporter(
            tmp_path, model_dir, dtype="bfloat16", destination=f"s3://{BUCKET}/down/a", s3=s3, maxAttempts=2
        )
        going_on.after_step(5, trainer, 5, evaluation=None, push=reports)
        going_on.finish(reports)  # Continue (the default): reported, not raised
        assert reports.progress["exportFailure"]["reason"] == "StoreUnreachable"

        stopping = _exporter(
            tmp_path,
            model_dir,
            dtype="bfloat16",
            destination=f"s3://{BUCKET}/down/b",
            s3=s3,
            maxAttempts=2,
            onFailure="Fail",
        )
        stopping.after_step(5, trainer, 5, evaluation=None, push=reports)
        with pytest.raises(ExportError, match=r"export of step 5 to s3://exports/down/b/step-000005 failed after 2"):
            stopping.finish(reports)
    finally:
        proxy.up()


def test_wrong_credentials_are_access_denied_and_leave_the_last_export(
    tmp_path: Path, model_dir: Path, trainer: Any, store: tuple[str, StoreProxy]
) -> None:
    endpoint, _ = store
    iam = boto3.client(
        "iam", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="a", aws_secret_access_key="b"
    )
    iam.create_user(UserName="exporter")
    policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
    iam.put_user_policy(UserName="exporter", PolicyName="s3", PolicyDocument=json.dumps(policy))
    key = iam.create_access_key(UserName="exporter")["AccessKey"]
    good = (key["AccessKeyId"], key["SecretAccessKey"])
    s3 = {"credentialsSecret": "store", "endpointURL": endpoint, "region": "us-east-1"}
    reports = Reports()
    _auth(endpoint, "0")  # from now on moto checks every request's signature against its IAM users
    try:
        right = _exporter(
            tmp_path, model_dir, keys=good, dtype="bfloat16", destination=f"s3://{BUCKET}/auth/job", s3=s3
        )
        right.after_step(5, trainer, 5, evaluation=None, push=reports)
        right.finish(reports)
        assert reports.progress["lastExportStep"] == 5
        first = _objects_as(endpoint, good, "auth/job/step-000005/")
        wrong = _exporter(
            tmp_path, model_dir, keys=("AKIAWRONG", "nope"), dtype="bfloat16",
            destination=f"s3://{BUCKET}/auth/job", s3=s3, maxAttempts=2, intervalSteps=3,
        )  # fmt: skip
        _step(trainer)
        wrong.after_step(6, trainer, 6, evaluation=None, push=reports)
        wrong.finish(reports)
        failure = reports.progress["exportFailure"]
        assert failure["reason"] == "AccessDenied" and "InvalidAccessKeyId" in failure["message"], failure
        assert _objects_as(endpoint, good, "auth/job/step-000005/") == first
        assert _objects_as(endpoint, good, "auth/job/step-000006/") == {}
    finally:
        _auth(endpoint, "inf")


def _auth(endpoint: str, count: str) -> None:
    import urllib.request

    request = urllib.request.Request(f"{endpoint}/moto-api/reset-auth", data=count.encode())
    request.add_header("Content-Type", "text/plain")  # a form body would not reach moto's handler as data
    urllib.request.urlopen(request).read()


def _objects_as(endpoint: str, keys: tuple[str, str], prefix: str) -> dict[str, bytes]:
    client = _client(endpoint, keys)
    listed = client.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])
    return {o["Key"][len(prefix) :]: client.get_object(Bucket=BUCKET, Key=o["Key"])["Body"].read() for o in listed}


def test_a_nan_weight_is_refused_and_nothing_is_written(tmp_path: Path, model_dir: Path) -> None:
    from r3operator.trainer.hf_policy import PolicyTrainer

    poisoned = PolicyTrainer(model_dir, device="cpu", learning_rate=1e-2, seed=0, compute_dtype="float32")
    with torch.no_grad():
        poisoned.model.model.layers[1].self_attn.q_proj.weight[0, 0] = float("nan")
    root = tmp_path / "exports"
    exporter = _exporter(tmp_path, model_dir, destination=f"file://{root}", onFailure="Fail")
    reports = Reports()
    with pytest.raises(ExportError, match="NonFiniteWeights"):
        exporter.after_step(5, poisoned, 5, evaluation=None, push=reports)
    failure = reports.progress["exportFailure"]
    assert failure["reason"] == "NonFiniteWeights" and failure["attempts"] == 1 and not failure["retrying"]
    assert "model.layers.1.self_attn.q_proj.weight" in failure["message"]
    assert not root.exists() and not list((tmp_path / "run" / "export-staging").iterdir())


def test_a_newer_export_gives_up_an_older_one_still_being_retried(
    tmp_path: Path, model_dir: Path, trainer: Any, store: tuple[str, StoreProxy]
) -> None:
    endpoint, proxy = store
    s3 = {"credentialsSecret": "store", "endpointURL": proxy.endpoint, "region": "us-east-1"}
    slow = {"export_retry_base_s": 30.0, "export_retry_cap_s": 30.0}
    exporter = _exporter(
        tmp_path,
        model_dir,
        backoff=slow,
        dtype="bfloat16",
        destination=f"s3://{BUCKET}/newer/job",
        s3=s3,
        intervalSteps=1,
    )
    reports = Reports()
    proxy.down()
    try:
        exporter.after_step(2, trainer, 2, evaluation=None, push=reports)  # fails, then waits 30 s to try again
        for _ in range(200):
            if exporter.failure is not None:
                break
            time.sleep(0.05)
        assert exporter.failure is not None and exporter.failure.retrying
    finally:
        proxy.up()
    _step(trainer)
    exporter.after_step(3, trainer, 3, evaluation=None, push=reports)
    exporter.finish(reports)  # returns once step 3 is in: step 2's wait was cut short, never retried
    assert [r.step for r in exporter.records] == [3] and exporter.failure is None
    assert MANIFEST not in _objects(endpoint, "newer/job/step-000002/")
    assert not list((tmp_path / "run" / "export-staging").iterdir())


def test_the_report_fits_status_progress_as_the_operator_reads_it(tmp_path: Path) -> None:
    from r3operator.api.v1alpha1 import ExportFailure, ExportRecord
    from r3operator.operator.progress import read_report

    records = [ExportRecord(step=s, uri=f"s3://b/p/step-{s:06d}", eval_reward=0.5) for s in range(1, 6)]
    failure = ExportFailure(step=6, reason="NoSpace", message="x" * 1024, attempts=5)
    body = export_module.progress_patch(records, failure)["status"]["progress"]
    config_map = {"data": {"progress": json.dumps(body)}}
    report = read_report(config_map)
    assert report.problem is None and report.progress is not None
    assert report.progress.last_export_step == 5 and report.progress.export_failure == failure
    assert yaml.safe_dump(body)  # plain data
