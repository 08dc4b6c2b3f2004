"""GPU: the same vLLM rollout replayed through HF and through Megatron (R3), and TP=2/EP=2 under torchrun.

    PYTHONPATH=/tmp/site:. VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0 \
        python -m pytest tests/gpu/test_megatron_replay.py -m gpu -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def synthetic_batch(model_dir: Path, seed: int = 0) -> tuple[Any, Any]:
    """A right-padded `TrainBatch` with random distinct routes, no engine needed."""
    from transformers import AutoConfig

    from r3operator.trainer.batch import TrainBatch

    cfg = AutoConfig.from_pretrained(model_dir)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, cfg.vocab_size, (4, 64), generator=g)
    attn = torch.ones_like(ids)
    attn[1, 59:] = 0
    attn[3, 50:] = 0
    pad = ~attn.bool()
    routes = torch.rand(4, 64, cfg.num_hidden_layers, cfg.num_experts, generator=g).argsort(-1)
    routes = routes[..., : cfg.num_experts_per_tok]
    batch = TrainBatch(
        input_ids=ids * attn,
        attention_mask=attn,
        response_mask=(attn[:, 1:] * attn[:, :-1]).bool(),
        rollout_logprobs=torch.zeros(4, 63),
        advantages=torch.zeros(4),
        engine_routes=routes,
        route_pad=pad,
        sample_ids=[f"s{i}" for i in range(4)],
    )
    return batch, routes


@needs_cuda
def test_vllm_rollout_replayed_through_hf_and_megatron() -> None:
    pytest.importorskip("vllm")
    pytest.importorskip("megatron.core")
    from benchmarks.bench_megatron import main

    r = main(["--model", "gpu", "--device", "cuda", "--prompts", "16", "--max-tokens", "64", "--repeat", "2"])
    for name in ("hf", "megatron"):
        assert r[name]["replay_applied_pct"] == 100.0, name
        off, on = r[name]["abs_diff_mean"]
        assert on < off, f"{name}: replay did not reduce |Δlogprob| ({off} -> {on})"
    cross = r["hf_vs_megatron_replay_abs_diff"]
    assert cross["mean"] < 1e-3 and cross["max"] < 5e-2, cross


def _worker(out: Path) -> None:
    """torchrun --nproc_per_node 2: TP=2 (sequence parallel) + EP=2 Megatron vs HF replay on rank 0."""
    from r3operator.api.enums import ReplayMode
    from r3operator.api.v1alpha1 import MegatronSpec
    from r3operator.models import ensure_reference_model
    from r3operator.trainer.megatron import build_megatron_trainer

    model_dir = ensure_reference_model("gpu")
    # MoE + TP trains only with sequence parallel; without TE the backend swaps in tagged torch norms.
    spec = MegatronSpec(tensor_parallel_size=2, expert_parallel_size=2, sequence_parallel=True)
    tr = build_megatron_trainer(spec, model_dir, "cuda")
    batch, routes = synthetic_batch(model_dir)
    on = tr.logprobs(batch, routes, ReplayMode.R3, probe=True)
    rec = tr.logprobs(batch, None, ReplayMode.R2, probe=True)

    def loss(lp: Any, mb: Any) -> tuple[Any, dict[str, float]]:
        mask = mb.response_mask.to(lp.device)
        return -(lp * mask).sum() / mask.sum(), {}

    stats = tr.train_step(batch, routes, loss)
    sd = tr.hf_state_dict()
    if int(os.environ["RANK"]) == 0:
        from transformers import AutoModelForCausalLM

        from r3operator.trainer.logprobs import token_logprobs
        from r3operator.trainer.replay.hf import RouterReplay

        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
        replay = RouterReplay().install(hf)
        with torch.no_grad(), replay.armed(routes.cuda(), padding_mask=batch.route_pad.cuda()):
            ref = token_logprobs(hf, batch.input_ids.cuda(), batch.attention_mask.cuda()).cpu()
        cols = batch.response_mask  # rows without a route route naturally on both backends
        captured = ~batch.route_pad
        out.write_text(
            json.dumps(
                {
                    "max_diff": float((on.logprobs - ref)[cols].abs().max()),
                    "dispatch_equal": bool(torch.equal(on.used[captured], routes.sort(-1).values[captured])),
                    "r2_recorded_is_used": bool(torch.equal(rec.recorded.sort(-1).values, rec.used)),
                    "state_dict_keys_equal": set(sd) == set(hf.state_dict()),
                    "loss_finite": bool(torch.isfinite(torch.tensor(stats["loss"]))),
                }
            )
        )


@needs_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="TP=2/EP=2 needs 2 GPUs")
def test_tp2_ep2_sequence_parallel_under_torchrun(tmp_path: Path) -> None:
    pytest.importorskip("megatron.core")
    out = tmp_path / "tp2ep2.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", __file__, str(out)]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]),
    }
    subprocess.run(cmd, check=True, env=env, timeout=600)
    r = json.loads(out.read_text())
    assert r["dispatch_equal"] and r["r2_recorded_is_used"] and r["state_dict_keys_equal"] and r["loss_finite"], r
    assert r["max_diff"] < 1e-3, r


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
