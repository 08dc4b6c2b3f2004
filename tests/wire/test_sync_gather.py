"""The sync's gather (wire/weights.py `full_tensor`, wire/kernel_layout.py `kernel_tensors`): an FSDP2 DTensor on
a one-rank mesh is taken as its local tensor without DTensor's redistribution, one on several ranks is still
gathered whole, and a fused engine parameter is cast once with the same bytes as its parts cast one by one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

from r3operator.wire.kernel_layout import EngineParameter, kernel_tensors, plan_kernel_layout, trainer_shapes
from r3operator.wire.weights import full_tensor


def _whole(seed: int) -> torch.Tensor:
    return torch.randn(6, 5, generator=torch.Generator().manual_seed(seed))


def _rank(rank: int, world: int, store: str, out: str) -> None:
    """One trainer rank: its FSDP2-like parameter (Shard(0), requires grad) as the sync gathers it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        param = distribute_tensor(_whole(0), mesh, [Shard(0)]).requires_grad_()
        if world == 1:

            def refuse(*args: Any, **kwargs: Any) -> Any:
                raise AssertionError("a one-rank DTensor was redistributed")

            setattr(DTensor, "redistribute", refuse)  # noqa: B010  # this child process only
        got = full_tensor(param, dtype=torch.bfloat16)
        plain = full_tensor(param)
        shares = plain.untyped_storage().data_ptr() == param.to_local().untyped_storage().data_ptr()
        torch.save({"got": got, "plain": plain, "grad": plain.requires_grad, "shares": shares}, f"{out}/{rank}.pt")
    finally:
        dist.destroy_process_group()


def _gather_on(world: int, tmp_path: Path) -> list[dict[str, Any]]:
    mp.spawn(_rank, args=(world, str(tmp_path / "store"), str(tmp_path)), nprocs=world, join=True)
    return [torch.load(tmp_path / f"{rank}.pt") for rank in range(world)]


def test_a_one_rank_dtensor_is_its_local_tensor_without_redistribution(tmp_path: Path) -> None:
    (result,) = _gather_on(1, tmp_path)
    assert torch.equal(result["plain"], _whole(0)) and result["shares"] and not result["grad"]
    assert torch.equal(result["got"], _whole(0).to(torch.bfloat16))


def test_a_dtensor_sharded_over_two_ranks_is_still_gathered_whole(tmp_path: Path) -> None:
    for result in _gather_on(2, tmp_path):
        assert torch.equal(result["plain"], _whole(0)) and not result["shares"]
        assert torch.equal(result["got"], _whole(0).to(torch.bfloat16))


def test_a_plain_tensor_already_in_the_dtype_is_not_copied() -> None:
    tensor = torch.randn(4, 3, requires_grad=True)
    same = full_tensor(tensor, dtype=torch.float32, device="cpu")
    assert same.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr() and not same.requires_grad


class _Ops(TorchDispatchMode):
    """Counts the operators that move bytes: casts, concatenations and copies."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        for name, op in (("cast", torch.ops.aten._to_copy.default), ("cat", torch.ops.aten.cat.default)):
            self.seen[name] = self.seen.get(name, 0) + (func is op)
        self.seen["copy"] = self.seen.get("copy", 0) + (func is torch.ops.aten.copy_.default)
        return func(*args, **(kwargs or {}))


def test_a_fused_parameter_is_built_by_one_casting_copy_per_part_with_no_intermediate_tensor() -> None:
    g = torch.Generator().manual_seed(1)
    state = {
        f"layers.0.self_attn.{p}.weight": torch.randn(rows, 8, generator=g)
        for p, rows in (("q_proj", 8), ("k_proj", 4), ("v_proj", 4))
    }
    state |= {
        f"layers.0.mlp.experts.{e}.{p}.weight": torch.randn(6, 8, generator=g)
        for e in range(3)
        for p in ("gate_proj", "up_proj")
    }
    state["norm.weight"] = torch.randn(8, generator=g)
    engine = [
        EngineParameter("layers.0.self_attn.qkv_proj.weight", "bfloat16", (16, 8)),
        EngineParameter("layers.0.mlp.experts.w13_weight", "bfloat16", (3, 12, 8)),
        EngineParameter("norm.weight", "bfloat16", (8,)),
    ]
    plan = plan_kernel_layout(trainer_shapes(state), engine)
    counting = _Ops()
    with counting:
        built = dict(kernel_tensors(state, plan, dtype=torch.bfloat16))
    # every byte read once and written once into the parameter: q, k, v; 3 experts x (gate, up); the norm
    assert counting.seen == {"cast": 0, "cat": 0, "copy": 3 + 3 * 2 + 1}
    bf16 = {name: t.to(torch.bfloat16) for name, t in state.items()}
    qkv = [bf16[f"layers.0.self_attn.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")]
    experts = [
        torch.cat([bf16[f"layers.0.mlp.experts.{e}.{p}.weight"] for p in ("gate_proj", "up_proj")]) for e in range(3)
    ]
    assert torch.equal(built["layers.0.self_attn.qkv_proj.weight"], torch.cat(qkv))
    assert torch.equal(built["layers.0.mlp.experts.w13_weight"], torch.stack(experts))
    assert torch.equal(built["norm.weight"], bf16["norm.weight"])
    assert all(t.dtype == torch.bfloat16 and t.is_contiguous() for t in built.values())
