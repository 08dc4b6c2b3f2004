"""securityContext defaults for engine and trainer pods: the Pod Security ``restricted`` level.

``restricted`` wants a non-root user, no privilege escalation, every capability dropped and the
runtime's default seccomp profile. The user ids are those of the project images
(images/engine: 1001, images/trainer: 1000), set explicitly so that an image built ``USER root``
still runs as a non-root user instead of being refused by the kubelet; ``fsGroup`` makes the
routing volume writable for that user.
"""

from __future__ import annotations

from typing import Any

ENGINE_UID = 1001
TRAINER_UID = 1000


def pod_security_context(uid: int) -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": uid,
        "runAsGroup": uid,
        "fsGroup": uid,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
