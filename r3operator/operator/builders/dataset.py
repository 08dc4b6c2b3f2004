"""An s3:// or gs:// ``task.datasetPath``: fetched by an init container of the trainer's head pod (where the driver runs
and reads it) into an emptyDir at DATA_MOUNT, with the same ``r3operator fetch`` as the model cache. One pod
fetches, so there is nothing to share; the credentials reach only that init container (secretKeyRef env).
The driver finds the copy with runtime/sources.py ``resolve_dataset_path``.
"""

from __future__ import annotations

from r3operator.api.sources import parse_source_uri
from r3operator.api.v1alpha1 import RLJob
from r3operator.operator.builders.model import ModelMount
from r3operator.operator.builders.model_cache import fetch_command, secret_env, store
from r3operator.operator.builders.security import container_security_context
from r3operator.settings import DATA_MOUNT

DATA_VOLUME = "data"
FETCH_DATASET_CONTAINER = "fetch-dataset"


def fetches_dataset(job: RLJob) -> bool:
    path = job.spec.task.dataset_path
    if not path:
        return False
    return parse_source_uri(path).fetched


def dataset_mount(job: RLJob, *, image: str, head: bool) -> ModelMount:
    task = job.spec.task
    if not head or not fetches_dataset(job) or task.dataset_path is None:
        return ModelMount()
    access = store(task.dataset_path, task.s3, task.gcs)
    fetch = {
        "name": FETCH_DATASET_CONTAINER,
        "image": image,
        "command": fetch_command(task.dataset_path, DATA_MOUNT, access=access),
        "env": secret_env(None, access),
        "volumeMounts": [{"name": DATA_VOLUME, "mountPath": DATA_MOUNT}],
        "securityContext": container_security_context(),
    }
    return ModelMount(
        volumes=[{"name": DATA_VOLUME, "emptyDir": {}}],
        mounts=[{"name": DATA_VOLUME, "mountPath": DATA_MOUNT, "readOnly": True}],
        init_containers=[fetch],
    )
