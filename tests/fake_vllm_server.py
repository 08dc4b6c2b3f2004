"""A fake `vllm serve` on 127.0.0.1 (aiohttp, in a thread) that fails on request (not a test module).

It serves what the runtime uses: `/health`, `/version`, `/v1/models`, `/v1/completions` (token ids,
logprobs, base64-npy routed experts for a 4-layer top-4 of 32 experts model, from the request's
`routed_experts_prompt_start` on), `/collective_rpc` for the r3_ weight-sync methods (with the engine-side
bracket and policy tag) and `/reset_prefix_cache`.

`script[path]` is a queue of what the next requests to `path` get: "ok", an HTTP status (int), "drop"
(the connection is closed without an answer) or "hang" (no answer until the server stops). `restart()`
stands for a restarted pod: original weights, no open bracket, policy tag None.
"""

from __future__ import annotations

import asyncio
import base64
import io
import threading
from collections import defaultdict, deque
from typing import Any

import numpy as np
from aiohttp import web

# The message kinds this stand-in answers, by the worker-extension method they run (engine/worker.py `r3_handle`).
EXTENSION_METHOD = {
    "begin_packed": "r3_begin_weight_update",
    "load_packed_file": "r3_load_packed_file",
    "finish_packed": "r3_finish_weight_update",
    "abort_packed": "r3_abort_weight_update",
    "policy_tag": "r3_policy_tag",
}


class FakeVLLMServer:
    def __init__(self) -> None:
        self.script: dict[str, deque[str | int]] = defaultdict(deque)
        self.log: list[str] = []  # "path" or "/collective_rpc:<method>", in arrival order
        self.starts: list[int] = []  # routed_experts_prompt_start of each completion request
        self.tag: str | None = None
        self.bracket_open = False
        self.on_completion: Any = None  # called before answering each completion (e.g. restart mid-rollout)
        self._loop = asyncio.new_event_loop()
        self._release = asyncio.Event()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None
        self.url = ""

    # -- lifecycle ------------------------------------------------------------------------------------
    def __enter__(self) -> FakeVLLMServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=30)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)

    async def _start(self) -> None:
        self._release = asyncio.Event()
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/version", self._version)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/collective_rpc", self._rpc)
        app.router.add_post("/reset_prefix_cache", self._reset)
        self._runner = web.AppRunner(app, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    async def _stop(self) -> None:
        self._release.set()
        if self._runner is not None:
            await self._runner.cleanup()

    def restart(self) -> None:
        self.tag, self.bracket_open = None, False

    # -- fault injection ------------------------------------------------------------------------------
    async def _fault(self, request: web.Request, name: str) -> web.StreamResponse | None:
        self.log.append(name)
        queue = self.script.get(name)
        action = queue.popleft() if queue else "ok"
        if action == "ok":
            return None
        if action == "drop":
            assert request.transport is not None
            request.transport.abort()
            return web.Response()
        if action == "hang":
            await self._release.wait()
            return web.Response(status=503)
        return web.json_response({"error": f"injected HTTP {action}"}, status=int(action))

    # -- routes ---------------------------------------------------------------------------------------
    async def _health(self, request: web.Request) -> web.StreamResponse:
        return await self._fault(request, "/health") or web.Response()

    async def _version(self, request: web.Request) -> web.StreamResponse:
        return await self._fault(request, "/version") or web.json_response({"version": "0.30.0-fake"})

    async def _models(self, request: web.Request) -> web.StreamResponse:
        return await self._fault(request, "/v1/models") or web.json_response({"data": [{"id": "tiny"}]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        if failed := await self._fault(request, "/v1/completions"):
            return failed
        if self.on_completion is not None:
            self.on_completion(self)
        body = await request.json()
        prompt, n, max_tokens = body["prompt"], body["n"], body["max_tokens"]
        start = int(body.get("routed_experts_prompt_start", 0))
        self.starts.append(start)
        choices = []
        for j in range(n):
            rng = np.random.default_rng([body["seed"], j])
            tokens = rng.integers(3, 512, size=max_tokens).tolist()
            base = rng.integers(0, 32, size=(len(prompt) + max_tokens - 1 - start, 4, 1))
            buf = io.BytesIO()
            np.save(buf, ((base + np.arange(4)) % 32).astype(np.int32))
            choices.append(
                {
                    "index": j,
                    "token_ids": tokens,
                    "prompt_token_ids": prompt,
                    "finish_reason": "length",
                    "logprobs": {"token_logprobs": [-1.0] * max_tokens},
                    "routed_experts": base64.b64encode(buf.getvalue()).decode(),
                    "tag": self.tag,
                }
            )
        return web.json_response({"choices": choices})

    async def _rpc(self, request: web.Request) -> web.StreamResponse:
        """The worker extension's one entry point: each message (wire/sync_messages.py) runs the `r3_` method the real
        extension's `r3_handle` dispatches it to; the log and the fault script name that method."""
        body = await request.json()
        message = body.get("args", [{}])[0] if body["method"] == "r3_handle" else {}
        method = EXTENSION_METHOD.get(str(message.get("kind")), body["method"])
        if failed := await self._fault(request, f"/collective_rpc:{method}"):
            return failed
        result: Any = None
        if method == "r3_begin_weight_update":
            if self.bracket_open:
                return web.json_response({"error": "an update is already active"}, status=500)
            self.bracket_open, self.tag = True, None
        elif method == "r3_load_packed_file":
            if not self.bracket_open:
                return web.json_response({"error": "chunk outside a bracket"}, status=500)
            result = 1
        elif method == "r3_finish_weight_update":
            if not self.bracket_open:
                return web.json_response({"error": "finish without begin"}, status=500)
            self.bracket_open, self.tag = False, message.get("policy_tag")
            result = {"chunks": 1, "tensors": 1}
        elif method == "r3_abort_weight_update":
            self.bracket_open, self.tag = False, None
            result = {"layers_restored": 0}
        elif method == "r3_policy_tag":
            result = self.tag
        return web.json_response({"results": [result]})

    async def _reset(self, request: web.Request) -> web.StreamResponse:
        return await self._fault(request, "/reset_prefix_cache") or web.Response()
