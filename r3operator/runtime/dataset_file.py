"""The local file a `task.name: dataset` job reads.

``R3OPERATOR_DATASET_PATH`` wins when it is set: whatever fetched or mounted the dataset somewhere other than
`spec.task.datasetPath` says where. Otherwise `spec.task.datasetPath` is the file: a path in the trainer's
filesystem (a relative one from the working directory), a ``file://`` URI, or ``s3://``/``gs://`` (the copy the
trainer's head pod fetched, runtime/sources.py); a path with another scheme is refused with the way out.
"""

from __future__ import annotations

from pathlib import Path

from r3operator.api.checks import DATASET_TASK
from r3operator.api.v1alpha1 import RLJob
from r3operator.runtime.sources import resolve_dataset_path
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
    if task.dataset_path.startswith("file://"):
        return Path(task.dataset_path.removeprefix("file://"))
    if task.dataset_path.startswith(("s3://", "gs://")):
        return resolve_dataset_path(job)  # the trainer head pod's fetched copy, or a local fetch (docs/models.md)
    scheme, separator, _ = task.dataset_path.partition("://")
    if separator:
        raise ValueError(
            f"spec.task.datasetPath {task.dataset_path!r}: the runtime reads a file in the trainer's filesystem or "
            f"fetches s3:// and gs://, not {scheme}://; mount or copy the file into the trainer and give its path, "
            f"or set {RuntimeSettings.env_name('dataset_path')} to it"
        )
    return Path(task.dataset_path)
