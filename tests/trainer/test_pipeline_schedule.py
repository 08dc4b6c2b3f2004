"""The Megatron backend's 1F1B schedule (`trainer/megatron/pipeline.py`) on 3 gloo processes, one stage each,
with a toy 3-stage network: the order of forwards and backwards each stage runs, the gradients against
plain autograd on the whole network, and the forward-only pass. No megatron needed: the stages are given
explicitly."""

from __future__ import annotations

import os
import socket

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.slow  # three spawned processes
STAGES, MICRO_BATCHES, WIDTH = 3, 4, 5


def _network() -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()) for _ in range(STAGES)]


def _inputs() -> list[torch.Tensor]:
    """Micro-batches of different row counts: each transfer must take its own micro-batch's shape."""
    g = torch.Generator().manual_seed(1)
    return [torch.randn(i + 1, WIDTH, generator=g) for i in range(MICRO_BATCHES)]


def _loss(out: torch.Tensor, i: int) -> torch.Tensor:
    return (out * (i + 1)).pow(2).mean()


def _worker(rank: int, port: int, queue: object) -> None:
    import torch.distributed as dist

    from r3operator.trainer.megatron.pipeline import Stage, StageLink, run_forward_only, run_one_f_one_b

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=STAGES)
    stage = Stage(
        index=rank,
        size=STAGES,
        prev_rank=rank - 1 if rank else None,
        next_rank=rank + 1 if rank < STAGES - 1 else None,
        last_rank=STAGES - 1,
    )
    link = StageLink(stage, "cpu", torch.float32)
    part, inputs = _network()[rank], _inputs()
    events: list[str] = []
    outputs: list[torch.Tensor] = []

    def forward(i: int, received: torch.Tensor | None) -> torch.Tensor:
        events.append(f"F{i}")
        out = part(inputs[i] if received is None else received)
        if torch.is_grad_enabled():  # the gradient reaching this stage's output: its backward of micro-batch i
            out.register_hook(lambda g, i=i: events.append(f"B{i}") or g)
        if stage.last:
            outputs.append(out.detach())
            return _loss(out, i)
        return out

    run_one_f_one_b(MICRO_BATCHES, link, forward, lambda i: tuple(inputs[i].shape))
    grads = [p.grad.clone() for p in part.parameters()]
    outputs.clear()
    with torch.no_grad():
        run_forward_only(MICRO_BATCHES, link, forward, lambda i: tuple(inputs[i].shape))
    dist.destroy_process_group()
    # Plain lists: a tensor sent through the queue is shared memory the exiting child takes with it.
    queue.put(
        (
            rank,
            events[: 2 * MICRO_BATCHES],
            [g.tolist() for g in grads],  # type: ignore[attr-defined]
            [o.tolist() for o in outputs],
        )
    )


def test_one_f_one_b_order_and_gradients_on_three_stages() -> None:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, queue)) for r in range(STAGES)]
    for p in procs:
        p.start()
    results = {rank: rest for rank, *rest in (queue.get(timeout=300) for _ in procs)}
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    # Stage i runs STAGES - i - 1 warm-up forwards, then alternates; backwards in forward order everywhere.
    assert results[0][0] == ["F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3"]
    assert results[1][0] == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]
    assert results[2][0] == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]
    # The same gradients as autograd through the whole network, summed over the micro-batches.
    network, inputs = _network(), _inputs()
    whole = torch.nn.Sequential(*network)
    expected_outputs = []
    for i, x in enumerate(inputs):
        out = whole(x)
        expected_outputs.append(out.detach())
        _loss(out, i).backward()
    for rank in range(STAGES):
        for got, param in zip(results[rank][1], network[rank].parameters(), strict=True):
            torch.testing.assert_close(torch.tensor(got), param.grad, atol=1e-6, rtol=1e-6)
    # The forward-only pass reaches the last stage with every micro-batch, in order.
    for got, want in zip(results[STAGES - 1][2], expected_outputs, strict=True):
        torch.testing.assert_close(torch.tensor(got), want, atol=1e-6, rtol=1e-6)
