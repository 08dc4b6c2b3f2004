"""A live stack shared by the observability tests: real exporters (feed.py) scraped every second by a real
Prometheus (Debian 2.42 from `make tools`) that also evaluates the generated rules."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from r3operator.observability.prom import PrometheusServer, find_binary

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "charts/r3operator/files/rules/r3operator.rules.yaml"


def tool(name: str) -> str:
    path = find_binary(name) or (str(REPO / ".tools/bin" / name) if (REPO / ".tools/bin" / name).exists() else None)
    if path is None:
        pytest.skip(f"{name} not found: run `make tools` (Debian prometheus package)")
    return path


@pytest.fixture(scope="session")
def live() -> Iterator[tuple[PrometheusServer, object]]:
    from r3operator.observability.feed import SyntheticFeed

    binary = tool("prometheus")
    with SyntheticFeed(tick_seconds=0.25) as feed, PrometheusServer(feed.targets(), [RULES], binary=binary) as prom:
        up = prom.wait_for(f"count(up == 1) == {len(feed.targets())}", timeout=30)
        assert up, f"targets not up: {prom.active_targets()}"
        # Two scrapes per target, and rate() over [1m] needs two samples.
        prom.wait_for("count(count_over_time(up[1m]) >= 3) == count(up)", timeout=20)
        yield prom, feed
