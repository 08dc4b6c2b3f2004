"""Rollout engines behind one typed façade: a vLLM `LLM` in a Ray actor, or `vllm serve` over HTTP.

The driver never passes method names as strings to Ray: `RayEngine` exposes typed methods that call
the actor's methods (`self._actor.generate.remote(...)`). Weight sync goes through the worker extension
(`r3operator.engine.worker`) inside ONE layerwise-reload bracket, then the prefix cache is reset.
"""

from __future__ import annotations

import json
import os
import tempfile
import urllib.request
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

from r3operator.engine.rollout import RolloutSample
from r3operator.engine.worker import WORKER_EXTENSION_CLS


class Engine(Protocol):
    def generate(
        self, prompts: Sequence[Sequence[int]], *, max_tokens: int, temperature: float, seed: int, n: int
    ) -> list[RolloutSample]: ...

    def update_weights(self, chunks: Iterable[list[tuple[str, Any]]]) -> dict[str, int]: ...

    def greedy(self, prompts: Sequence[Sequence[int]], *, max_tokens: int) -> list[list[int]]: ...

    def weights_digest(self) -> str: ...

    def vllm_version(self) -> str: ...


# ---------------------------------------------------------------------------------- in a Ray actor


class EngineActor:
    """Ray actor body: one in-process vLLM `LLM` with routed-expert capture and the r3_ worker extension."""

    def __init__(self, model_dir: str, *, device: str, dtype: str, seed: int, max_model_len: int) -> None:
        from r3operator.engine.llm import apply_engine_env, llm_kwargs
        from r3operator.engine.plugin import register, self_check

        apply_engine_env(device)
        register()  # vLLM also loads it via the entry point; idempotent
        self_check()
        from r3operator.engine.rollout import InProcessLLMClient

        kwargs = llm_kwargs(
            model_dir,
            device=device,
            seed=seed,
            max_model_len=max_model_len,
            dtype=dtype,
            extra={"skip_tokenizer_init": True, "worker_extension_cls": WORKER_EXTENSION_CLS},
        )
        self.client = InProcessLLMClient(**kwargs)
        self.llm = self.client.llm

    def generate(
        self, prompts: Sequence[Sequence[int]], max_tokens: int, temperature: float, seed: int, n: int
    ) -> list[RolloutSample]:
        return self.client.generate(prompts, max_tokens=max_tokens, temperature=temperature, seed=seed, n=n)

    def begin_weight_update(self) -> None:
        self.llm.collective_rpc("r3_begin_weight_update")

    def load_chunk(self, chunk: list[tuple[str, Any]]) -> int:
        return int(sum(self.llm.collective_rpc("r3_load_chunk", args=(chunk,))))

    def finish_weight_update(self) -> dict[str, int]:
        result = self.llm.collective_rpc("r3_finish_weight_update")[0]
        self.llm.reset_prefix_cache()  # cached blocks (and their routes) predate the new weights
        return result

    def abort_weight_update(self) -> None:
        self.llm.collective_rpc("r3_abort_weight_update")

    def greedy(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def weights_digest(self) -> str:
        return str(self.llm.collective_rpc("r3_weights_digest")[0])

    def vllm_version(self) -> str:
        import vllm

        return str(vllm.__version__)


class RayEngine:
    """Typed façade over an `EngineActor` handle."""

    def __init__(self, model_dir: Path, *, device: str, dtype: str, seed: int, max_model_len: int) -> None:
        import ray

        options: dict[str, Any] = {"num_cpus": 1}
        env = {"RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": str(os.cpu_count() or 1)}
        if device.startswith("cuda"):
            options["num_gpus"] = 0.5  # trainer (the driver) and engine share one GPU locally
        actor_cls = ray.remote(EngineActor).options(**options, runtime_env={"env_vars": env})
        self._actor = actor_cls.remote(
            str(model_dir), device=device, dtype=dtype, seed=seed, max_model_len=max_model_len
        )
        self._ray = ray
        ray.get(self._actor.vllm_version.remote())  # wait for start; surfaces init errors here

    def generate(
        self, prompts: Sequence[Sequence[int]], *, max_tokens: int, temperature: float, seed: int, n: int
    ) -> list[RolloutSample]:
        return self._ray.get(self._actor.generate.remote(list(map(list, prompts)), max_tokens, temperature, seed, n))

    def update_weights(self, chunks: Iterable[list[tuple[str, Any]]]) -> dict[str, int]:
        self._ray.get(self._actor.begin_weight_update.remote())
        try:
            for chunk in chunks:
                self._ray.get(self._actor.load_chunk.remote(chunk))
        except BaseException:
            self._ray.get(self._actor.abort_weight_update.remote())
            raise
        return self._ray.get(self._actor.finish_weight_update.remote())

    def greedy(self, prompts: Sequence[Sequence[int]], *, max_tokens: int) -> list[list[int]]:
        return self._ray.get(self._actor.greedy.remote(list(map(list, prompts)), max_tokens))

    def weights_digest(self) -> str:
        return self._ray.get(self._actor.weights_digest.remote())

    def vllm_version(self) -> str:
        return self._ray.get(self._actor.vllm_version.remote())

    def shutdown(self) -> None:
        self._ray.kill(self._actor)


# --------------------------------------------------------------------------------------- over HTTP


class HTTPEngine:
    """An engine Service running `vllm serve --worker-extension-cls r3operator.engine.worker....`.

    Rollouts use `/v1/completions` (`OpenAIHTTPClient`). Weight sync writes each chunk as safetensors on
    the shared volume (`staging_dir`) and calls the extension via vLLM's `/collective_rpc` dev route
    (`VLLM_SERVER_DEV_MODE=1`, set by the operator), then `/reset_prefix_cache`.
    """

    def __init__(self, base_url: str, *, staging_dir: Path, num_experts: int | None, timeout_s: float = 600) -> None:
        from r3operator.engine.rollout import OpenAIHTTPClient

        self.base_url = base_url.rstrip("/")
        self.staging_dir = staging_dir
        self.timeout_s = timeout_s
        self.client = OpenAIHTTPClient(base_url, num_experts=num_experts, timeout_s=timeout_s)

    def _post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        req = urllib.request.Request(self.base_url + path, data=json.dumps(body or {}).encode(), method="POST")
        req.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
            raw = resp.read()
        return json.loads(raw) if raw else None

    def _rpc(self, method: str, *args: str) -> Any:
        return self._post("/collective_rpc", {"method": method, "args": list(args)})

    def generate(
        self, prompts: Sequence[Sequence[int]], *, max_tokens: int, temperature: float, seed: int, n: int
    ) -> list[RolloutSample]:
        return self.client.generate(prompts, max_tokens=max_tokens, temperature=temperature, seed=seed, n=n)

    def update_weights(self, chunks: Iterable[list[tuple[str, Any]]]) -> dict[str, int]:
        from safetensors.torch import save_file

        self.staging_dir.mkdir(parents=True, exist_ok=True)
        self._rpc("r3_begin_weight_update")
        count = 0
        try:
            for chunk in chunks:
                fd, name = tempfile.mkstemp(suffix=".safetensors", dir=self.staging_dir)
                os.close(fd)
                try:
                    save_file(dict(chunk), name)
                    self._rpc("r3_load_chunk_from_file", name)
                finally:
                    Path(name).unlink(missing_ok=True)
                count += 1
        except BaseException:
            self._rpc("r3_abort_weight_update")
            raise
        self._rpc("r3_finish_weight_update")
        self._post("/reset_prefix_cache")
        return {"chunks": count}

    def greedy(self, prompts: Sequence[Sequence[int]], *, max_tokens: int) -> list[list[int]]:
        samples = self.client.generate(prompts, max_tokens=max_tokens, temperature=0.0, seed=0, n=1)
        return [list(s.token_ids) for s in samples]

    def weights_digest(self) -> str:
        result = self._rpc("r3_weights_digest")
        return str(result["results"][0] if isinstance(result, dict) else result[0])

    def vllm_version(self) -> str:
        with urllib.request.urlopen(self.base_url + "/version", timeout=30) as resp:
            return str(json.loads(resp.read()).get("version"))

    def shutdown(self) -> None:
        return None


class EngineGroup:
    """All engines of the job: prompts are split across them; weight sync goes to every one."""

    def __init__(self, engines: Sequence[Engine]) -> None:
        if not engines:
            raise ValueError("no rollout engines")
        self.engines = list(engines)

    def generate(
        self, prompts: Sequence[Sequence[int]], *, max_tokens: int, temperature: float, seed: int, n: int
    ) -> list[RolloutSample]:
        if len(self.engines) == 1:
            return self.engines[0].generate(prompts, max_tokens=max_tokens, temperature=temperature, seed=seed, n=n)
        from concurrent.futures import ThreadPoolExecutor
        from dataclasses import replace

        def one(global_i: int) -> list[RolloutSample]:
            # Seeds follow the global prompt index (request_seed), so the split does not change samples.
            engine = self.engines[global_i % len(self.engines)]
            part = engine.generate(
                [prompts[global_i]], max_tokens=max_tokens, temperature=temperature, seed=seed + global_i * n, n=n
            )
            return [replace(s, prompt_index=global_i, sample_id=f"p{global_i}-c{s.choice_index}") for s in part]

        with ThreadPoolExecutor(max_workers=len(self.engines)) as pool:
            return [s for part in pool.map(one, range(len(prompts))) for s in part]

    def update_weights(self, chunks_factory: Any) -> dict[str, int]:
        result: dict[str, int] = {}
        for engine in self.engines:
            result = engine.update_weights(chunks_factory())
        return result

    def greedy(self, prompts: Sequence[Sequence[int]], *, max_tokens: int) -> list[list[int]]:
        return self.engines[0].greedy(prompts, max_tokens=max_tokens)

    def greedy_all(self, prompts: Sequence[Sequence[int]], *, max_tokens: int) -> list[list[list[int]]]:
        return [engine.greedy(prompts, max_tokens=max_tokens) for engine in self.engines]

    def weights_digest(self) -> str:
        return self.engines[0].weights_digest()

    def vllm_version(self) -> str:
        return self.engines[0].vllm_version()

    def shutdown(self) -> None:
        for engine in self.engines:
            engine.shutdown()  # type: ignore[attr-defined]
