"""The trainer's identity: ServiceAccount, Role and RoleBinding, all named ``<job>-trainer``.

The trainer driver reports its progress into the ConfigMap ``<job>-progress`` (``runtime.metrics.StatusPusher``),
which the operator creates and copies, checked, into the RLJob's ``status.progress`` (operator/progress.py).
Those pods run the job author's ``trainer.image``, so the Role grants them exactly ``get``/``patch`` on that one
ConfigMap (``resourceNames``): nothing on any RLJob or its status, nothing of another job. The status is written
by the operator alone.
"""

from __future__ import annotations

from typing import Any

from r3operator.api.v1alpha1 import RLJob
from r3operator.operator import meta
from r3operator.operator.builders.overrides import role_template

RBAC_API_VERSION = "rbac.authorization.k8s.io/v1"
RBAC_GROUP = "rbac.authorization.k8s.io"


def chosen_service_account(job: RLJob) -> str | None:
    """The trainer pods' ServiceAccount named by a pod template (trainer's, else spec.podTemplate), if any."""
    template = role_template(job, meta.ROLE_TRAINER)
    return template.service_account_name if template is not None else None


def trainer_service_account_name(job: RLJob) -> str:
    """The ServiceAccount the trainer pods run as, and the one the Role is bound to: a chosen one keeps
    exactly the narrow grant of <job>-trainer (the Role is the same), it just runs under the user's name."""
    return chosen_service_account(job) or meta.child_name(job, meta.ROLE_TRAINER)


def build_trainer_service_account(job: RLJob) -> dict[str, Any]:
    """<job>-trainer; not created when a pod template names the trainer's ServiceAccount."""
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": meta.object_meta(job, meta.ROLE_TRAINER),
    }


def build_trainer_role(job: RLJob) -> dict[str, Any]:
    only_its_report = [meta.child_name(job, meta.ROLE_PROGRESS)]
    return {
        "apiVersion": RBAC_API_VERSION,
        "kind": "Role",
        "metadata": meta.object_meta(job, meta.ROLE_TRAINER),
        "rules": [
            {
                "apiGroups": [""],
                "resources": ["configmaps"],
                "resourceNames": only_its_report,
                "verbs": ["get", "patch"],
            },
        ],
    }


def build_trainer_role_binding(job: RLJob) -> dict[str, Any]:
    return {
        "apiVersion": RBAC_API_VERSION,
        "kind": "RoleBinding",
        "metadata": meta.object_meta(job, meta.ROLE_TRAINER),
        "roleRef": {"apiGroup": RBAC_GROUP, "kind": "Role", "name": meta.child_name(job, meta.ROLE_TRAINER)},
        "subjects": [
            {
                "kind": "ServiceAccount",
                "name": trainer_service_account_name(job),
                "namespace": job.metadata.namespace or "default",
            }
        ],
    }
