"""Start the operator: kopf with our handlers and settings, standalone (no kopf peering).

One replica runs kopf directly. With leader election (``--leader-elect``, the chart's default with more
than one replica) every replica first waits for a coordination.k8s.io Lease (operator/leader.py) and
only its holder runs kopf; the others stand by and take over when it stops or loses the Lease.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from r3operator.operator.leader import LeaseConfig


def run(
    *,
    namespaces: Sequence[str] = (),
    all_namespaces: bool = False,
    liveness: str | None = "http://0.0.0.0:8080/healthz",
    kubeconfig: str | None = None,
    verbose: bool = False,
    lease: LeaseConfig | None = None,
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

    def operator(liveness_endpoint: str | None) -> Coroutine[Any, Any, None]:
        return kopf.operator(
            standalone=True,
            clusterwide=all_namespaces,
            namespaces=list(namespaces),
            liveness_endpoint=liveness_endpoint,
        )

    if lease is None:
        asyncio.run(operator(liveness or None))
        return
    # kopf's liveness endpoint would exist on the leader only; health.py serves both replicas.
    asyncio.run(_run_elected(lease, liveness, lambda: operator(None)))


async def _run_elected(
    lease: LeaseConfig, liveness: str | None, start_kopf: Callable[[], Coroutine[Any, Any, None]]
) -> None:
    import kopf

    from r3operator.operator import metrics
    from r3operator.operator.health import health_app, serve_health
    from r3operator.operator.kube import KubeClient
    from r3operator.operator.leader import LeaderElector, run_as_leader
    from r3operator.settings import operator_settings

    settings = kopf.OperatorSettings()
    info = kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(settings=settings)
    if info is None:
        raise RuntimeError("leader election: no in-cluster service account and no kubeconfig")
    client = KubeClient.from_connection_info(info)
    port = operator_settings().metrics_port
    if port:  # a standby is scraped as well: it reports r3operator_leader 0 and no RLJob series
        metrics.serve(port)
    metrics.LEADER.set(0)
    elector = LeaderElector(client, lease, on_leading=lambda leading: metrics.LEADER.set(1 if leading else 0))
    kopf_task: list[asyncio.Task[None]] = []

    async def operate() -> None:
        kopf_task.append(asyncio.ensure_future(start_kopf()))
        await kopf_task[0]

    health = (
        await serve_health(health_app(elector, lambda: bool(kopf_task) and not kopf_task[0].done()), liveness)
        if liveness
        else None
    )
    try:
        await run_as_leader(elector, operate)
    finally:
        if health is not None:
            await health.cleanup()
        await client.close()
