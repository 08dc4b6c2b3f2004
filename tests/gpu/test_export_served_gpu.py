"""On CUDA and the GPU image's vLLM (0.22.1): an export of the `gpu` reference model after a few training steps, in
the engines' dtype (bf16) and in fp32, loaded into a fresh vLLM engine from its directory alone (as `vllm serve`
loads a model), gives the trainer's logprobs on probe sequences within the weight canary's tolerance for that dtype
on CUDA (weightsync/canary.py: bf16 0.25, fp32 at TF32's roundoff 0.031); the model the training started from does
not. The CPU twin is tests/runtime/test_export_e2e.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from r3operator.runtime.export import publish_local, stage, verify_export  # noqa: E402
from r3operator.weightsync.canary import canary_tolerance  # noqa: E402

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[1, 17, 233, 41, 9], [1, 412, 3, 3], [1, 2, 150, 151, 152]]
ANSWERS = [[300, 301, 302, 2], [1900, 77, 2], [5, 6, 7, 8, 2]]
PROBES = [p + a for p, a in zip(PROMPTS, ANSWERS, strict=True)]


def trainer_logprobs(trainer: Any, layers: int, top_k: int, *, compute: bool) -> list[list[float]]:
    """Each probe token's logprob given the ones before it, every router choosing on its own (nothing to replay in
    a served model); `compute`: under the trainer's bf16 autocast, like a bf16 engine."""
    found = []
    for probe in PROBES:
        routes = torch.zeros((1, len(probe), layers, top_k), dtype=torch.int64)
        natural = torch.ones((1, len(probe)), dtype=torch.bool)
        logp = torch.log_softmax(trainer.canary_forward(probe, routes, natural, compute=compute).logits.float(), -1)
        found.append([float(logp[i, probe[i + 1]]) for i in range(len(probe) - 1)])
    return found


def worst(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def test_exports_served_by_vllm_on_cuda_give_the_trainers_logprobs(tmp_path: Path) -> None:
    from transformers import AutoConfig

    from r3operator.models import ensure_reference_model
    from r3operator.trainer.hf_policy import PolicyTrainer

    model_dir = ensure_reference_model("gpu")
    config = AutoConfig.from_pretrained(model_dir)
    layers, top_k = int(config.num_hidden_layers), int(config.num_experts_per_tok)
    trainer = PolicyTrainer(model_dir, device="cuda", learning_rate=1e-3, seed=0, compute_dtype="bfloat16")
    for _ in range(5):
        trainer.sft_step(PROMPTS, ANSWERS)
    exports = {}
    for dtype in ("bfloat16", "float32"):
        staged = stage(
            trainer,
            step=5,
            staging_root=tmp_path / "staging",
            model_dir=model_dir,
            dtype=dtype,
            chunk_size_mb=512,
            about={},
        )
        exports[dtype] = publish_local(staged, tmp_path / dtype)
        assert verify_export(exports[dtype])["dtype"] == dtype
    want_bf16 = trainer_logprobs(trainer, layers, top_k, compute=True)
    want_fp32 = trainer_logprobs(trainer, layers, top_k, compute=False)
    del trainer
    torch.cuda.empty_cache()

    models = [
        [str(exports["bfloat16"]), "bfloat16"],
        [str(exports["float32"]), "float32"],
        [str(model_dir), "bfloat16"],
    ]
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tests" / "runtime" / "vllm_probe.py"),
            json.dumps(models),
            json.dumps(PROBES),
            "cuda",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    bf16, fp32, start = json.loads(done.stdout.strip().splitlines()[-1])
    figures = {"bf16": worst(bf16, want_bf16), "fp32": worst(fp32, want_fp32), "start": worst(start, want_bf16)}
    print(f"max |Δlogprob| served vs trainer: {json.dumps(figures)}")
    assert figures["bf16"] <= canary_tolerance("bfloat16", "cuda").logprob, figures
    assert figures["fp32"] <= canary_tolerance("float32", "cuda").logprob, figures
    assert figures["start"] > 1.0, figures  # the comparison tells the trained policy from where it started
