"""Rollout clients: token ids in; token ids, sampled-token logprobs and routed experts out.

Two implementations behind one protocol:

- `InProcessLLMClient` wraps `vllm.LLM` (imported lazily, so this module loads without vLLM);
- `OpenAIHTTPClient` talks to `vllm serve` over `/v1/completions` with token-id prompts
  (`return_token_ids: true`, `logprobs: 0` for the sampled token's logprob, `routed_experts` = base64 npy).

Both derive per-request seeds the same way (prompt i gets `seed + i * n`; vLLM gives child j of a
request `seed + j`), so the same prompts, seed and engine give the same samples through either client.

`OpenAIHTTPClient` retries transient failures (connection refused/reset, timeouts, HTTP 408/429/5xx) with
exponential backoff (`wire/retry.py`); a request is safe to repeat because its seed fixes its samples.

Routes are validated with `check_row_count` (rows == prompt + generated - 1 - start). A sample whose
routes are absent or malformed keeps `routes=None` and a `routes_error`: routes are treated as missing,
never as truncated data (reference §8.1.3).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypedDict, runtime_checkable

import numpy as np

from r3operator.models.architecture import num_experts as experts_of
from r3operator.routing.codec import RoutedExperts, encode, from_vllm
from r3operator.routing.codec import decode as decode_routes
from r3operator.routing.errors import RoutingDataError
from r3operator.routing.sample import ROUTES_MISSING, RolloutSample
from r3operator.wire.retry import Backoff, http_transient, retry_call

if TYPE_CHECKING:  # pragma: no cover
    from r3operator.routing.store import RoutingStore


class FullDistribution(TypedDict):
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float


FULL_DISTRIBUTION = FullDistribution(top_p=1.0, top_k=-1, min_p=0.0, repetition_penalty=1.0)
"""Sampling parameters that leave softmax(logits / T) untouched: what the trainer's logprobs assume."""


@runtime_checkable
class RolloutClient(Protocol):
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_tokens: int,
        temperature: float,
        seed: int,
        n: int = 1,
        routed_experts_prompt_start: int | Sequence[int] = 0,
    ) -> list[RolloutSample]: ...


def request_seed(seed: int, prompt_index: int, n: int) -> int:
    """Seed for prompt `prompt_index`; its n children get `+0..n-1` from vLLM, so no two samples share one."""
    return seed + prompt_index * n


def prompt_starts(prompts: Sequence[Sequence[int]], routed_experts_prompt_start: int | Sequence[int]) -> list[int]:
    """One `routed_experts_prompt_start` per prompt (an int applies to all), each checked against its prompt.

    A multi-turn request asks only for the rows it does not hold yet, so every conversation has its own start.
    """
    if not prompts:
        raise ValueError("prompts is empty")
    if isinstance(routed_experts_prompt_start, int):
        starts = [routed_experts_prompt_start] * len(prompts)
    else:
        starts = [int(s) for s in routed_experts_prompt_start]
        if len(starts) != len(prompts):
            raise ValueError(f"{len(starts)} routed_experts_prompt_start values for {len(prompts)} prompts")
    for i, (prompt, start) in enumerate(zip(prompts, starts, strict=True)):
        if len(prompt) == 0:
            raise ValueError(f"prompts[{i}] has no tokens")
        if not 0 <= start < len(prompt):
            raise ValueError(
                f"routed_experts_prompt_start={start} must be in [0, {len(prompt)}), the length of prompts[{i}]"
            )
    return starts


def build_sample(
    *,
    prompt_index: int,
    choice_index: int,
    prompt_token_ids: Sequence[int],
    token_ids: Sequence[int],
    logprobs: Sequence[float | None] | np.ndarray,
    routed_experts: np.ndarray | str | bytes | None,
    routed_experts_prompt_start: int,
    num_experts: int | None,
    finish_reason: str | None = None,
) -> RolloutSample:
    """Assemble a sample, converting and validating the engine's routed experts."""
    from r3operator.routing.stitch import check_row_count

    lp = np.asarray([np.nan if v is None else v for v in logprobs], dtype=np.float32)
    if lp.shape != (len(token_ids),):
        raise ValueError(f"got {lp.shape[0]} logprobs for {len(token_ids)} generated tokens")
    routes: RoutedExperts | None = None
    error: str | None = None
    if routed_experts is None:
        error = ROUTES_MISSING
    else:
        try:
            rows = len(prompt_token_ids) + len(token_ids) - 1 - routed_experts_prompt_start
            routes = routes_from(routed_experts, start=routed_experts_prompt_start, rows=rows, num_experts=num_experts)
            check_row_count(routes, prompt_len=len(prompt_token_ids), generated_len=len(token_ids))
        except RoutingDataError as exc:
            routes, error = None, str(exc)
    return RolloutSample(
        sample_id=f"p{prompt_index}-c{choice_index}",
        prompt_index=prompt_index,
        choice_index=choice_index,
        prompt_token_ids=tuple(int(t) for t in prompt_token_ids),
        token_ids=tuple(int(t) for t in token_ids),
        logprobs=lp,
        routes=routes,
        routes_error=error,
        finish_reason=finish_reason,
        routed_experts_prompt_start=routed_experts_prompt_start,
    )


def routes_from(value: np.ndarray | str | bytes, *, start: int, rows: int, num_experts: int | None) -> RoutedExperts:
    """An answer's routes asked from row `start`, `rows` of them. A vLLM before #51906 (0.30) takes
    `routed_experts_prompt_start` in `SamplingParams` only, not on /v1/completions, and answers every row from 0
    (`start` + `rows` of them): those before `start` are dropped here, so that both answer the same record."""
    routes = from_vllm(value, start=start, num_experts=num_experts)
    if start and routes.num_tokens == start + rows:
        routes = encode(decode_routes(routes)[start:], start=start, num_experts=num_experts)
    return routes


def write_samples(
    store: RoutingStore,
    samples: Sequence[RolloutSample],
    *,
    step: int,
    num_experts: int,
    policy_version: int,
    sample_id: Callable[[RolloutSample], str] | None = None,
) -> dict[str, Path]:
    """Write every sample's routes to `store`; samples without routes are skipped (they replay natively)."""
    paths: dict[str, Path] = {}
    for sample in samples:
        if sample.routes is None:
            continue
        sid = sample_id(sample) if sample_id else sample.sample_id
        paths[sid] = store.put(
            step=step,
            sample_id=sid,
            routes=sample.routes,
            num_experts=num_experts,
            policy_version=policy_version,
        )
    return paths


def salted(client: Any, policy_tag: str | None) -> bool:
    """Make `client`'s requests carry `policy_tag` as vLLM's `cache_salt` from now on; False when there is no tag
    (the caller resets the prefix cache instead).

    The salt goes into the hash of every prefix-cache block, so blocks computed under an earlier policy are never
    hit again and a finished sync need not reset the prefix cache: vLLM's reset walks every block of the KV pool in
    Python, 20-23 ms a sync on an H200 with 35 % of its memory for the engine (2026-11-27), more with a bigger cache,
    a whole round trip of a sync's fixed cost. The old blocks stay free and are evicted as any other."""
    if not policy_tag:
        return False
    client.cache_salt = policy_tag
    return True


class InProcessLLMClient:
    """`RolloutClient` over an in-process `vllm.LLM` (built from `llm_kwargs` or passed in)."""

    cache_salt: str | None = None  # the policy of the engine's last finished sync (`salted`)

    def __init__(self, llm: Any = None, *, num_experts: int | None = None, **llm_kwargs: Any) -> None:
        if llm is None:
            from vllm import LLM  # lazy: vLLM is heavy and optional

            llm_kwargs.setdefault("enable_return_routed_experts", True)
            llm = LLM(**llm_kwargs)
        self.llm = llm
        if num_experts is None:
            num_experts = experts_of(llm.llm_engine.model_config.hf_config)
        self.num_experts = num_experts

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_tokens: int,
        temperature: float,
        seed: int,
        n: int = 1,
        routed_experts_prompt_start: int | Sequence[int] = 0,
    ) -> list[RolloutSample]:
        from vllm import SamplingParams

        starts = prompt_starts(prompts, routed_experts_prompt_start)
        params = [
            SamplingParams(
                n=n,
                max_tokens=max_tokens,
                temperature=temperature,
                **FULL_DISTRIBUTION,
                seed=request_seed(seed, i, n),
                logprobs=0,  # the sampled token's logprob only
                routed_experts_prompt_start=starts[i],
            )
            for i in range(len(prompts))
        ]
        salt = {"cache_salt": self.cache_salt} if self.cache_salt else {}
        inputs = [{"prompt_token_ids": [int(t) for t in p], **salt} for p in prompts]
        outputs = self.llm.generate(inputs, params, use_tqdm=False)
        samples = []
        for i, out in enumerate(outputs):
            for j, choice in enumerate(out.outputs):
                token_ids = list(choice.token_ids)
                lps = [entry[tok].logprob for entry, tok in zip(choice.logprobs or [], token_ids, strict=True)]
                samples.append(
                    build_sample(
                        prompt_index=i,
                        choice_index=j,
                        prompt_token_ids=out.prompt_token_ids,
                        token_ids=token_ids,
                        logprobs=lps,
                        routed_experts=choice.routed_experts,
                        routed_experts_prompt_start=starts[i],
                        num_experts=self.num_experts,
                        finish_reason=choice.finish_reason,
                    )
                )
        return samples


MAX_CONCURRENT_REQUESTS = 512
"""Requests one `generate` keeps in flight to one server. vLLM batches whatever has arrived (continuous batching,
up to its `max_num_seqs`, queueing the rest), so a request held back here is a sequence the engine could have
decoded beside the others: a rollout of 128 one-sample requests, 8 at a time, decodes 16 small batches one after
another instead of one. The cap only bounds this process's threads; the server's own limit does the rest."""


class OpenAIHTTPClient:
    """`RolloutClient` over a vLLM OpenAI server's `/v1/completions` (non-streaming; R3 needs that)."""

    cache_salt: str | None = None  # the policy of the engine's last finished sync (`salted`)

    def __init__(
        self,
        base_url: str,
        *,
        model: str | None = None,
        num_experts: int | None = None,
        timeout_s: float = 300.0,
        max_concurrency: int = MAX_CONCURRENT_REQUESTS,
        api_key: str | None = None,
        backoff: Backoff | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        if self.base_url.endswith("/v1"):
            self.base_url = self.base_url[: -len("/v1")]
        self.timeout_s = timeout_s
        self.max_concurrency = max_concurrency
        self.api_key = api_key
        self.num_experts = num_experts
        self.backoff = backoff or Backoff.from_env()
        self.model = model or self._first_model()

    def request(self, method: str, path: str, body: dict[str, Any] | None = None, *, retry: bool = True) -> Any:
        """One JSON request (None for an empty body). Transient failures (connection refused/reset, timeout,
        HTTP 408/429/5xx) are retried with `self.backoff` and end in `EngineUnavailableError`; with
        `retry=False` the first one does. Any other HTTP error raises `RuntimeError` with the server's text."""
        url = self.base_url + path

        def once() -> Any:
            data = None if body is None else json.dumps(body).encode()
            req = urllib.request.Request(url, data=data, method=method)
            req.add_header("Content-Type", "application/json")
            if self.api_key:
                req.add_header("Authorization", f"Bearer {self.api_key}")
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                raw = resp.read()
            return json.loads(raw) if raw else None

        backoff = self.backoff if retry else Backoff(attempts=1, sleep=self.backoff.sleep)
        try:
            return retry_call(once, what=f"{method} {url}", backoff=backoff, transient=http_transient)
        except urllib.error.HTTPError as exc:  # not transient: a request this server refuses
            detail = exc.read().decode(errors="replace")[:500]
            raise RuntimeError(f"{method} {url} failed: HTTP {exc.code}: {detail}") from exc

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.request(method, path, body) or {}

    def _first_model(self) -> str:
        models = self._request("GET", "/v1/models").get("data") or []
        if not models:
            raise RuntimeError(f"{self.base_url}/v1/models lists no model")
        return str(models[0]["id"])

    def completion_body(
        self, prompt: Sequence[int], *, max_tokens: int, temperature: float, seed: int, n: int, start: int
    ) -> dict[str, Any]:
        return {
            "model": self.model,
            "prompt": [int(t) for t in prompt],
            "max_tokens": max_tokens,
            "temperature": temperature,
            # vLLM's server fills parameters a request leaves out from the model's generation_config.json
            # (Qwen3: top_k 20, top_p 0.95); the trainer scores the full softmax of logits / T, so sampling
            # must not truncate it.
            **FULL_DISTRIBUTION,
            "seed": seed,
            "n": n,
            "logprobs": 0,  # token_logprobs[i] = logprob of the sampled token i
            "return_token_ids": True,  # exact prompt_token_ids / token_ids, no detokenise round trip
            "routed_experts_prompt_start": start,
            "stream": False,
            **({"cache_salt": self.cache_salt} if self.cache_salt else {}),
        }

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_tokens: int,
        temperature: float,
        seed: int,
        n: int = 1,
        routed_experts_prompt_start: int | Sequence[int] = 0,
    ) -> list[RolloutSample]:
        starts = prompt_starts(prompts, routed_experts_prompt_start)

        def one(i: int) -> list[RolloutSample]:
            body = self.completion_body(
                prompts[i],
                max_tokens=max_tokens,
                temperature=temperature,
                seed=request_seed(seed, i, n),
                n=n,
                start=starts[i],
            )
            response = self._request("POST", "/v1/completions", body)
            choices = sorted(response["choices"], key=lambda c: c["index"])
            return [self._sample(i, j, c, starts[i]) for j, c in enumerate(choices)]

        with ThreadPoolExecutor(max_workers=max(1, min(self.max_concurrency, len(prompts)))) as pool:
            return [s for batch in pool.map(one, range(len(prompts))) for s in batch]

    def _sample(self, i: int, j: int, choice: dict[str, Any], start: int) -> RolloutSample:
        if choice.get("token_ids") is None or choice.get("prompt_token_ids") is None:
            raise RuntimeError("server returned no token ids; it must support `return_token_ids` (vLLM >= 0.10)")
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
        if logprobs is None:
            raise RuntimeError("server returned no token_logprobs although `logprobs: 0` was requested")
        return build_sample(
            prompt_index=i,
            choice_index=j,
            prompt_token_ids=choice["prompt_token_ids"],
            token_ids=choice["token_ids"],
            logprobs=logprobs,
            routed_experts=choice.get("routed_experts"),
            routed_experts_prompt_start=start,
            num_experts=self.num_experts,
            finish_reason=choice.get("finish_reason"),
        )
