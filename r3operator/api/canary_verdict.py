"""The upgrade canary's verdict on the wire: the canary container's termination message.

The canary Job's container (runtime/upgrade_canary.py) writes its verdict to ``TERMINATION_LOG``; the
kubelet copies it into the Pod's ``status.containerStatuses[].state.terminated.message`` and the operator
reads it from there (operator/upgrade_record.py). Only the kubelet writes a Pod's status, so the trainer
pods, which may patch their RLJob's status, cannot forge it.
"""

from __future__ import annotations

import json

from pydantic import ValidationError

from r3operator.api.v1alpha1 import UpgradeCanary

TERMINATION_LOG = "/dev/termination-log"
TERMINATION_MESSAGE_LIMIT = 4096
"""The kubelet keeps at most this many bytes of a container's termination message."""


def termination_message(verdict: UpgradeCanary) -> str:
    """The verdict as JSON that fits a termination message: the per-engine texts go first, then the
    message is shortened, so that what passed or failed and why always arrives."""
    data = verdict.model_dump(mode="json", by_alias=True, exclude_none=True)
    text = json.dumps(data, separators=(",", ":"))
    for side in ("old", "new"):
        if len(text.encode()) <= TERMINATION_MESSAGE_LIMIT:
            return text
        if isinstance(data.get(side), dict):
            data[side].pop("message", None)
            text = json.dumps(data, separators=(",", ":"))
    while len(text.encode()) > TERMINATION_MESSAGE_LIMIT and data["message"]:
        data["message"] = data["message"][: len(data["message"]) // 2]
        text = json.dumps(data, separators=(",", ":"))
    return text


def parse_verdict(message: str) -> UpgradeCanary | None:
    """The verdict in a termination message; None when it is not one."""
    try:
        return UpgradeCanary.model_validate_json(message)
    except ValidationError:
        return None
