"""Pods that cannot start, summarised per role for status: the scheduler cannot place them, or the kubelet
cannot build a container's environment.

A job that asks for more GPUs than the cluster has (or whose pods do not tolerate the GPU nodes' taints)
otherwise shows only "0/4 engine replicas ready": the scheduler's own reason is what tells the user why.
Likewise a Secret or ConfigMap an env var names that is missing, or lacks the key (the kubelet's
CreateContainerConfigError: ``secret "hf-token" not found``, ``couldn't find key token in Secret ns/hf``):
where the operator may not read Secrets this is how a missing one is reported (operator/references.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

from r3operator.operator import meta


def unschedulable_by_role(pods: Iterable[dict[str, Any]]) -> dict[str, str]:
    """Role -> "<n> pod(s): <the scheduler's message>" for pods with PodScheduled=False/Unschedulable.

    The most common message per role is kept (pods of one role fail for one reason as a rule)."""
    messages: dict[str, Counter[str]] = {}
    for pod in pods:
        if (pod.get("metadata") or {}).get("deletionTimestamp"):
            continue
        role = ((pod.get("metadata") or {}).get("labels") or {}).get(meta.LABEL_ROLE)
        for cond in (pod.get("status") or {}).get("conditions") or []:
            unschedulable = (cond.get("type"), cond.get("status"), cond.get("reason")) == (
                "PodScheduled",
                "False",
                "Unschedulable",
            )
            if unschedulable and role:
                messages.setdefault(role, Counter())[str(cond.get("message") or "no reason given")] += 1
    return _summary(messages)


CONFIG_ERROR = "CreateContainerConfigError"


def config_errors_by_role(pods: Iterable[dict[str, Any]]) -> dict[str, str]:
    """Role -> "<n> pod(s): <the kubelet's message>" for pods with a container (init containers too) waiting
    in CreateContainerConfigError; the message names the Secret or ConfigMap and the key."""
    messages: dict[str, Counter[str]] = {}
    for pod in pods:
        if (pod.get("metadata") or {}).get("deletionTimestamp"):
            continue
        role = ((pod.get("metadata") or {}).get("labels") or {}).get(meta.LABEL_ROLE)
        status = pod.get("status") or {}
        for container in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
            waiting = (container.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") == CONFIG_ERROR and role:
                message = f"container {container.get('name')}: {waiting.get('message') or CONFIG_ERROR}"
                messages.setdefault(role, Counter())[message] += 1
                break  # one per pod: the first container that cannot start is the one the kubelet is stuck on
    return _summary(messages)


def _summary(messages: dict[str, Counter[str]]) -> dict[str, str]:
    summary = {}
    for role, counts in messages.items():
        message, _ = counts.most_common(1)[0]
        total = sum(counts.values())
        summary[role] = f"{total} pod{'s' if total != 1 else ''}: {message}"[:512]
    return summary
