"""What the offline commands (validate, explain, render) are told about the cluster they cannot see.

A multi-pod engine replica is a LeaderWorkerSet, which the cluster must serve. Like ``helm template``
with ``--api-versions``, the commands assume it by default (render prints the LeaderWorkerSet; validate
and explain add the warning ENGINE-LWS-ASSUMED), and take a flag to say what the cluster has: with
``--no-leaderworkerset`` such a replica is refused by rule ENGINE-LWS, as the operator refuses it.
"""

from __future__ import annotations

from typing import Annotated

import typer

from r3operator.api.context import RuleContext
from r3operator.api.v1alpha1 import RLJobSpec

LeaderWorkerSetOption = Annotated[
    bool | None,
    typer.Option(
        "--leaderworkerset/--no-leaderworkerset",
        help="The cluster serves LeaderWorkerSet (leaderworkersets.leaderworkerset.x-k8s.io), or not. Default: "
        "not known; a multi-pod engine replica is rendered as one, with warning ENGINE-LWS-ASSUMED.",
    ),
]


def rule_context(spec: RLJobSpec, leader_worker_set: bool | None) -> RuleContext:
    return RuleContext.for_spec(spec, leader_worker_set=leader_worker_set)
