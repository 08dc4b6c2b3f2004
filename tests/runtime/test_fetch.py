"""The one resolver against each scheme with a generated reference model: an S3-compatible store started here
(moto's server, real HTTP and SigV4 through boto3), a local HF-layout directory given as a plain path, a
PVC-style mounted path; and the guarantees of the cache: fetched once, a half-written or changed copy refused."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from spec_edits import apply_edits

from r3operator.api import vllm_args as args
from r3operator.api.load import parse_rljob
from r3operator.api.sources import parse_source_uri
from r3operator.api.v1alpha1 import RLJob
from r3operator.models import ensure_reference_model
from r3operator.runtime import sources
from r3operator.runtime.config import resolve_model_dir
from r3operator.runtime.fetch import (
    GCS_ENDPOINT,
    READY_FILE,
    FetchError,
    S3Options,
    SourceNotReady,
    _store_options,
    fetch,
    verify,
)

moto_server = pytest.importorskip("moto.server", reason="moto[server] (the dev extra) serves S3 in these tests")
boto3 = pytest.importorskip("boto3")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "qwen3-30b-a3b-r3-fsdp.yaml"
ACCESS_KEY = "AKIAFETCHTEST0000001"
SECRET_KEY = "fetch-test-secret-7f3c9a1e5b"
HELD_OUT = b'{"prompt": "2+3", "answer": "5"}\n'


def _tree(directory: Path) -> dict[str, str]:
    """Relative path → sha256 of every file (the ready marker left out)."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != READY_FILE
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_reference_model("tiny", cache_dir=tmp_path_factory.mktemp("reference"))


@pytest.fixture(scope="module")
def s3_endpoint(reference: Path) -> Iterator[str]:
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
    )
    client.create_bucket(Bucket="models")
    for path in sorted(reference.rglob("*")):
        if path.is_file():
            client.upload_file(str(path), "models", f"ref/tiny/{path.relative_to(reference)}")
    client.put_object(Bucket="models", Key="ref/tiny-sibling/config.json", Body=b"{}")  # shares the prefix text
    client.create_bucket(Bucket="data")
    client.put_object(Bucket="data", Key="math/train.jsonl", Body=b'{"prompt": "1+1", "answer": "2"}\n')
    client.put_object(Bucket="data", Key="math/test.jsonl", Body=HELD_OUT)
    yield endpoint
    server.stop()


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Credentials as the fetch container gets them (env from the Secret), and no machine-wide AWS config."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")


def _job(**edits: Any) -> RLJob:
    doc = yaml.safe_load(EXAMPLE.read_text())
    apply_edits(doc, edits)
    return parse_rljob(doc)


@pytest.mark.usefixtures("aws_env")
def test_s3_prefix_is_fetched_byte_for_byte_and_only_once(reference: Path, s3_endpoint: str, tmp_path: Path) -> None:
    done = fetch("s3://models/ref/tiny", tmp_path, s3=S3Options(endpoint_url=s3_endpoint))
    assert done.path == done.directory == tmp_path / "s3" / "models" / "ref" / "tiny"
    assert _tree(done.path) == _tree(reference)  # and nothing of ref/tiny-sibling
    assert done.bytes == sum(p.stat().st_size for p in reference.rglob("*") if p.is_file())
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(done.path).num_experts == AutoConfig.from_pretrained(reference).num_experts
    # A second fetch finds the verified copy: it needs no store at all (an unreachable endpoint here).
    again = fetch("s3://models/ref/tiny", tmp_path, s3=S3Options(endpoint_url="http://127.0.0.1:9"))
    assert again.path == done.path
    assert [p.name for p in done.path.parent.iterdir()] == ["tiny"]  # no partial directory left behind


@pytest.mark.usefixtures("aws_env")
def test_one_s3_object_is_fetched_as_a_file(s3_endpoint: str, tmp_path: Path) -> None:
    done = fetch("s3://data/math/train.jsonl", tmp_path, s3=S3Options(endpoint_url=s3_endpoint))
    assert done.path == tmp_path / "s3" / "data" / "math" / "train.jsonl" / "train.jsonl"
    assert done.path.read_text() == '{"prompt": "1+1", "answer": "2"}\n'
    assert verify(done.directory).path == done.path


@pytest.mark.usefixtures("aws_env")
def test_an_empty_prefix_and_a_missing_bucket_fail_naming_the_uri(s3_endpoint: str, tmp_path: Path) -> None:
    with pytest.raises(FetchError, match=r"s3://models/absent: no objects under this prefix"):
        fetch("s3://models/absent", tmp_path, s3=S3Options(endpoint_url=s3_endpoint))
    with pytest.raises(FetchError, match=r"s3://no-such-bucket/m: .*NoSuchBucket"):
        fetch("s3://no-such-bucket/m", tmp_path, s3=S3Options(endpoint_url=s3_endpoint))
    assert not any(tmp_path.rglob(READY_FILE))


def test_s3_without_credentials_fails_naming_the_uri(
    s3_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(FetchError, match=r"s3://models/ref/tiny: Unable to locate credentials"):
        fetch("s3://models/ref/tiny", tmp_path, s3=S3Options(endpoint_url=s3_endpoint, region="us-east-1"))


@pytest.mark.usefixtures("aws_env")
def test_a_half_written_or_changed_copy_is_refused_and_a_new_fetch_replaces_it(
    s3_endpoint: str, tmp_path: Path
) -> None:
    options = S3Options(endpoint_url=s3_endpoint)
    done = fetch("s3://models/ref/tiny", tmp_path, s3=options)
    weights = next(done.path.glob("*.safetensors"))
    original = weights.read_bytes()
    weights.write_bytes(original[: len(original) // 2])  # a copy cut short
    with pytest.raises(SourceNotReady, match=r"safetensors has \d+ bytes, .* says \d+"):
        verify(done.directory)
    weights.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))  # same size, other content
    assert verify(done.directory).path == done.path  # the fast check reads sizes only
    with pytest.raises(SourceNotReady, match="does not match its sha256"):
        verify(done.directory, checksums=True)
    # A new fetch with checksums finds the change and replaces the whole copy.
    assert fetch("s3://models/ref/tiny", tmp_path, s3=options, checksums=True).path == done.path
    assert weights.read_bytes() == original
    marker = done.directory / READY_FILE
    marker.write_text(marker.read_text().replace('"size": ', '"size": 1'))
    with pytest.raises(SourceNotReady, match="is damaged"):
        verify(done.directory)
    marker.unlink()
    with pytest.raises(SourceNotReady, match="has no ready marker"):
        verify(done.directory)


@pytest.mark.usefixtures("aws_env")
def test_concurrent_fetches_into_one_cache_leave_one_complete_copy(
    reference: Path, s3_endpoint: str, tmp_path: Path
) -> None:
    results: list[Path] = []
    errors: list[BaseException] = []

    def one() -> None:
        try:
            results.append(fetch("s3://models/ref/tiny", tmp_path, s3=S3Options(endpoint_url=s3_endpoint)).path)
        except BaseException as exc:  # surfaced below, with the thread's own traceback
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(set(results)) == 1
    assert _tree(results[0]) == _tree(reference)
    assert sorted(p.name for p in results[0].parent.iterdir()) == ["tiny"]


@pytest.mark.usefixtures("aws_env")
def test_the_driver_fetches_locally_with_the_spec_endpoint_and_reads_the_mounted_cache_in_a_pod(
    reference: Path, s3_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("R3OPERATOR_MODEL_DIR", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("R3OPERATOR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(args, "MODEL_MOUNT", str(tmp_path / "not-mounted"))
    s3 = {"credentialsSecret": "store", "endpointURL": s3_endpoint}
    job = _job(**{"model.uri": "s3://models/ref/tiny", "model.revision": None, "model.s3": s3})
    local = resolve_model_dir(job)
    assert local == tmp_path / "cache" / "sources" / "s3" / "models" / "ref" / "tiny"
    assert _tree(local) == _tree(reference)
    # In a pod: the operator's fetch filled the mounted cache with the same `r3operator fetch`; the driver
    # only verifies it (the endpoint is unreachable from here on).
    monkeypatch.setattr(args, "MODEL_MOUNT", str(tmp_path / "cache" / "sources"))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    stale = _job(
        **{
            "model.uri": "s3://models/ref/tiny",
            "model.revision": None,
            "model.s3": {**s3, "endpointURL": "http://127.0.0.1:9"},
        }
    )
    assert resolve_model_dir(stale) == local
    (local / READY_FILE).unlink()
    with pytest.raises(SourceNotReady):
        resolve_model_dir(stale)


@pytest.mark.usefixtures("aws_env")
def test_dataset_path_resolves_plain_paths_as_they_are_and_fetches_s3(
    s3_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("R3OPERATOR_CACHE_DIR", str(tmp_path / "cache"))
    assert sources.resolve_dataset_path(_job(**{"task.datasetPath": None})) is None
    plain = tmp_path / "train.jsonl"
    assert sources.resolve_dataset_path(_job(**{"task.datasetPath": str(plain)})) == plain
    job = _job(
        **{
            "task.datasetPath": "s3://data/math/train.jsonl",
            "task.s3": {"credentialsSecret": "x", "endpointURL": s3_endpoint},
        }
    )
    path = sources.resolve_dataset_path(job)
    assert path is not None and path.read_text().startswith('{"prompt": "1+1"')


def test_an_s3_eval_dataset_is_fetched_by_the_head_pods_init_container_and_found_by_the_driver(
    s3_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The init container the operator renders for evaluation.datasetPath (its command, with the task's store
    credentials as env) fills the data mount; the driver in the pod finds that copy without reaching the store.
    Outside a cluster the driver fetches the same file itself."""
    from r3operator.operator.builders.dataset import FETCH_EVAL_DATASET_CONTAINER, dataset_mount
    from r3operator.runtime.dataset_file import resolve_eval_dataset_file
    from r3operator.settings import DATA_MOUNT

    job = _job(
        **{
            "task.name": "dataset",
            "task.reward": "math",
            "task.datasetPath": str(tmp_path / "train.jsonl"),
            "task.s3": {"credentialsSecret": "store", "endpointURL": s3_endpoint},
            "evaluation": {"datasetPath": "s3://data/math/test.jsonl"},
        }
    )
    [init] = dataset_mount(job, image="trainer", head=True).init_containers
    assert init["name"] == FETCH_EVAL_DATASET_CONTAINER
    assert {e["name"]: e["valueFrom"]["secretKeyRef"]["name"] for e in init["env"]}["AWS_ACCESS_KEY_ID"] == "store"
    mount = tmp_path / "data-mount"
    argv = [str(mount) if arg == DATA_MOUNT else arg for arg in init["command"]]
    assert argv[:2] == ["r3operator", "fetch"]
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("AWS_")},
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": str(tmp_path / "none"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
        "PYTHONPATH": os.pathsep.join(sys.path),
    }
    done = _cli(*argv[2:], env=env)
    assert done.returncode == 0, done.stderr[-2000:]

    monkeypatch.setattr(sources, "DATA_MOUNT", str(mount))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    unreachable = job.model_copy(deep=True)
    assert unreachable.spec.task.s3 is not None
    unreachable.spec.task.s3.endpoint_url = "http://127.0.0.1:9"
    in_pod = resolve_eval_dataset_file(unreachable)
    assert in_pod is not None and in_pod.is_relative_to(mount) and in_pod.read_bytes() == HELD_OUT

    monkeypatch.delenv("KUBERNETES_SERVICE_HOST")
    monkeypatch.setattr(sources, "DATA_MOUNT", str(tmp_path / "not-mounted"))
    monkeypatch.setenv("R3OPERATOR_CACHE_DIR", str(tmp_path / "cache"))
    for key, value in env.items():
        if key.startswith("AWS_"):
            monkeypatch.setenv(key, value)
    local = resolve_eval_dataset_file(job)
    assert local is not None and local.is_relative_to(tmp_path / "cache") and local.read_bytes() == HELD_OUT


def test_gs_goes_to_cloud_storages_xml_api_unless_an_endpoint_is_given():
    gs, s3 = parse_source_uri("gs://models/ref/tiny"), parse_source_uri("s3://models/ref/tiny")
    assert _store_options(gs, S3Options()) == (S3Options(GCS_ENDPOINT, "auto"), True)
    assert _store_options(gs, S3Options("https://storage-psc.p.googleapis.com")) == (
        S3Options("https://storage-psc.p.googleapis.com", "auto"),
        True,
    )
    assert GCS_ENDPOINT == "https://storage.googleapis.com"
    assert _store_options(s3, S3Options()) == (S3Options(), False)  # AWS S3 keeps boto3's checksums


@pytest.mark.usefixtures("aws_env")
def test_gs_sources_are_fetched_through_the_s3_protocol_with_the_hmac_key(
    reference: Path, s3_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The moto server stands in for storage.googleapis.com: the same boto3 path, SigV4 with the HMAC key from
    the AWS_* variables, the gcs block's endpoint override."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("R3OPERATOR_MODEL_DIR", raising=False)
    monkeypatch.setenv("R3OPERATOR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(args, "MODEL_MOUNT", str(tmp_path / "not-mounted"))
    gcs = {"credentialsSecret": "hmac", "endpointURL": s3_endpoint}
    local = resolve_model_dir(_job(**{"model.uri": "gs://models/ref/tiny", "model.revision": None, "model.gcs": gcs}))
    assert local == tmp_path / "cache" / "sources" / "gs" / "models" / "ref" / "tiny"
    assert _tree(local) == _tree(reference)
    dataset = _job(**{"task.datasetPath": "gs://data/math/train.jsonl", "task.gcs": gcs})
    path = sources.resolve_dataset_path(dataset)
    assert path is not None and path.read_text().startswith('{"prompt": "1+1"')
    with pytest.raises(FetchError, match=r"gs://models/absent: no objects under this prefix"):
        fetch("gs://models/absent", tmp_path, s3=S3Options(endpoint_url=s3_endpoint))


def test_a_local_hf_layout_directory_and_a_pvc_path_are_used_where_they_are(
    reference: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("R3OPERATOR_MODEL_DIR", raising=False)
    assert resolve_model_dir(_job(**{"model.uri": f"file://{reference}"})) == reference
    # pvc://claim/path: the claim is mounted at MODEL_MOUNT; the model is the path inside it.
    monkeypatch.setattr(args, "MODEL_MOUNT", str(reference.parent))
    assert resolve_model_dir(_job(**{"model.uri": f"pvc://weights/{reference.name}"})) == reference


def _cli(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "r3operator", "fetch", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_cli_fetch_and_verify_exit_codes_and_never_print_the_credentials(s3_endpoint: str, tmp_path: Path) -> None:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("AWS_")},
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": str(tmp_path / "none"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
        "PYTHONPATH": os.pathsep.join(sys.path),
    }
    root = tmp_path / "cache"
    missing = _cli("s3://models/ref/tiny", str(root), "--verify", env=env)
    assert missing.returncode == 1 and "is absent" in missing.stderr
    ok = _cli("s3://models/ref/tiny", str(root), "--endpoint-url", s3_endpoint, env=env)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert ok.stdout.strip() == str(root / "s3" / "models" / "ref" / "tiny")
    verified = _cli("s3://models/ref/tiny", str(root), "--verify", "--checksums", env=env)
    assert verified.returncode == 0 and verified.stdout == ok.stdout
    gs = _cli("gs://models/ref/tiny", str(root), "--endpoint-url", s3_endpoint, env=env)
    assert gs.returncode == 0, gs.stderr[-2000:]
    assert gs.stdout.strip() == str(root / "gs" / "models" / "ref" / "tiny")
    failed = _cli("s3://no-such-bucket/m", str(root), "--endpoint-url", s3_endpoint, env=env)
    assert failed.returncode == 1 and "NoSuchBucket" in failed.stderr
    bad = _cli("hf://not-a-repo", str(root), env=env)
    assert bad.returncode == 2 and "expected hf://org/name" in bad.stderr
    for run in (missing, ok, verified, gs, failed, bad):
        assert SECRET_KEY not in run.stdout + run.stderr
        assert ACCESS_KEY not in run.stdout + run.stderr


def test_cli_hf_fetch_goes_through_huggingface_hub_and_leaves_nothing_when_it_fails(tmp_path: Path) -> None:
    """Offline, the Hub client refuses: the fetch fails naming the repository and the revision, and leaves
    neither a marker nor a partial directory that a reader could take for a copy."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "home"),
        "HF_TOKEN": SECRET_KEY,
        "PYTHONPATH": os.pathsep.join(sys.path),
    }
    run = _cli("hf://org/absent-model@v1.0", str(tmp_path / "cache"), env=env)
    assert run.returncode == 1
    assert "hf://org/absent-model (revision v1.0)" in run.stderr
    assert SECRET_KEY not in run.stdout + run.stderr
    assert [p.name for p in (tmp_path / "cache" / "hf" / "org" / "absent-model").iterdir()] == []
