"""The upgrade canary: a Job with the trainer image that scores an old and the new engine replica (an
engine image change), or one replica with the old and the new trainer image (a trainer image change).

It runs `r3operator upgrade-canary` (runtime/upgrade_canary.py) in a pod shaped like a trainer pod (the
trainer's ServiceAccount, config, routing volume with the latest checkpoint, model mount, one GPU), so the
scoring uses the trainer's current weights and numerics. Its verdict is the container's termination message
(``/dev/termination-log``), which the kubelet copies into the Pod's status and the operator reads from there
(operator/upgrade_record.py): nothing the trainer pods may write (the RLJob's status) carries it, and the pod
gets no API token, since it writes nothing. One Job per attempt: the attempt is in its labels and
arguments, and a Job of an earlier attempt is replaced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from r3operator.api.canary_verdict import TERMINATION_LOG
from r3operator.api.enums import EngineRole
from r3operator.api.v1alpha1 import RLJob
from r3operator.operator import meta
from r3operator.operator.builders.config import engine_replica_url
from r3operator.operator.builders.trainer import trainer_pod_template
from r3operator.settings import CONFIG_PATH

CONTAINER_NAME = "upgrade-canary"
LABEL_ATTEMPT = f"{meta.PREFIX}/upgrade-attempt"
BASELINE_DIR = "/var/run/r3operator-canary"
BASELINE = f"{BASELINE_DIR}/old-trainer.json"


@dataclass(frozen=True, slots=True)
class CanaryTarget:
    """The canary Job's inputs: which replica is old, which is new, and the attempt it answers.

    component "trainer": one engine replica (``old_replica``) scored by the old and the new trainer image."""

    attempt: str
    old_image: str
    new_image: str
    old_replica: int
    new_replica: int
    component: str = "engine"
    prefill: tuple[int, int] | None = None
    """A disaggregated job's prefill replicas (old, new) of the pairs the canary scores (None: one engine each)."""


def build_upgrade_canary_job(job: RLJob, target: CanaryTarget) -> dict[str, Any]:
    """Engine upgrades: the trainer image scores an old and the new replica. Trainer upgrades: an init
    container with the old trainer image scores replica 0 into a shared emptyDir, then the new trainer
    image scores the same replica and compares (`--baseline`)."""
    template = trainer_pod_template(job, CONTAINER_NAME, head=False)
    container = template["spec"]["containers"][0]
    container["command"] = ["r3operator", "upgrade-canary"]
    container["terminationMessagePath"] = TERMINATION_LOG
    container["terminationMessagePolicy"] = "File"  # the verdict, not the log's tail
    common = ["--config", CONFIG_PATH, "--new", engine_replica_url(job, target.new_replica)]
    gpus = "1"  # one trainer GPU scores the engines' samples
    container["resources"] = {"requests": {"nvidia.com/gpu": gpus}, "limits": {"nvidia.com/gpu": gpus}}
    if target.component == "trainer":
        container["image"] = target.new_image
        container["args"] = [
            *common,
            "--new-image",
            target.new_image,
            "--baseline",
            BASELINE,
            "--old-image",
            target.old_image,
            "--attempt",
            target.attempt,
        ]
        scratch = {"name": "canary", "mountPath": BASELINE_DIR}
        container["volumeMounts"] = [*container["volumeMounts"], scratch]
        old = {
            **container,
            "name": "score-old-trainer",
            "image": target.old_image,
            "args": [*common, "--new-image", target.old_image, "--score-only", BASELINE],
        }
        template["spec"]["initContainers"] = [*template["spec"].get("initContainers", []), old]
        template["spec"]["volumes"] = [*template["spec"]["volumes"], {"name": "canary", "emptyDir": {}}]
    else:
        container["args"] = [
            *common,
            "--new-image",
            target.new_image,
            "--old",
            engine_replica_url(job, target.old_replica),
            "--old-image",
            target.old_image,
            "--attempt",
            target.attempt,
        ]
        if target.prefill is not None:  # a disaggregated job: each side is a prefill → decode pair
            old_prefill, new_prefill = target.prefill
            container["args"] += [
                "--old-prefill",
                engine_replica_url(job, old_prefill, role=EngineRole.PREFILL),
                "--new-prefill",
                engine_replica_url(job, new_prefill, role=EngineRole.PREFILL),
            ]
    labels = {**meta.labels(job, meta.ROLE_UPGRADE_CANARY), LABEL_ATTEMPT: target.attempt}
    template["metadata"] = {"labels": labels}
    template["spec"]["restartPolicy"] = "Never"
    template["spec"]["automountServiceAccountToken"] = False
    metadata = meta.object_meta(job, meta.ROLE_UPGRADE_CANARY)
    metadata["labels"] = {**metadata.get("labels", {}), LABEL_ATTEMPT: target.attempt}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": metadata,
        "spec": {
            "backoffLimit": 1,
            "ttlSecondsAfterFinished": 3600,
            "template": template,
        },
    }
