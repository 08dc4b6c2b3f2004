"""The leader's Lease renewal against the real API server when every request is slow: a round that takes
longer than the retry period but well within the renew deadline keeps the Lease (client-go's renew loop
allows a round the rest of the deadline); the leader exits only when the deadline passes unrenewed."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from operator_harness import Cluster

from r3operator.operator.leader import LEASE, LeaderElector, LeaseConfig

NS = "rl-lease"
SLOW_S = 0.8
"""Each request's added delay: a GET + PUT round takes 1.6 s, over three retry periods."""


def test_a_renewal_slower_than_the_retry_period_keeps_the_lease(cluster: Cluster) -> None:
    cluster.namespace(NS)
    config = LeaseConfig(
        namespace=NS,
        name="slow-renewals",
        identity="slow-leader",
        lease_duration_s=8.0,
        renew_deadline_s=5.0,
        retry_period_s=0.5,
    )

    async def scenario() -> tuple[list[float], dict[str, Any], dict[str, Any], bool]:
        client, reader = cluster.client(), cluster.client()
        exits: list[float] = []
        elector = LeaderElector(client, config, exit_on_loss=lambda: exits.append(time.monotonic()))
        try:
            await elector.acquire()
            before = await reader.get(LEASE, NS, config.name)
            real_request = client._request

            async def slow(*args: Any, **kwargs: Any) -> Any:
                await asyncio.sleep(SLOW_S)
                return await real_request(*args, **kwargs)

            client._request = slow  # type: ignore[method-assign]
            keeper = asyncio.create_task(elector.keep())
            await asyncio.sleep(2.5 * config.renew_deadline_s)
            keeper.cancel()
            await asyncio.gather(keeper, return_exceptions=True)
            after = await reader.get(LEASE, NS, config.name)
            return exits, before or {}, after or {}, elector.leading
        finally:
            await client.close()
            await reader.close()

    exits, before, after, leading = asyncio.run(scenario())
    assert exits == [] and leading, "the leader gave up a Lease it kept renewing"
    assert after["spec"]["holderIdentity"] == "slow-leader"
    assert after["spec"]["renewTime"] > before["spec"]["renewTime"]
