"""A Hugging Face directory from each trainer backend: the HF policy in one process, FSDP2 over two gloo ranks (the
shards gathered), Megatron (converted to HF names). Each export is loaded back by transformers, which knows nothing
of the trainer, and must compute the trainer's own logits; the sharded layout, and a NaN weight refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from r3operator.trainer.hf_export import (  # noqa: E402
    INDEX_FILE,
    SINGLE_FILE,
    NonFiniteWeightsError,
    trainer_tensors,
    write_safetensors,
)

pytestmark = pytest.mark.slow
PROMPTS, ANSWERS = [[5, 6, 7], [8, 9, 10]], [[20, 21], [22, 23]]
PROBES = [[3, 17, 42, 8, 90, 5], [1, 2, 3, 4]]


def export_of(trainer: Any, model_dir: Path, out: Path, **kwargs: Any) -> list[str]:
    """The trainer's weights in fp32 and the model's config: what transformers needs to load it."""
    out.mkdir()
    files = write_safetensors(trainer_tensors(trainer, dtype=torch.float32, chunk_size_mb=1), out, **kwargs)
    shutil.copyfile(model_dir / "config.json", out / "config.json")
    return files


def hf_logits(directory: Path, sequence: list[int]) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        return model(input_ids=torch.tensor([sequence]), use_cache=False).logits[0].float()


def assert_loads_as(trainer: Any, directory: Path, *, atol: float) -> None:
    for probe in PROBES:
        torch.testing.assert_close(hf_logits(directory, probe), trainer.canary_logits(probe).float(), atol=atol, rtol=0)


def trained(trainer: Any, model_dir: Path) -> Any:
    """A few supervised steps: the weights no longer equal the files in `model_dir`."""
    for _ in range(3):
        trainer.sft_step(PROMPTS, ANSWERS)
    moved = max((hf_logits(model_dir, p) - trainer.canary_logits(p).float()).abs().max().item() for p in PROBES)
    assert moved > 1e-3, "the steps did not move the weights: the export could be the model it started from"
    return trainer


def test_the_hf_policy_exports_what_it_computes_sharded_or_not(tiny_moe_dir: Path, tmp_path: Path) -> None:
    from r3operator.trainer.hf_policy import PolicyTrainer

    trainer = trained(
        PolicyTrainer(tiny_moe_dir, device="cpu", learning_rate=1e-2, seed=0, compute_dtype="float32"), tiny_moe_dir
    )
    assert export_of(trainer, tiny_moe_dir, tmp_path / "one") == [SINGLE_FILE]
    assert_loads_as(trainer, tmp_path / "one", atol=0.0)

    files = export_of(trainer, tiny_moe_dir, tmp_path / "sharded", max_shard_bytes=64 << 10)
    shards = [f for f in files if f != INDEX_FILE]
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors", files
    index = json.loads((tmp_path / "sharded" / INDEX_FILE).read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for _, t in trainer_tensors(trainer, dtype=torch.float32, chunk_size_mb=1)
    )
    assert not list((tmp_path / "sharded").glob(".shard-*"))
    assert_loads_as(trainer, tmp_path / "sharded", atol=0.0)


def test_fsdp_shards_over_two_ranks_are_gathered_into_one_model(
    tiny_moe_dir: Path, tmp_path: Path, ray_started: None
) -> None:
    from r3operator.trainer.distributed import DistributedTrainer, PolicyOptions

    options = PolicyOptions(learning_rate=1e-2, seed=0, compute_dtype="float32")
    ranks = DistributedTrainer(tiny_moe_dir, world_size=2, device="cpu", options=options)
    try:
        trained(ranks, tiny_moe_dir)
        export_of(ranks, tiny_moe_dir, tmp_path / "fsdp")
        assert_loads_as(ranks, tmp_path / "fsdp", atol=1e-5)
    finally:
        ranks.close()


def test_megatron_exports_hf_names_transformers_loads(tmp_path: Path, tiny_moe: Any) -> None:
    pytest.importorskip("megatron.core", reason="megatron-core not installed (pip extra `megatron`)")
    from r3operator.trainer.megatron import build_megatron_trainer
    from r3operator.trainer.megatron.adapter import MegatronPolicyTrainer

    model_dir = tmp_path / "model"
    tiny_moe("qwen3_moe").save_pretrained(model_dir)
    trainer = MegatronPolicyTrainer(
        build_megatron_trainer(None, model_dir, "cpu", micro_batch_size=2), compute_dtype="float32"
    )
    trained(trainer, model_dir)
    export_of(trainer, model_dir, tmp_path / "megatron")
    # Megatron's and transformers' forwards sum in different orders: fp32 rounding, far below what one step moved.
    assert_loads_as(trainer, tmp_path / "megatron", atol=1e-4)


def test_a_non_finite_weight_refuses_the_export_naming_it(tmp_path: Path) -> None:
    tensors = [("a.weight", torch.ones(4)), ("b.weight", torch.tensor([1.0, float("nan")])), ("c.bias", torch.ones(2))]
    tmp_path.joinpath("out").mkdir()
    with pytest.raises(NonFiniteWeightsError, match=r"1 weight tensor\(s\) hold NaN or infinity \(b.weight\)"):
        write_safetensors(iter(tensors), tmp_path / "out", max_shard_bytes=8)
    # The shard before the bad one may be on disk, never under a name a reader takes for weights.
    assert not list((tmp_path / "out").glob("model*"))
    inf = [("x", torch.tensor([float("inf")], dtype=torch.bfloat16))]
    with pytest.raises(NonFiniteWeightsError, match=r"\(x\)"):
        write_safetensors(iter(inf), tmp_path / "out")
