"""Pipeline parallelism for the Megatron backend: hidden states forward and their gradients back between
adjacent stages, in the 1F1B order of micro-batches.

megatron-core's own schedule (`forward_backward_pipelining_without_interleaving`, 0.16-0.19) counts tokens
in `torch.zeros([], device="cuda")` and enters `torch.autocast("cuda")`, which no CPU shim
(`parallel.install_cpu_shims`) can stand in for; and the old-logprob pass needs each micro-batch's
recorded routes and probe ids, which its forward-only path does not hand back. So this module runs the
same 1F1B order on torch.distributed point-to-point (gloo on CPU, NCCL on GPU):

- stage `i` of `p` runs `min(p - i - 1, m)` forwards first (warm-up), then alternates one forward and
  one backward, then the remaining backwards. Backwards run in forward order on every stage, which is
  the order the REPLAY_BACKWARD FIFO of megatron's RouterReplay pops (activation recompute re-runs each
  micro-batch's routers inside its backward, `trainer/replay/megatron.py`);
- sends are non-blocking (`isend`, waited at the end of the schedule) and receives blocking, so a stage
  never waits on its neighbour's receive: the 1F1B order then cannot deadlock;
- each activation is preceded by a small header (dtype, shape), because under bf16 autocast the dtype
  of a stage's output is whatever its last op produced; a gradient has its activation's dtype and shape.

With one stage every exchange is skipped and the order is forward, backward per micro-batch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Stage:
    """This rank's pipeline stage and its neighbours' global ranks (None at either end)."""

    index: int = 0
    size: int = 1
    prev_rank: int | None = None
    next_rank: int | None = None
    last_rank: int = 0  # global rank of the last stage of this rank's pipeline
    group: Any = None

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.size - 1

    @classmethod
    def current(cls) -> Stage:
        """From megatron's parallel_state (initialised)."""
        from megatron.core import parallel_state as ps

        size = ps.get_pipeline_model_parallel_world_size()
        index = ps.get_pipeline_model_parallel_rank()
        return cls(
            index=index, size=size,
            prev_rank=None if index == 0 else ps.get_pipeline_model_parallel_prev_rank(),
            next_rank=None if index == size - 1 else ps.get_pipeline_model_parallel_next_rank(),
            last_rank=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group(),
        )  # fmt: skip


@dataclass
class StageLink:
    """Point-to-point between this stage and its neighbours; `finish()` waits for the sends in flight."""

    stage: Stage
    device: Any
    pending: list[tuple[Any, Any]] = field(default_factory=list)  # (work, tensor kept alive until sent)

    def _isend(self, tensor: Any, dst: int) -> None:
        import torch.distributed as dist

        tensor = tensor.contiguous()
        self.pending.append((dist.isend(tensor, dst=dst), tensor))

    def send_forward(self, hidden: Any) -> None:
        import torch

        if self.stage.next_rank is None:
            raise RuntimeError("the last pipeline stage has no next stage to send to")
        dtype = str(hidden.dtype).removeprefix("torch.")
        if dtype not in _DTYPES or hidden.dim() > 4:
            raise RuntimeError(f"pipeline activations must be {_DTYPES} with <= 4 dims, got {dtype} {hidden.dim()}")
        shape = list(hidden.shape) + [0] * (4 - hidden.dim())
        header = torch.tensor([_DTYPES.index(dtype), hidden.dim(), *shape], dtype=torch.int64, device=self.device)
        self._isend(header, self.stage.next_rank)
        self._isend(hidden.detach(), self.stage.next_rank)

    def recv_forward(self) -> Any:
        import torch
        import torch.distributed as dist

        if self.stage.prev_rank is None:
            raise RuntimeError("the first pipeline stage has no previous stage to receive from")
        header = torch.empty(6, dtype=torch.int64, device=self.device)
        dist.recv(header, src=self.stage.prev_rank)
        code, ndim, *shape = (int(v) for v in header.tolist())
        hidden = torch.empty(shape[:ndim], dtype=getattr(torch, _DTYPES[code]), device=self.device)
        dist.recv(hidden, src=self.stage.prev_rank)
        return hidden

    def send_backward(self, grad: Any) -> None:
        if self.stage.prev_rank is None:
            raise RuntimeError("the first pipeline stage has no previous stage to send a gradient to")
        self._isend(grad, self.stage.prev_rank)

    def recv_backward(self, output: Any) -> Any:
        """The gradient of `output` (this stage's activation of the micro-batch) from the next stage."""
        import torch
        import torch.distributed as dist

        if self.stage.next_rank is None:
            raise RuntimeError("the last pipeline stage has no next stage to receive a gradient from")
        grad = torch.empty_like(output)
        dist.recv(grad, src=self.stage.next_rank)
        return grad

    def finish(self) -> None:
        for work, _tensor in self.pending:
            work.wait()
        self.pending = []


# forward(i, received): micro-batch i's output on this stage. `received` is the previous stage's activation
# (None on the first stage); the last stage returns the scalar loss to differentiate, others their activation.
StageForward = Callable[[int, Any], Any]


def run_forward_only(count: int, link: StageLink, forward: StageForward) -> None:
    """Every micro-batch forward through this stage, in order (no gradients)."""
    stage = link.stage
    for i in range(count):
        out = forward(i, None if stage.first else link.recv_forward())
        if not stage.last:
            link.send_forward(out)
    link.finish()


def run_one_f_one_b(count: int, link: StageLink, forward: StageForward) -> None:
    """Forward and backward of `count` micro-batches through this stage in 1F1B order (module docstring);
    gradients accumulate in the parameters."""
    import torch

    stage = link.stage
    in_flight: deque[tuple[Any, Any]] = deque()  # (received activation, output) of forwards not yet backward

    def step_forward(i: int) -> None:
        received = None if stage.first else link.recv_forward().requires_grad_()
        out = forward(i, received)
        if not stage.last:
            link.send_forward(out)
        in_flight.append((received, out))

    def step_backward() -> None:
        received, out = in_flight.popleft()
        if stage.last:
            out.backward()
        else:
            torch.autograd.backward(out, grad_tensors=link.recv_backward(out))
        if not stage.first:
            if received.grad is None:
                raise RuntimeError("pipeline stage input got no gradient: is the input tensor set on the model?")
            link.send_backward(received.grad)

    warmup = min(stage.size - stage.index - 1, count)
    for i in range(warmup):
        step_forward(i)
    for i in range(warmup, count):
        step_forward(i)
        step_backward()
    for _ in range(warmup):
        step_backward()
    link.finish()  # not on an error: a neighbour that failed would never take the sends
