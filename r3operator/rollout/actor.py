"""Ray actor body: one in-process vLLM `LLM` with routed-expert capture and the r3_ worker extension."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, TypeVar, cast

from r3operator.engine.worker import WORKER_EXTENSION_CLS
from r3operator.rollout.base import Greedy
from r3operator.rollout.client import salted
from r3operator.routing.sample import RolloutSample
from r3operator.wire.sync_messages import STAMPING, InitTransfer, LoadPacked, SyncMessage, UpdateWeights, WorldSize
from r3operator.wire.weights import PackedChunk

A = TypeVar("A")

log = logging.getLogger(__name__)


class EngineActor:
    """Ray actor body: one in-process vLLM `LLM` with routed-expert capture and the r3_ worker extension."""

    def __init__(
        self,
        model_dir: str,
        *,
        device: str,
        dtype: str,
        seed: int,
        max_model_len: int,
        weight_transfer_backend: str | None = None,
        gpu_memory_utilization: float | None = None,
        capture_routes: bool = True,
        engine_flags: Sequence[str] = (),
    ) -> None:
        from r3operator.engine.flags import engine_flag_kwargs
        from r3operator.engine.llm import RUN_FIXED_KWARGS, apply_engine_env, llm_kwargs
        from r3operator.engine.plugin import register, self_check

        apply_engine_env(device)
        register()  # vLLM also loads it via the entry point; idempotent
        self_check()
        from r3operator.rollout.client import InProcessLLMClient

        flags = engine_flag_kwargs(engine_flags, fixed=RUN_FIXED_KWARGS)
        if flags.kept:
            log.warning(
                "spec.inference.extraArgs set %s, which the run sets itself (the trainer relies on them): not applied",
                ", ".join(flags.kept),
            )
        if flags.serve_only:
            log.warning(
                "spec.inference.extraArgs %s are flags of the `vllm serve` server; an in-process engine has no use for "
                "them",
                " ".join(flags.serve_only),
            )
        kwargs = llm_kwargs(
            model_dir,
            device=device,
            seed=seed,
            max_model_len=max_model_len,
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            extra={
                **flags.kwargs,
                "skip_tokenizer_init": True,
                "worker_extension_cls": WORKER_EXTENSION_CLS,
                "enable_return_routed_experts": capture_routes,
                **({"weight_transfer_config": {"backend": weight_transfer_backend}} if weight_transfer_backend else {}),
            },
        )
        self.client = InProcessLLMClient(**kwargs)
        self.llm = self.client.llm

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_tokens: int,
        temperature: float,
        seed: int,
        n: int,
        routed_experts_prompt_start: Sequence[int] | None = None,
    ) -> list[RolloutSample]:
        return self.client.generate(
            prompts,
            max_tokens=max_tokens,
            temperature=temperature,
            seed=seed,
            n=n,
            routed_experts_prompt_start=routed_experts_prompt_start or 0,
        )

    def send(self, message: SyncMessage[A], buffer: Any = None) -> A:
        """The weight sync's one call (`RayEngine.send`): `message` to vLLM's own weight-transfer API or, through
        `collective_rpc`, to every worker's extension (`r3_handle`), then its typed answer. `buffer`: a packed
        chunk's, handed over apart by Ray (zero-copy from the object store), put back into the message here."""
        llm = self.llm
        if isinstance(message, InitTransfer):
            llm.init_weight_transfer_engine({"init_info": message.init_info})
            results: list[Any] = []
        elif isinstance(message, UpdateWeights):
            llm.update_weights({"update_info": message.update_info})
            results = []
        elif isinstance(message, WorldSize):
            results = [llm.llm_engine.vllm_config.parallel_config.world_size_across_dp]
        else:
            if buffer is not None and isinstance(message, LoadPacked):
                message = cast(SyncMessage[A], LoadPacked(PackedChunk(buffer, message.chunk.entries)))
            results = list(llm.collective_rpc("r3_handle", args=(message.encode(),)))
        if isinstance(message, STAMPING):
            self._new_policy(message.policy_tag)
        elif message.clears_prefix_cache:  # blocks computed by processed layers' new weights must not be reused
            llm.reset_prefix_cache()
        return message.answer(results)

    def _new_policy(self, policy_tag: str | None) -> None:
        """Cached blocks (and their routes) predate the new weights: the next requests salt the prefix cache with
        the new policy (rollout/client.py `salted`), or without a tag the cache is reset."""
        if not salted(self.client, policy_tag):
            self.llm.reset_prefix_cache()

    def greedy(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[Greedy]:
        samples = self.client.generate(prompts, max_tokens=max_tokens, temperature=0.0, seed=0, n=1)
        return [Greedy(list(s.token_ids), [float(x) for x in s.logprobs], s.routes) for s in samples]

    def vllm_version(self) -> str:
        import vllm

        return str(vllm.__version__)
