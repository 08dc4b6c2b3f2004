"""Which part of each whole parameter this engine rank holds (wire/shards.py), read off vLLM's own layers.

Each sharded layer keeps what its weight loader narrows the checkpoint by (read in vLLM 0.30's
model_executor/layers/linear.py, vocab_parallel_embedding.py and fused_moe/; the reference test,
tests/engine/test_engine_shards.py, loads a checkpoint into a tensor- and an expert-parallel model with vLLM's own
`load_weights` and compares every parameter with what these shards take of the kernel builder's whole tensors):

- `QKVParallelLinear`: rank r holds q's heads [r·h, (r+1)·h) and k's and v's head group r // replicas (a group is
  held by `num_kv_head_replicas` ranks when there are fewer kv heads than ranks);
- `MergedColumnParallelLinear`: each fused part's r-th slice (gate's, then up's);
- `ColumnParallelLinear`: the r-th slice of the rows; `RowParallelLinear`: of the weight's columns (its bias whole);
- `VocabParallelEmbedding`, `ParallelLMHead`: the vocabulary rows of the rank, when no padding row is in its part;
- the routed experts (`w13_weight` [E, 2I, H], `w2_weight` [E, H, I]): the experts `expert_map` gives the rank, in its
  local order, and under tensor-parallel MoE the r-th slice of the intermediate size of gate, up and down.

A layer sharded in a way not read here reports its local shape; the trainer's plan then finds no source of that
shape and the sync stays in the checkpoint layout, saying which parameter (wire/kernel_layout.py).
"""

from __future__ import annotations

from typing import Any

from r3operator.wire.shards import Run, Shard, shard_of

# Any: vLLM's layers ship no types we can name here.


def parameter_shards(model: Any) -> tuple[dict[str, Shard], str | None]:
    """Each parameter of `model` this rank holds a part of, by name; and why the kernel layout cannot be right on this
    engine however it is sent (None: it can), for a sharding read here but not served as loaded."""
    shards: dict[str, Shard] = {}
    for module_name, module in model.named_modules():
        for local, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{local}" if module_name else local
            try:
                shard = _shard(module, local, tuple(param.shape))
            except _NotServedAsLoaded as exc:
                return {}, f"{name}: {exc}"
            except (AttributeError, TypeError, ValueError):
                # A layer of a vLLM whose attributes are not the ones read here (0.22.x's FusedMoE): its local shape
                # goes to the plan, which names the parameter if that is not the whole one. Never a failed sync.
                shard = None
            if shard is not None:
                shards[name] = shard
    return shards, None


class _NotServedAsLoaded(Exception):
    """A sharding whose served layout is not a part of the whole (the message says why)."""


def _kinds(module: Any) -> set[str]:
    return {cls.__name__ for cls in type(module).__mro__}


def _shard(module: Any, local: str, shape: tuple[int, ...]) -> Shard | None:
    kinds = _kinds(module)
    if "QKVParallelLinear" in kinds:
        return _qkv(module, shape)
    if "MergedColumnParallelLinear" in kinds:
        return _merged_column(module, shape)
    if "ColumnParallelLinear" in kinds:
        rows = int(module.output_size_per_partition)
        return shard_of((int(module.output_size), *shape[1:]), {0: [(int(module.tp_rank) * rows, rows)]})
    if "RowParallelLinear" in kinds:
        if local != "weight":
            return None  # the bias is whole on every rank
        cols = int(module.input_size_per_partition)
        return shard_of((shape[0], int(module.input_size)), {1: [(int(module.tp_rank) * cols, cols)]})
    if "VocabParallelEmbedding" in kinds:
        return _vocabulary(module, shape)
    if local in ("w13_weight", "w2_weight") and hasattr(module, "expert_map"):
        return _experts(module, local, shape)
    return None


def _qkv(module: Any, shape: tuple[int, ...]) -> Shard | None:
    head, v_head = int(module.head_size), int(getattr(module, "v_head_size", None) or module.head_size)
    q_whole, k_whole = int(module.total_num_heads) * head, int(module.total_num_kv_heads) * head
    v_whole = int(module.total_num_kv_heads) * v_head
    kv_heads = int(module.num_kv_heads)
    q_local, k_local, v_local = int(module.num_heads) * head, kv_heads * head, kv_heads * v_head
    rank, group = int(module.tp_rank), int(module.tp_rank) // int(module.num_kv_head_replicas)
    runs: list[Run] = [(rank * q_local, q_local), (q_whole + group * k_local, k_local)]
    runs.append((q_whole + k_whole + group * v_local, v_local))
    return shard_of((q_whole + k_whole + v_whole, *shape[1:]), {0: runs})


def _merged_column(module: Any, shape: tuple[int, ...]) -> Shard | None:
    sizes, ranks, rank = [int(s) for s in module.output_sizes], int(module.tp_size), int(module.tp_rank)
    runs, offset = [], 0
    for size in sizes:
        part = size // ranks
        runs.append((offset + rank * part, part))
        offset += size
    return shard_of((offset, *shape[1:]), {0: runs})


def _vocabulary(module: Any, shape: tuple[int, ...]) -> Shard | None:
    indices = module.shard_indices
    start, end = int(indices.org_vocab_start_index), int(indices.org_vocab_end_index)
    if end - start != shape[0]:
        raise _NotServedAsLoaded(f"its {shape[0]} rows hold {end - start} vocabulary rows and padding")
    return shard_of((int(module.org_vocab_size), *shape[1:]), {0: [(start, end - start)]})


def _experts(module: Any, local: str, shape: tuple[int, ...]) -> Shard | None:
    config = getattr(getattr(module, "moe_config", None), "moe_parallel_config", None) or getattr(
        module, "moe_parallel_config", None
    )
    if config is not None and getattr(config, "enable_eplb", False):
        raise _NotServedAsLoaded("EPLB places redundant physical experts: the rank's blocks are not logical experts")
    experts = int(module.global_num_experts)
    expert_map = module.expert_map
    if expert_map is None:
        held: list[Run] = [(0, experts)]
    else:  # global expert -> this rank's index, -1 where another rank holds it
        placed = enumerate(expert_map.tolist())
        by_local = sorted((int(local_index), g) for g, local_index in placed if local_index >= 0)
        held = [(g, 1) for _, g in by_local]
    tp_size = int(getattr(config, "tp_size", 1) or 1)
    tp_rank = int(getattr(config, "tp_rank", 0) or 0) if tp_size > 1 else 0
    inter_local = int(module.intermediate_size_per_partition)
    inter = inter_local * tp_size
    if local == "w13_weight":  # [E, 2I, H]: per expert gate's rows, then up's
        rows: list[Run] = [(tp_rank * inter_local, inter_local), (inter + tp_rank * inter_local, inter_local)]
        return shard_of((experts, 2 * inter, shape[2]), {0: held, 1: rows})
    return shard_of((experts, shape[1], inter), {0: held, 2: [(tp_rank * inter_local, inter_local)]})
