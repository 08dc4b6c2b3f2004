"""CUDA stream helpers shared by the weight sync's two sides; each is a no-op off CUDA (`stream` None)."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any


def on_stream(stream: Any) -> AbstractContextManager[Any]:
    """`torch.cuda.stream(stream)`, or nothing when `stream` is None (a CPU tensor's work)."""
    import torch

    return torch.cuda.stream(stream) if stream is not None else nullcontext()


def recorded_event(stream: Any) -> Any:
    """A CUDA event recorded on `stream` now: another stream's `wait_event` orders its work after this point."""
    import torch

    event = torch.cuda.Event()
    event.record(stream)
    return event
