"""Disaggregated rollouts: each request prefilled on a prefill engine, decoded on a decode engine, its routes stitched.

vLLM's own disaggregated protocol, driven from here (not a proxy such as `vllm-router`): the driver already picks the
engine of every request and must assemble each sample's routes, and the router releases on PyPI (0.1.17) return no
routed experts of a P/D pair; one more hop would only add latency. Per sample:

1. prefill engine: `/v1/completions` with `max_tokens` 1 and `kv_transfer_params` {"do_remote_decode": true}
   (NixlConnector's request; R3StorageConnector takes the same); it computes every prompt token, answers the prompt's
   routes (rows `[start, P)`) and the `kv_transfer_params` for the decode engine;
2. decode engine: the same prompt, the sample's own seed and `max_tokens`, those `kv_transfer_params` and
   `routed_experts_prompt_start` P - 1: it loads the prompt's KV, recomputes the last prompt token to sample from,
   generates, and answers the routes of the rows it computed, `[P - 1, P + G - 1)`, and every logprob (a vLLM
   that takes `routed_experts_prompt_start` only in `SamplingParams`, before 0.30, answers every row from 0: the
   rows before P - 1, stale for the KV it loaded, are dropped here);
3. `routing/stitch.stitch_disaggregated`: the prompt's rows from the prefill engine, the generated tokens' from the
   decode engine; the decode engine's row of the boundary token is compared with the prefill engine's.

The sample has the shape a single engine's has (the same `routed_experts_prompt_start`, rows and seeds: child j of
prompt i is one request with seed `request_seed(seed, i, n) + j`, as vLLM seeds a request's children), so multi-turn
conversations, partial rollouts and the asynchronous producer stitch it as any other.

Every engine of both roles is in `engines`: a weight sync, its canary and receipt, and the policy check before and
after each rollout (`weightsync/faults.py`) reach each one, so a prefill engine a version behind its decode engine is
re-synced before it serves. A prefill engine is paired only with decode engines of its own build (`r3_engine_build`:
vLLM release and pod image), so while an upgrade rolls the two roles no request crosses builds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from r3operator.rollout.client import build_sample, prompt_starts, request_seed, routes_from
from r3operator.rollout.engines import EngineGroup, HTTPEngine
from r3operator.routing.codec import RoutedExperts
from r3operator.routing.errors import RoutingDataError
from r3operator.routing.sample import RolloutSample
from r3operator.routing.stitch import stitch_disaggregated
from r3operator.wire.retry import EngineUnavailableError
from r3operator.wire.sync_messages import EngineBuild

log = logging.getLogger("r3operator.runtime")

PREFILL_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
"""What a prefill request carries (vLLM's examples/disaggregated proxies send these for NixlConnector)."""
LOADED_TOKENS = "r3_loaded_tokens"  # engine/kv_storage.py: the decode engine's count of tokens it did not compute


class DisaggregatedGroup(EngineGroup):
    """Prefill and decode engines over HTTP. `engines` is every engine of both roles, prefill first."""

    def __init__(self, prefill: Sequence[HTTPEngine], decode: Sequence[HTTPEngine]) -> None:
        if not prefill or not decode:
            raise ValueError(
                f"a disaggregated group needs both roles, got {len(prefill)} prefill, {len(decode)} decode"
            )
        super().__init__([*prefill, *decode])
        self.prefill = list(prefill)
        self.decode = list(decode)
        self.stats = PDStats()
        self._count = threading.Lock()

    def pairs(self) -> list[tuple[HTTPEngine, HTTPEngine]]:
        """(prefill, decode) pairs of one build, round robin over the decode engines; raises EngineUnavailableError
        when no two engines of the roles share a build (an upgrade has moved every engine of one role only)."""
        everyone = [*self.prefill, *self.decode]
        builds = {id(e): e.send(EngineBuild()) for e in everyone}
        pairs = []
        for i, decode in enumerate(self.decode):
            same = [p for p in self.prefill if builds[id(p)] == builds[id(decode)]]
            if same:
                pairs.append((same[i % len(same)], decode))
        if not pairs:
            described = ", ".join(f"{e.name}: {builds[id(e)]}" for e in everyone)
            raise EngineUnavailableError(f"no prefill engine shares a build with a decode engine ({described})")
        skipped = len(self.decode) - len(pairs)
        if skipped:
            log.warning("%d decode engine(s) have no prefill engine of their build: they get no rollout", skipped)
        return pairs

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
        starts = prompt_starts(prompts, 0 if routed_experts_prompt_start is None else routed_experts_prompt_start)
        pairs = self.pairs()
        jobs = [(i, j) for i in range(len(prompts)) for j in range(n)]

        def one(k: int) -> RolloutSample:
            i, j = jobs[k]
            prefill, decode = pairs[k % len(pairs)]
            return self.one(
                prefill,
                decode,
                list(prompts[i]),
                prompt_index=i,
                choice_index=j,
                max_tokens=max_tokens,
                temperature=temperature,
                seed=request_seed(seed, i, n) + j,
                start=starts[i],
            )

        workers = max(1, min(len(jobs), 4 * len(pairs)))
        before = replace(self.stats)
        with ThreadPoolExecutor(max_workers=workers) as pool:
            samples = list(pool.map(one, range(len(jobs))))
        log.info("prefill/decode rollout: %s", self.stats.since(before))
        return samples

    def one(
        self,
        prefill: HTTPEngine,
        decode: HTTPEngine,
        prompt: list[int],
        *,
        prompt_index: int,
        choice_index: int,
        max_tokens: int,
        temperature: float,
        seed: int,
        start: int,
    ) -> RolloutSample:
        """One sample: prefill request, decode request, stitched routes."""
        clock = time.perf_counter()
        body = prefill.client.completion_body(
            prompt, max_tokens=1, temperature=temperature, seed=seed, n=1, start=start
        )
        first = prefill.client.request(
            "POST", "/v1/completions", {**body, "kv_transfer_params": PREFILL_TRANSFER_PARAMS}
        )
        prefill_s = time.perf_counter() - clock
        params = first.get("kv_transfer_params")
        if not params:
            raise RuntimeError(
                f"{prefill.name} answered a prefill request without kv_transfer_params: it runs without the "
                "prefill role's KV connector (inference.disaggregation)"
            )
        last = len(prompt) - 1
        body = decode.client.completion_body(
            prompt, max_tokens=max_tokens, temperature=temperature, seed=seed, n=1, start=last
        )
        second = decode.client.request("POST", "/v1/completions", {**body, "kv_transfer_params": params})
        decode_s = time.perf_counter() - clock - prefill_s
        loaded = int((second.get("kv_transfer_params") or {}).get(LOADED_TOKENS) or 0)
        [choice] = second["choices"]
        [prefilled] = first["choices"]
        sample = build_sample(
            prompt_index=prompt_index,
            choice_index=choice_index,
            prompt_token_ids=prompt,
            token_ids=choice["token_ids"],
            logprobs=(choice.get("logprobs") or {}).get("token_logprobs") or [],
            routed_experts=None,  # stitched below
            routed_experts_prompt_start=start,
            num_experts=decode.client.num_experts,
            finish_reason=choice.get("finish_reason"),
        )
        try:
            experts = decode.client.num_experts
            # A vLLM before 0.30 answers both requests' rows from 0 (`routes_from`): the decode engine's rows of the
            # prompt tokens whose KV it loaded are stale, and are dropped with the rest before `last`.
            head = routes_from(
                prefilled.get("routed_experts"), start=start, rows=len(prompt) - start, num_experts=experts
            )
            tail = routes_from(
                choice.get("routed_experts"), start=last, rows=len(choice["token_ids"]), num_experts=experts
            )
            routes, boundary_agrees = stitch_disaggregated(
                head, tail, prompt_len=len(prompt), generated_len=len(choice["token_ids"]), num_experts=experts
            )
        except RoutingDataError as exc:
            return _with_routes(sample, None, f"prefill/decode routes: {exc}")
        route_field = prefilled.get("routed_experts")
        with self._count:
            self.stats.add(
                loaded_tokens=loaded,
                boundary_disagreements=int(not boundary_agrees),
                prefill_s=prefill_s,
                decode_s=decode_s,
                prefill_route_bytes=len(route_field) if isinstance(route_field, str) else 0,
            )
        return _with_routes(sample, routes, None)


def _with_routes(sample: RolloutSample, routes: RoutedExperts | None, error: str | None) -> RolloutSample:
    return replace(sample, routes=routes, routes_error=error)


@dataclass
class PDStats:
    """What the prefill → decode path did, summed over the group's samples (logged after every rollout)."""

    samples: int = 0
    loaded_tokens: int = 0
    """Prompt tokens whose KV decode engines loaded instead of computing (R3StorageConnector says; NIXL does not)."""
    boundary_disagreements: int = 0
    """Samples whose decode engine routed the prompt's last token otherwise than the prefill engine."""
    prefill_s: float = 0.0
    """Seconds of the prefill requests, each from send to answer (requests overlap: a sum, not wall time)."""
    decode_s: float = 0.0
    prefill_route_bytes: int = 0
    """The prompt routes' field in the prefill answers (base64 .npy): the routes moved to the driver beside the
    decode engine's."""

    def add(self, **amounts: float) -> None:
        self.samples += 1
        for name, amount in amounts.items():
            setattr(self, name, getattr(self, name) + amount)

    def since(self, before: PDStats) -> str:
        n = self.samples - before.samples
        per = max(n, 1)
        return (
            f"{n} samples; per sample: prefill request {(self.prefill_s - before.prefill_s) / per * 1e3:.1f} ms, "
            f"decode request {(self.decode_s - before.decode_s) / per * 1e3:.1f} ms, "
            f"{(self.prefill_route_bytes - before.prefill_route_bytes) / per:.0f} bytes of prompt routes, "
            f"{(self.loaded_tokens - before.loaded_tokens) / per:.1f} prompt tokens' KV loaded; "
            f"{self.boundary_disagreements - before.boundary_disagreements} boundary disagreements"
        )
