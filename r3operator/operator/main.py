"""Start the operator: kopf with our handlers and settings; standalone, single replica.

kopf has no Lease-based leader election and its peering freezes equal-priority replicas, so the
operator runs as ONE replica (Deployment ``strategy: Recreate``) in standalone mode (no peering).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence


def run(
    *,
    namespaces: Sequence[str] = (),
    all_namespaces: bool = False,
    liveness: str | None = "http://0.0.0.0:8080/healthz",
    kubeconfig: str | None = None,
    verbose: bool = False,
) -> None:
    """Blocks until the operator stops (SIGINT/SIGTERM). In-cluster when a service account is mounted."""
    import kopf

    if kubeconfig:
        os.environ["KUBECONFIG"] = kubeconfig
    if not namespaces and not all_namespaces:
        raise ValueError("pass --namespace NS (repeatable) or --all-namespaces")
    kopf.configure(verbose=verbose, log_prefix=True)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    from r3operator.operator import handlers  # noqa: F401  (registers the handlers)

    asyncio.run(
        kopf.operator(
            standalone=True,
            clusterwide=all_namespaces,
            namespaces=list(namespaces),
            liveness_endpoint=liveness or None,
        )
    )
