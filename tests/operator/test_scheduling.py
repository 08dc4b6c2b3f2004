"""The scheduler's reasons, summarised per role for status (operator/scheduling.py)."""

from __future__ import annotations

from typing import Any

from r3operator.operator.scheduling import unschedulable_by_role


def _pod(role: str, *conditions: tuple[str, str, str, str], deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"labels": {"r3operator.io/role": role}}
    if deleting:
        meta["deletionTimestamp"] = "2026-11-23T00:00:00Z"
    return {
        "metadata": meta,
        "status": {"conditions": [{"type": t, "status": s, "reason": r, "message": m} for t, s, r, m in conditions]},
    }


GPU = ("PodScheduled", "False", "Unschedulable", "0/18 nodes are available: 16 Insufficient nvidia.com/gpu.")
TAINT = ("PodScheduled", "False", "Unschedulable", "0/18 nodes are available: 16 node(s) had untolerated taint.")


def test_unschedulable_pods_are_counted_per_role_with_the_most_common_message() -> None:
    pods = [_pod("engine", GPU), _pod("engine", GPU), _pod("engine", TAINT), _pod("trainer", TAINT)]
    assert unschedulable_by_role(pods) == {
        "engine": "3 pods: 0/18 nodes are available: 16 Insufficient nvidia.com/gpu.",
        "trainer": "1 pod: 0/18 nodes are available: 16 node(s) had untolerated taint.",
    }


def test_scheduled_pending_deleting_and_unlabelled_pods_are_not_reported() -> None:
    scheduled = ("PodScheduled", "True", "", "")
    gated = ("PodScheduled", "False", "SchedulingGated", "waiting for Kueue")
    pods = [
        _pod("engine", scheduled),
        _pod("engine", gated),
        _pod("engine", GPU, deleting=True),
        {
            "metadata": {"labels": {}},
            "status": {"conditions": [dict(zip(("type", "status", "reason", "message"), GPU, strict=True))]},
        },
    ]
    assert unschedulable_by_role(pods) == {}
