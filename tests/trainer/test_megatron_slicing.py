"""Pure index mapping / slicing of the Megatron replay, checked against megatron-core's own functions.

The multi-rank part runs 2 real gloo processes on CPU: megatron's `get_batch_on_this_cp_rank` (CP zig-zag),
`scatter_to_sequence_parallel_region` (SP) and a PP=2 GPTModel with a dense first layer (global layer
numbers of each stage's routers) are compared with `cp_zigzag`, `sp_shard` and `plan_micro_batch`.
"""

from __future__ import annotations

import inspect
import os
import socket

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core", reason="megatron-core not installed (pip extra `megatron`)")

from r3operator.trainer.replay.megatron import (  # noqa: E402
    UNCAPTURED,
    MegatronReplayError,
    ParallelLayout,
    adopt_layer_numbers,
    cp_zigzag,
    instance_layers,
    pack_rows,
    plan_micro_batch,
    sp_shard,
    to_router_rows,
)

pytestmark = pytest.mark.slow


def routes(b: int = 2, s: int = 8, layers: int = 4, experts: int = 16, k: int = 3, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(b, s, layers, experts, generator=g).argsort(-1)[..., :k]


def test_dense_layers_are_skipped_by_global_layer_number() -> None:
    x = routes()
    x[:, :, 0] = 0  # vLLM reports zeros for the dense layer 0
    plan = plan_micro_batch(x, None, [1, 3], ParallelLayout())
    assert len(plan.per_layer) == 2
    assert torch.equal(plan.per_layer[0], x[:, :, 1].transpose(0, 1).reshape(-1, 3))
    assert torch.equal(plan.per_layer[1], x[:, :, 3].transpose(0, 1).reshape(-1, 3))
    assert plan.per_layer[0].dtype == torch.int64


def test_router_rows_are_sequence_major() -> None:
    x = torch.arange(2 * 3).view(2, 3, 1)  # [B=2, S=3, K=1], value = b*3 + s
    assert to_router_rows(x).flatten().tolist() == [0, 3, 1, 4, 2, 5]  # row s*B + b


def test_rows_without_a_route_are_marked_uncaptured_and_flagged() -> None:
    x = routes(b=1, s=4, layers=2)
    x[0, 0] = 0  # a row without a route carries whatever the batch put there (zeros): it is masked
    mask = torch.tensor([[True, False, False, True]])
    plan = plan_micro_batch(x, mask, [0, 1], ParallelLayout(), num_experts=16)
    for layer, t in enumerate(plan.per_layer):  # B=1: router rows = positions
        assert (t[[0, 3]] == UNCAPTURED).all()
        assert torch.equal(t[[1, 2]], x[0, 1:3, layer])
    assert torch.equal(plan.padding_mask, mask)


def test_out_of_range_layer_and_expert_are_refused() -> None:
    with pytest.raises(MegatronReplayError, match="global layer 4"):
        plan_micro_batch(routes(), None, [4], ParallelLayout())
    with pytest.raises(MegatronReplayError, match=r"outside \[0, 8\)"):
        plan_micro_batch(routes(experts=16), None, [0], ParallelLayout(), num_experts=8)


def test_layer_count_duplicates_and_zero_rows_on_moe_layers_are_refused() -> None:
    with pytest.raises(MegatronReplayError, match="routes cover 4 layers but the model has 5 decoder layers"):
        plan_micro_batch(routes(), None, [1], ParallelLayout(), num_experts=16, num_layers=5)
    zero = routes()
    zero[1, 2, 1] = 0  # an unmasked all-zero row on MoE layer 1 would replay expert 0 three times
    with pytest.raises(MegatronReplayError, match=r"MoE layer 1: row 10 is all zero \[0, 0, 0\].*padding mask"):
        plan_micro_batch(zero, None, [1, 3], ParallelLayout(), num_experts=16, num_layers=4)
    masked = torch.zeros(2, 8, dtype=torch.bool)
    masked[1, 2] = True  # the same row flagged "no route" is fine
    plan_micro_batch(zero, masked, [1, 3], ParallelLayout(), num_experts=16, num_layers=4)
    plan_micro_batch(zero, None, [3], ParallelLayout(), num_experts=16, num_layers=4)  # layer 1 dense here
    dup = routes()
    dup[0, 5, 3] = torch.tensor([7, 2, 7])
    with pytest.raises(MegatronReplayError, match=r"MoE layer 3: row 5 repeats an expert id \[7, 2, 7\]"):
        plan_micro_batch(dup, None, [1, 3], ParallelLayout(), num_experts=16, num_layers=4)


def test_packing_keeps_the_inputs_token_order() -> None:
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])
    attn = (ids != 0).long()
    x = routes(s=4)
    packed_ids = pack_rows(ids, attn)
    assert packed_ids.tolist() == [[5, 6, 7, 8, 9]]
    packed = pack_rows(x, attn)
    assert torch.equal(packed[0, 3], x[1, 0]) and packed.shape[:2] == (1, 5)
    plan = plan_micro_batch(x, None, [2], ParallelLayout(packed=True), attention_mask=attn)
    assert torch.equal(plan.per_layer[0], packed[0, :, 2])


def test_cp_and_sp_shapes_and_errors() -> None:
    x = torch.arange(8).view(1, 8)
    assert cp_zigzag(x, 2, 0).tolist() == [[0, 1, 6, 7]] and cp_zigzag(x, 2, 1).tolist() == [[2, 3, 4, 5]]
    assert sp_shard(x, 2, 1).tolist() == [[4, 5, 6, 7]]
    with pytest.raises(MegatronReplayError, match="2\\*contextParallelSize"):
        cp_zigzag(torch.zeros(1, 6), 2, 0)


class _Inst:
    def __init__(self, n: int | None) -> None:
        self.layer_number = n


def test_instance_layers_need_unique_layer_numbers() -> None:
    assert instance_layers([_Inst(2), _Inst(4)]) == [1, 3]
    with pytest.raises(MegatronReplayError, match="no layer_number"):
        instance_layers([_Inst(None)])
    with pytest.raises(MegatronReplayError, match="stale instances"):
        instance_layers([_Inst(2), _Inst(2)])


# --- two gloo ranks: compare with megatron-core's own slicing ---------------------------------------------


def _worker(rank: int, port: int, queue: object) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import scatter_to_sequence_parallel_region
    from megatron.core.utils import get_batch_on_this_cp_rank

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    out: dict[str, object] = {}
    x = routes(b=2, s=8, layers=3)
    tokens = torch.arange(16).view(2, 8)
    # CP=2: megatron slices tokens; our routes must follow them row for row.
    ps.initialize_model_parallel(context_parallel_size=2)
    cp_group = ps.get_context_parallel_group()
    batch = {"tokens": tokens, "cu_seqlens": None}
    # megatron-core 0.19 added a positional `is_hybrid_cp`; 0.16 (CI's Python 3.11) has only cp_group.
    if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters:
        got = get_batch_on_this_cp_rank(batch, False, cp_group=cp_group)
    else:
        got = get_batch_on_this_cp_rank(batch, cp_group=cp_group)
    ours = cp_zigzag(tokens, 2, ps.get_context_parallel_rank())
    plan = plan_micro_batch(x, None, [0, 2], ParallelLayout(cp_size=2, cp_rank=ps.get_context_parallel_rank()))
    expect = x[:, :, 2].gather(1, got["tokens"].remainder(8)[..., None].expand(2, 4, 3))
    out["cp"] = torch.equal(got["tokens"], ours) and torch.equal(plan.per_layer[1], to_router_rows(expect))
    ps.destroy_model_parallel()
    # TP=2 + SP: hidden states [S, B, H] are scattered on dim 0.
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    hidden = torch.arange(8 * 2, dtype=torch.float32).view(8, 2, 1)  # value = s*2 + b
    mine = scatter_to_sequence_parallel_region(hidden).view(-1).long()  # router row order of this rank
    layout = ParallelLayout(tp_size=2, tp_rank=ps.get_tensor_model_parallel_rank(), sequence_parallel=True)
    pos = torch.arange(8).view(1, 8, 1, 1).expand(2, 8, 1, 1) * 2 + torch.arange(2).view(2, 1, 1, 1)
    plan = plan_micro_batch(pos, None, [0], layout)
    out["sp"] = torch.equal(plan.per_layer[0].view(-1), mine)
    ps.destroy_model_parallel()
    # PP=2 with a dense first layer: each stage's routers carry their global layer numbers.
    from types import SimpleNamespace

    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from r3operator.trainer.megatron.config import transformer_config
    from r3operator.trainer.megatron.parallel import ParallelSizes

    ps.initialize_model_parallel(pipeline_model_parallel_size=2)
    hf = SimpleNamespace(
        model_type="qwen3_moe",
        num_hidden_layers=4,
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_experts=16,
        num_experts_per_tok=3,
        norm_topk_prob=True,
        rms_norm_eps=1e-6,
        mlp_only_layers=[0],
        decoder_sparse_step=1,
    )
    cfg = transformer_config(hf, ParallelSizes(pp=2), dtype=torch.float32, device="cpu")
    RouterReplay.clear_global_router_replay_instances()
    stage = GPTModel(
        config=cfg,
        transformer_layer_spec=get_gpt_decoder_block_spec(cfg, False, "RMSNorm"),
        vocab_size=64,
        max_sequence_length=64,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
    )
    adopt_layer_numbers(stage)
    layers = instance_layers(RouterReplay.global_router_replay_instances)
    out["pp_layers"] = layers
    routes4 = routes(layers=4, experts=16)
    plan = plan_micro_batch(routes4, None, layers, ParallelLayout())
    RouterReplay.set_replay_data(plan.per_layer)  # len == local instances, or ValueError
    out["pp_data"] = all(
        torch.equal(inst.target_topk_idx, to_router_rows(routes4[:, :, layer]))
        for inst, layer in zip(RouterReplay.global_router_replay_instances, layers, strict=True)
    )
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    queue.put((rank, out))  # type: ignore[attr-defined]


def test_slicing_matches_megatron_on_two_gloo_ranks() -> None:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for rank in (0, 1):
        assert results[rank]["cp"], f"CP zig-zag differs from get_batch_on_this_cp_rank on rank {rank}"
        assert results[rank]["sp"], f"SP slice differs from scatter_to_sequence_parallel_region on rank {rank}"
        assert results[rank]["pp_data"]
    # 4 layers, layer 0 dense: stage 0 builds layers 0-1 (one router, global layer 1), stage 1 layers 2-3.
    assert results[0]["pp_layers"] == [1] and results[1]["pp_layers"] == [2, 3]
