"""The R3 canary: one short completion that must come back with routed experts of the right shape.

``RoutingReplayActive`` turns True only after an engine answered ``POST /v1/completions`` with a
``routed_experts`` field (base64 of an ``.npy`` array, vLLM >= 0.22) whose shape is
``[tokens, numLayers, topK]``. Anything else (capture off, wrong model, wrong shape, HTTP error) is
a failed canary with a message saying what came back.
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass

import aiohttp
import numpy as np

CANARY_PROMPT = "1 2 3 4"
CANARY_MAX_TOKENS = 2


@dataclass(frozen=True, slots=True)
class CanaryResult:
    ok: bool
    message: str
    engine_hash: str = ""
    """Engine spec hash the canary ran against; a new hash needs a new canary."""
    shape: tuple[int, ...] | None = None


def check_routed_experts(field: object, *, num_layers: int, top_k: int) -> CanaryResult:
    """Decode the OpenAI ``routed_experts`` field and check it is ``[*, numLayers, topK]``."""
    if field is None:
        return CanaryResult(False, "response has no routed_experts (is --enable-return-routed-experts on?)")
    if not isinstance(field, str):
        return CanaryResult(False, f"routed_experts is a {type(field).__name__}, expected base64 .npy text")
    try:
        array = np.load(io.BytesIO(base64.b64decode(field, validate=True)), allow_pickle=False)
    except (binascii.Error, ValueError, OSError, EOFError) as exc:
        return CanaryResult(False, f"routed_experts is not base64 of a .npy array: {exc}")
    shape = tuple(int(x) for x in array.shape)
    if len(shape) != 3 or shape[1:] != (num_layers, top_k):
        return CanaryResult(
            False, f"routed_experts shape {list(shape)}, expected [*, {num_layers}, {top_k}]", shape=shape
        )
    return CanaryResult(True, f"routed_experts shape {list(shape)} = [tokens, numLayers, topK]", shape=shape)


async def run_canary(
    base_url: str, *, model: str, num_layers: int, top_k: int, timeout_s: float = 10.0
) -> CanaryResult:
    body = {"model": model, "prompt": CANARY_PROMPT, "max_tokens": CANARY_MAX_TOKENS, "temperature": 0.0}
    url = base_url.rstrip("/") + "/v1/completions"
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session,
            session.post(url, json=body) as resp,
        ):
            if resp.status != 200:
                text = (await resp.text())[:300]
                return CanaryResult(False, f"POST {url}: HTTP {resp.status}: {text}")
            payload = await resp.json()
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        return CanaryResult(False, f"POST {url}: {type(exc).__name__}: {exc}")
    choices = payload.get("choices") if isinstance(payload, dict) else None
    if not choices:
        return CanaryResult(False, f"POST {url}: response has no choices")
    return check_routed_experts(choices[0].get("routed_experts"), num_layers=num_layers, top_k=top_k)
