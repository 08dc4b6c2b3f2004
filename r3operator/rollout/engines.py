"""Rollout engines behind one typed façade: a vLLM `LLM` in a Ray actor, or `vllm serve` over HTTP.

The driver never passes method names as strings to Ray: `RayEngine` exposes typed methods that call
the actor's methods (`self._actor.generate.remote(...)`). Weight sync goes through the worker extension
(`r3operator.engine.worker`) inside ONE layerwise-reload bracket, then the next requests are salted with the new policy.
"""

from __future__ import annotations

import json
import os
import tempfile
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from r3operator.rollout.actor import EngineActor
from r3operator.rollout.base import MAX_CHUNKS_IN_FLIGHT, Engine, Greedy
from r3operator.rollout.client import salted
from r3operator.wire.receipt import Fingerprint, parse_fingerprints
from r3operator.wire.retry import Backoff, http_transient, ray_transient, ready_backoff, retry_call
from r3operator.wire.sample import RolloutSample
from r3operator.wire.sync_phases import SyncPhases, chunk_seconds
from r3operator.wire.weights import PackedChunk


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

    def begin_weight_update(self) -> None:
        self._in_flight = []
        self._call("begin weight update", self._actor.begin_weight_update.remote, retry=False)

    def load_packed(self, chunk: PackedChunk) -> None:
        """Submit the chunk (one `ray.put` per chunk, shared by every engine) without waiting for it."""
        if "ray" not in chunk.handles:
            chunk.handles["ray"] = self._ray.put(chunk.buffer)
        self._in_flight.append(self._actor.load_packed.remote(chunk.handles["ray"], chunk.entries))
        while len(self._in_flight) > MAX_CHUNKS_IN_FLIGHT:
            self._call("load weight chunk", partial(_submitted, self._in_flight.pop(0)), retry=False)

    def release(self, chunk: PackedChunk) -> None:
        chunk.handles.pop("ray", None)  # submitted tasks keep their argument alive until they ran

    def finish_weight_update(self, policy_tag: str | None = None) -> dict[str, int]:
        # Every chunk must have loaded before the bracket closes: a failed chunk raises here, before
        # finalize, and the caller aborts the bracket.
        pending, self._in_flight = self._in_flight, []
        self._call("load weight chunks", lambda: pending, retry=False)
        return self._call(
            "finish weight update", lambda: self._actor.finish_weight_update.remote(policy_tag), retry=False
        )

    def abort_weight_update(self) -> None:
        self._in_flight = []
        self._call("abort weight update", self._actor.abort_weight_update.remote)

    # -- vLLM's native weight transfer (no retries inside a bracket, as for the packed path) ----------
    def native_world_size(self) -> int:
        return int(self._call("world size", self._actor.native_world_size.remote))

    def native_init(self, init_info: dict[str, Any]) -> None:
        self._call("init weight transfer", lambda: self._actor.native_init.remote(init_info), retry=False)

    def native_start(self, layout: str = "checkpoint") -> None:
        self._call("start weight update", lambda: self._actor.native_start.remote(layout), retry=False)

    def native_parameters(self) -> dict[str, Any]:
        return dict(self._call("parameter metadata", self._actor.native_parameters.remote))

    def native_parameter_fingerprints(self) -> list[dict[str, Fingerprint]]:
        answers = self._call("parameter fingerprints", self._actor.native_parameter_fingerprints.remote)
        return [parse_fingerprints(answer) for answer in answers]

    def native_update(self, update_info: dict[str, Any]) -> None:
        self._call("update weights", lambda: self._actor.native_update.remote(update_info), retry=False)

    def native_finish(self, policy_tag: str | None) -> None:
        self._call("finish weight update", lambda: self._actor.native_finish.remote(policy_tag), retry=False)

    def native_abort(self) -> None:
        self._call("abort weight update", self._actor.native_abort.remote)

    def native_direct_sync(self, update: dict[str, Any], policy_tag: str | None) -> None:
        self._call(
            "direct weight update", lambda: self._actor.native_direct_sync.remote(update, policy_tag), retry=False
        )

    def native_staged_attach(self, share: dict[str, Any]) -> None:
        self._call("attach staging buffer", lambda: self._actor.native_staged_attach.remote(share), retry=False)

    def native_staged_sync(self, policy_tag: str | None) -> None:
        self._call("staged weight update", lambda: self._actor.native_staged_sync.remote(policy_tag), retry=False)

    def native_mapped_attach(self, share: dict[str, Any]) -> list[dict[str, Any]]:
        return self._call("map parameters", lambda: self._actor.native_mapped_attach.remote(share), retry=False)

    def native_mapped_sync(self, number: int, policy_tag: str | None, timeout_s: float) -> None:
        self._call(
            "mapped weight update",
            lambda: self._actor.native_mapped_sync.remote(number, policy_tag, timeout_s),
            retry=False,
        )

    def device_uuids(self) -> list[str | None]:
        return self._call("device uuids", self._actor.device_uuids.remote)

    def policy_tag(self) -> str | None:
        return self._call("policy tag", self._actor.policy_tag.remote)

    def greedy(self, prompts: Sequence[Sequence[int]], *, max_tokens: int) -> list[Greedy]:
        batch = list(map(list, prompts))
        return self._call("greedy decode", lambda: self._actor.greedy.remote(batch, max_tokens))

    def sync_receipts(self) -> list[dict[str, Any]]:
        return self._call("sync receipts", self._actor.sync_receipts.remote)

    def weights_digest(self) -> str:
        return self._call("weights digest", self._actor.weights_digest.remote)

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

    def _rpc_all(self, method: str, *args: Any, retry: bool = True) -> list[Any]:
        """The extension method's result on every worker (vLLM answers {"results": [one per worker]})."""
        result = self._post("/collective_rpc", {"method": method, "args": list(args)}, retry=retry)
        return list(result.get("results") or []) if isinstance(result, dict) else []

    def _rpc(self, method: str, *args: Any, retry: bool = True) -> Any:
        """The extension method's result on the first worker."""
        results = self._rpc_all(method, *args, retry=retry)
        return results[0] if results else None

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

    def begin_weight_update(self) -> None:
        self.staging_dir.mkdir(parents=True, exist_ok=True)
        self._rpc("r3_begin_weight_update", retry=False)

    def load_packed(self, chunk: PackedChunk) -> None:
        """Stage the chunk once on the shared volume (one file for every engine), load it via RPC."""
        if "file" not in chunk.handles:
            import torch
            from safetensors.torch import save_file

            fd, name = tempfile.mkstemp(suffix=".safetensors", dir=self.staging_dir)
            os.close(fd)
            save_file({"buffer": torch.from_numpy(chunk.buffer)}, name, metadata={"entries": json.dumps(chunk.entries)})
            chunk.handles["file"] = name
        self._rpc("r3_load_packed_file", chunk.handles["file"], retry=False)

    def release(self, chunk: PackedChunk) -> None:
        if name := chunk.handles.pop("file", None):
            Path(name).unlink(missing_ok=True)

    def finish_weight_update(self, policy_tag: str | None = None) -> dict[str, int]:
        result = self._rpc("r3_finish_weight_update", *([policy_tag] if policy_tag else []), retry=False)
        self._new_policy(policy_tag)
        return result if isinstance(result, dict) else {}

    def abort_weight_update(self) -> None:
        self._rpc("r3_abort_weight_update")
        self._post("/reset_prefix_cache")

    # -- vLLM's native weight transfer: its routes (dev mode, like /collective_rpc) ---------------------
    def native_world_size(self) -> int:
        return int((self.client.request("GET", "/get_world_size") or {})["world_size"])

    def native_init(self, init_info: dict[str, Any]) -> None:
        self._post("/init_weight_transfer_engine", {"init_info": init_info}, retry=False)

    def native_start(self, layout: str = "checkpoint") -> None:
        # One round trip: our hook (weights in flux until the finish), then vLLM's own start on every worker.
        self._rpc("r3_native_begin", layout, retry=False)

    def native_parameters(self) -> dict[str, Any]:
        return dict(self._rpc("r3_parameter_metadata") or {})

    def native_parameter_fingerprints(self) -> list[dict[str, Fingerprint]]:
        return [parse_fingerprints(answer) for answer in self._rpc_all("r3_parameter_fingerprints")]

    def native_update(self, update_info: dict[str, Any]) -> None:
        self._post("/update_weights", {"update_info": json_safe_update_info(update_info)}, retry=False)

    def native_finish(self, policy_tag: str | None) -> None:
        self._rpc("r3_native_end", *([policy_tag] if policy_tag else []), retry=False)  # vLLM's finish, then ours
        self._new_policy(policy_tag)

    def _new_policy(self, policy_tag: str | None) -> None:
        """After a finished sync: the next requests salt the prefix cache with the new policy (rollout/client.py
        `salted`: no stale block is hit again), or without a tag the scheduler's cache is reset (its own route)."""
        if not salted(self.client, policy_tag):
            self._post("/reset_prefix_cache")

    def native_abort(self) -> None:
        self._rpc("r3_abort_native_weight_update")
        self._post("/reset_prefix_cache")

    def native_direct_sync(self, update: dict[str, Any], policy_tag: str | None) -> None:
        self._rpc("r3_direct_sync", update, policy_tag, retry=False)  # the whole bracket in one call
        self._new_policy(policy_tag)

    def native_staged_attach(self, share: dict[str, Any]) -> None:
        self._rpc("r3_staged_attach", share, retry=False)

    def native_staged_sync(self, policy_tag: str | None) -> None:
        self._rpc("r3_staged_sync", *([policy_tag] if policy_tag else []), retry=False)  # the bracket in one call
        self._new_policy(policy_tag)

    def native_mapped_attach(self, share: dict[str, Any]) -> list[dict[str, Any]]:
        return self._rpc_all("r3_mapped_attach", share, retry=False)

    def native_mapped_sync(self, number: int, policy_tag: str | None, timeout_s: float) -> None:
        self._rpc("r3_mapped_sync", number, policy_tag, timeout_s, retry=False)  # returns once the trainer wrote
        self._new_policy(policy_tag)

    def device_uuids(self) -> list[str | None]:
        return self._rpc_all("r3_device_uuid")

    def engine_build(self) -> str:
        """The engine's vLLM release and pod image (`r3_engine_build`): pairs a disaggregated job's roles."""
        return str(self._rpc("r3_engine_build"))

    def policy_tag(self) -> str | None:
        tags = set(self._rpc_all("r3_policy_tag") or [None])
        return tags.pop() if len(tags) == 1 else None  # every worker must hold the same policy

    def greedy(self, prompts: Sequence[Sequence[int]], *, max_tokens: int) -> list[Greedy]:
        samples = self.client.generate(prompts, max_tokens=max_tokens, temperature=0.0, seed=0, n=1)
        return [Greedy(list(s.token_ids), [float(x) for x in s.logprobs], s.routes) for s in samples]

    def sync_receipts(self) -> list[dict[str, Any]]:
        """Every worker's receipt of the last sync (a TP engine has one per worker)."""
        return self._rpc_all("r3_sync_receipt")

    def weights_digest(self) -> str:
        return str(self._rpc("r3_weights_digest"))

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
    """All engines of the job: prompts are split across them; weight sync goes to every one."""

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

    def update_weights(
        self, chunks: Iterable[PackedChunk], *, policy_tag: str | None = None, phases: SyncPhases | None = None
    ) -> dict[str, int]:
        """ONE layerwise-reload bracket per engine: begin once, every chunk, finish once, which stamps the engine
        with `policy_tag` (then its requests are salted with it). Each chunk is packed once and shipped to every
        engine; a failure aborts every bracket without finalising it (`r3_abort_weight_update`). `phases` gets
        the seconds of each phase (wire/sync_phases.py)."""
        clock = phases if phases is not None else SyncPhases()
        with clock("begin"):
            for engine in self.engines:
                engine.begin_weight_update()
        count, nbytes = 0, 0
        try:
            for chunk in clock.timed("produce", chunks):
                # The chunk says what it spent on the trainer's side; the rest of producing it (a trainer
                # rank's chunk crossing Ray) counts as gathering.
                own = chunk_seconds(chunk)
                clock.merge(own)
                clock.add("gather", clock.seconds.pop("produce", 0.0) - sum(own.values()))
                try:
                    with clock("transfer"):
                        for engine in self.engines:
                            engine.load_packed(chunk)
                finally:  # a failed chunk's staged file must not outlive the attempt either
                    for engine in self.engines:
                        engine.release(chunk)
                count, nbytes = count + 1, nbytes + chunk.nbytes
            clock.add("gather", clock.seconds.pop("produce", 0.0))
            with clock("finish"):
                results = [engine.finish_weight_update(policy_tag) for engine in self.engines]
        except BaseException:
            for engine in self.engines:
                try:
                    engine.abort_weight_update()
                except Exception as exc:  # keep the original error; the engine is probably gone
                    import logging

                    logging.getLogger(__name__).error(
                        "aborting the weight update on %s failed: %s", getattr(engine, "name", "an engine"), exc
                    )
            raise
        return {**(results[0] if results else {}), "chunks": count, "bytes": nbytes}

    def greedy(self, prompts: Sequence[Sequence[int]], *, max_tokens: int) -> list[Greedy]:
        return self.engines[0].greedy(prompts, max_tokens=max_tokens)

    def greedy_all(self, prompts: Sequence[Sequence[int]], *, max_tokens: int) -> list[list[Greedy]]:
        return [engine.greedy(prompts, max_tokens=max_tokens) for engine in self.engines]

    def weights_digest(self) -> str:
        return self.engines[0].weights_digest()

    def vllm_version(self) -> str:
        return self.engines[0].vllm_version()

    def shutdown(self) -> None:
        for engine in self.engines:
            engine.shutdown()
