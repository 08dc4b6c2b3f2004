"""The engine façade the driver talks to, whatever runs the engine (a Ray actor or `vllm serve`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol, TypeVar

from r3operator.routing.codec import RoutedExperts
from r3operator.routing.sample import RolloutSample
from r3operator.wire.sync_messages import SyncMessage

A = TypeVar("A")


class Greedy(NamedTuple):
    """One greedy continuation: its tokens, the engine's logprob of each, and the experts the engine routed
    the sequence through (None when the engine returned none); the weight canary replays them."""

    tokens: list[int]
    logprobs: list[float]
    routes: RoutedExperts | None = None  # of prompt + tokens


class StaleEngineError(RuntimeError):
    """An engine does not serve the current policy: a result it produced is discarded. The weight-sync
    supervisor raises it (`weightsync/faults.py`, `current_only`); the producer catches it beside
    `EngineUnavailableError`."""


# Chunks in flight to one Ray engine: the next chunk is packed and put while the engine loads this one,
# without holding the whole model in the object store.
MAX_CHUNKS_IN_FLIGHT = 2


class Engine(Protocol):
    """One rollout engine: generation, and one transport call (`send`) for the weight sync's messages
    (`wire/sync_messages.py`; `weightsync/endpoints.py` speaks them). `generate`, `greedy` and `wait_ready` retry
    transient faults and end in `EngineUnavailableError`; so does `send` of a message that may be repeated (a
    query, an abort), never of a verb inside a bracket (`wire/retry.py` says why). `name` identifies the engine in
    errors and logs."""

    name: str

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
        """`routed_experts_prompt_start[i]`: the rows of prompt i's first tokens that the caller already holds
        (a multi-turn conversation's earlier turns) are not returned; None: every row."""
        ...

    def wait_ready(self) -> None: ...

    def greedy(self, prompts: Sequence[Sequence[int]], *, max_tokens: int) -> list[Greedy]: ...

    def send(self, message: SyncMessage[A]) -> A:
        """The weight sync's one transport call: carry `message` to the engine's workers (or to vLLM's own
        weight-transfer API) and return its typed answer. Retried only where the message allows it;
        after a `STAMPING` message the next requests are salted with its policy tag (rollout/client.py `salted`)."""
        ...

    def vllm_version(self) -> str: ...

    def shutdown(self) -> None: ...
