"""Pipeline parallelism for the Megatron backend: hidden states forward and their gradients back between
adjacent stages, in the 1F1B order of micro-batches.

megatron-core's own schedule (`forward_backward_pipelining_without_interleaving`, 0.16-0.19) counts tokens
in `torch.zeros([], device="cuda")` and enters `torch.autocast("cuda")`, which no CPU shim
(`parallel.install_cpu_shims`) can stand in for; and the old-logprob pass needs each micro-batch's
recorded routes and probe ids, which its forward-only path does not hand back. So this module runs the
same 1F1B order, with the same pairing of transfers, on torch.distributed point-to-point (gloo on CPU, NCCL
on GPU):

- stage `i` of `p` runs `min(p - i - 1, m)` forwards first (warm-up), then alternates one forward and
  one backward, then the remaining backwards. Backwards run in forward order on every stage, which is
  the order the REPLAY_BACKWARD FIFO of megatron's RouterReplay pops (activation recompute re-runs each
  micro-batch's routers inside its backward, `trainer/replay/megatron.py`);
- in the alternating part a forward's send to the next stage goes out in one batch with the receive of
  the gradient from it, and a backward's send to the previous stage with the receive of the next
  activation from it (megatron's `send_forward_recv_backward` / `send_backward_recv_forward`): two
  neighbours that both send before they receive would otherwise wait on each other under NCCL;
- as in megatron, every activation travels in the pipeline dtype (the parameters' dtype) and with a shape
  both sides know from the micro-batch, so no metadata is exchanged.

With one stage every exchange is skipped and the order is forward, backward per micro-batch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# Any: Megatron-Core ships no type information: its schedules, models and the tensors they hand back are Any here.


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
            index=index,
            size=size,
            prev_rank=None if index == 0 else ps.get_pipeline_model_parallel_prev_rank(),
            next_rank=None if index == size - 1 else ps.get_pipeline_model_parallel_next_rank(),
            last_rank=ps.get_pipeline_model_parallel_last_rank(),
            group=ps.get_pipeline_model_parallel_group(),
        )


@dataclass
class StageLink:
    """Point-to-point between this stage and its neighbours. Every transfer is waited for before the call
    returns, except plain sends (`send_forward` / `send_backward`), which `finish()` waits for."""

    stage: Stage
    device: Any
    dtype: Any  # the pipeline dtype every activation and its gradient travel in
    pending: list[tuple[Any, Any]] = field(default_factory=list)  # (work, tensor kept alive until sent)

    def _buffer(self, shape: tuple[int, ...]) -> Any:
        import torch

        return torch.empty(shape, dtype=self.dtype, device=self.device)

    def _wire(self, tensor: Any) -> Any:
        return tensor.detach().to(dtype=self.dtype).contiguous()

    def _exchange(self, send: Any, peer: int, recv_shape: tuple[int, ...]) -> Any:
        import torch.distributed as dist

        out, buf = self._wire(send), self._buffer(recv_shape)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, out, peer), dist.P2POp(dist.irecv, buf, peer)])
        for work in works:
            work.wait()
        return buf

    def _send(self, tensor: Any, peer: int) -> None:
        import torch.distributed as dist

        out = self._wire(tensor)
        self.pending.append((dist.isend(out, dst=peer), out))

    def _recv(self, shape: tuple[int, ...], peer: int) -> Any:
        import torch.distributed as dist

        buf = self._buffer(shape)
        dist.recv(buf, src=peer)
        return buf

    def recv_forward(self, shape: tuple[int, ...]) -> Any:
        return self._recv(shape, _peer(self.stage.prev_rank, "previous"))

    def send_forward(self, hidden: Any) -> None:
        self._send(hidden, _peer(self.stage.next_rank, "next"))

    def recv_backward(self, shape: tuple[int, ...]) -> Any:
        return self._recv(shape, _peer(self.stage.next_rank, "next"))

    def send_backward(self, grad: Any) -> None:
        self._send(grad, _peer(self.stage.prev_rank, "previous"))

    def send_forward_recv_backward(self, hidden: Any, shape: tuple[int, ...]) -> Any:
        """Send this micro-batch's activation on; take the gradient (`shape`) of the oldest one in flight."""
        return self._exchange(hidden, _peer(self.stage.next_rank, "next"), shape)

    def send_backward_recv_forward(self, grad: Any, shape: tuple[int, ...]) -> Any:
        return self._exchange(grad, _peer(self.stage.prev_rank, "previous"), shape)

    def finish(self) -> None:
        for work, _tensor in self.pending:
            work.wait()
        self.pending = []


def _peer(rank: int | None, which: str) -> int:
    if rank is None:
        raise RuntimeError(f"this pipeline stage has no {which} stage")
    return rank


# forward(i, received): micro-batch i's output on this stage. `received` is the previous stage's activation
# (None on the first stage); the last stage returns the scalar loss to differentiate, others their activation.
StageForward = Callable[[int, Any], Any]
# shape_of(i): the shape of the activation micro-batch i passes between stages (the same on every stage).
ActivationShape = Callable[[int], tuple[int, ...]]


def run_forward_only(count: int, link: StageLink, forward: StageForward, shape_of: ActivationShape) -> None:
    """Every micro-batch forward through this stage, in order (no gradients)."""
    stage = link.stage
    for i in range(count):
        out = forward(i, None if stage.first else link.recv_forward(shape_of(i)))
        if not stage.last:
            link.send_forward(out)
    link.finish()


def run_one_f_one_b(count: int, link: StageLink, forward: StageForward, shape_of: ActivationShape) -> None:
    """Forward and backward of `count` micro-batches through this stage in 1F1B order (module docstring);
    gradients accumulate in the parameters."""
    import torch

    stage = link.stage
    in_flight: deque[tuple[Any, Any]] = deque()  # (received activation, output) of forwards not yet backward

    def run_forward(i: int, received: Any) -> Any:
        if received is not None:
            received.requires_grad_()
        out = forward(i, received)
        in_flight.append((received, out))
        return out

    def run_backward(grad: Any) -> Any:
        """Backward of the oldest micro-batch in flight; the gradient of its input (None on the first stage)."""
        received, out = in_flight.popleft()
        if stage.last:
            out.backward()
        else:
            torch.autograd.backward(out, grad_tensors=grad.to(out.dtype))
        if stage.first:
            return None
        if received.grad is None:
            raise RuntimeError("pipeline stage input got no gradient: is the input tensor set on the model?")
        return received.grad

    def receive(i: int) -> Any:
        return None if stage.first else link.recv_forward(shape_of(i))

    warmup = min(stage.size - stage.index - 1, count)
    for i in range(warmup):
        out = run_forward(i, receive(i))
        if not stage.last:
            link.send_forward(out)
    received = receive(warmup) if warmup < count else None
    for i in range(warmup, count):
        out = run_forward(i, received)
        grad = None if stage.last else link.send_forward_recv_backward(out, tuple(in_flight[0][1].shape))
        input_grad = run_backward(grad)
        if i == count - 1:
            if input_grad is not None:
                link.send_backward(input_grad)
        elif input_grad is not None:
            received = link.send_backward_recv_forward(input_grad, shape_of(i + 1))
        else:
            received = receive(i + 1)
    for _ in range(warmup):
        grad = None if stage.last else link.recv_backward(tuple(in_flight[0][1].shape))
        input_grad = run_backward(grad)
        if input_grad is not None:
            link.send_backward(input_grad)
    link.finish()  # not on an error: a neighbour that failed would never take the sends
