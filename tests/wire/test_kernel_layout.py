"""The kernel-format layout (wire/kernel_layout.py) against vLLM's own loader.

The reference is vLLM: its `Qwen3MoeForCausalLM`, built from the tiny reference model's config on CPU, loads
the trainer's checkpoint-format tensors with its own `load_weights` (no post-load processing, so no CPU
prepack: the loaded layout), and every parameter must come out bit-equal to the tensor the kernel layout
builds for it from the same state dict. A mapping with gate and up swapped must be caught.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from r3operator.wire.kernel_layout import (
    EngineParameter,
    KernelLayoutError,
    engine_parameters,
    kernel_metadata,
    kernel_tensors,
    plan_kernel_layout,
    trainer_shapes,
)

pytestmark = pytest.mark.slow

SENTINEL = 1234.0


@pytest.fixture(scope="module")
def trainer_state() -> dict[str, Any]:
    """The trainer's state dict of the tiny model (transformers 5: experts fused), random bf16 values so
    that a swapped or misplaced block cannot go unnoticed."""
    import torch
    from transformers import Qwen3MoeForCausalLM

    from r3operator.models.reference import get_spec

    with torch.device("meta"):
        hf = Qwen3MoeForCausalLM(get_spec("tiny").hf_config())
    generator = torch.Generator().manual_seed(0)
    return {
        name: torch.randn(tuple(t.shape), generator=generator, dtype=torch.float32).to(torch.bfloat16)
        for name, t in hf.state_dict().items()
    }


@pytest.fixture(scope="module")
def vllm_loaded(trainer_state: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """vLLM's parameters after its own `load_weights` of the checkpoint tensors (experts unfused)."""
    pytest.importorskip("vllm")
    from benchmarks.bench_engine_load import build_engine_model, engine_config
    from r3operator.wire.weights import checkpoint_tensors

    with engine_config("tiny") as config:
        model = build_engine_model(config, "cpu")
        for param in model.parameters():  # a value no loaded tensor holds everywhere
            param.data.fill_(SENTINEL)
        model.load_weights(checkpoint_tensors(trainer_state))
        params = {name: p.detach().clone() for name, p in model.named_parameters()}
    untouched = [name for name, p in params.items() if bool((p == SENTINEL).all())]
    assert untouched == [], "vLLM's loader left parameters unloaded: the reference itself is incomplete"
    yield params


def _engine(params: dict[str, Any]) -> list[EngineParameter]:
    return engine_parameters([(n, str(p.dtype), tuple(p.shape)) for n, p in params.items()])


def _mismatches(built: dict[str, Any], reference: dict[str, Any]) -> list[str]:
    import torch

    return [
        name
        for name, ref in reference.items()
        if built[name].dtype != ref.dtype
        or built[name].shape != ref.shape
        or not torch.equal(built[name].view(torch.int16), ref.view(torch.int16))
    ]


def test_every_parameter_is_bit_equal_to_vllms_load_weights(
    trainer_state: dict[str, Any], vllm_loaded: dict[str, Any]
) -> None:
    import torch

    plan = plan_kernel_layout(trainer_shapes(trainer_state), _engine(vllm_loaded))
    built = dict(kernel_tensors(trainer_state, plan, dtype=torch.bfloat16))
    assert list(built) == list(vllm_loaded)  # one tensor per vLLM parameter, in its order
    assert _mismatches(built, vllm_loaded) == []
    meta = kernel_metadata(plan, dtype=torch.bfloat16)
    assert [(n, tuple(s)) for n, _, s in meta] == [(n, tuple(t.shape)) for n, t in built.items()]
    # the point of the layout: far fewer tensors than the checkpoint format's per-expert ones
    assert any(".w13_weight" in n for n in built) and len(built) < len(trainer_state) * 2


def test_vllm_022s_direct_copy_of_the_kernel_tensors_gives_vllms_own_load(
    trainer_state: dict[str, Any], vllm_loaded: dict[str, Any]
) -> None:
    """What the engine does with them (vLLM 0.22.1 `update_weights`, kernel format: `model.get_parameter(name)
    .copy_(weight)` per tensor, under the worker extension's `no_grad`) into a fresh vLLM model: every name
    resolves and the result is vLLM's own `load_weights` of the checkpoint tensors."""
    import torch

    from benchmarks.bench_engine_load import build_engine_model, engine_config, load_sync_kernel

    plan = plan_kernel_layout(trainer_shapes(trainer_state), _engine(vllm_loaded))
    with engine_config("tiny") as config:
        model = build_engine_model(config, "cpu")
        for param in model.parameters():
            param.data.fill_(SENTINEL)
        written = load_sync_kernel(model, [list(kernel_tensors(trainer_state, plan, dtype=torch.bfloat16))])
        params = {name: p.detach() for name, p in model.named_parameters()}
    assert written == len(vllm_loaded)
    assert _mismatches(params, vllm_loaded) == []


def test_per_expert_trainer_tensors_give_the_same_parameters(
    trainer_state: dict[str, Any], vllm_loaded: dict[str, Any]
) -> None:
    """A trainer whose state dict names experts one by one (a Megatron export, older transformers)."""
    import torch

    from r3operator.wire.weights import checkpoint_tensors

    per_expert = dict(checkpoint_tensors(trainer_state))
    plan = plan_kernel_layout(trainer_shapes(per_expert), _engine(vllm_loaded))
    built = dict(kernel_tensors(per_expert, plan, dtype=torch.bfloat16))
    assert _mismatches(built, vllm_loaded) == []


@pytest.mark.parametrize("per_expert", [False, True], ids=["fused", "per-expert"])
def test_gate_and_up_swapped_is_caught(
    trainer_state: dict[str, Any], vllm_loaded: dict[str, Any], per_expert: bool
) -> None:
    import torch

    from r3operator.wire.weights import checkpoint_tensors

    state = dict(checkpoint_tensors(trainer_state)) if per_expert else trainer_state
    plan = plan_kernel_layout(trainer_shapes(state), _engine(vllm_loaded), order=("up_proj", "gate_proj"))
    built = dict(kernel_tensors(state, plan, dtype=torch.bfloat16))
    wrong = _mismatches(built, vllm_loaded)
    assert wrong and all(".w13_weight" in n or ".gate_up_proj." in n for n in wrong)


def test_a_parameter_of_another_shape_is_named(trainer_state: dict[str, Any]) -> None:
    shapes = trainer_shapes(trainer_state)
    q = "model.layers.0.self_attn.q_proj.weight"
    k, v = q.replace("q_proj", "k_proj"), q.replace("q_proj", "v_proj")
    rows = shapes[q][0] + shapes[k][0] + shapes[v][0]
    # a tensor-parallel engine (2 ranks) reports half the rows
    engine = [EngineParameter("model.layers.0.self_attn.qkv_proj.weight", "bfloat16", (rows // 2, shapes[q][1]))]
    with pytest.raises(KernelLayoutError, match=r"model\.layers\.0\.self_attn\.qkv_proj\.weight has shape"):
        plan_kernel_layout({q: shapes[q], k: shapes[k], v: shapes[v]}, engine)


def test_a_parameter_without_source_and_a_tensor_without_parameter_are_named(trainer_state: dict[str, Any]) -> None:
    shapes = trainer_shapes(trainer_state)
    with pytest.raises(KernelLayoutError, match=r"engine parameter model\.extra\.weight .*has no model\.extra\.weight"):
        plan_kernel_layout(shapes, [EngineParameter("model.extra.weight", "bfloat16", (2, 2))])
    engine = [EngineParameter("model.norm.weight", "bfloat16", shapes["model.norm.weight"])]
    with pytest.raises(KernelLayoutError, match=r"trainer tensor .* goes into no engine parameter"):
        plan_kernel_layout(shapes, engine)


def test_vllm_cpu_engines_refuse_the_kernel_layout() -> None:
    """On CPU, vLLM's MoE backend prepacks w13/w2 after loading: the served layout is not the loaded one, and
    the worker extension says so (engine/worker.py `kernel_layout_refusal`), on vLLM's real model."""
    pytest.importorskip("vllm")
    from benchmarks.bench_engine_load import build_engine_model, engine_config
    from r3operator.engine.worker import kernel_layout_refusal

    with engine_config("tiny") as config:
        model = build_engine_model(config, "meta")
    reason = kernel_layout_refusal(model)
    assert reason is not None and "CPU MoE backend" in reason and "mlp.experts" in reason
