"""Retries and backoff of engine calls, against a fake vLLM server on 127.0.0.1 that fails on request.

Every wait goes through an injected sleep that records instead of sleeping, so the delays are asserted
exactly (jitter 0) and no test depends on the clock.
"""

from __future__ import annotations

import random
import urllib.error
from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_vllm_server import FakeVLLMServer

from r3operator.wire.retry import Backoff, EngineUnavailableError, http_transient, retry_call

pytest.importorskip("aiohttp")


@pytest.fixture
def server() -> Iterator[FakeVLLMServer]:
    with FakeVLLMServer() as fake:
        yield fake


def _backoff(slept: list[float], attempts: int = 4) -> Backoff:
    return Backoff(attempts=attempts, base_s=1.0, cap_s=8.0, jitter=0.0, sleep=slept.append)


# ------------------------------------------------------------------------------------------ the policy


def test_delays_double_up_to_the_cap_and_jitter_stays_within_its_fraction() -> None:
    plain = Backoff(base_s=0.5, cap_s=4.0, jitter=0.0)
    assert [plain.delay(i) for i in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    jittered = Backoff(base_s=0.5, cap_s=4.0, jitter=0.5, rng=random.Random(7))
    delays = [jittered.delay(i) for i in range(40)]
    ceilings = [min(4.0, 0.5 * 2**i) for i in range(40)]
    assert all(c / 2 <= d <= c for d, c in zip(delays, ceilings, strict=True))
    assert len({round(d / c, 6) for d, c in zip(delays, ceilings, strict=True)}) > 30  # drawn, not fixed


def test_retries_end_in_one_error_naming_the_call_the_tries_and_the_last_error() -> None:
    slept: list[float] = []

    def refused() -> None:
        raise ConnectionRefusedError(111, "Connection refused")

    with pytest.raises(EngineUnavailableError) as info:
        retry_call(
            refused, what="POST http://engine-0/v1/completions", backoff=_backoff(slept, 3), transient=http_transient
        )
    assert str(info.value) == (
        "POST http://engine-0/v1/completions failed 3 times over 3.0 s of backoff; last error: "
        "ConnectionRefusedError: [Errno 111] Connection refused"
    )
    assert slept == [1.0, 2.0]


def test_a_non_transient_error_is_raised_at_once() -> None:
    slept: list[float] = []
    calls = []

    def bad_request() -> None:
        calls.append(1)
        raise urllib.error.HTTPError("http://e/v1/completions", 400, "Bad Request", None, None)  # type: ignore[arg-type]

    with pytest.raises(urllib.error.HTTPError):
        retry_call(bad_request, what="x", backoff=_backoff(slept), transient=http_transient)
    assert calls == [1] and slept == []


# ------------------------------------------------------------------------------------ the HTTP client


def _client(server: FakeVLLMServer, slept: list[float], **kwargs: object) -> object:
    from r3operator.rollout.client import OpenAIHTTPClient

    return OpenAIHTTPClient(server.url, num_experts=32, backoff=_backoff(slept), **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("failure", [503, 502, 429, "drop"])
def test_rollout_survives_transient_failures(server: FakeVLLMServer, failure: str | int) -> None:
    slept: list[float] = []
    client = _client(server, slept)
    server.script["/v1/completions"].extend([failure, failure])
    samples = client.generate([[1, 5, 6]], max_tokens=3, temperature=1.0, seed=3, n=2)  # type: ignore[attr-defined]
    assert [s.routes_status for s in samples] == ["ok", "ok"] and len(samples[0].token_ids) == 3
    assert server.log.count("/v1/completions") == 3
    assert slept == [1.0, 2.0]


def test_a_dead_engine_ends_in_a_clear_error(server: FakeVLLMServer) -> None:
    slept: list[float] = []
    client = _client(server, slept)
    server.script["/v1/completions"].extend([503] * 10)
    with pytest.raises(
        EngineUnavailableError,
        match=rf"POST {server.url}/v1/completions failed 4 times over 7.0 s "
        r"of backoff; last error: HTTPError: HTTP Error 503",
    ):
        client.generate([[1, 5, 6]], max_tokens=3, temperature=1.0, seed=3)  # type: ignore[attr-defined]
    assert slept == [1.0, 2.0, 4.0]


def test_a_hanging_engine_times_out_and_is_retried(server: FakeVLLMServer) -> None:
    slept: list[float] = []
    client = _client(server, slept, timeout_s=0.2)
    server.script["/v1/completions"].extend(["hang", "hang"])
    samples = client.generate([[1, 5, 6]], max_tokens=2, temperature=1.0, seed=3)  # type: ignore[attr-defined]
    assert len(samples) == 1 and server.log.count("/v1/completions") == 3 and slept == [1.0, 2.0]


def test_a_refused_request_is_not_retried(server: FakeVLLMServer) -> None:
    slept: list[float] = []
    client = _client(server, slept)
    server.script["/v1/completions"].append(400)
    with pytest.raises(RuntimeError, match=r"HTTP 400: .*injected HTTP 400"):
        client.generate([[1, 5, 6]], max_tokens=2, temperature=1.0, seed=3)  # type: ignore[attr-defined]
    assert server.log.count("/v1/completions") == 1 and slept == []


# ------------------------------------------------------------------------ HTTPEngine + the supervisor


def _engine(server: FakeVLLMServer, tmp_path: Path, slept: list[float]) -> object:
    from r3operator.rollout.engines import HTTPEngine

    return HTTPEngine(
        server.url,
        staging_dir=tmp_path / "staging",
        num_experts=32,
        backoff=_backoff(slept),
        ready=_backoff(slept, attempts=10),
    )


def _chunks() -> list[object]:
    import torch

    from r3operator.wire.weights import pack_chunk

    return [pack_chunk([(f"layer{i}.weight", torch.full((4, 4), float(i)))]) for i in range(3)]


def _supervisor(engine: object, slept: list[float], canaried: list[list[str]]) -> object:
    from r3operator.rollout.engines import EngineGroup
    from r3operator.weightsync.faults import EngineSupervisor

    def canary(engines: list[object]) -> None:
        canaried.append([e.name for e in engines])  # type: ignore[attr-defined]

    group = EngineGroup([engine])  # type: ignore[list-item]
    return EngineSupervisor(group, chunks=_chunks, backoff=_backoff(slept), canary=canary, nonce="run1")


def test_engine_start_waits_for_health(server: FakeVLLMServer, tmp_path: Path) -> None:
    slept: list[float] = []
    server.script["/health"].extend([503, "drop", 503])
    _engine(server, tmp_path, slept)
    assert server.log[:4] == ["/health"] * 4 and slept == [1.0, 2.0, 4.0]


def test_sync_failing_half_way_is_aborted_not_finished_then_repeated(server: FakeVLLMServer, tmp_path: Path) -> None:
    slept: list[float] = []
    canaried: list[list[str]] = []
    engine = _engine(server, tmp_path, slept)
    supervisor = _supervisor(engine, slept, canaried)
    server.script["/collective_rpc:r3_load_packed_file"].extend(["ok", 500])
    server.log.clear()
    supervisor.sync(1)  # type: ignore[attr-defined]
    rpcs = [e.removeprefix("/collective_rpc:") for e in server.log if e.startswith("/collective_rpc")]
    assert rpcs == [
        "r3_abort_weight_update",  # every attempt first closes any bracket the engine may still hold
        "r3_begin_weight_update",
        "r3_load_packed_file",
        "r3_load_packed_file",  # the 2nd chunk fails
        "r3_abort_weight_update",  # never r3_finish_weight_update on a partial load
        "r3_abort_weight_update",
        "r3_begin_weight_update",
        "r3_load_packed_file",
        "r3_load_packed_file",
        "r3_load_packed_file",
        "r3_finish_weight_update",
    ]
    assert server.tag == "run1:1" and not server.bracket_open
    assert not list((tmp_path / "staging").iterdir())  # staged chunks are removed, failed attempt included


def test_engine_restarted_mid_rollout_is_resynced_and_canaried_before_the_rollout_is_repeated(
    server: FakeVLLMServer, tmp_path: Path
) -> None:
    slept: list[float] = []
    canaried: list[list[str]] = []
    engine = _engine(server, tmp_path, slept)
    supervisor = _supervisor(engine, slept, canaried)
    supervisor.sync(1)  # type: ignore[attr-defined]
    restarts = []

    def restart_once(fake: FakeVLLMServer) -> None:  # the pod restarts while the rollout runs
        if not restarts:
            restarts.append(1)
            fake.restart()

    server.on_completion = restart_once
    server.log.clear()
    samples = supervisor.on_policy(  # type: ignore[attr-defined]
        lambda: engine.generate([[1, 5, 6]], max_tokens=2, temperature=1.0, seed=3, n=1),  # type: ignore[attr-defined]
        what="step 1 rollout",
    )
    events = [e.removeprefix("/collective_rpc:") for e in server.log if e != "/reset_prefix_cache"]
    assert events == [
        "r3_policy_tag",
        "/v1/completions",  # served, but by an engine that restarted meanwhile:
        "r3_policy_tag",  # ... found after the call, so its result is discarded
        "r3_policy_tag",
        "/health",
        "r3_abort_weight_update",
        "r3_begin_weight_update",
        "r3_load_packed_file",
        "r3_load_packed_file",
        "r3_load_packed_file",
        "r3_finish_weight_update",  # re-synced with the current weights
        "/v1/completions",
        "r3_policy_tag",  # the rollout again, on the current policy
    ]
    assert canaried == [[server.url]]  # the re-synced engine passed the canary before its rollout
    assert server.tag == "run1:1" and len(samples) == 1
