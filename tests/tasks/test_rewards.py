"""The declared rewards of a dataset task: exact-match, math, a user function, and an HTTP endpoint (a real
HTTP server started in the test, answering, failing and too slow)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from r3operator.api.v1alpha1 import TaskSpec
from r3operator.tasks.http_reward import HTTPReward
from r3operator.tasks.rewards import (
    ExactMatchReward,
    FunctionReward,
    MathReward,
    RewardError,
    RewardInput,
    build_reward,
)
from r3operator.wire.retry import Backoff


def _input(completion: str, answer: str, n: int = 0, **metadata: Any) -> RewardInput:
    return RewardInput(
        sample_id=f"p0-c{n}",
        prompt="what is 3 plus 4 ?",
        completion=completion,
        answer=answer,
        metadata={"id": "row-0", **metadata},
    )


def test_exact_match_collapses_whitespace_only() -> None:
    inputs = [_input(" 7 ", "7"), _input("seven", "7"), _input("the  answer", "the answer"), _input("7.", "7")]
    assert ExactMatchReward().score(inputs) == [1.0, 0.0, 1.0, 0.0]


def test_math_reward_reads_final_answers() -> None:
    inputs = [_input(r"so \boxed{7}", "7"), _input("3 + 4 = 7", "#### 7"), _input("3 + 4 = 8", "7")]
    assert MathReward().score(inputs) == [1.0, 1.0, 0.0]


# ------------------------------------------------------------------------------------- function


@pytest.fixture
def reward_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A user's reward module on sys.path, as it would be installed in the trainer image."""
    package = tmp_path / "my_rewards"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "score.py").write_text(
        "def judge(prompt, completion, answer, metadata):\n"
        "    return 0.5 * (completion.strip() == answer) + 0.5 * (metadata['id'] == 'row-0' and 'plus' in prompt)\n"
        "def broken(prompt, completion, answer, metadata):\n"
        "    return float('nan') if completion else 'high'\n"
        "NOT_CALLABLE = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_rewards.score"


def test_function_reward_gets_prompt_completion_answer_metadata(reward_module: str) -> None:
    reward = build_reward(
        TaskSpec(name="dataset", dataset_path="/d.jsonl", reward="function", reward_function=f"{reward_module}:judge")
    )
    assert reward.score([_input("7", "7"), _input("8", "7")]) == [1.0, 0.5]


def test_function_reward_refuses_what_is_not_a_number(reward_module: str) -> None:
    reward = FunctionReward(f"{reward_module}:broken")
    with pytest.raises(RewardError, match=rf"reward function {reward_module}:broken on sample p0-c0 returned nan"):
        reward.score([_input("7", "7")])
    with pytest.raises(RewardError, match="returned 'high'; a reward is a finite number"):
        reward.score([_input("", "7")])


@pytest.mark.parametrize(
    ("reference", "message"),
    [
        ("no_such_module_r3:judge", "cannot import 'no_such_module_r3' in the trainer"),
        ("my_rewards.score:absent", "my_rewards.score has no callable 'absent'"),
        ("my_rewards.score:NOT_CALLABLE", "has no callable 'NOT_CALLABLE'"),
    ],
)
def test_function_that_cannot_be_loaded_names_the_field(reward_module: str, reference: str, message: str) -> None:
    with pytest.raises(RewardError, match=rf"^spec.task.rewardFunction '{reference}': .*{message}"):
        FunctionReward(reference)


# ----------------------------------------------------------------------------------------- HTTP

Handler = Callable[[BaseHTTPRequestHandler, dict[str, Any]], None]


@pytest.fixture
def reward_server() -> Iterator[Callable[[Handler], str]]:
    """Start a real HTTP server on 127.0.0.1 whose POST handler is the test's; returns its URL."""
    servers: list[ThreadingHTTPServer] = []

    def start(handle: Handler) -> str:
        class _Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                handle(self, body)

            def log_message(self, *args: Any) -> None:
                return None

        server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}/score"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def _answer(handler: BaseHTTPRequestHandler, status: int, payload: Any) -> None:
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


def _backoff(waits: list[float], attempts: int = 3) -> Backoff:
    return Backoff(attempts=attempts, base_s=1.0, cap_s=4.0, jitter=0.0, sleep=waits.append)


def test_http_reward_posts_the_batch_and_reads_scores(reward_server: Callable[[Handler], str]) -> None:
    seen: list[dict[str, Any]] = []

    def score(handler: BaseHTTPRequestHandler, body: dict[str, Any]) -> None:
        seen.append(body)
        _answer(handler, 200, {"scores": [float(s["completion"] == s["answer"]) for s in body["samples"]]})

    url = reward_server(score)
    reward = HTTPReward(url, timeout_s=5, backoff=_backoff([]), batch_size=2)
    inputs = [_input("7", "7", 0), _input("8", "7", 1, level=3), _input("7", "7", 2)]
    assert reward.score(inputs) == [1.0, 0.0, 1.0]
    assert [len(b["samples"]) for b in seen] == [2, 1]  # batches of batch_size, in order
    assert seen[0]["samples"][1] == {
        "id": "p0-c1",
        "prompt": "what is 3 plus 4 ?",
        "completion": "8",
        "answer": "7",
        "metadata": {"id": "row-0", "level": 3},
    }


def test_http_reward_retries_a_transient_failure(reward_server: Callable[[Handler], str]) -> None:
    calls: list[int] = []

    def flaky(handler: BaseHTTPRequestHandler, body: dict[str, Any]) -> None:
        calls.append(1)
        if len(calls) == 1:
            _answer(handler, 503, {"error": "warming up"})
        else:
            _answer(handler, 200, {"scores": [0.25] * len(body["samples"])})

    waits: list[float] = []
    reward = HTTPReward(reward_server(flaky), timeout_s=5, backoff=_backoff(waits))
    assert reward.score([_input("7", "7")]) == [0.25]
    assert len(calls) == 2 and waits == [1.0]


def test_http_reward_refuses_a_client_error_at_once_quoting_the_answer(reward_server: Callable[[Handler], str]) -> None:
    calls: list[int] = []

    def refuse(handler: BaseHTTPRequestHandler, body: dict[str, Any]) -> None:
        calls.append(1)
        _answer(handler, 400, b"samples[0].answer: expected a number")

    url = reward_server(refuse)
    with pytest.raises(RewardError, match=rf"reward endpoint {url} answered HTTP 400: samples\[0\].answer: expected"):
        HTTPReward(url, timeout_s=5, backoff=_backoff([])).score([_input("7", "7")])
    assert len(calls) == 1


def test_http_reward_endpoint_that_times_out_fails_after_its_retries(reward_server: Callable[[Handler], str]) -> None:
    release = threading.Event()
    calls: list[int] = []

    def stuck(handler: BaseHTTPRequestHandler, body: dict[str, Any]) -> None:
        calls.append(1)
        release.wait(10)  # longer than the client's timeout; released when the test ends
        _answer(handler, 200, {"scores": [1.0]})

    url = reward_server(stuck)
    waits: list[float] = []
    try:
        with pytest.raises(RewardError, match=rf"reward endpoint {url} failed 3 times .* last error: .*timed out"):
            HTTPReward(url, timeout_s=0.2, backoff=_backoff(waits)).score([_input("7", "7")])
    finally:
        release.set()
    assert len(calls) == 3 and waits == [1.0, 2.0]


def test_http_reward_endpoint_that_is_down_fails_naming_it() -> None:
    with pytest.raises(RewardError, match=r"reward endpoint http://127.0.0.1:9/score failed 2 times"):
        HTTPReward("http://127.0.0.1:9/score", timeout_s=1, backoff=_backoff([], attempts=2)).score([_input("7", "7")])


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"not json", "answered no JSON"),
        ({"score": [1.0]}, 'expected {"scores": \\[number, ...\\]}'),
        ({"scores": [1.0, 0.0]}, "answered 2 scores for 1 samples"),
        ({"scores": [None]}, r"\(score 0\) returned None"),
    ],
)
def test_http_reward_refuses_a_malformed_answer(
    reward_server: Callable[[Handler], str], payload: Any, message: str
) -> None:
    url = reward_server(lambda handler, body: _answer(handler, 200, payload))
    with pytest.raises(RewardError, match=message):
        HTTPReward(url, timeout_s=5, backoff=_backoff([])).score([_input("7", "7")])


def test_build_reward_takes_the_endpoint_and_timeout_from_the_spec() -> None:
    reward = build_reward(
        TaskSpec(
            name="dataset",
            dataset_path="/d.jsonl",
            reward="http",
            reward_url="http://reward.rl.svc/score",
            reward_timeout_seconds=7,
        )
    )
    assert isinstance(reward, HTTPReward) and (reward.url, reward.timeout_s) == ("http://reward.rl.svc/score", 7)
