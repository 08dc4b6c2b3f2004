"""The HTTP reward endpoint (`spec.task.reward: http`, `spec.task.rewardURL`).

One POST per batch of at most `batch_size` samples, body and answer JSON:

    → {"samples": [{"id": "p0-c1", "prompt": "...", "completion": "...", "answer": "...", "metadata": {...}}, ...]}
    ← {"scores": [1.0, 0.0, ...]}            one finite number per sample, in the same order

A request is safe to repeat (scoring has no side effect the driver relies on), so connection errors,
timeouts (`spec.task.rewardTimeoutSeconds` per request) and HTTP 408/429/5xx are retried with exponential
backoff (`wire/retry.py`); any other status, a malformed answer, or a failure left after every retry
stops the step with a RewardError naming the URL.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

from r3operator.tasks.reward_base import RewardError, RewardInput, checked_score
from r3operator.wire.retry import Backoff, EngineUnavailableError, http_transient, retry_call

DEFAULT_BACKOFF = Backoff(attempts=4, base_s=1.0, cap_s=10.0)
BODY_EXCERPT = 300  # characters of an error answer quoted in the message


class HTTPReward:
    def __init__(
        self, url: str, *, timeout_s: float, backoff: Backoff = DEFAULT_BACKOFF, batch_size: int = 256
    ) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.backoff = backoff
        self.batch_size = batch_size

    def score(self, inputs: Sequence[RewardInput]) -> list[float]:
        scores: list[float] = []
        for begin in range(0, len(inputs), self.batch_size):
            scores += self._score_batch(inputs[begin : begin + self.batch_size])
        return scores

    def _score_batch(self, batch: Sequence[RewardInput]) -> list[float]:
        body = {
            "samples": [
                {
                    "id": i.sample_id,
                    "prompt": i.prompt,
                    "completion": i.completion,
                    "answer": i.answer,
                    "metadata": dict(i.metadata),
                }
                for i in batch
            ]
        }
        # default=str: Parquet columns may hold dates or decimals, which JSON has no type for.
        payload = json.dumps(body, default=str).encode()
        what = f"reward endpoint {self.url}"
        try:
            answer = retry_call(lambda: self._post(payload), what=what, backoff=self.backoff, transient=http_transient)
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:BODY_EXCERPT]
            raise RewardError(f"{what} answered HTTP {exc.code}: {detail}") from exc
        except EngineUnavailableError as exc:
            raise RewardError(str(exc)) from exc
        return self._parse(answer, expected=len(batch))

    def _post(self, payload: bytes) -> bytes:
        request = urllib.request.Request(
            self.url, data=payload, method="POST", headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
            return bytes(response.read())

    def _parse(self, answer: bytes, *, expected: int) -> list[float]:
        what = f"reward endpoint {self.url}"
        try:
            data: Any = json.loads(answer)
        except ValueError as exc:
            raise RewardError(f"{what} answered no JSON ({exc}): {answer[:BODY_EXCERPT]!r}") from None
        scores = data.get("scores") if isinstance(data, dict) else None
        if not isinstance(scores, list):
            raise RewardError(f'{what} answered {str(data)[:BODY_EXCERPT]}; expected {{"scores": [number, ...]}}')
        if len(scores) != expected:
            raise RewardError(f"{what} answered {len(scores)} scores for {expected} samples")
        return [checked_score(value, what=f"{what} (score {n})") for n, value in enumerate(scores)]
