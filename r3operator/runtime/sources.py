"""The driver's side of the one resolver: the local path of ``spec.model.uri``, ``spec.task.datasetPath`` and
``spec.evaluation.datasetPath``.

In a pod the operator has fetched hf://, s3:// and gs:// sources already (the model cache at MODEL_MOUNT, the
dataset files at DATA_MOUNT): the driver verifies that copy and never fetches itself. Outside a cluster (a local
``r3operator run``) the same fetch fills ``<cache dir>/sources`` on first use, with the credentials of the
environment.
"""

from __future__ import annotations

from pathlib import Path

from r3operator.api.sources import parse_source_uri
from r3operator.api.v1alpha1 import GCSAccess, RLJob, S3Access
from r3operator.api.vllm_args import model_source
from r3operator.runtime.fetch import S3Options, fetch, target_directory, verify
from r3operator.settings import DATA_MOUNT, runtime_settings


def local_sources_root() -> Path:
    """Where a run outside a cluster fetches hf://, s3:// and gs:// sources (``R3OPERATOR_CACHE_DIR`` moves it)."""
    return (runtime_settings().cache_dir or Path.home() / ".cache" / "r3operator") / "sources"


def store_options(uri: str, s3: S3Access | None, gcs: GCSAccess | None) -> S3Options:
    """The endpoint of the store ``uri`` names, from its spec block (``s3`` or ``gcs``)."""
    if parse_source_uri(uri).scheme == "gs":
        return S3Options() if gcs is None else S3Options(endpoint_url=gcs.endpoint_url)
    return S3Options() if s3 is None else S3Options(endpoint_url=s3.endpoint_url, region=s3.region)


def fetched_model_dir(job: RLJob) -> Path:
    """The verified local copy of a fetched model: the mounted cache in a pod, else a local fetch."""
    model = job.spec.model
    env = runtime_settings()
    mounted = env.host_path(model_source(job.spec).directory)  # R3OPERATOR_MOUNTS maps a pod path to this host
    if mounted.is_dir() or env.in_cluster:
        return verify(mounted).path
    options = store_options(model.uri, model.s3, model.gcs)
    return fetch(model.uri, local_sources_root(), revision=model.revision, s3=options).path


def resolve_dataset_path(job: RLJob) -> Path | None:
    """The local file or directory of ``task.datasetPath`` (None when the task has none)."""
    return _data_path(job, job.spec.task.dataset_path, "spec.task.datasetPath")


def resolve_eval_dataset_path(job: RLJob) -> Path | None:
    """The local file of ``evaluation.datasetPath`` (None without an evaluation), fetched with the task's
    store credentials."""
    evaluation = job.spec.evaluation
    return None if evaluation is None else _data_path(job, evaluation.dataset_path, "spec.evaluation.datasetPath")


def _data_path(job: RLJob, path: str | None, field: str) -> Path | None:
    task = job.spec.task
    if not path:
        return None
    source = parse_source_uri(path)
    if source.scheme == "file":
        return Path(source.location)
    if not source.fetched:
        raise ValueError(f"{field} {path}: use a path, s3://bucket/key or gs://bucket/key")
    env = runtime_settings()
    in_pod = env.host_path(target_directory(source, Path(DATA_MOUNT)))
    if in_pod.is_dir() or env.in_cluster:
        return verify(in_pod).path
    return fetch(path, local_sources_root(), s3=store_options(path, task.s3, task.gcs)).path
