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
permuted tensor fingerprints differently), in int64 on the tensor's own device: no device-to-host copy
of the weights, and the same result on the trainer's GPU and on the engine's.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
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

    One read of the tensor: the words are laid out as rows of `WEIGHT_PERIOD` columns and summed per
    column in int64 (no int64 copy of the tensor); the weighted sum is then over the column sums. On the
    CPU numpy does the sums (torch's integer reductions there are ~40x slower)."""
    import torch

    words = _words(tensor)
    if words.device.type == "cpu":
        return torch.tensor(_fingerprint_numpy(words.numpy()), dtype=torch.int64)
    return _fingerprint_torch(words)


def _fingerprint_torch(words: Any) -> Any:
    import torch

    n = words.numel()
    full = n - n % WEIGHT_PERIOD
    device = words.device
    out = torch.zeros(3, dtype=torch.int64, device=device)
    out[0] = n
    if full:
        columns = words[:full].view(-1, WEIGHT_PERIOD).sum(dim=0, dtype=torch.int64)
        weights = torch.arange(1, WEIGHT_PERIOD + 1, dtype=torch.int64, device=device)
        out[1] += columns.sum()
        out[2] += (columns * weights).sum()
    if n > full:  # the last, partial row
        tail = words[full:].to(torch.int64)
        weights = torch.arange(1, n - full + 1, dtype=torch.int64, device=device)
        out[1] += tail.sum()
        out[2] += (tail * weights).sum()
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


def fingerprint(tensor: Any) -> Fingerprint:
    a, b, c = (int(x) for x in fingerprint_device(tensor).tolist())
    return a, b, c


class FingerprintLog:
    """Fingerprints of named tensors, computed on their device and read back once (`result`)."""

    def __init__(self) -> None:
        self._names: list[str] = []
        self._pending: list[Any] = []
        self._done: dict[str, Fingerprint] = {}

    def add(self, name: str, tensor: Any) -> None:
        self._names.append(name)
        self._pending.append(fingerprint_device(tensor))

    def add_many(self, named: Iterable[tuple[str, Any]]) -> None:
        for name, tensor in named:
            self.add(name, tensor)

    def tap(self, named: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """Pass `named` through, fingerprinting each tensor on the way (a sender's iterator)."""
        for name, tensor in named:
            self.add(name, tensor)
            yield name, tensor

    def merge(self, fingerprints: Mapping[str, Sequence[int]]) -> None:
        self._done.update({name: _as_fp(fp) for name, fp in fingerprints.items()})

    def result(self) -> dict[str, Fingerprint]:
        if self._pending:
            import torch

            by_device: dict[Any, list[int]] = {}
            for i, fp in enumerate(self._pending):
                by_device.setdefault(fp.device, []).append(i)
            for indices in by_device.values():  # one host sync per device
                rows = torch.stack([self._pending[i] for i in indices]).tolist()
                for i, row in zip(indices, rows, strict=True):
                    self._done[self._names[i]] = _as_fp(row)
            self._names, self._pending = [], []
        return dict(self._done)

    def clear(self) -> None:
        self._names, self._pending, self._done = [], [], {}


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
        self._seen = set()

    def record(self, named: Sequence[tuple[str, Any]]) -> None:
        for name, tensor in named:
            if name in self._seen:
                self.duplicates.append(name)
            self._seen.add(name)
            self.received.add(name, tensor)

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
        return {"closed": self.closed, "received": {k: list(v) for k, v in self.received.result().items()},
                "unchanged": list(self.unchanged), "checked": self.checked,
                "duplicates": sorted(set(self.duplicates))}  # fmt: skip


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
        raise ReceiptMismatchError(f"{where}: the engine received {len(received)} of the {len(sent)} tensors "
                                   f"sent; missing: {_listing(missing)}")  # fmt: skip
    extra = [n for n in received if n not in sent]
    if extra:
        raise ReceiptMismatchError(f"{where}: the engine loaded tensors that were not sent: {_listing(extra)}")
    if duplicates := list(receipt.get("duplicates") or []):
        raise ReceiptMismatchError(f"{where}: the engine was handed these tensors more than once: "
                                   f"{_listing(duplicates)}")  # fmt: skip
    differ = [n for n in sent if received[n] != sent[n]]
    if differ:
        raise ReceiptMismatchError(f"{where}: {len(differ)} tensor(s) arrived with other bytes than the trainer "
                                   f"sent: {_listing(differ)}")  # fmt: skip
    if unchanged := list(receipt.get("unchanged") or []):
        raise ReceiptMismatchError(
            f"{where}: the engine kept its previous values in {len(unchanged)} of the {receipt.get('checked')} "
            f"parameters it could check although new ones arrived: {_listing(unchanged)}"
        )
