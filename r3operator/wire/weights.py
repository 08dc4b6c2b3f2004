"""Trainer state dict → checkpoint-format (HF on-disk names) chunks for the engines.

transformers 5.x keeps Qwen3-MoE / Qwen2-MoE / OLMoE experts fused (`mlp.experts.gate_up_proj`
[E, 2I, H], `mlp.experts.down_proj` [E, H, I]); checkpoints and vLLM's `load_weights` use per-expert
`mlp.experts.<e>.{gate,up,down}_proj.weight`. The split below is the inverse of transformers'
load-time fusion (gate rows first, then up rows), checked in tests against the file on disk.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from r3operator.wire.receipt import Fingerprint, FingerprintLog
from r3operator.wire.sync_phases import SyncPhases

# Any: wire/ loads no framework at import: the trainer's tensors (torch, FSDP's DTensor, or numpy views) and their
# dtypes and devices are Any here.

_FUSED_GATE_UP = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.gate_up_proj$")
_FUSED_DOWN = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.down_proj$")


def full_tensor(tensor: Any, *, dtype: Any = None, device: Any = None) -> Any:
    """One trainer tensor, detached and whole (an FSDP2 DTensor gathered with `full_tensor()`), cast to `dtype`
    on its own device before the move to `device` (None: leave either as it is).

    A sync calls this for every tensor, and its host time sets a GPU sync's pace (docs/runtime.md): a
    DTensor on a mesh of one rank already holds the whole tensor, so its local tensor is taken as it is
    (a DTensor's detach, redistribute and gather each go through DTensor's Python dispatch); a mesh of
    several ranks is gathered."""
    if hasattr(tensor, "full_tensor"):  # FSDP2 DTensor
        import torch

        with torch.no_grad():  # nothing here is differentiated; without grad `to_local` is the local tensor
            local = tensor.to_local()
            t = local if tensor.device_mesh.size() == 1 and local.shape == tensor.shape else tensor.full_tensor()
    else:
        t = tensor
    return cast(t.detach(), dtype=dtype, device=device)


def cast(tensor: Any, *, dtype: Any = None, device: Any = None) -> Any:
    """`tensor` in `dtype` (cast on its own device: a bf16 engine costs half the bytes moved), then on
    `device`; None leaves either as it is, and a tensor already right is returned as it is."""
    if dtype is not None and tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    return tensor.to(device) if device is not None else tensor


def checkpoint_tensors(
    state_dict: Mapping[str, Any], *, dtype: Any = None, device: Any = "cpu"
) -> Iterator[tuple[str, Any]]:
    """Yield (checkpoint name, tensor) for every trainer tensor, experts unfused, detached.

    An FSDP2 DTensor is gathered one parameter at a time (`full_tensor()`, streaming: never the whole
    model unsharded at once). The cast to `dtype` happens on the source device, before the move to
    `device` (None: stay there), so a bf16 engine costs half the device-to-host bytes.
    """
    for name, tensor in state_dict.items():
        t = full_tensor(tensor, dtype=dtype, device=device)
        if match := _FUSED_GATE_UP.match(name):
            half = t.shape[1] // 2
            for e in range(t.shape[0]):
                yield f"{match['prefix']}.{e}.gate_proj.weight", t[e, :half].contiguous()
                yield f"{match['prefix']}.{e}.up_proj.weight", t[e, half:].contiguous()
        elif match := _FUSED_DOWN.match(name):
            for e in range(t.shape[0]):
                yield f"{match['prefix']}.{e}.down_proj.weight", t[e].contiguous()
        else:
            yield name, t.contiguous()


def checkpoint_metadata(state_dict: Mapping[str, Any], *, dtype: Any = None) -> list[tuple[str, Any, tuple[int, ...]]]:
    """(checkpoint name, dtype, shape) of every tensor `checkpoint_tensors` yields, in the same order,
    without materialising anything (an FSDP2 DTensor's shape is its global shape)."""
    out: list[tuple[str, Any, tuple[int, ...]]] = []
    for name, tensor in state_dict.items():
        dt = dtype if dtype is not None else tensor.dtype
        shape = tuple(int(d) for d in tensor.shape)
        if match := _FUSED_GATE_UP.match(name):
            half = (shape[1] // 2, *shape[2:])
            for e in range(shape[0]):
                out.append((f"{match['prefix']}.{e}.gate_proj.weight", dt, half))
                out.append((f"{match['prefix']}.{e}.up_proj.weight", dt, half))
        elif match := _FUSED_DOWN.match(name):
            out.extend((f"{match['prefix']}.{e}.down_proj.weight", dt, shape[1:]) for e in range(shape[0]))
        else:
            out.append((name, dt, shape))
    return out


def chunk_tensors(tensors: Iterator[tuple[str, Any]], *, chunk_size_mb: int) -> Iterator[list[tuple[str, Any]]]:
    """Group tensors into chunks of at most `chunk_size_mb` MiB (a larger single tensor is its own chunk)."""
    if chunk_size_mb < 1:
        raise ValueError(f"weightSync.chunkSizeMB must be >= 1, got {chunk_size_mb}")
    limit = chunk_size_mb * 1024 * 1024
    chunk: list[tuple[str, Any]] = []
    size = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if chunk and size + nbytes > limit:
            yield chunk
            chunk, size = [], 0
        chunk.append((name, tensor))
        size += nbytes
    if chunk:
        yield chunk


# ---------------------------------------------------------------------- flat transport buffers
#
# Why one buffer and not a list of (name, tensor): the per-expert tensors above are views into the fused
# [E, 2I, H] / [E, H, I] parameter, and pickling a view pickles its WHOLE storage, so every expert's
# gate/up/down would ship the full fused tensor again (measured with a list: ~5-12 s of `ray.put` per sync
# for the 16 MB tiny model). A chunk is ONE contiguous uint8 buffer (each tensor copied in once, 64-byte
# aligned) plus an entry table; Ray ships a numpy buffer zero-copy through the object store, and the
# engine side rebuilds the tensors as views of that buffer (no per-tensor allocation before load_weights).

ALIGN = 64


@dataclass
class PackedChunk:
    """One weight-sync chunk: `buffer` (uint8 numpy, contiguous) + (name, dtype, shape, offset) entries."""

    buffer: np.ndarray
    entries: list[tuple[str, str, tuple[int, ...], int]]
    handles: dict[str, Any] = field(default_factory=dict)  # per-transport memo (ray ref, staged file), every engine's
    fingerprints: dict[str, Fingerprint] = field(default_factory=dict)  # of each tensor (wire/receipt.py)
    seconds: dict[str, float] = field(default_factory=dict)  # trainer-side sync phases (wire/sync_phases.py)
    releases: list[Callable[[], None]] = field(default_factory=list)  # what a transport's `handles` need undone

    @property
    def nbytes(self) -> int:
        return int(self.buffer.nbytes)

    def release(self) -> None:
        """Let go of what the transports made of this chunk (a Ray object, a staged file) once every engine has had
        it, whether it loaded or not."""
        releases, self.releases = self.releases, []
        self.handles.clear()  # submitted Ray tasks keep their argument alive until they ran
        for undo in releases:
            undo()


def pack_chunk(chunk: Sequence[tuple[str, Any]]) -> PackedChunk:
    """Pack on the tensors' device (one device-to-host copy per chunk on a GPU), return a CPU buffer."""
    import torch

    entries: list[tuple[str, str, tuple[int, ...], int]] = []
    offset = 0
    for name, tensor in chunk:
        entries.append((name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset))
        offset += -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN
    device = chunk[0][1].device if chunk else "cpu"
    begin = time.perf_counter()
    sent = FingerprintLog()
    for name, tensor in chunk:
        sent.add(name, tensor)
    fingerprints = sent.result()
    packing = time.perf_counter()
    buffer = torch.empty(max(offset, 1), dtype=torch.uint8, device=device)
    slots, sources = [], []
    for (_name, _dtype, _shape, start), (_, tensor) in zip(entries, chunk, strict=True):
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes:  # as bytes, so that one foreach copy takes every dtype (a few kernels, not one per tensor)
            slots.append(buffer[start : start + nbytes])
            sources.append(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
    if slots:
        torch._foreach_copy_(slots, sources)
    host = buffer.cpu().numpy()
    seconds = {"fingerprint": packing - begin, "pack": time.perf_counter() - packing}
    return PackedChunk(host, entries, fingerprints=fingerprints, seconds=seconds)


Announced = tuple[str, Any, tuple[int, ...]]
"""(name, torch dtype, shape) of one tensor a sync announced to the engines."""


def announced_zeros(announced: Sequence[Announced], device: Any) -> Iterator[tuple[str, Any]]:
    """Views of ONE zero buffer, as big as the largest of `announced`, one per announced (name, dtype, shape): what
    a failed NCCL sync still sends, so that the engines' receive, sized from the announcement, ends; and what an
    engine that cannot take a sync receives into, so that the trainer's broadcasts end."""
    import torch

    sizes = [tensor_nbytes(shape, dtype) for _, dtype, shape in announced]
    zeros = torch.zeros(max(sizes, default=0), dtype=torch.uint8, device=device)
    for (name, dtype, shape), size in zip(announced, sizes, strict=True):
        yield name, zeros[:size].view(dtype).view(shape)


def tensor_nbytes(shape: Sequence[int], dtype: Any) -> int:
    """The bytes of a tensor of `shape` in the torch `dtype`, without making one."""
    return math.prod(int(dim) for dim in shape) * int(dtype.itemsize)


def unpack_chunk(buffer: Any, entries: Sequence[Sequence[Any]]) -> list[tuple[str, Any]]:
    """(name, tensor) views into `buffer` (numpy or torch uint8; read-only object-store memory is fine:
    `load_weights` only reads them)."""
    import warnings

    import torch

    if not isinstance(buffer, torch.Tensor):
        with warnings.catch_warnings():  # a read-only numpy buffer: we never write through these views
            warnings.simplefilter("ignore", UserWarning)
            buffer = torch.from_numpy(np.asarray(buffer))
    out = []
    for name, dtype, shape, start in entries:
        dt = getattr(torch, str(dtype))
        nbytes = tensor_nbytes(shape, dt)
        out.append((str(name), buffer[int(start) : int(start) + nbytes].view(dt).view(tuple(shape))))
    return out


def packed_chunks(state_dict: Mapping[str, Any], *, chunk_size_mb: int, dtype: Any = None) -> Iterator[PackedChunk]:
    """The trainer state as packed chunks, in checkpoint format (experts unfused), cast to `dtype` and
    packed on the trainer's device."""
    phases = SyncPhases()
    tensors = phases.timed("gather", checkpoint_tensors(state_dict, dtype=dtype, device=None))
    for chunk in chunk_tensors(tensors, chunk_size_mb=chunk_size_mb):
        packed = pack_chunk(chunk)
        packed.seconds["gather"] = phases.seconds.pop("gather", 0.0)
        yield packed
