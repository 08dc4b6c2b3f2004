"""Operator settings from the environment (R3OPERATOR_*), read once at import of the handlers.

Every variable the operator reads is declared here with its default and meaning.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from r3operator.operator.builders.trainer_rbac import DEFAULT_TRAINER_CLUSTER_ROLE
from r3operator.operator.canary import DEFAULT_CANARY_URL


def _float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not a number") from None


@dataclass(frozen=True)  # no slots: from_env reads the class-level defaults
class OperatorConfig:
    resync_s: float = 10.0
    """R3OPERATOR_RESYNC_SECONDS: the level-based timer interval per RLJob."""
    idle_s: float = 5.0
    """R3OPERATOR_IDLE_SECONDS: the timer waits until the RLJob was unchanged this long."""
    discovery_ttl_s: float = 15.0
    """R3OPERATOR_DISCOVERY_TTL_SECONDS: cache of 'is KubeRay / the PodMonitor CRD installed'."""
    watch_server_timeout_s: int = 600
    """R3OPERATOR_WATCH_SERVER_TIMEOUT: server-side watch timeout (kopf watches can hang silently). Whole
    seconds: kube-apiserver parses `timeoutSeconds` as an integer and refuses `600.0` with a 400."""
    watch_client_timeout_s: float = 660.0
    """R3OPERATOR_WATCH_CLIENT_TIMEOUT: client-side watch timeout, a bit above the server's."""
    metrics_port: int = 9090
    """R3OPERATOR_METRICS_PORT: prometheus-client port; 0 disables the server."""
    canary: bool = True
    """R3OPERATOR_CANARY: 0 disables the R3 routed-experts canary."""
    canary_url: str = DEFAULT_CANARY_URL
    """R3OPERATOR_CANARY_URL: where the canary goes ({service}, {namespace}, {port}, {name})."""
    trainer_cluster_role: str = DEFAULT_TRAINER_CLUSTER_ROLE
    """R3OPERATOR_TRAINER_CLUSTERROLE: the ClusterRole bound to each RLJob's trainer ServiceAccount."""

    @classmethod
    def from_env(cls) -> OperatorConfig:
        return cls(
            resync_s=_float("R3OPERATOR_RESYNC_SECONDS", cls.resync_s),
            idle_s=_float("R3OPERATOR_IDLE_SECONDS", cls.idle_s),
            discovery_ttl_s=_float("R3OPERATOR_DISCOVERY_TTL_SECONDS", cls.discovery_ttl_s),
            watch_server_timeout_s=int(_float("R3OPERATOR_WATCH_SERVER_TIMEOUT", cls.watch_server_timeout_s)),
            watch_client_timeout_s=_float("R3OPERATOR_WATCH_CLIENT_TIMEOUT", cls.watch_client_timeout_s),
            metrics_port=int(_float("R3OPERATOR_METRICS_PORT", cls.metrics_port)),
            canary=os.environ.get("R3OPERATOR_CANARY", "1") not in ("0", "false", "False"),
            canary_url=os.environ.get("R3OPERATOR_CANARY_URL") or cls.canary_url,
            trainer_cluster_role=os.environ.get("R3OPERATOR_TRAINER_CLUSTERROLE") or cls.trainer_cluster_role,
        )
