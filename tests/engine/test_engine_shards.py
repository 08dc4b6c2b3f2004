"""Each engine rank's part of the whole parameters (engine/shards.py), against vLLM's own `load_weights`.

The reference is vLLM's: its `Qwen3MoeForCausalLM` of the tiny reference config, built with two or four ranks under
gloo on the CPU (tests/engine/shard_ranks.py), loads the checkpoint with its own weight loaders; every parameter of
every rank must be, bit for bit, the part `parameter_shards` names of what the kernel builder makes of the same
checkpoint (wire/kernel_layout.py). Tensor-parallel 2 (q, k and v heads, gate and up, rows and columns, the
vocabulary, the experts' intermediate size), tensor-parallel 4 (fewer kv heads than ranks: each kv group held by two
ranks) and expert-parallel 2 (each rank half the experts, whole).
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
pytest.importorskip("vllm")

pytestmark = pytest.mark.slow

RANKS = Path(__file__).with_name("shard_ranks.py")


def _ranks(model: Path, out: Path, how: str, ranks: int) -> list[dict[str, Any]]:
    env = {**os.environ, "VLLM_DIST_IDENT": f"r3-shards-{how}-{ranks}-{os.getpid()}", "VLLM_CPU_KVCACHE_SPACE": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(RANKS.parents[2]), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, str(RANKS), str(model), str(out), how, str(ranks)],
        capture_output=True,
        text=True,
        check=False,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads((out / f"rank-{rank}.json").read_text()) for rank in range(ranks)]


@pytest.mark.parametrize(
    ("how", "ranks", "sharded"),
    [
        ("tp", 2, {"qkv_proj.weight", "o_proj.weight", "w13_weight", "w2_weight", "embed_tokens.weight"}),
        ("tp", 4, {"qkv_proj.weight", "o_proj.weight", "w13_weight", "w2_weight", "lm_head.weight"}),
        ("ep", 2, {"qkv_proj.weight", "o_proj.weight", "w13_weight", "w2_weight"}),
    ],
)
def test_every_ranks_part_of_the_kernel_builders_tensors_is_what_vllms_loader_put_there(
    tiny_model_dir: Path, tmp_path: Path, how: str, ranks: int, sharded: set[str]
) -> None:
    reports = _ranks(tiny_model_dir, tmp_path, how, ranks)
    for rank, report in enumerate(reports):
        assert report["refused"] is None
        wrong = [name for name, p in report["parameters"].items() if not p["equal"]]
        assert wrong == [], f"rank {rank}: {wrong}"
        held = {name for name, p in report["parameters"].items() if p["shard"] is not None}
        assert {suffix for suffix in sharded if any(name.endswith(suffix) for name in held)} == sharded
    # Every rank holds a different part of each sharded parameter, and the parts cover the whole between them
    # (expert-parallel: each expert on one rank; tensor-parallel: each row or column once, a kv group twice at 4).
    for name, first in reports[0]["parameters"].items():
        if first["shard"] is None:
            continue
        runs = [tuple(map(tuple, r["parameters"][name]["shard"]["runs"][0] or [])) for r in reports]
        if runs[0]:
            assert len(set(runs)) == ranks or (how, ranks) == ("tp", 4), name
    if how == "ep":
        experts = [r["parameters"]["model.layers.0.mlp.experts.routed_experts.w13_weight"]["shard"] for r in reports]
        assert [e["runs"][0] for e in experts] == [[[0, 16]], [[16, 16]]]  # linear placement, 32 experts


class QKVParallelLinear(torch.nn.Module):
    """Named as vLLM's layer, without the attributes engine/shards.py reads: another vLLM's layer."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(4, 2))


class VocabParallelEmbedding(torch.nn.Module):
    """A rank whose vocabulary part ends in padding rows (its loader leaves them; the trainer sends none)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(6, 2))
        self.org_vocab_size = 10
        self.shard_indices = type("Indices", (), {"org_vocab_start_index": 5, "org_vocab_end_index": 10})()


def test_a_layer_read_otherwise_is_no_shard_and_padding_rows_refuse_the_layout() -> None:
    from r3operator.engine.shards import parameter_shards

    model = torch.nn.ModuleDict({"attn": QKVParallelLinear(), "embed": torch.nn.Identity()})
    assert parameter_shards(model) == ({}, None)  # the plan then names the parameter if its shape is not the whole
    padded = torch.nn.ModuleDict({"embed_tokens": VocabParallelEmbedding()})
    assert parameter_shards(padded) == ({}, "embed_tokens.weight: its 6 rows hold 5 vocabulary rows and padding")
