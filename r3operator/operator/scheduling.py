"""Pods the scheduler cannot place, summarised per role for status.

A job that asks for more GPUs than the cluster has (or whose pods do not tolerate the GPU nodes' taints)
otherwise shows only "0/4 engine replicas ready": the scheduler's own reason is what tells the user why.
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
    summary = {}
    for role, counts in messages.items():
        message, _ = counts.most_common(1)[0]
        total = sum(counts.values())
        summary[role] = f"{total} pod{'s' if total != 1 else ''}: {message}"[:512]
    return summary
