"""operator/kube.py's client against a local HTTP server: how many requests it keeps in flight at once."""

from __future__ import annotations

import asyncio

from aiohttp import web

from r3operator.operator.kube import KINDS, KubeClient


def test_at_most_64_requests_are_in_flight_and_the_rest_wait_for_a_connection_without_failing():
    seen = {"now": 0, "most": 0}

    async def handler(request: web.Request) -> web.Response:
        seen["now"] += 1
        seen["most"] = max(seen["most"], seen["now"])
        await asyncio.sleep(0.05)
        seen["now"] -= 1
        return web.json_response({"kind": "ConfigMap", "metadata": {"name": request.match_info["name"]}})

    async def scenario() -> None:
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/rl/configmaps/{name}", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        client = KubeClient(f"http://127.0.0.1:{port}")
        try:
            found = await asyncio.gather(*(client.get(KINDS["ConfigMap"], "rl", f"c{i}") for i in range(200)))
        finally:
            await client.close()
            await runner.cleanup()
        assert [f["metadata"]["name"] for f in found if f] == [f"c{i}" for i in range(200)]

    asyncio.run(scenario())
    assert 32 <= seen["most"] <= 64, seen
