"""Child names of an RLJob and the name limits they impose: one table, read by the operator's
builders (``operator/meta.py``) and by the CRD's root CEL rule (``api/crd.py``).

Every child is named ``<job>-<suffix>``. A child's name must fit the tightest limit of its kind, so
the longest RLJob name is the minimum over the children of ``limit - len("-<suffix>")``. The CRD
refuses longer names at admission, before any child exists.
"""

from __future__ import annotations

from dataclasses import dataclass

DNS1035_LABEL_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
"""A Service name (and so the engine Service ``<job>-engine``) must be a DNS-1035 label: it starts
with a letter. The RLJob name prefixes every child, so it must start with a letter too."""

DNS_LABEL_MAX = 63
DNS_SUBDOMAIN_MAX = 253
KUBERAY_RAYJOB_NAME_MAX = 47
"""KubeRay refuses longer RayJob names: it derives the RayCluster name and the head/worker pod names
from it, each within the 63-character label limit."""
REVISION_HASH_SUFFIX = 11
"""The StatefulSet controller labels each pod ``controller-revision-hash: <statefulset>-<hash>``, a
label value (≤ 63) with a hash of up to 10 characters and a dash; the pod names
``<statefulset>-<ordinal>`` are shorter than that label whenever the ordinal has fewer than 11 digits."""


@dataclass(frozen=True, slots=True)
class ChildName:
    role: str
    suffix: str
    limit: int
    """The longest name the tightest of this child's kinds accepts."""
    why: str


ROLE_STORAGE = "routing-storage"
ROLE_CONFIG = "config"
ROLE_ENGINE = "engine"
ROLE_PREFILL = "prefill"
"""A disaggregated job's prefill engines (api/disaggregation.py); its decode engines keep ROLE_ENGINE."""
ROLE_TRAINER = "trainer"
ROLE_METRICS = "metrics"
ROLE_UPGRADE_CANARY = "upgrade-canary"
JOB_POD_SUFFIX = 6
"""The Job controller names its pods ``<job>-<5 random characters>``, a DNS label."""
ROLE_WORKLOAD = "workload"
ROLE_MODEL_CACHE = "model-cache"
ROLE_MODEL_FETCH = "model-fetch"
ROLE_PROGRESS = "progress"

CHILD_NAMES: tuple[ChildName, ...] = (
    ChildName(ROLE_STORAGE, "routing", DNS_SUBDOMAIN_MAX, "PersistentVolumeClaim"),
    ChildName(ROLE_CONFIG, "config", DNS_SUBDOMAIN_MAX, "ConfigMap"),
    ChildName(
        ROLE_ENGINE,
        "engine",
        DNS_LABEL_MAX - REVISION_HASH_SUFFIX,
        "StatefulSet (controller-revision-hash label) and headless Service (DNS-1035 label)",
    ),
    ChildName(
        ROLE_PREFILL,
        "prefill",
        DNS_LABEL_MAX - REVISION_HASH_SUFFIX,
        "prefill engines' StatefulSet and headless Service (inference.disaggregation)",
    ),
    ChildName(ROLE_TRAINER, "trainer", KUBERAY_RAYJOB_NAME_MAX, "RayJob (KubeRay), ServiceAccount, Role, RoleBinding"),
    ChildName(ROLE_METRICS, "metrics", DNS_SUBDOMAIN_MAX, "PodMonitor"),
    ChildName(
        ROLE_UPGRADE_CANARY,
        "upgrade-canary",
        DNS_LABEL_MAX - JOB_POD_SUFFIX,
        "Job of the engine-upgrade canary (its pods are <job>-<5 characters>)",
    ),
    ChildName(ROLE_WORKLOAD, "workload", DNS_SUBDOMAIN_MAX, "Kueue Workload"),
    ChildName(ROLE_MODEL_CACHE, "model-cache", DNS_SUBDOMAIN_MAX, "PersistentVolumeClaim"),
    ChildName(
        ROLE_MODEL_FETCH,
        "model-fetch",
        DNS_LABEL_MAX - JOB_POD_SUFFIX,
        "Job that fills the model cache (its pods are <job>-<5 characters>)",
    ),
    ChildName(ROLE_PROGRESS, "progress", DNS_SUBDOMAIN_MAX, "ConfigMap the trainer reports its progress in"),
)
SUFFIXES: dict[str, str] = {c.role: c.suffix for c in CHILD_NAMES}

RESERVED_NAME_PREFIX = "kube-"
"""Kubernetes reserves ``kube-`` for its own namespaces and components: an RLJob ``kube-system`` would make a
ServiceAccount, Role and RoleBinding ``kube-system-trainer`` that read as the cluster's own."""

MANAGED_IDENTITY_SUFFIX = "-" + SUFFIXES[ROLE_TRAINER]
"""Every ServiceAccount the operator manages is ``<job>-trainer`` (operator/builders/trainer_rbac.py): a pod
template that named one would run its pods with another job's identity."""


def child_name(job_name: str, role: str) -> str:
    return f"{job_name}-{SUFFIXES[role]}"


def max_job_name_length() -> int:
    return min(c.limit - len(c.suffix) - 1 for c in CHILD_NAMES)


MAX_JOB_NAME_LENGTH = max_job_name_length()
