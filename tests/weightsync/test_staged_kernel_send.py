"""The kernel layout to a colocated engine through one shared staging buffer (weightsync/staged.py, engine/worker.py
`staged_targets` / `copy_staged`, wire/shared_buffer.py), on the CPU.

On the CPU the buffer is a POSIX shared-memory segment (the GPU shares a CUDA IPC handle through the same
description and protocol): the first test maps it in a second process, as an engine does. The references are
written out (the fusions and the cast, test_direct_kernel_send's `_expected`) and the trainer's own fingerprints
compared with what the engine holds (`compare_receipt`)."""

from __future__ import annotations

import json
import multiprocessing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from test_direct_kernel_send import Engine, _expected, _trainer_state

from r3operator.api.weight_transfer import TransferMethod
from r3operator.engine.worker import WeightUpdateStateError, copy_staged, staged_targets
from r3operator.weightsync.staged import StagedKernelSend
from r3operator.wire.kernel_layout import engine_parameters, plan_kernel_layout, trainer_shapes
from r3operator.wire.receipt import FingerprintLog, SyncReceipt, compare_receipt
from r3operator.wire.shared_buffer import SharedBufferError, StagedEntry, entry_views, open_shared
from r3operator.wire.sync_messages import BeginNative, BracketLayout
from r3operator.wire.sync_phases import SyncPhases


def _plan(state: Mapping[str, torch.Tensor], engine: Engine) -> Any:
    return plan_kernel_layout(trainer_shapes(state), engine_parameters(engine.reported()))


def _attach(engine: Engine, share: Mapping[str, Any]) -> tuple[Any, list[tuple[str, Any, Any]]]:
    """What `r3_staged_attach` does, on `engine`: the share arrives as JSON."""
    share = json.loads(json.dumps(share))
    entries = [StagedEntry.from_json(e) for e in share["entries"]]
    opened = open_shared(share["buffer"])
    return opened, staged_targets(engine, entries, entry_views(opened.tensor, entries))


def _engine_process(share: dict[str, Any], results: Any) -> None:
    """An engine in its own process: map the trainer's buffer, take one sync, hand back its parameters and
    receipt."""
    engine, receipt = Engine(), SyncReceipt()
    opened, targets = _attach(engine, share)
    receipt.begin(list(engine.named_parameters()))
    copy_staged(targets, receipt)
    receipt.finish(list(engine.named_parameters()))
    held = {n: (p.detach().view(torch.int16).numpy().tobytes(), tuple(p.shape)) for n, p in engine.named_parameters()}
    results.put((held, receipt.report()))  # plain bytes: a tensor in a queue is shared, and this process ends
    del targets
    opened.close()


def test_an_engine_process_maps_the_buffer_and_holds_every_parameter_as_vllm_fuses_it() -> None:
    state, sender, sent = _trainer_state(5), StagedKernelSend(), FingerprintLog(bucket_bytes=64)
    plan = _plan(state, Engine())
    share = sender.attachment(plan, device="cpu")
    assert share is not None and share["buffer"]["kind"] == "shm"
    sender.fill(state, plan, sent=sent, phases=SyncPhases())
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    process = context.Process(target=_engine_process, args=(share, results))
    process.start()
    held, report = results.get(timeout=120)
    process.join(timeout=60)
    assert process.exitcode == 0
    for name, want in _expected(state).items():
        words, shape = held[name]
        assert torch.equal(torch.frombuffer(bytearray(words), dtype=torch.int16).view(shape), want.view(torch.int16))
    compare_receipt(sent.result(), report, where="engine process")
    assert set(report["engine_seconds"]) == {"receipt", "load", "unchanged"}
    sender.close()


def test_the_buffer_is_shared_once_and_the_next_sync_writes_the_new_values_into_it() -> None:
    engine, sender = Engine(), StagedKernelSend()
    first = _trainer_state(1)
    plan = _plan(first, engine)
    share = sender.attachment(plan, device="cpu")
    assert share is not None
    opened, targets = _attach(engine, share)
    sender.attached = True
    buffer = sender._buffer
    for state in (first, _trainer_state(2)):
        assert sender.attachment(plan, device="cpu") is None  # mapped already: nothing to send again
        sender.fill(state, plan, sent=FingerprintLog(), phases=SyncPhases())
        receipt = SyncReceipt()
        receipt.begin(list(engine.named_parameters()))
        copy_staged(targets, receipt)
        for name, want in _expected(state).items():
            assert torch.equal(getattr(engine, name).data, want), name
    assert sender._buffer is buffer
    slots = sum(e.nbytes for e in sender._entries)
    assert slots <= sender.staged_bytes < slots + 256 * len(plan)  # one slot per parameter, aligned

    smaller = {k: v for k, v in first.items() if "experts" not in k}  # another model: the buffer is made again
    other = Engine()
    reported = [p for p in other.reported() if "experts" not in p[0]]
    other_plan = plan_kernel_layout(trainer_shapes(smaller), engine_parameters(reported))
    again = sender.attachment(other_plan, device="cpu")
    assert again is not None and sender._buffer is not buffer and len(again["entries"]) == len(other_plan)
    del targets
    opened.close()
    sender.close()
    assert sender.staged_bytes == 0


def test_a_slot_the_engine_cannot_take_is_named_when_the_buffer_is_attached() -> None:
    state, sender = _trainer_state(3), StagedKernelSend()
    share = sender.attachment(_plan(state, Engine()), device="cpu")
    assert share is not None
    shrunk = Engine()
    shrunk.w2 = torch.nn.Parameter(torch.zeros(2, 2, dtype=torch.bfloat16))  # another model's expert block
    with pytest.raises(WeightUpdateStateError, match=r"model\.layers\.0\.mlp\.experts\.w2_weight \(staged bfloat16"):
        _attach(shrunk, share)
    bad = json.loads(json.dumps(share))
    bad["entries"][0][3] = 1 << 40
    with pytest.raises(SharedBufferError, match=r"lie outside the \d+-byte buffer"):
        _attach(Engine(), bad)
    with pytest.raises(SharedBufferError, match="shared buffer kind 'nfs'"):
        open_shared({"kind": "nfs", "nbytes": 1})
    sender.close()


# ------------------------------------------------------------------------------ through the sender


@dataclass
class _StagedEndpoint:
    """A colocated engine as the sender sees it: its staged attach and sync run `engine/worker.py`'s functions on a
    real module and receipt; `restarted` forgets the attachment, as a new engine process would."""

    name: str
    engine: Engine = field(default_factory=Engine)
    receipt: SyncReceipt = field(default_factory=SyncReceipt)
    calls: list[str] = field(default_factory=list)
    tag: str | None = None
    _mapped: Any = None

    def native_parameters(self) -> dict[str, Any]:
        return {"parameters": self.engine.reported(), "refused": None}

    # A checkpoint-layout bracket (the kernel layout's reference sync): vLLM's start, its receiver handing each batch
    # to the (tapped) `load_weights`, its finish, as the worker extension records them.
    def native_start(self, bracket: BeginNative) -> None:
        assert not bracket.kernel
        self.calls.append("checkpoint")
        self.receipt.begin(self.engine.vllm_named())

    def load_checkpoint(self, batch: list[tuple[str, torch.Tensor]]) -> None:
        self.receipt.record(batch)
        self.engine.load_checkpoint(batch)

    def native_finish(self, policy_tag: str | None) -> None:
        self.receipt.finish(self.engine.vllm_named())
        self.tag = policy_tag

    def native_parameter_fingerprints(self) -> list[dict[str, tuple[int, int, int]]]:
        log = FingerprintLog()
        log.add_many(self.engine.vllm_named())
        return [log.result()]

    def native_staged_attach(self, share: dict[str, Any]) -> None:
        self.calls.append("attach")
        self._mapped = _attach(self.engine, share)

    def native_staged_sync(self, policy_tag: str | None) -> None:
        self.calls.append("sync")
        if self._mapped is None:
            raise WeightUpdateStateError("r3_staged_sync: no staging buffer attached")
        self.receipt.begin(list(self.engine.named_parameters()))
        copy_staged(self._mapped[1], self.receipt)
        self.receipt.finish(list(self.engine.named_parameters()))
        self.tag = policy_tag

    def native_abort(self) -> None:
        self.calls.append("abort")

    def restarted(self) -> None:
        self._mapped, self.tag = None, None


def _staged_sender(monkeypatch: pytest.MonkeyPatch, state: Any, *endpoints: _StagedEndpoint) -> Any:
    from r3operator.weightsync import transfer

    monkeypatch.setattr(transfer, "trainer_vllm_api", lambda: "static")  # vLLM 0.22.1's sender (the GPU image)
    client = transfer.FanOutClient(list(endpoints), bracket=BeginNative(BracketLayout.KERNEL))
    sender = transfer.NativeSender(
        TransferMethod.IPC, client, lambda: state(), dtype=torch.bfloat16, buffer_size_bytes=1
    )
    sender.device = "cpu"

    def bracketed_send(meta: Any) -> None:  # vLLM's packed IPC in the checkpoint layout: CUDA only, stood in for
        client.start_weight_update()
        batch = list(sender.tensors())
        for endpoint in endpoints:
            endpoint.load_checkpoint(batch)
        client.finish_weight_update()

    monkeypatch.setattr(sender, "_bracketed_send", bracketed_send)
    return sender


class _Unreadable(dict[str, Any]):
    """A trainer whose expert block cannot be read (its shapes can: the plan is made)."""

    def __getitem__(self, key: str) -> Any:
        if "experts" in key:
            raise RuntimeError(f"trainer tensor {key} is gone")
        return super().__getitem__(key)


def test_every_engine_takes_each_sync_in_one_call_and_a_failed_build_asks_none(monkeypatch: pytest.MonkeyPatch) -> None:
    current: dict[str, Any] = {"state": _trainer_state(7)}
    a, b = _StagedEndpoint("a"), _StagedEndpoint("b")
    sender = _staged_sender(monkeypatch, lambda: current["state"], a, b)
    sender.send("run:0")  # the plan's first sync: the checkpoint layout, vLLM's load the reference of the kernel one
    assert sender.kernel_refused is None and sender.reference_seconds is not None
    for endpoint in (a, b):
        assert endpoint.calls == ["checkpoint"] and endpoint.tag == "run:0"
        compare_receipt(sender.sent.result(), endpoint.receipt.report(), where=endpoint.name)
    current["state"] = _trainer_state(6)
    sender.send("run:1")
    for endpoint in (a, b):
        assert endpoint.calls == ["checkpoint", "attach", "sync"] and endpoint.tag == "run:1"
        compare_receipt(sender.sent.result(), endpoint.receipt.report(), where=endpoint.name)
        for name, want in _expected(current["state"]).items():
            assert torch.equal(getattr(endpoint.engine, name).data, want), name

    held = {n: p.detach().clone() for n, p in a.engine.named_parameters()}
    current["state"] = _Unreadable(_trainer_state(8))
    with pytest.raises(RuntimeError, match=r"experts\.gate_up_proj is gone"):
        sender.send("run:2")
    assert a.calls[1:] == ["attach", "sync"] and a.tag == "run:1"  # never asked: the whole previous policy, tagged
    assert all(torch.equal(p, held[n]) for n, p in a.engine.named_parameters())

    b.restarted()  # a new engine process maps nothing: its sync fails, and the next one attaches again
    current["state"] = _trainer_state(9)
    with pytest.raises(WeightUpdateStateError, match="no staging buffer attached"):
        sender.send("run:3")
    sender.send("run:4")
    assert b.calls[-2:] == ["attach", "sync"] and b.tag == "run:4"
    assert torch.equal(b.engine.w13.data, _expected(current["state"])["w13"])
    sender.close()


def test_the_checkpoint_layout_over_ipc_is_not_staged(monkeypatch: pytest.MonkeyPatch) -> None:
    sender = _staged_sender(monkeypatch, dict, _StagedEndpoint("a"))
    sender.client.bracket = BeginNative()
    assert not sender._stages([("w", torch.bfloat16, (4,))])
    sender.client.bracket = BeginNative(BracketLayout.KERNEL)
    assert sender._stages([("w", torch.bfloat16, (4,))])


def test_a_buffer_an_engine_cannot_map_sends_this_sync_and_the_next_through_vllms_packed_ipc(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Refused before any engine's weights were touched (another GPU, an allocator without IPC): the sync goes on
    in vLLM's bracket, and the reason is kept."""
    a = _StagedEndpoint("a")

    def refuse(share: dict[str, Any]) -> None:
        a.calls.append("attach")
        raise SharedBufferError("the staging buffer is on GPU GPU-1, this engine worker on GPU GPU-2")

    a.native_staged_attach = refuse  # type: ignore[method-assign]
    sender = _staged_sender(monkeypatch, lambda: _trainer_state(10), a)
    sender.send("run:0")  # the reference, in the checkpoint layout
    bracketed: list[str] = []
    monkeypatch.setattr(sender, "_bracketed_send", lambda meta: bracketed.append("vllm packed ipc"))
    sender.send("run:1")
    sender.send("run:2")
    assert bracketed == ["vllm packed ipc"] * 2 and a.calls == ["checkpoint", "attach"]
    assert sender.staging_refused is not None and "GPU-2" in sender.staging_refused
    assert sender._staged is None
