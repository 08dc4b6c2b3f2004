"""The trainer's weights as the safetensors files of a Hugging Face model directory, from either backend.

The tensors are the ones the weight sync sends the engines (`Trainer.weight_chunks`): checkpoint names, experts
unfused, FSDP2 shards gathered one parameter at a time, Megatron's converted to HF names (trainer/megatron/
convert.py); so an export loads wherever the model it was trained from loads (`vllm serve`, transformers).

Files: `model.safetensors`, or `model-00001-of-0000N.safetensors` … with `model.safetensors.index.json` (the
layout `save_pretrained` writes) when the weights pass `max_shard_bytes`. Every tensor is checked before its
shard is written: a NaN or an infinity refuses the export (`NonFiniteWeightsError`, naming the tensors), as the
non-finite guard keeps them off the engines and the checkpoints.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from r3operator.trainer.base import Trainer
from r3operator.wire.weights import unpack_chunk

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 4 << 30
"""A shard is held in host memory while it is written; 4 GiB keeps that bounded on a large model."""
_NAMED_AT_MOST = 5


class NonFiniteWeightsError(ValueError):
    """A weight holds NaN or infinity: nothing is written; the message names the tensors."""


def trainer_tensors(trainer: Trainer, *, dtype: Any, chunk_size_mb: int) -> Iterator[tuple[str, Any]]:
    """(checkpoint name, CPU tensor in `dtype`) for every weight of the trainer's current policy."""
    for chunk in trainer.weight_chunks(chunk_size_mb=chunk_size_mb, dtype=dtype):
        yield from unpack_chunk(chunk.buffer, chunk.entries)


def write_safetensors(
    tensors: Iterable[tuple[str, Any]], directory: Path, *, max_shard_bytes: int = DEFAULT_SHARD_BYTES
) -> list[str]:
    """Write `tensors` into `directory` as safetensors shards (and the index when there are several); returns the
    files written. Raises NonFiniteWeightsError, naming the tensors, before the first shard with one is written."""
    import torch
    from safetensors.torch import save_file

    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    shards: list[list[str]] = []
    pending: dict[str, Any] = {}
    size = 0
    total = 0
    non_finite: list[str] = []

    def flush() -> None:
        nonlocal pending, size
        if not pending:
            return
        if non_finite:
            raise _refused(non_finite)
        part = directory / f".shard-{len(shards) + 1:05d}.safetensors"
        save_file(pending, str(part), metadata={"format": "pt"})
        shards.append(list(pending))
        pending, size = {}, 0

    seen: set[str] = set()
    for name, tensor in tensors:
        if name in seen:
            raise ValueError(f"the trainer named the weight {name} twice")
        seen.add(name)
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            non_finite.append(name)
        nbytes = tensor.numel() * tensor.element_size()
        if pending and size + nbytes > max_shard_bytes:
            flush()
        # A copy of its own: safetensors refuses tensors that share storage (these are views of one chunk).
        pending[name] = tensor.detach().to("cpu").contiguous().clone()
        size += nbytes
        total += nbytes
    flush()
    if non_finite:
        raise _refused(non_finite)
    if not shards:
        raise ValueError("the trainer has no weights to export")
    if len(shards) == 1:
        os.replace(directory / ".shard-00001.safetensors", directory / SINGLE_FILE)
        return [SINGLE_FILE]
    names = [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    weight_map: dict[str, str] = {}
    for i, (file, members) in enumerate(zip(names, shards, strict=True), start=1):
        os.replace(directory / f".shard-{i:05d}.safetensors", directory / file)
        weight_map.update(dict.fromkeys(members, file))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return [*names, INDEX_FILE]


def _refused(names: list[str]) -> NonFiniteWeightsError:
    more = len(names) - _NAMED_AT_MOST
    shown = ", ".join(names[:_NAMED_AT_MOST]) + (f" and {more} more" if more > 0 else "")
    return NonFiniteWeightsError(f"{len(names)} weight tensor(s) hold NaN or infinity ({shown}): export refused")
