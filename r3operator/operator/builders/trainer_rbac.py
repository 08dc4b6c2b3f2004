"""The trainer's identity: ServiceAccount, Role and RoleBinding, all named ``<job>-trainer``.

The trainer driver merge-patches ``status.progress`` of its RLJob from inside the RayJob pods
(``runtime.metrics.StatusPusher``). Those pods run the job author's ``trainer.image``, so what they
may do is scoped to their own RLJob by name: a Role per RLJob whose rules carry
``resourceNames: [<job>]`` (``get`` on the RLJob, ``get``/``patch`` on its ``/status``). One job's
pods cannot read or write another job's RLJob, which a namespace-wide grant would allow.

RBAC cannot narrow a status patch to ``status.progress``; the operator therefore never acts on
what the status says (terminal state comes from the RayJob it observes, see ``lifecycle.py``).
"""

from __future__ import annotations

from typing import Any

from r3operator.api.v1alpha1 import GROUP, PLURAL, RLJob
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
    only_this_job = [job.metadata.name]
    return {
        "apiVersion": RBAC_API_VERSION,
        "kind": "Role",
        "metadata": meta.object_meta(job, meta.ROLE_TRAINER),
        "rules": [
            {"apiGroups": [GROUP], "resources": [PLURAL], "resourceNames": only_this_job, "verbs": ["get"]},
            {
                "apiGroups": [GROUP],
                "resources": [f"{PLURAL}/status"],
                "resourceNames": only_this_job,
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
