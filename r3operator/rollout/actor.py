"""Ray actor body: one in-process vLLM `LLM` with routed-expert capture and the r3_ worker extension."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from r3operator.engine.worker import WORKER_EXTENSION_CLS
from r3operator.rollout.base import Greedy
from r3operator.rollout.client import salted
from r3operator.wire.sample import RolloutSample

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

    def begin_weight_update(self) -> None:
        self.llm.collective_rpc("r3_begin_weight_update")

    def load_packed(self, buffer: Any, entries: list[Any]) -> int:
        # `buffer` arrives as a read-only numpy view of the object store (zero-copy).
        return int(sum(self.llm.collective_rpc("r3_load_packed", args=(buffer, entries))))

    def finish_weight_update(self, policy_tag: str | None = None) -> dict[str, int]:
        result = self.llm.collective_rpc("r3_finish_weight_update", args=(policy_tag,))[0]
        self._new_policy(policy_tag)
        return result

    def _new_policy(self, policy_tag: str | None) -> None:
        """Cached blocks (and their routes) predate the new weights: the next requests salt the prefix cache with
        the new policy (rollout/client.py `salted`), or without a tag the cache is reset."""
        if not salted(self.client, policy_tag):
            self.llm.reset_prefix_cache()

    def abort_weight_update(self) -> None:
        self.llm.collective_rpc("r3_abort_weight_update")
        self.llm.reset_prefix_cache()  # blocks computed by processed layers' new weights must not be reused

    # -- vLLM's native weight transfer (weightsync/transfer.py drives it) -----------------------------
    def native_world_size(self) -> int:
        return int(self.llm.llm_engine.vllm_config.parallel_config.world_size_across_dp)

    def native_init(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def native_start(self, layout: str = "checkpoint") -> None:
        self.llm.collective_rpc("r3_native_begin", args=(layout,))  # our hook, then vLLM's start (engine/worker.py)

    def native_parameters(self) -> dict[str, Any]:
        return dict(self.llm.collective_rpc("r3_parameter_metadata")[0])

    def native_parameter_fingerprints(self) -> list[dict[str, list[int]]]:
        return list(self.llm.collective_rpc("r3_parameter_fingerprints"))  # one per worker

    def native_update(self, update_info: dict[str, Any]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def native_finish(self, policy_tag: str | None) -> None:
        self.llm.collective_rpc("r3_native_end", args=(policy_tag,))  # vLLM's finish, then ours
        self._new_policy(policy_tag)

    def device_uuids(self) -> list[str | None]:
        return list(self.llm.collective_rpc("r3_device_uuid"))

    def native_abort(self) -> None:
        self.llm.collective_rpc("r3_abort_native_weight_update")
        self.llm.reset_prefix_cache()

    def native_direct_sync(self, update: dict[str, Any], policy_tag: str | None) -> None:
        self.llm.collective_rpc("r3_direct_sync", args=(update, policy_tag))  # bracket, receive, flag, tag: one call
        self._new_policy(policy_tag)

    def native_staged_attach(self, share: dict[str, Any]) -> None:
        self.llm.collective_rpc("r3_staged_attach", args=(share,))

    def native_staged_sync(self, policy_tag: str | None) -> None:
        self.llm.collective_rpc("r3_staged_sync", args=(policy_tag,))  # bracket, copies, receipt, tag: one call
        self._new_policy(policy_tag)

    def native_mapped_attach(self, share: dict[str, Any]) -> list[dict[str, Any]]:
        return list(self.llm.collective_rpc("r3_mapped_attach", args=(share,)))

    def native_mapped_sync(self, number: int, policy_tag: str | None, timeout_s: float) -> None:
        self.llm.collective_rpc(
            "r3_mapped_sync", args=(number, policy_tag, timeout_s)
        )  # returns once the trainer wrote
        self._new_policy(policy_tag)

    def policy_tag(self) -> str | None:
        """The tag of the last finished sync if every worker holds it, else None (see the worker extension)."""
        tags = set(self.llm.collective_rpc("r3_policy_tag"))
        return tags.pop() if len(tags) == 1 else None

    def greedy(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[Greedy]:
        samples = self.client.generate(prompts, max_tokens=max_tokens, temperature=0.0, seed=0, n=1)
        return [Greedy(list(s.token_ids), [float(x) for x in s.logprobs], s.routes) for s in samples]

    def sync_receipts(self) -> list[dict[str, Any]]:
        return list(self.llm.collective_rpc("r3_sync_receipt"))

    def weights_digest(self) -> str:
        return str(self.llm.collective_rpc("r3_weights_digest")[0])

    def vllm_version(self) -> str:
        import vllm

        return str(vllm.__version__)
