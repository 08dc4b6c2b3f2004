"""An s3:// or gs:// ``task.datasetPath`` or ``evaluation.datasetPath``: fetched by an init container of the trainer's
head pod (where the driver runs and reads it) into an emptyDir at DATA_MOUNT, with the same ``r3operator fetch`` as the
model cache; one container per file (``fetch-dataset``, ``fetch-eval-dataset``), each into its own directory under the
mount. One pod fetches, so there is nothing to share; the credentials (``task.s3`` or ``task.gcs`` for both files)
reach only those init containers (secretKeyRef env). The driver finds the copies with runtime/sources.py.
"""

from __future__ import annotations

from typing import Any

from r3operator.api.sources import parse_source_uri
from r3operator.api.v1alpha1 import RLJob
from r3operator.operator.builders.model import ModelMount
from r3operator.operator.builders.model_cache import fetch_command, secret_env, store
from r3operator.operator.builders.security import container_security_context
from r3operator.settings import DATA_MOUNT

DATA_VOLUME = "data"
FETCH_DATASET_CONTAINER = "fetch-dataset"
FETCH_EVAL_DATASET_CONTAINER = "fetch-eval-dataset"


def fetched(path: str | None) -> bool:
    """Whether the trainer's head pod fetches ``path`` (an s3:// or gs:// file) before the driver starts."""
    return bool(path) and parse_source_uri(str(path)).fetched


def fetched_datasets(job: RLJob) -> list[tuple[str, str]]:
    """(init container, URI) of each dataset file the head pod fetches: the task's, then the evaluation's."""
    evaluation = job.spec.evaluation
    files = [
        (FETCH_DATASET_CONTAINER, job.spec.task.dataset_path),
        (FETCH_EVAL_DATASET_CONTAINER, evaluation.dataset_path if evaluation is not None else None),
    ]
    return [(name, path) for name, path in files if path is not None and fetched(path)]


def dataset_mount(job: RLJob, *, image: str, head: bool) -> ModelMount:
    task = job.spec.task
    files = fetched_datasets(job)
    if not head or not files:
        return ModelMount()
    fetches: list[dict[str, Any]] = []
    for name, path in files:
        access = store(path, task.s3, task.gcs)
        fetches.append(
            {
                "name": name,
                "image": image,
                "command": fetch_command(path, DATA_MOUNT, access=access),
                "env": secret_env(None, access),
                "volumeMounts": [{"name": DATA_VOLUME, "mountPath": DATA_MOUNT}],
                "securityContext": container_security_context(),
            }
        )
    return ModelMount(
        volumes=[{"name": DATA_VOLUME, "emptyDir": {}}],
        mounts=[{"name": DATA_VOLUME, "mountPath": DATA_MOUNT, "readOnly": True}],
        init_containers=fetches,
    )
