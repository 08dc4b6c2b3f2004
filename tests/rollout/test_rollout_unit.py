"""RolloutSample assembly: routes validated against the row-count rule, never truncated."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import pytest

from r3operator.rollout.client import build_sample, request_seed, write_samples
from r3operator.routing.sample import ROUTES_MISSING, RolloutSample
from r3operator.routing.store import RoutingStore


def _routes(rows: int, layers: int = 2, k: int = 2) -> np.ndarray:
    return (np.arange(rows * layers * k).reshape(rows, layers, k) % 8).astype(np.uint8)


def _npy_b64(arr: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, arr)
    return base64.b64encode(buf.getvalue()).decode()


def _sample(routed: object, *, prompt: int = 4, gen: int = 3, start: int = 0) -> RolloutSample:
    return build_sample(
        prompt_index=0,
        choice_index=1,
        prompt_token_ids=list(range(prompt)),
        token_ids=list(range(gen)),
        logprobs=[-0.5] * gen,
        routed_experts=routed,
        routed_experts_prompt_start=start,
        num_experts=8,
    )


@pytest.mark.parametrize("as_b64", [False, True])
def test_routes_with_the_expected_rows_are_kept(as_b64: bool) -> None:
    arr = np.stack([np.stack([np.array([0, 1]), np.array([2, 3])])] * 6).astype(np.uint8)  # 4 + 3 - 1 rows
    sample = _sample(_npy_b64(arr) if as_b64 else arr)
    assert sample.routes_status == "ok"
    assert sample.routes.shape == (6, 2, 2) and sample.routes.start == 0
    assert sample.logprobs.dtype == np.float32 and sample.sequence == (0, 1, 2, 3, 0, 1, 2)
    assert sample.sample_id == "p0-c1"


def test_wrong_row_count_is_invalid_not_truncated() -> None:
    sample = _sample(_routes(7))
    assert sample.routes is None and sample.routes_status == "invalid"
    assert "row" in sample.routes_error


def test_prompt_start_shifts_the_expected_rows() -> None:
    arr = np.tile(np.array([[0, 1], [2, 3]], dtype=np.uint8), (4, 1, 1))  # 4 + 3 - 1 - 2 rows
    sample = _sample(arr, start=2)
    assert sample.routes_status == "ok" and sample.routes.start == 2


def test_missing_routes_are_reported_as_missing() -> None:
    sample = _sample(None)
    assert sample.routes_status == "missing" and sample.routes_error == ROUTES_MISSING


def test_request_seeds_never_collide_across_prompts_and_children() -> None:
    seeds = {request_seed(7, i, 3) + j for i in range(5) for j in range(3)}
    assert len(seeds) == 15


def test_write_samples_skips_samples_without_routes(tmp_path: Path) -> None:
    ok = _sample(np.tile(np.array([[0, 1], [2, 3]], dtype=np.uint8), (6, 1, 1)))
    paths = write_samples(RoutingStore(tmp_path), [ok, _sample(None)], step=3, num_experts=8, policy_version=1)
    assert list(paths) == ["p0-c1"]
    record = RoutingStore(tmp_path).get(step=3, sample_id="p0-c1")
    assert np.array_equal(record.array(), np.tile(np.array([[0, 1], [2, 3]]), (6, 1, 1)))


def test_prompt_starts_one_per_prompt_each_inside_its_prompt() -> None:
    from r3operator.rollout.client import prompt_starts

    assert prompt_starts([[1, 2, 3], [1, 2]], 1) == [1, 1]
    assert prompt_starts([[1, 2, 3], [1, 2]], [2, 0]) == [2, 0]
    with pytest.raises(
        ValueError, match="routed_experts_prompt_start=2 must be in \\[0, 2\\), the length of prompts\\[1\\]"
    ):
        prompt_starts([[1, 2, 3], [1, 2]], [0, 2])
    with pytest.raises(ValueError, match="1 routed_experts_prompt_start values for 2 prompts"):
        prompt_starts([[1, 2, 3], [1, 2]], [0])


def test_http_requests_sample_the_full_softmax_whatever_the_models_generation_config() -> None:
    """vLLM's server takes top_k/top_p/min_p/repetition_penalty a request omits from the model's
    generation_config.json (Qwen3 ships top_k 20, top_p 0.95): each request must turn them off itself."""
    from r3operator.rollout.client import OpenAIHTTPClient

    client = OpenAIHTTPClient.__new__(OpenAIHTTPClient)
    client.model = "m"
    body = client.completion_body([1, 2], max_tokens=4, temperature=0.6, seed=0, n=1, start=0)
    assert (body["top_k"], body["top_p"], body["min_p"], body["repetition_penalty"]) == (-1, 1.0, 0.0, 1.0)
    assert body["temperature"] == 0.6


def test_http_rollout_keeps_every_request_of_a_batch_in_flight_at_once() -> None:
    """vLLM decodes together only the requests that have arrived: the server here answers no completion until
    all of a rollout's requests are in flight (a barrier of that many), so a client that holds requests back
    (8 at a time, as it once did) never gets an answer and fails instead of rolling out in small batches."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from r3operator.rollout.client import OpenAIHTTPClient
    from r3operator.wire.retry import Backoff, EngineUnavailableError

    prompts = [[1, 2, i] for i in range(32)]
    arrived = threading.Barrier(len(prompts), timeout=60)  # a loaded 2-core CI box starts 32 threads slowly

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _json(self, status: int, payload: object) -> None:
            raw = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            try:
                arrived.wait()
            except threading.BrokenBarrierError:
                self._json(503, {"error": "not every request of the rollout arrived"})
                return
            choice = {
                "index": 0,
                "prompt_token_ids": body["prompt"],
                "token_ids": [7],
                "logprobs": {"token_logprobs": [-0.5]},
                "finish_reason": "length",
            }
            self._json(200, {"choices": [choice]})

    class Server(ThreadingHTTPServer):
        # listen()'s backlog: the default 5 drops some of 32 simultaneous connects on a loaded box, and their
        # SYN retries (1, 2, 4 … s) can outlast the barrier.
        request_queue_size = 128

    server = Server(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = OpenAIHTTPClient(
            f"http://127.0.0.1:{server.server_address[1]}", model="m", num_experts=4, backoff=Backoff(attempts=1)
        )
        try:
            samples = client.generate(prompts, max_tokens=1, temperature=1.0, seed=0)
        except EngineUnavailableError as exc:
            pytest.fail(f"the client held requests back: {exc}")
    finally:
        server.shutdown()
        server.server_close()
    assert [s.prompt_token_ids for s in samples] == [tuple(p) for p in prompts]
