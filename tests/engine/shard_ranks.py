"""vLLM's own tensor- or expert-parallel Qwen3-MoE on the CPU, its ranks under gloo (not a test module).

`python tests/engine/shard_ranks.py MODEL_DIR OUT {tp,ep} RANKS`: each rank builds vLLM's `Qwen3MoeForCausalLM` of
the checkpoint's config with RANKS ranks, loads the checkpoint with vLLM's own `load_weights`, and writes to
OUT/rank-<r>.json what tests/engine/test_engine_shards.py compares: for every parameter, its local shape, the shard
`parameter_shards` reads off its layer, and whether the part of the kernel builder's whole tensor that shard takes
equals, bit for bit, what vLLM's loader put there.
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path
from typing import Any


def rank_main(rank: int, world: int, port: int, model: str, out: str, expert_parallel: bool) -> None:
    import torch
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.engine.arg_utils import EngineArgs

    from r3operator.engine.shards import parameter_shards
    from r3operator.wire.kernel_layout import EngineParameter, kernel_tensors, plan_kernel_layout, trainer_shapes
    from r3operator.wire.shards import take

    args = EngineArgs(
        model=model,
        dtype="float32",
        max_model_len=128,
        enforce_eager=True,
        skip_tokenizer_init=True,
        tensor_parallel_size=world,
        enable_expert_parallel=expert_parallel,
        distributed_executor_backend="mp",
    )
    config = args.create_engine_config()
    with set_current_vllm_config(config):
        init_distributed_environment(
            world_size=world,
            rank=rank,
            local_rank=rank,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            backend="gloo",
        )
        ensure_model_parallel_initialized(world, 1)
        from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM

        engine: Any = Qwen3MoeForCausalLM(vllm_config=config, prefix="")
        state: dict[str, Any] = {}
        for path in sorted(Path(model).glob("*.safetensors")):
            state.update(load_file(str(path)))
        with torch.no_grad():
            engine.load_weights(iter(state.items()))
        shards, refused = parameter_shards(engine)
        params = dict(engine.named_parameters())
        whole = [
            EngineParameter(
                name, str(p.dtype).removeprefix("torch."), shards[name].whole if name in shards else tuple(p.shape)
            )
            for name, p in params.items()
        ]
        plan = plan_kernel_layout(trainer_shapes(state), whole)
        report: dict[str, Any] = {"refused": refused, "parameters": {}}
        for name, built in kernel_tensors(state, plan, dtype=torch.float32):
            shard = shards.get(name)
            part = take(built, shard) if shard is not None else built
            report["parameters"][name] = {
                "local": list(params[name].shape),
                "shard": None if shard is None else shard.to_wire(),
                "equal": bool(part.shape == params[name].shape and torch.equal(part, params[name].data)),
            }
    Path(out, f"rank-{rank}.json").write_text(json.dumps(report))


def main(argv: list[str]) -> None:
    import torch.multiprocessing as mp

    model, out, how, ranks = argv
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    mp.spawn(rank_main, args=(int(ranks), port, model, out, how == "ep"), nprocs=int(ranks))


if __name__ == "__main__":
    main(sys.argv[1:])
