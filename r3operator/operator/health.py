"""`/healthz` and `/readyz` of an operator replica run with leader election, leader or standby.

kopf's own liveness endpoint exists only once kopf runs, i.e. on the leader: a standby would fail its
liveness probe and be restarted forever. This server runs from the start in the same event loop, so a
blocked loop fails the probe as it would fail kopf's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from urllib.parse import urlparse

from aiohttp import web

from r3operator.operator.leader import LeaderElector


def health_app(elector: LeaderElector, kopf_running: Callable[[], bool]) -> web.Application:
    stale_after = 3 * elector.config.retry_period_s + elector.config.renew_deadline_s

    def alive() -> bool:
        if elector.leading:
            return kopf_running()
        return time.monotonic() - elector.last_contact < stale_after

    async def healthz(_: web.Request) -> web.Response:
        ok = alive()
        return web.Response(status=200 if ok else 500, text="ok\n" if ok else "stalled\n")

    async def readyz(_: web.Request) -> web.Response:
        # Ready once the Lease API answered: a standby counts, so a rolling update can proceed to the
        # next pod while the old leader still holds the Lease.
        ok = elector.last_contact > 0 and alive()
        role = "leader" if elector.leading else "standby"
        return web.Response(status=200 if ok else 503, text=f"{role}\n")

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    return app


async def serve_health(app: web.Application, endpoint: str) -> web.AppRunner:
    """Serve on `endpoint` (``http://HOST:PORT/…``; the path is ignored: both routes are served)."""
    url = urlparse(endpoint)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, url.hostname or "0.0.0.0", url.port or 8080).start()
    return runner
