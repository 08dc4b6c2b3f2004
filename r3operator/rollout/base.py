"""The engine façade the driver talks to, whatever runs the engine (a Ray actor or `vllm serve`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

from r3operator.routing.sample import RolloutSample
from r3operator.wire.receipt import Fingerprint
from r3operator.wire.weights import PackedChunk


class Greedy(NamedTuple):
    """One greedy continuation: its tokens, the engine's logprob of each, and the experts the engine routed
    the sequence through (None when the engine returned none); the weight canary replays them."""

    tokens: list[int]
    logprobs: list[float]
    routes: Any = None  # RoutedExperts of prompt + tokens


class StaleEngineError(RuntimeError):
    """An engine does not serve the current policy: a result it produced is discarded. The weight-sync
    supervisor raises it (`weightsync/faults.py`, `current_only`); the producer catches it beside
    `EngineUnavailableError`."""


# Chunks in flight to one Ray engine: the next chunk is packed and put while the engine loads this one,
# without holding the whole model in the object store.
MAX_CHUNKS_IN_FLIGHT = 2


class NativeEndpoint(Protocol):
    """One engine's native weight-transfer control plane (weightsync/transfer.py, weightsync/sync.py)."""

    name: str

    def native_world_size(self) -> int: ...

    def native_init(self, init_info: dict[str, Any]) -> None: ...

    def native_start(self, layout: str = "checkpoint") -> None:
        """Open the bracket; `layout` is `weightSync.layout` ("kernel": vLLM 0.22's is_checkpoint_format=False)."""
        ...

    def native_parameters(self) -> dict[str, Any]:
        """The engine model's parameters and whether it refuses the kernel layout (`r3_parameter_metadata`)."""
        ...

    def native_parameter_fingerprints(self) -> list[dict[str, Fingerprint]]:
        """Every worker's fingerprint of every parameter it holds now (`r3_parameter_fingerprints`): the kernel
        layout's reference check compares them with what it would send (weightsync/transfer.py)."""
        ...

    def native_update(self, update_info: dict[str, Any]) -> None: ...

    def native_finish(self, policy_tag: str | None) -> None: ...

    def native_abort(self) -> None: ...

    def native_direct_sync(self, update: dict[str, Any], policy_tag: str | None) -> None:
        """One kernel-format NCCL sync (weightsync/direct.py) in one call: bracket, receive, commit flag, tag; the next
        requests are salted with the new policy (rollout/client.py `salted`)."""
        ...

    def native_staged_attach(self, share: dict[str, Any]) -> None:
        """Map the trainer's staging buffer (weightsync/staged.py) on every worker, checked against its parameters."""
        ...

    def native_staged_sync(self, policy_tag: str | None) -> None:
        """One kernel-format sync from the mapped staging buffer (bracket, copies, receipt, tag in one call); the next
        requests are salted with the new policy."""
        ...

    def native_mapped_attach(self, share: dict[str, Any]) -> list[dict[str, Any]]:
        """Every worker shares its parameters' memory with the trainer (weightsync/mapped.py); one answer per worker."""
        ...

    def native_mapped_sync(self, number: int, policy_tag: str | None, timeout_s: float) -> None:
        """Mapped sync `number` in one call, which returns once the trainer has written the parameters (bracket, wait,
        tag); the next requests are salted with the new policy."""
        ...

    def policy_tag(self) -> str | None: ...


class Engine(NativeEndpoint, Protocol):
    """One rollout engine. `generate`, `greedy`, `policy_tag` and `wait_ready` retry transient faults and end
    in `EngineUnavailableError`; the weight-update bracket calls do not retry (`wire/retry.py` says why).
    `name` identifies the engine in errors and logs."""

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

    def begin_weight_update(self) -> None: ...

    def load_packed(self, chunk: PackedChunk) -> None: ...

    def release(self, chunk: PackedChunk) -> None: ...

    def finish_weight_update(self, policy_tag: str | None = None) -> dict[str, int]: ...

    def abort_weight_update(self) -> None: ...

    def device_uuids(self) -> list[str | None]:
        """The physical GPU of each worker (None on CPU)."""
        ...

    def wait_ready(self) -> None: ...

    def greedy(self, prompts: Sequence[Sequence[int]], *, max_tokens: int) -> list[Greedy]: ...

    def sync_receipts(self) -> list[dict[str, Any]]:
        """Each worker's receipt of the last finished sync (wire/receipt.py)."""
        ...

    def weights_digest(self) -> str: ...

    def vllm_version(self) -> str: ...

    def shutdown(self) -> None: ...
