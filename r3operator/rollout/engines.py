"""Rollout engines behind one typed façade: a vLLM `LLM` in a Ray actor, or `vllm serve` over HTTP.

The driver never passes method names as strings to Ray: `RayEngine` exposes typed methods that call
the actor's methods (`self._actor.generate.remote(...)`). Besides generation, an engine has one transport call,
`send`, that carries a weight-sync message (`wire/sync_messages.py`) to its workers' extension
(`r3operator.engine.worker`, `r3_handle`) or to vLLM's own weight-transfer API; the sync itself is `weightsync/`'s.
"""

from __future__ import annotations

import json
import os
import tempfile
import urllib.request
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, TypeVar, cast

import numpy as np

from r3operator.rollout.actor import EngineActor
from r3operator.rollout.base import MAX_CHUNKS_IN_FLIGHT, Engine, Greedy
from r3operator.rollout.client import salted
from r3operator.routing.sample import RolloutSample
from r3operator.wire.retry import Backoff, http_transient, ray_transient, ready_backoff, retry_call
from r3operator.wire.sync_messages import (
    STAMPING,
    AbortPacked,
    BeginPacked,
    FinishPacked,
    InitTransfer,
    LoadPacked,
    LoadPackedFile,
    SyncMessage,
    UpdateWeights,
    WorldSize,
)
from r3operator.wire.weights import PackedChunk

A = TypeVar("A")


def _submitted(ref: Any) -> Any:
    """What `RayEngine._call` waits for when the task was submitted already: its reference."""
    return ref


class RayEngine:
    """Typed façade over an `EngineActor` handle.

    The actor restarts up to `max_restarts` times when its process dies (Ray re-runs the constructor: the
    engine comes back with the model's original weights and policy tag None, so the driver re-syncs it).
    A call that outlives `call_timeout_s` kills the actor so that it restarts instead of hanging the run.
    """

    def __init__(
        self,
        model_dir: Path,
        *,
        device: str,
        dtype: str,
        seed: int,
        max_model_len: int,
        max_restarts: int = 3,
        call_timeout_s: float = 600.0,
        backoff: Backoff | None = None,
        ready: Backoff | None = None,
        name: str = "ray engine 0",
        weight_transfer_backend: str | None = None,
        gpu_memory_utilization: float | None = None,
        capture_routes: bool = True,
        engine_flags: Sequence[str] = (),
    ) -> None:
        import ray

        options: dict[str, Any] = {"num_cpus": 1, "max_restarts": max_restarts, "max_task_retries": 0}
        env = {"RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": str(os.cpu_count() or 1)}
        if device.startswith("cuda"):
            options["num_gpus"] = 0.5  # trainer (the driver) and engine share one GPU locally
        actor_cls = ray.remote(EngineActor).options(**options, runtime_env={"env_vars": env})
        # Ray types a handle's methods as the class's plain methods (`.remote` is typed only for methods
        # declared with @ray.method, which would type EngineActor's direct calls wrongly): this façade's
        # signatures carry the types instead.
        self._actor: Any = actor_cls.remote(
            str(model_dir),
            device=device,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            weight_transfer_backend=weight_transfer_backend,
            gpu_memory_utilization=gpu_memory_utilization,
            capture_routes=capture_routes,
            engine_flags=tuple(engine_flags),
        )
        self.weight_transfer_backend = weight_transfer_backend
        self._ray = ray
        self.name = name
        self.call_timeout_s = call_timeout_s
        self.backoff = backoff or Backoff.from_env()
        self.ready = ready or ready_backoff()
        self._in_flight: list[Any] = []
        self.wait_ready()  # surfaces init errors here

    def _call(self, what: str, submit: Callable[[], Any], *, retry: bool = True) -> Any:
        def once() -> Any:
            try:
                return self._ray.get(submit(), timeout=self.call_timeout_s)
            except self._ray.exceptions.GetTimeoutError:
                self._ray.kill(self._actor, no_restart=False)  # hung: restart it (within max_restarts)
                raise

        backoff = self.backoff if retry else Backoff(attempts=1, sleep=self.backoff.sleep)
        return retry_call(once, what=f"{self.name}: {what}", backoff=backoff, transient=ray_transient)

    def wait_ready(self) -> None:
        retry_call(
            lambda: self._ray.get(self._actor.vllm_version.remote(), timeout=self.call_timeout_s),
            what=f"{self.name}: waiting for the engine to start",
            backoff=self.ready,
            transient=ray_transient,
        )

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
        batch = list(map(list, prompts))
        starts = None if routed_experts_prompt_start is None else [int(s) for s in routed_experts_prompt_start]
        remote = self._actor.generate.remote
        return self._call("generate", lambda: remote(batch, max_tokens, temperature, seed, n, starts))

    def send(self, message: SyncMessage[A]) -> A:
        """The sync's one transport call (`Engine.send`) through the actor's `send`. A packed chunk is submitted
        without waiting (one `ray.put` per chunk, shared by every engine): at most `MAX_CHUNKS_IN_FLIGHT` load
        while the next is packed, and every one must have loaded before the bracket closes, so a failed chunk
        raises before the finish and the caller aborts the bracket."""
        if isinstance(message, LoadPacked):
            self._submit_chunk(message)
            return cast(A, 0)
        if isinstance(message, (BeginPacked, AbortPacked)):
            self._in_flight = []
        elif isinstance(message, FinishPacked):
            pending, self._in_flight = self._in_flight, []
            self._call("load weight chunks", lambda: pending, retry=False)
        remote = self._actor.send.remote
        return cast(A, self._call(message.what, lambda: remote(message), retry=message.retry))

    def _submit_chunk(self, message: LoadPacked) -> None:
        chunk = message.chunk
        if "ray" not in chunk.handles:
            chunk.handles["ray"] = self._ray.put(chunk.buffer)
        # The buffer goes as its own argument, which Ray resolves to a read-only view of the object store.
        bare = LoadPacked(PackedChunk(np.empty(0, dtype=np.uint8), chunk.entries))
        self._in_flight.append(self._actor.send.remote(bare, chunk.handles["ray"]))
        while len(self._in_flight) > MAX_CHUNKS_IN_FLIGHT:
            self._call("load weight chunk", partial(_submitted, self._in_flight.pop(0)), retry=False)

    def greedy(self, prompts: Sequence[Sequence[int]], *, max_tokens: int) -> list[Greedy]:
        batch = list(map(list, prompts))
        return self._call("greedy decode", lambda: self._actor.greedy.remote(batch, max_tokens))

    def vllm_version(self) -> str:
        return self._call("vLLM version", self._actor.vllm_version.remote)

    def shutdown(self) -> None:
        self._ray.kill(self._actor)


# --------------------------------------------------------------------------------------- over HTTP


class HTTPEngine:
    """An engine Service running `vllm serve --worker-extension-cls r3operator.engine.worker....`.

    Rollouts use `/v1/completions` (`OpenAIHTTPClient`). Weight sync writes each chunk as safetensors on
    the shared volume (`staging_dir`) and calls the extension via vLLM's `/collective_rpc` dev route
    (served only with `VLLM_SERVER_DEV_MODE=1` in the engine's environment); aborts also `/reset_prefix_cache`.
    Readiness is vLLM's `GET /health`; a restarted pod serves the model's original weights with policy tag
    None.
    """

    def __init__(
        self,
        base_url: str,
        *,
        staging_dir: Path,
        num_experts: int | None,
        timeout_s: float = 600,
        backoff: Backoff | None = None,
        ready: Backoff | None = None,
    ) -> None:
        from r3operator.rollout.client import OpenAIHTTPClient

        self.base_url = base_url.rstrip("/")
        self.name = self.base_url
        self.staging_dir = staging_dir
        self.timeout_s = timeout_s
        self.backoff = backoff or Backoff.from_env()
        self.ready = ready or ready_backoff()
        self.wait_ready()
        self.client = OpenAIHTTPClient(base_url, num_experts=num_experts, timeout_s=timeout_s, backoff=self.backoff)

    def _post(self, path: str, body: dict[str, Any] | None = None, *, retry: bool = True) -> Any:
        return self.client.request("POST", path, body or {}, retry=retry)

    def _rpc_all(self, message: SyncMessage[Any], *, retry: bool) -> list[Any]:
        """Every worker's result of `message` in the extension (vLLM answers {"results": [one per worker]})."""
        result = self._post("/collective_rpc", {"method": "r3_handle", "args": [message.encode()]}, retry=retry)
        return list(result.get("results") or []) if isinstance(result, dict) else []

    def wait_ready(self) -> None:
        def healthy() -> None:
            with urllib.request.urlopen(self.base_url + "/health", timeout=min(self.timeout_s, 30.0)):
                return None

        retry_call(healthy, what=f"{self.name}: waiting for GET /health", backoff=self.ready, transient=http_transient)

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
        return self.client.generate(
            prompts,
            max_tokens=max_tokens,
            temperature=temperature,
            seed=seed,
            n=n,
            routed_experts_prompt_start=routed_experts_prompt_start or 0,
        )

    def send(self, message: SyncMessage[A]) -> A:
        """The sync's one transport call (`Engine.send`): vLLM's own weight-transfer routes for its
        messages (dev mode, like `/collective_rpc`), else `/collective_rpc` to every worker's `r3_handle`. A packed
        chunk is staged once on the shared volume for every engine (a buffer is not JSON), then loaded from there."""
        if isinstance(message, WorldSize):
            results = [(self.client.request("GET", "/get_world_size") or {})["world_size"]]
        elif isinstance(message, InitTransfer):
            self._post("/init_weight_transfer_engine", {"init_info": message.init_info}, retry=False)
            results = []
        elif isinstance(message, UpdateWeights):
            self._post("/update_weights", {"update_info": json_safe_update_info(message.update_info)}, retry=False)
            results = []
        elif isinstance(message, LoadPacked):
            results = self._rpc_all(LoadPackedFile(self._stage(message.chunk)), retry=False)
        else:
            results = self._rpc_all(message, retry=message.retry)
        if isinstance(message, STAMPING):
            self._new_policy(message.policy_tag)
        elif message.clears_prefix_cache:
            self._post("/reset_prefix_cache")
        return message.answer(results)

    def _stage(self, chunk: PackedChunk) -> str:
        """The chunk as safetensors on the shared volume: one file for every engine, removed by `chunk.release`."""
        if "file" not in chunk.handles:
            import torch
            from safetensors.torch import save_file

            self.staging_dir.mkdir(parents=True, exist_ok=True)
            fd, name = tempfile.mkstemp(suffix=".safetensors", dir=self.staging_dir)
            os.close(fd)
            save_file({"buffer": torch.from_numpy(chunk.buffer)}, name, metadata={"entries": json.dumps(chunk.entries)})
            chunk.handles["file"] = name
            chunk.releases.append(partial(Path(name).unlink, missing_ok=True))
        return str(chunk.handles["file"])

    def _new_policy(self, policy_tag: str | None) -> None:
        """After a finished sync: the next requests salt the prefix cache with the new policy (rollout/client.py
        `salted`: no stale block is hit again), or without a tag the scheduler's cache is reset (its own route)."""
        if not salted(self.client, policy_tag):
            self._post("/reset_prefix_cache")

    def greedy(self, prompts: Sequence[Sequence[int]], *, max_tokens: int) -> list[Greedy]:
        samples = self.client.generate(prompts, max_tokens=max_tokens, temperature=0.0, seed=0, n=1)
        return [Greedy(list(s.token_ids), [float(x) for x in s.logprobs], s.routes) for s in samples]

    def vllm_version(self) -> str:
        return str((self.client.request("GET", "/version") or {}).get("version"))

    def shutdown(self) -> None:
        return None


def json_safe_update_info(update_info: dict[str, Any]) -> dict[str, Any]:
    """CUDA IPC handles are not JSON: over HTTP vLLM takes them pickled + base64 as `ipc_handles_pickled`
    (the engine needs VLLM_ALLOW_INSECURE_SERIALIZATION=1). NCCL update infos are plain JSON already."""
    if update_info.get("ipc_handles") is None:
        return update_info
    import base64
    import pickle

    out = {k: v for k, v in update_info.items() if k != "ipc_handles"}
    out["ipc_handles_pickled"] = base64.b64encode(pickle.dumps(update_info["ipc_handles"])).decode()
    return out


class EngineGroup:
    """All engines of the job: prompts are split across them; a weight sync goes to every one
    (`weightsync/`)."""

    def __init__(self, engines: Sequence[Engine]) -> None:
        if not engines:
            raise ValueError("no rollout engines")
        self.engines = list(engines)

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
        """Every prompt's samples; `routed_experts_prompt_start` is passed on only when given, so an engine
        that predates multi-turn rollouts still serves single-turn ones."""
        starts = routed_experts_prompt_start
        if starts is not None and len(starts) != len(prompts):
            raise ValueError(f"{len(starts)} routed_experts_prompt_start values for {len(prompts)} prompts")
        if len(self.engines) == 1:
            extra: dict[str, Any] = {} if starts is None else {"routed_experts_prompt_start": starts}
            return self.engines[0].generate(
                prompts, max_tokens=max_tokens, temperature=temperature, seed=seed, n=n, **extra
            )
        from concurrent.futures import ThreadPoolExecutor
        from dataclasses import replace

        def one(global_i: int) -> list[RolloutSample]:
            # Seeds follow the global prompt index (request_seed), so the split does not change samples.
            engine = self.engines[global_i % len(self.engines)]
            extra: dict[str, Any] = {} if starts is None else {"routed_experts_prompt_start": [starts[global_i]]}
            part = engine.generate(
                [prompts[global_i]],
                max_tokens=max_tokens,
                temperature=temperature,
                seed=seed + global_i * n,
                n=n,
                **extra,
            )
            return [replace(s, prompt_index=global_i, sample_id=f"p{global_i}-c{s.choice_index}") for s in part]

        with ThreadPoolExecutor(max_workers=len(self.engines)) as pool:
            return [s for part in pool.map(one, range(len(prompts))) for s in part]

    def greedy(self, prompts: Sequence[Sequence[int]], *, max_tokens: int) -> list[Greedy]:
        return self.engines[0].greedy(prompts, max_tokens=max_tokens)

    def greedy_all(self, prompts: Sequence[Sequence[int]], *, max_tokens: int) -> list[list[Greedy]]:
        return [engine.greedy(prompts, max_tokens=max_tokens) for engine in self.engines]

    def vllm_version(self) -> str:
        return self.engines[0].vllm_version()

    def shutdown(self) -> None:
        for engine in self.engines:
            engine.shutdown()
