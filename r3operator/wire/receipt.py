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
(8-bit when the byte count is odd), summed plainly and weighted by position (mod 251, so a shifted or
permuted tensor fingerprints differently), in integers on the tensor's own device: no device-to-host copy
of the weights, and the same result on the trainer's GPU and on the engine's.

On a GPU a sync's fingerprints must cost neither kernels nor waits:
- an MoE sync in checkpoint layout is thousands of small expert tensors: `FingerprintLog` gathers them
  into buckets of up to `BUCKET_BYTES`, each fingerprinted with a fixed number of kernels
  (`fingerprint_bucket`), whatever the tensors in it;
- a kernel-layout sync is a few big ones (a fused expert block of a3b is 805 MB): each is reduced in
  slices of `SLICE_BYTES` (`_fingerprint_torch`), so torch's widened copy of a reduction's input stays a
  cached slice-sized block instead of a new 4x-sized one per tensor and stream;
- nothing waits for the device until `FingerprintLog.result` reads every fingerprint back in one copy
  (the buckets' small index table goes up from pinned memory).
The values are the same whichever way: the tests compare every path with the definition written out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import numpy as np

Fingerprint = tuple[int, int, int]
"""(element count of the 16/8-bit view, plain sum, position-weighted sum)."""

WEIGHT_PERIOD = 251


def _words(tensor: Any) -> Any:
    import torch

    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return raw.view(torch.int16) if raw.numel() % 2 == 0 else raw


def fingerprint_device(tensor: Any) -> Any:
    """The fingerprint as an int64 tensor [count, sum, weighted] on the tensor's device (no host sync).

    The words are laid out as rows of `WEIGHT_PERIOD` columns and summed per column (`_fingerprint_torch`);
    the weighted sum is then over the column sums. On the CPU numpy does the sums (torch's integer
    reductions there are ~40x slower)."""
    import torch

    words = _words(tensor)
    if words.device.type == "cpu" and NUMPY_ON_CPU:
        return torch.tensor(_fingerprint_numpy(words.numpy()), dtype=torch.int64)
    return _fingerprint_torch(words)


def _group_sums(words: Any) -> Any:
    """Column sums of each group of `GROUP_ROWS` rows of `words` (a whole number of groups), int64
    [groups, WEIGHT_PERIOD] (1/16 of the words' bytes).

    torch widens a reduction's input to the output dtype before reducing (`sum(dtype=int64)` of int16
    words writes an int64 copy of them, 4x their bytes): the groups are summed in int32, the narrowest
    exact type for 64 rows (64 x 2^15 < 2^31), in slices of at most `SLICE_BYTES` of words, so that copy
    is at most 2x a slice whatever the size of `words` (an a3b expert block is 805 MB)."""
    import torch

    block = GROUP_ROWS * WEIGHT_PERIOD
    step = max(1, SLICE_BYTES // (words.element_size() * block)) * block
    n = words.numel()
    pieces = [
        words[start : start + step].view(-1, GROUP_ROWS, WEIGHT_PERIOD).sum(dim=1, dtype=torch.int32)
        for start in range(0, n, step)
    ]
    if not pieces:
        return torch.zeros(0, WEIGHT_PERIOD, dtype=torch.int64, device=words.device)
    return (pieces[0] if len(pieces) == 1 else torch.cat(pieces)).to(torch.int64)


def _fingerprint_torch(words: Any) -> Any:
    """`fingerprint_device` with torch's reductions: the whole groups of rows through `_group_sums` (a
    slice starts at a whole row, so a word's column is still its position mod `WEIGHT_PERIOD`), then the
    rest; a few kernels per `SLICE_BYTES` and no temporary bigger than 2x a slice."""
    import torch

    n = words.numel()
    device = words.device
    whole = n - n % (GROUP_ROWS * WEIGHT_PERIOD)
    columns = _group_sums(words[:whole]).sum(dim=0)
    if n > whole:  # fewer than a group of rows: padded with zeros to whole rows, which add nothing
        rest = words[whole:].to(torch.int64)
        rest = torch.nn.functional.pad(rest, (0, -rest.numel() % WEIGHT_PERIOD))
        columns += rest.view(-1, WEIGHT_PERIOD).sum(dim=0)
    weights = torch.arange(1, WEIGHT_PERIOD + 1, dtype=torch.int64, device=device)
    out = torch.zeros(3, dtype=torch.int64, device=device)
    out[0] = n
    out[1] = columns.sum()
    out[2] = (columns * weights).sum()
    return out


def _fingerprint_numpy(words: np.ndarray) -> list[int]:
    n = int(words.size)
    full = n - n % WEIGHT_PERIOD
    columns = np.zeros(WEIGHT_PERIOD, dtype=np.int64)
    if full:
        columns = words[:full].reshape(-1, WEIGHT_PERIOD).sum(axis=0, dtype=np.int64)
    tail = words[full:].astype(np.int64)
    weights = np.arange(1, WEIGHT_PERIOD + 1, dtype=np.int64)
    plain = int(columns.sum()) + int(tail.sum())
    weighted = int((columns * weights).sum()) + int((tail * weights[: tail.size]).sum())
    return [n, plain, weighted]


BUCKET_BYTES = 256 << 20
"""How many bytes of tensors `FingerprintLog` fingerprints together: the bucket's flat copy is this big."""

SLICE_BYTES = 256 << 20
"""At most this many bytes of words are reduced at once (`_group_sums`, a big tensor or a bucket): the widened
int32 copy torch makes of a reduction's input is then at most 2x this, reused from the allocator's cache,
instead of an int64 copy of the whole tensor (3.2 GB for an 805 MB expert block, allocated anew on each of
vLLM's producer streams)."""

NUMPY_ON_CPU = True
"""CPU tensors are fingerprinted one by one with numpy: torch's integer reductions there are ~10x slower
(a bucket of 32 expert tensors, 100 MB bf16: numpy 0.32 s, `fingerprint_bucket` 3.5 s on 2 cores)."""

GROUP_ROWS = 64
"""Rows of `WEIGHT_PERIOD` words summed per tensor before the segment sums: each tensor's slot in a bucket
is padded to a whole number of such groups, so no group straddles two tensors."""


def fingerprint(tensor: Any) -> Fingerprint:
    a, b, c = (int(x) for x in fingerprint_device(tensor).tolist())
    return a, b, c


def fingerprint_bucket(tensors: Sequence[Any]) -> Any:
    """The fingerprints of `tensors` (all on one device, every one an even number of bytes) as an int64
    tensor [len(tensors), 3] on that device, with a fixed number of kernels whatever their count:

    - one flat int16 copy of every tensor's words, each in a slot padded with zeros to a whole number of
      `GROUP_ROWS` x `WEIGHT_PERIOD` (zeros add nothing to either sum; a slot starts at column 0, so a
      word's column is its position in its tensor mod `WEIGHT_PERIOD`);
    - the column sums of each group of `GROUP_ROWS` rows (`_group_sums`; then int64, 1/16 of the words' bytes);
    - per tensor, the column sums of its groups as a difference of two rows of their running sum (exact in
      integers, deterministic, no atomics), then count, plain and weighted sum as in `_fingerprint_torch`.
    """
    import torch

    if not tensors:
        return torch.zeros(0, 3, dtype=torch.int64)
    words = [_words(t) for t in tensors]
    device = words[0].device
    odd = [i for i, w in enumerate(words) if w.dtype != torch.int16]
    if odd:
        raise ValueError(f"fingerprint_bucket: tensor {odd[0]} has an odd number of bytes; use fingerprint_device")
    block = GROUP_ROWS * WEIGHT_PERIOD
    counts = [int(w.numel()) for w in words]
    starts, ends, groups = [], [], 0
    for n in counts:
        starts.append(groups)
        groups += -(-n // block)
        ends.append(groups)
    flat = torch.zeros(groups * block, dtype=torch.int16, device=device)
    slots = [(flat[s * block : s * block + n], w) for s, n, w in zip(starts, counts, words, strict=True) if n]
    if slots:
        torch._foreach_copy_([slot for slot, _ in slots], [w for _, w in slots])
    partial = _group_sums(flat)
    running = torch.nn.functional.pad(partial, (0, 0, 1, 0)).cumsum_(dim=0)  # row g: groups [0, g)
    # One small host-to-device copy the host does not wait for: from pinned memory (the allocator keeps it
    # until the copy is done). From pageable memory the driver may first wait for the stream, which here
    # holds vLLM's previous broadcast.
    pinned = device.type == "cuda"
    table = torch.tensor([counts, starts, ends], dtype=torch.int64, pin_memory=pinned).to(device, non_blocking=True)
    columns = running.index_select(0, table[2]) - running.index_select(0, table[1])
    weights = torch.arange(1, WEIGHT_PERIOD + 1, dtype=torch.int64, device=device)
    return torch.stack([table[0], columns.sum(dim=1), (columns * weights).sum(dim=1)], dim=1)


@dataclass
class _Bucket:
    names: list[str] = field(default_factory=list)
    tensors: list[Any] = field(default_factory=list)
    nbytes: int = 0
    stream: Any = None  # the CUDA stream current when its tensors were added (None off CUDA)


def _current_stream(device: Any) -> Any:
    import torch

    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def _on_stream(stream: Any) -> AbstractContextManager[Any]:
    import torch

    return torch.cuda.stream(stream) if stream is not None else nullcontext()


def _wait_for(streams: Iterable[Any]) -> None:
    """Order the current stream after everything queued so far on `streams` (reading fingerprints that
    were computed there: vLLM 0.22's producer returns without synchronizing its side streams)."""
    import torch

    for stream in streams:
        torch.cuda.current_stream(stream.device).wait_stream(stream)


class FingerprintLog:
    """Fingerprints of named tensors, computed on their device and read back once (`result`).

    On a GPU `add` only takes the tensor into an open bucket (`BUCKET_BYTES`), fingerprinted in one go when
    it fills or at `flush`: the caller must not change or reuse a tensor's memory before then (a receiver's
    buffer: flush at the end of each batch, as `add_many` does). Tensors on the CPU (numpy), of an odd byte
    count or bigger than a bucket are fingerprinted at once, one by one.

    A bucket is fingerprinted on the CUDA stream its tensors were added under, and closes when the current
    stream changes: vLLM's packed NCCL producer runs the sender's iterator (the cast, this log) on one side
    stream per buffer, so a tensor is only ready, and its memory only safe to reuse, in its own stream's
    order."""

    def __init__(self, bucket_bytes: int = BUCKET_BYTES) -> None:
        self.bucket_bytes = bucket_bytes
        self._pending: list[tuple[list[str], Any]] = []  # (names, their fingerprints [k, 3] on a device)
        self._streams: list[Any] = []  # the CUDA streams fingerprints were computed on
        self._done: dict[str, Fingerprint] = {}
        self._open: dict[Any, _Bucket] = {}  # by device

    def add(self, name: str, tensor: Any) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        device = tensor.device
        stream = _current_stream(device)
        bucket = self._open.get(device)
        if bucket is not None and bucket.stream != stream:
            self._close(device)
        if (device.type == "cpu" and NUMPY_ON_CPU) or nbytes % 2 or nbytes > self.bucket_bytes:
            if device in self._open:  # keep the order added (a name added twice keeps the last)
                self._close(device)
            self._pending.append(([name], fingerprint_device(tensor).unsqueeze(0)))
            self._note(stream)
            return
        bucket = self._open.setdefault(device, _Bucket(stream=stream))
        bucket.names.append(name)
        bucket.tensors.append(tensor.detach())
        bucket.nbytes += nbytes
        if bucket.nbytes >= self.bucket_bytes:
            self._close(device)

    def _close(self, device: Any) -> None:
        bucket = self._open.pop(device)
        with _on_stream(bucket.stream):
            self._pending.append((bucket.names, fingerprint_bucket(bucket.tensors)))
        self._note(bucket.stream)

    def _note(self, stream: Any) -> None:
        if stream is not None and stream not in self._streams:
            self._streams.append(stream)

    def flush(self) -> None:
        """Fingerprint the open buckets now (their kernels are queued; `result` reads them back)."""
        for device in list(self._open):
            self._close(device)

    def add_many(self, named: Iterable[tuple[str, Any]]) -> None:
        for name, tensor in named:
            self.add(name, tensor)
        self.flush()

    def merge(self, fingerprints: Mapping[str, Sequence[int]]) -> None:
        self._done.update({name: _as_fp(fp) for name, fp in fingerprints.items()})

    def result(self) -> dict[str, Fingerprint]:
        self.flush()
        _wait_for(self._streams)
        self._streams = []
        if self._pending:
            import torch

            by_device: dict[Any, list[int]] = {}
            for i, (_, fps) in enumerate(self._pending):
                by_device.setdefault(fps.device, []).append(i)
            rows_of: dict[int, list[list[int]]] = {}
            for indices in by_device.values():  # one host sync per device
                rows, at = torch.cat([self._pending[i][1] for i in indices]).tolist(), 0
                for i in indices:
                    count = len(self._pending[i][0])
                    rows_of[i], at = rows[at : at + count], at + count
            for i, (names, _) in enumerate(self._pending):  # in the order added: a name added twice keeps the last
                for name, row in zip(names, rows_of[i], strict=True):
                    self._done[name] = _as_fp(row)
            self._pending = []
        return dict(self._done)

    def clear(self) -> None:
        self._pending, self._done, self._open, self._streams = [], {}, {}, []


def _as_fp(values: Sequence[int]) -> Fingerprint:
    a, b, c = (int(v) for v in values)
    return a, b, c


@dataclass
class SyncReceipt:
    """The engine side, one per worker: what `load_weights` was handed in this bracket, and whether the
    parameters named like those tensors changed (see the module doc)."""

    received: FingerprintLog = field(default_factory=FingerprintLog)
    before: dict[str, Fingerprint] = field(default_factory=dict)
    last_received: dict[str, Fingerprint] = field(default_factory=dict)
    unchanged: list[str] = field(default_factory=list)
    checked: int = 0
    duplicates: list[str] = field(default_factory=list)
    closed: bool = False
    # Host seconds the engine spent in this bracket, by part ("load": vLLM's `load_weights`, "receipt": the
    # records above), as the worker extension measured them: where a sync's `transfer` goes on the engine.
    engine_seconds: dict[str, float] = field(default_factory=dict)
    _seen: set[str] = field(default_factory=set)

    def begin(self, parameters: Iterable[tuple[str, Any]]) -> None:
        """At the bracket's start: fingerprint what the parameters of at most two dimensions hold now (the
        ones that can be named like a checkpoint tensor; a fused 3-D expert block never is, and skipping
        those skips most of an MoE's bytes)."""
        log = FingerprintLog()
        log.add_many((name, p) for name, p in parameters if p.dim() <= 2)
        self.before = log.result()
        self.received.clear()
        self.unchanged, self.checked, self.duplicates, self.closed = [], 0, [], False
        self.engine_seconds = {}
        self._seen = set()

    def record(self, named: Sequence[tuple[str, Any]]) -> None:
        for name, tensor in named:
            if name in self._seen:
                self.duplicates.append(name)
            self._seen.add(name)
            self.received.add(name, tensor)
        self.received.flush()  # a receiver reuses its buffer for the next batch

    def add_engine_seconds(self, part: str, seconds: float) -> None:
        self.engine_seconds[part] = self.engine_seconds.get(part, 0.0) + seconds

    def finish(self, parameters: Iterable[tuple[str, Any]]) -> None:
        """At the bracket's close: every parameter named like a received tensor, of its shape and dtype, must
        have changed where the received bytes differ from what came last time (or, at an engine's first
        sync, from what the parameter held): else the engine kept its previous weights."""
        received = self.received.result()
        wanted = {name: tensor for name, tensor in parameters if name in received and name in self.before}
        after = FingerprintLog()
        after.add_many(wanted.items())
        now = after.result()
        self.checked = 0
        for name in sorted(now):
            if now[name][0] != received[name][0]:  # another layout (padded, fused): not comparable here
                continue
            baseline = self.last_received.get(name, self.before[name])
            if received[name] == baseline:
                continue  # the same bytes as last time: nothing had to change
            self.checked += 1
            if now[name] == self.before[name]:
                self.unchanged.append(name)
        self.last_received = received
        self.closed = True

    def report(self) -> dict[str, Any]:
        """JSON-safe: what the driver compares with the sent fingerprints."""
        return {
            "closed": self.closed,
            "received": {k: list(v) for k, v in self.received.result().items()},
            "unchanged": list(self.unchanged),
            "checked": self.checked,
            "duplicates": sorted(set(self.duplicates)),
            "engine_seconds": dict(self.engine_seconds),
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
