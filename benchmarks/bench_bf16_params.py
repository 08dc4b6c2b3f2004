"""The trainer's bf16 old-logprob pass against the engine's view of the same weights, after an update.

    python -m benchmarks.bench_bf16_params --layers 2 --lr 1e-5 1e-4 --out benchmarks/results/bf16-params.json

a3b-shaped layers (hidden 2048, 128 experts of 768, top-8, 32/4 heads of 128), vocabulary 2048, random
initialisation rounded to bf16 (W0, a bf16 checkpoint), loaded by the project's `PolicyTrainer` (fp32
masters, bf16 autocast). One Adam-like step W1 = W0 - lr * sign(noise) (Adam's first step is about
lr * sign(grad)) moves the masters off the bf16 grid. Three old-logprob passes (natural routing) of 4 random
rows of 96 tokens at W1:

- `rounded`: the trainer as it is (`trainer.bf16_params` on);
- `unrounded`: the hooks taken off, what the trainer computed before them (fp32 embedding and norm weights);
- `engine_view`: the hooks off and every parameter rounded to bf16 in place, the weights a bf16 engine holds.

It reports mean and max |Δlogprob| of `rounded` and of `unrounded` against `engine_view`, and the same at W0.
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchmarks.report_json import emit


def a3b_shaped(layers: int) -> Any:
    """The `a3b` reference model's layer (r3operator/models/reference.py, the one source of its shape), `layers`
    of it, randomly initialised by transformers and put on the bf16 grid (W0)."""
    import torch
    from transformers import Qwen3MoeForCausalLM

    from r3operator.models.reference import REFERENCE_SPECS

    torch.manual_seed(0)
    config = REFERENCE_SPECS["a3b"].model_copy(update={"num_hidden_layers": layers}).hf_config()
    # (mypy reads transformers' `to` as taking the model, as in hf_policy.)
    return Qwen3MoeForCausalLM(config).to(torch.bfloat16).eval()  # type: ignore[arg-type]


def passes(trainer: Any, batch: Any, w: Any) -> dict[str, Any]:
    """The three passes at weights `w(index, name)` (an fp32 tensor; made one at a time: 2 cores, 23 GB)."""
    import torch

    from r3operator.api.enums import ReplayMode
    from r3operator.trainer import bf16_params

    def load(rounded: bool) -> None:
        with torch.no_grad():
            for index, (name, param) in enumerate(trainer.model.named_parameters()):
                value = w(index, name)
                param.copy_(value.to(torch.bfloat16) if rounded else value)

    def lp() -> Any:
        return trainer.old_logprobs(batch, ReplayMode.DISABLED).logprobs

    load(False)
    bf16_params.install(trainer.model)
    out = {"rounded": lp()}
    bf16_params.uninstall(trainer.model)
    out["unrounded"] = lp()
    load(True)
    out["engine_view"] = lp()
    return out


def compare(out: dict[str, Any]) -> dict[str, float]:
    ref = out["engine_view"]
    row: dict[str, float] = {}
    for name in ("rounded", "unrounded"):
        diff = (out[name] - ref).abs()
        row[f"{name}_mean_abs"] = float(diff.mean())
        row[f"{name}_max_abs"] = float(diff.max())
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, nargs="+", default=[1e-5, 1e-4])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    import torch

    from r3operator.trainer.batch import TrainBatch
    from r3operator.trainer.hf_policy import PolicyTrainer

    start = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        a3b_shaped(args.layers).save_pretrained(tmp)
        trainer = PolicyTrainer(Path(tmp), device="cpu", learning_rate=1e-5, seed=0)
    w0 = {n: p.detach().to(torch.bfloat16) for n, p in trainer.model.named_parameters()}  # exact: on the grid
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(2, 2048, (4, 96), generator=g)
    batch = TrainBatch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        response_mask=torch.ones(4, 95, dtype=torch.bool),
        rollout_logprobs=torch.zeros(4, 95),
        advantages=torch.zeros(4),
        engine_routes=None,
        route_pad=None,
        sample_ids=[f"s{i}" for i in range(4)],
    )
    rows = [{"lr": 0.0, **compare(passes(trainer, batch, lambda i, n: w0[n].float()))}]
    print(rows[-1], flush=True)
    for lr in args.lr:

        def w1(index: int, name: str, lr: float = lr) -> Any:
            noise = torch.Generator().manual_seed(1000 + index)
            return w0[name].float() - lr * torch.sign(torch.randn(w0[name].shape, generator=noise))

        rows.append({"lr": lr, **compare(passes(trainer, batch, w1))})
        print(rows[-1], flush=True)
    result = {
        "benchmark": "bf16_params",
        "command": "python -m benchmarks.bench_bf16_params "
        + " ".join([f"--layers {args.layers}", "--lr", *map(str, args.lr)]),
        "date_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}",
        "model": f"a3b-shaped, {args.layers} layers, vocab 2048, W0 on the bf16 grid",
        "tokens": "4 rows x 96 random tokens, natural routing",
        "rows": rows,
        "wall_s": round(time.time() - start, 1),
    }
    emit(result, args.out)


if __name__ == "__main__":
    main()
