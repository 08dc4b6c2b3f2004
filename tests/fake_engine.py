"""An in-process stand-in for a rollout engine, with scripted faults (not a test module).

It keeps the engine-side state the runtime relies on: an open weight-update bracket and the policy tag of
the last finished sync (None after a restart or an abort); the sync's messages reach its verbs through `send`
(tests/sync_fakes.py). Rollouts are random tokens seeded by the request
seed like vLLM, with routes for the tiny model (4 layers, top-4 of 32 experts) that are a function of token
and position (`route_row`), returned from each request's `routed_experts_prompt_start` on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from sync_fakes import SendsToVerbs

from r3operator.rollout.base import Greedy
from r3operator.rollout.client import build_sample
from r3operator.routing.sample import RolloutSample
from r3operator.wire.retry import EngineUnavailableError
from r3operator.wire.weights import PackedChunk, unpack_chunk


@dataclass
class FakeEngine(SendsToVerbs):
    name: str = "fake engine"
    num_layers: int = 4
    top_k: int = 4
    num_experts: int = 32
    vocab: int = 512
    routes: bool = True
    tag: str | None = None
    bracket_open: bool = False
    restarts: int = 0
    calls: list[str] = field(default_factory=list)
    # fault script: method name -> 1-based call numbers on which the engine dies (EngineUnavailableError,
    # and it comes back restarted: original weights, tag None)
    die_on: dict[str, set[int]] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    starts_seen: list[list[int]] = field(default_factory=list)  # routed_experts_prompt_start of each request
    # (prompt ids, choice index) -> the completion to return instead of random tokens, or None for random ones
    answer: Callable[[tuple[int, ...], int], list[int] | None] | None = None
    prompts_seen: list[tuple[int, ...]] = field(default_factory=list)
    # True: the routes also depend on the installed policy tag, as a real router's do on the weights, so a
    # test can tell which policy computed a stitched row
    routes_follow_policy: bool = False

    def _call(self, method: str) -> None:
        self.calls.append(method)
        self.counts[method] = self.counts.get(method, 0) + 1
        if self.counts[method] in self.die_on.get(method, set()):
            self.restart()
            raise EngineUnavailableError(f"{self.name}: {method} failed 6 times; last error: connection refused")

    def restart(self) -> None:
        self.restarts += 1
        self.tag, self.bracket_open = None, False

    def route_row(self, position: int, token: int, tag: str | None = None) -> np.ndarray:
        """The experts this fake routes `token` at `position` to ([layers, top_k]): a test can tell from a
        stitched row which token and position it was computed for (and, with `routes_follow_policy`, under
        which policy tag)."""
        salt = sum(map(ord, tag or "")) if self.routes_follow_policy else 0
        base = (token * 7 + position * 3 + salt + np.arange(self.num_layers)[:, None] * 5) % self.num_experts
        return ((base + np.arange(self.top_k)[None, :]) % self.num_experts).astype(np.int32)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_tokens: int,
        temperature: float,
        seed: int,
        n: int,
        routed_experts_prompt_start: Sequence[int] | None = None,
    ) -> list[RolloutSample]:
        self._call("generate")
        starts = [0] * len(prompts) if routed_experts_prompt_start is None else list(routed_experts_prompt_start)
        self.starts_seen.append(starts)
        samples = []
        for i, prompt in enumerate(prompts):
            self.prompts_seen.append(tuple(prompt))
            for j in range(n):
                rng = np.random.default_rng([seed, i, j])
                tokens = rng.integers(3, self.vocab, size=max_tokens)
                scripted = self.answer(tuple(prompt), j) if self.answer is not None else None
                if scripted is not None:
                    tokens = np.asarray(scripted[:max_tokens])
                sequence = [*prompt, *tokens.tolist()]
                # Rows for positions [start, P + G - 1): the last sampled token is never fed back.
                ids = np.stack([self.route_row(p, sequence[p], self.tag) for p in range(starts[i], len(sequence) - 1)])
                samples.append(
                    build_sample(
                        prompt_index=i,
                        choice_index=j,
                        prompt_token_ids=prompt,
                        token_ids=tokens.tolist(),
                        logprobs=np.full(len(tokens), -1.0),
                        routed_experts=ids if self.routes else None,
                        routed_experts_prompt_start=starts[i],
                        num_experts=self.num_experts,
                    )
                )
        return samples

    def begin_weight_update(self) -> None:
        self._call("begin")
        if self.bracket_open:
            raise RuntimeError("r3_begin_weight_update: an update is already active")
        self.bracket_open, self.tag = True, None

    def load_packed(self, chunk: PackedChunk) -> None:
        self._call("load")
        assert self.bracket_open, "chunk outside a bracket"

    def finish_weight_update(self, policy_tag: str | None = None) -> dict[str, int]:
        self._call("finish")
        assert self.bracket_open, "finish without begin"
        self.bracket_open, self.tag = False, policy_tag
        return {}

    def abort_weight_update(self) -> None:
        self._call("abort")
        self.bracket_open, self.tag = False, None

    def policy_tag(self) -> str | None:
        self._call("policy_tag")
        return self.tag

    def wait_ready(self) -> None:
        self._call("wait_ready")

    def greedy(self, prompts: Sequence[Sequence[int]], *, max_tokens: int) -> list[Greedy]:
        self._call("greedy")
        return [Greedy([2], [0.0]) for _ in prompts]

    def weights_digest(self) -> str:
        return self.tag or "original"

    def vllm_version(self) -> str:
        return "fake"

    def shutdown(self) -> None:
        return None


class RecordingEngine(FakeEngine):
    """Keeps a copy of every tensor of the last finished weight sync (`weights`, as the engine would load it)."""

    def __init__(self) -> None:
        super().__init__()
        self.loading: dict[str, Any] = {}
        self.weights: dict[str, Any] = {}

    def begin_weight_update(self) -> None:
        super().begin_weight_update()
        self.loading = {}

    def load_packed(self, chunk: PackedChunk) -> None:
        super().load_packed(chunk)
        self.loading.update((name, tensor.clone()) for name, tensor in unpack_chunk(chunk.buffer, chunk.entries))

    def finish_weight_update(self, policy_tag: str | None = None) -> dict[str, int]:
        self.weights = self.loading
        return super().finish_weight_update(policy_tag)
