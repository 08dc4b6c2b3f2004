"""The trainer's identity: a ServiceAccount ``<job>-trainer`` and a RoleBinding ``<job>-trainer``.

The trainer driver merge-patches ``status.progress`` of its RLJob from inside the RayJob pods
(``runtime.metrics.StatusPusher``). The namespace's default ServiceAccount cannot, so every RLJob gets
its own ServiceAccount, bound in its namespace to the chart's ClusterRole ``<release>-trainer`` (only
``get`` on ``rljobs`` and ``get``/``patch`` on ``rljobs/status``). The ClusterRole's name is an
operator setting (``R3OPERATOR_TRAINER_CLUSTER_ROLE``) passed in, so these builders stay pure.
"""

from __future__ import annotations

from typing import Any

from r3operator.api.v1alpha1 import RLJob
from r3operator.operator import meta
from r3operator.settings import DEFAULT_TRAINER_CLUSTER_ROLE

RBAC_API_VERSION = "rbac.authorization.k8s.io/v1"


def trainer_service_account_name(job: RLJob) -> str:
    return meta.child_name(job, meta.ROLE_TRAINER)


def build_trainer_service_account(job: RLJob) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": meta.object_meta(job, meta.ROLE_TRAINER),
    }


def build_trainer_role_binding(job: RLJob, cluster_role: str = DEFAULT_TRAINER_CLUSTER_ROLE) -> dict[str, Any]:
    return {
        "apiVersion": RBAC_API_VERSION,
        "kind": "RoleBinding",
        "metadata": meta.object_meta(job, meta.ROLE_TRAINER),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": cluster_role},
        "subjects": [
            {
                "kind": "ServiceAccount",
                "name": trainer_service_account_name(job),
                "namespace": job.metadata.namespace or "default",
            }
        ],
    }
