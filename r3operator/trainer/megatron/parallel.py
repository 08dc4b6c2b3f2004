"""Process group + megatron parallel_state set-up, and the two CPU shims a local-spec forward needs.

On a CPU-only torch, megatron-core 0.19.2's forward path calls CUDA in exactly two places that the
local (non-Transformer-Engine) spec cannot avoid:

- `RotaryEmbedding.get_emb` and `Router.gating` move tensors to `torch.cuda.current_device()`;
- `DotProductAttention.forward` forks the CUDA RNG tracker (`get_cuda_rng_tracker().fork()`) around
  attention dropout, even when dropout is 0, and activation recompute (`tensor_parallel.checkpoint`)
  saves / restores the CUDA RNG state around each recomputed chunk.

`install_cpu_shims()` makes `torch.cuda.current_device()` return "cpu", installs an RNG tracker whose
`fork()` is a no-op and makes the CUDA RNG state get/set no-ops (dropout is 0: no random numbers are drawn).
None touches routing, replay or any arithmetic; all are refused when CUDA exists.
A third CUDA-only default (`get_default_causal_mask` builds the causal mask on "cuda") is avoided by always
passing an explicit attention mask, which the trainer needs anyway for padding.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from r3operator.trainer.fsdp import free_local_port

_SHIMS_INSTALLED = False


def install_cpu_shims() -> None:
    global _SHIMS_INSTALLED
    import torch

    if torch.cuda.is_available():
        raise RuntimeError("CPU shims are for CUDA-less torch only")
    if _SHIMS_INSTALLED:
        return
    import megatron.core.tensor_parallel.random as mrandom

    class _CpuRngTracker(mrandom.CudaRNGStatesTracker):  # type: ignore[misc]  # megatron-core: no types
        @contextlib.contextmanager
        def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:  # dropout is 0: nothing to fork
            yield

        def add(self, name: str, seed: int) -> None:
            self.states_[name] = None

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment, return-value]  # the CPU shim
    # Activation recompute (CheckpointFunction) saves/restores the CUDA RNG state around each chunk.
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.empty(0, dtype=torch.uint8)
    mrandom._set_cuda_rng_state = lambda *a, **k: None
    mrandom._CUDA_RNG_STATE_TRACKER = _CpuRngTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    _SHIMS_INSTALLED = True


def fill_upstream_gaps() -> None:
    """megatron-core 0.16.x binds `moe_utils.te_general_gemm` only when Transformer Engine imports, yet the
    router's gating linear reads the name unconditionally (NameError without TE). Bind it to None, which
    selects megatron's own torch.mm path; a no-op on releases that define it."""
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


@dataclass(frozen=True)
class ParallelSizes:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    sequence_parallel: bool = False

    @classmethod
    def from_spec(cls, spec: Any | None) -> ParallelSizes:
        """From the RLJob `trainer.megatron` block (r3operator.api.v1alpha1.MegatronSpec) or None."""
        if spec is None:
            return cls()
        return cls(
            tp=spec.tensor_parallel_size,
            pp=spec.pipeline_parallel_size,
            cp=spec.context_parallel_size,
            ep=spec.expert_parallel_size,
            etp=spec.expert_tensor_parallel_size,
            sequence_parallel=spec.sequence_parallel,
        )


def init_parallel(sizes: ParallelSizes, device: str, *, seed: int = 0) -> None:
    """torch.distributed (env:// under torchrun, else a 1-process group) + megatron parallel_state."""
    fill_upstream_gaps()
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    cuda = device.startswith("cuda")
    if not cuda:
        install_cpu_shims()
    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_local_port()))
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if cuda else "gloo")
    if ps.model_parallel_is_initialized():
        same = (
            ps.get_tensor_model_parallel_world_size() == sizes.tp
            and ps.get_pipeline_model_parallel_world_size() == sizes.pp
            and ps.get_context_parallel_world_size() == sizes.cp
            and ps.get_expert_model_parallel_world_size() == sizes.ep
        )
        if same:
            return
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=sizes.tp,
        pipeline_model_parallel_size=sizes.pp,
        context_parallel_size=sizes.cp,
        expert_model_parallel_size=sizes.ep,
        expert_tensor_parallel_size=sizes.etp,
    )
    if cuda:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)


def check_world(
    sizes: ParallelSizes,
    world: int,
    *,
    num_experts: int | None = None,
    num_layers: int | None = None,
    tied_embeddings: bool = False,
) -> None:
    """Refuse a rank count the parallel sizes do not fit, naming the fields (before any process starts; the
    model's fields once its config is read)."""
    ranks = f"the trainer's {world} ranks (trainer.nodes × trainer.gpusPerNode, or --trainer-ranks)"
    model = sizes.tp * sizes.pp * sizes.cp
    if world % model:
        raise ValueError(
            f"trainer.megatron: tensorParallelSize × pipelineParallelSize × contextParallelSize = {sizes.tp} × "
            f"{sizes.pp} × {sizes.cp} = {model} does not divide {ranks}; the data-parallel size is their quotient"
        )
    expert = sizes.ep * sizes.etp * sizes.pp
    if world % expert:
        raise ValueError(
            f"trainer.megatron: expertParallelSize × expertTensorParallelSize × pipelineParallelSize = {sizes.ep} × "
            f"{sizes.etp} × {sizes.pp} = {expert} does not divide {ranks}"
        )
    if num_experts is not None and num_experts % sizes.ep:
        raise ValueError(
            f"trainer.megatron.expertParallelSize {sizes.ep} does not divide the model's {num_experts} experts"
        )
    if num_layers is not None and num_layers % sizes.pp:
        # Megatron splits the decoder evenly unless told otherwise; uneven first/last stages are not exposed.
        raise ValueError(
            f"trainer.megatron.pipelineParallelSize {sizes.pp} does not divide the model's "
            f"{num_layers} decoder layers (num_hidden_layers)"
        )
    if sizes.pp > 1 and tied_embeddings:
        # The last stage would hold a copy of the input embedding whose gradient must be summed with the
        # first stage's (megatron's embedding group); this backend does not do that reduction.
        raise ValueError(
            f"trainer.megatron.pipelineParallelSize {sizes.pp} with a model that ties its input "
            "and output embeddings (tie_word_embeddings) is not supported; use pipelineParallelSize 1"
        )
    if sizes.tp > 1 and not sizes.sequence_parallel:
        raise ValueError(
            f"trainer.megatron.tensorParallelSize {sizes.tp} on an MoE model needs "
            f"trainer.megatron.sequenceParallel: true"
        )
