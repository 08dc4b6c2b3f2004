"""The local files a `task.name: dataset` job reads: the training rows and the held-out evaluation rows.

``R3OPERATOR_DATASET_PATH`` wins for the training file when it is set: whatever fetched or mounted the dataset
somewhere other than `spec.task.datasetPath` says where. Otherwise `spec.task.datasetPath` (and
`spec.evaluation.datasetPath`) is the file: a path in the trainer's filesystem (a relative one from the working
directory), a ``file://`` URI, or ``s3://``/``gs://`` (the copy the trainer's head pod fetched, runtime/sources.py);
a path with another scheme is refused with the way out.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from r3operator.api.checks import DATASET_TASK
from r3operator.api.v1alpha1 import RLJob
from r3operator.runtime.sources import resolve_dataset_path, resolve_eval_dataset_path
from r3operator.settings import RuntimeSettings, runtime_settings


def resolve_dataset_file(job: RLJob) -> Path | None:
    """The dataset file of a dataset task; None for the built-in tasks."""
    task = job.spec.task
    if task.name != DATASET_TASK:
        return None
    if env_path := runtime_settings().dataset_path:
        return env_path
    if task.dataset_path is None:
        raise ValueError("spec.task.datasetPath: task.name dataset needs a JSONL or Parquet file")
    variable = RuntimeSettings.env_name("dataset_path")
    return _local_file(
        job, task.dataset_path, "spec.task.datasetPath", resolve_dataset_path, f", or set {variable} to it"
    )


def resolve_eval_dataset_file(job: RLJob) -> Path | None:
    """The held-out file of `spec.evaluation`; None without one."""
    evaluation = job.spec.evaluation
    if evaluation is None:
        return None
    return _local_file(job, evaluation.dataset_path, "spec.evaluation.datasetPath", resolve_eval_dataset_path, "")


def _local_file(job: RLJob, path: str, field: str, fetched: Callable[[RLJob], Path | None], also: str) -> Path | None:
    if path.startswith("file://"):
        return Path(path.removeprefix("file://"))
    if path.startswith(("s3://", "gs://")):
        return fetched(job)  # the trainer head pod's fetched copy, or a local fetch (docs/models.md)
    scheme, separator, _ = path.partition("://")
    if separator:
        raise ValueError(
            f"{field} {path!r}: the runtime reads a file in the trainer's filesystem or fetches s3:// and gs://, not "
            f"{scheme}://; mount or copy the file into the trainer and give its path{also}"
        )
    return Path(path)
