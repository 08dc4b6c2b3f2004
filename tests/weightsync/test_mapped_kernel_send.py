"""The kernel layout written by the trainer straight into a colocated engine's parameters (weightsync/mapped.py,
engine/mapped.py, wire/doorbell.py), on the CPU.

On the CPU the engine moves its parameters into a POSIX shared-memory segment it owns (a GPU shares each parameter's
CUDA allocation through the same description): the first test runs the engine in a second process, as vLLM's worker
is. The references are written out (vLLM's fusions and the cast, test_direct_kernel_send's `_expected`), and the
trainer's fingerprints of what it wrote are compared with the engine's of what it holds (`compare_receipt`)."""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from test_direct_kernel_send import Engine, _expected, _trainer_state
from test_staged_kernel_send import _staged_sender, _StagedEndpoint, _Unreadable

from r3operator.engine.mapped import MappedParameters, MappedSyncFailed, map_parameters, take_mapped_sync
from r3operator.engine.worker import WeightSyncWorkerExtension
from r3operator.weightsync.mapped import MappedKernelSend
from r3operator.wire.doorbell import Doorbell, DoorbellTimeout
from r3operator.wire.kernel_layout import engine_parameters, plan_kernel_layout, trainer_shapes
from r3operator.wire.receipt import FingerprintLog, SyncReceipt, compare_receipt
from r3operator.wire.shared_buffer import SharedBufferError
from r3operator.wire.sync_phases import SyncPhases


def _plan(state: Mapping[str, torch.Tensor]) -> Any:
    return plan_kernel_layout(trainer_shapes(state), engine_parameters(Engine().reported()))


def _named(engine: Engine) -> list[tuple[str, torch.nn.Parameter]]:
    return [(Engine.NAMES[short], param) for short, param in engine.named_parameters()]


def _map(engine: Engine, share: Mapping[str, Any]) -> tuple[MappedParameters, dict[str, Any]]:
    """What `r3_mapped_attach` does, on `engine`: the same function."""
    return map_parameters(_named(engine), share)


def _held(engine: Engine) -> dict[str, tuple[bytes, tuple[int, ...]]]:
    return {n: (p.detach().view(torch.int16).numpy().tobytes(), tuple(p.shape)) for n, p in engine.named_parameters()}


def _engine_process(requests: Any, answers: Any) -> None:
    """An engine worker in its own process: share its parameters, then take each numbered sync until None."""
    engine, receipt = Engine(), SyncReceipt()
    state, answer = _map(engine, requests.get(timeout=120))
    answers.put([answer])
    while (number := requests.get(timeout=120)) is not None:
        receipt.begin(_named(engine))
        try:
            take_mapped_sync(state, number, timeout_s=60)
        except MappedSyncFailed as exc:
            receipt.abandon()
            answers.put(("failed", str(exc), _held(engine)))
            continue
        receipt.record_later([(n, d) for n, d, _ in state.parameters])
        receipt.finish_later(_named(engine))
        answers.put(("ok", receipt.report(), _held(engine)))
    state.close()


def _same(held: Mapping[str, tuple[bytes, tuple[int, ...]]], name: str, want: torch.Tensor) -> bool:
    words, shape = held[name]
    return torch.equal(torch.frombuffer(bytearray(words), dtype=torch.int16).view(shape), want.view(torch.int16))


def test_an_engine_process_is_written_in_place_and_a_failed_write_is_rung_as_failed() -> None:
    context = multiprocessing.get_context("spawn")
    requests, answers = context.Queue(), context.Queue()
    process = context.Process(target=_engine_process, args=(requests, answers))
    process.start()
    replies: list[Any] = []

    def ask(engine: int, share: dict[str, Any]) -> list[dict[str, Any]]:
        assert engine == 0
        requests.put(share)
        return list(answers.get(timeout=120))

    def start(number: int, policy_tag: str | None, timeout_s: float) -> list[Callable[[], None]]:
        requests.put(number)
        return [lambda: replies.append(answers.get(timeout=120))]

    try:
        state, sender, sent = _trainer_state(5), MappedKernelSend(), FingerprintLog(bucket_bytes=64)
        plan = _plan(state)
        sender.attach(1, ask, plan)
        sender.sync(state, plan, start=start, policy_tag="run:1", sent=sent, phases=SyncPhases())
        outcome, report, held = replies[-1]
        assert outcome == "ok"
        for name, want in _expected(state).items():
            assert _same(held, name, want), name
        compare_receipt(sent.result(), report, where="engine process")

        # The trainer fails after the first parameter: it rings failed, the engine's call fails, the mapping goes.
        with pytest.raises(RuntimeError, match=r"experts\.gate_up_proj is gone"):
            sender.sync(
                _Unreadable(_trainer_state(6)),
                plan,
                start=start,
                policy_tag="run:2",
                sent=FingerprintLog(),
                phases=SyncPhases(),
            )
        outcome, message, held = replies[-1]
        assert outcome == "failed" and "failed while writing" in message
        assert _same(held, "qkv", _expected(_trainer_state(6))["qkv"])  # written before the failure: tag None covers it
        assert _same(held, "w13", _expected(state)["w13"])
        assert not sender.attached
    finally:
        requests.put(None)
        process.join(timeout=60)
    assert process.exitcode == 0


def test_a_parameter_reallocated_since_it_was_shared_is_named() -> None:
    engine = Engine()
    owner = Doorbell(1)
    state, _ = _map(engine, {"doorbell": owner.description(), "slot_base": 0})
    assert state.moved(engine) == []
    engine.w2.data = torch.zeros_like(engine.w2.data)  # what a reload or a sleep and wake would do
    assert state.moved(engine) == ["model.layers.0.mlp.experts.w2_weight"]
    state.close()
    owner.close()


def test_a_share_that_does_not_match_the_plan_is_refused_naming_the_parameter() -> None:
    state = _trainer_state(1)
    shrunk = Engine()
    shrunk.w2 = torch.nn.Parameter(torch.zeros(2, 2, dtype=torch.bfloat16))  # another model's expert block
    sender = MappedKernelSend()

    def ask(engine: int, share: dict[str, Any]) -> list[dict[str, Any]]:
        return [_map(shrunk, share)[1]]

    with pytest.raises(
        SharedBufferError, match=r"experts\.w2_weight \(planned bfloat16 \[\d+, \d+, \d+\], shared bfloat16 \[2, 2\]\)"
    ):
        sender.attach(1, ask, _plan(state))
    assert not sender.attached


def test_the_doorbell_waits_for_the_other_side_and_gives_up_when_it_stopped() -> None:
    owner = Doorbell(2)
    engine = Doorbell.attach(owner.description())
    engine.ring_opened(1, 3)
    owner.wait_opened(1, 3, timeout_s=1, give_up=lambda: False)
    with pytest.raises(DoorbellTimeout, match="slot 0: the engine never opened sync 3 \\(the other side stopped\\)"):
        owner.wait_opened(0, 3, timeout_s=30, give_up=lambda: True)
    with pytest.raises(DoorbellTimeout, match=r"within 0\.05 s"):
        engine.wait_written(1, 3, timeout_s=0.05)
    owner.ring_failed(1, 3)
    assert engine.wait_written(1, 3, timeout_s=1) is False
    threading.Timer(0.05, owner.ring_written, args=(1, 4)).start()
    assert engine.wait_written(1, 4, timeout_s=10) is True
    with pytest.raises(SharedBufferError, match="slot 2 outside its 2 slot"):
        engine.ring_opened(2, 1)
    engine.close()
    owner.close()


# ------------------------------------------------------------------------------ through the sender


class _Served:
    """The engine module as vLLM's model runner serves it: its parameters under their vLLM names."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        return _named(self.engine)

    def named_modules(self) -> Any:
        return self.engine.named_modules()

    def get_parameter(self, name: str) -> torch.nn.Parameter:
        return self.engine.get_parameter(name)


class _MappedWorker(WeightSyncWorkerExtension):
    """The worker extension's `r3_mapped_attach` / `r3_mapped_sync` on a CPU module: vLLM's bracket calls stand in
    (recorded); the mapping, the wait for the trainer, the receipt and the tag are the extension's own."""

    def __init__(self, engine: Engine, receipt: SyncReceipt) -> None:
        self.served, self.calls = _Served(engine), []
        self._r3_receipt_state = receipt

    def _r3_model(self) -> Any:
        return self.served

    def r3_native_begin(self, layout: str = "checkpoint", in_place: bool = False) -> None:
        self.calls.append(f"begin {layout}")
        self._r3_receipt().begin(self._r3_parameters(), in_place=in_place)

    def finish_weight_update(self) -> None:  # vLLM's Worker: closes its bracket
        self.calls.append("finish")

    def r3_abort_native_weight_update(self) -> dict[str, int]:
        self.calls.append("abort")
        self._r3_receipt().abandon()
        self._r3_policy_tag = None
        return {"layers_restored": 0}


@dataclass
class _MappedEndpoint(_StagedEndpoint):
    """A colocated engine that shares its parameters: its mapped attach and sync are the worker extension's own
    (`_MappedWorker`), run in the sender's threads."""

    refuse: bool = False
    worker: _MappedWorker = field(init=False)

    def __post_init__(self) -> None:
        self.worker = _MappedWorker(self.engine, self.receipt)

    def native_mapped_attach(self, share: dict[str, Any]) -> list[dict[str, Any]]:
        self.calls.append("map")
        if self.refuse:
            raise SharedBufferError("cudaIpcGetMemHandle: the allocation cannot be shared (a VMM allocator)")
        return [self.worker.r3_mapped_attach(share)]

    def native_mapped_sync(self, number: int, policy_tag: str | None, timeout_s: float) -> None:
        self.calls.append("mapped sync")
        self.worker.r3_mapped_sync(number, policy_tag, timeout_s)
        self.tag = self.worker.r3_policy_tag()


def test_the_sender_writes_every_engine_in_place_and_falls_back_to_the_staging_buffer_when_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    current: dict[str, Any] = {"state": _trainer_state(7)}
    a, b = _MappedEndpoint("a"), _MappedEndpoint("b")
    sender = _staged_sender(monkeypatch, lambda: current["state"], a, b)
    sender.send("run:0")  # the plan's reference, in the checkpoint layout
    current["state"] = _trainer_state(6)
    sender.send("run:1")
    current["state"] = _trainer_state(8)
    sender.send("run:2")
    assert sender.ipc_path == "mapped" and sender.mapping_refused is None
    for endpoint in (a, b):
        assert endpoint.calls == ["checkpoint", "map", "mapped sync", "mapped sync"] and endpoint.tag == "run:2"
        assert endpoint.worker.calls == ["begin kernel", "finish"] * 2
        compare_receipt(sender.sent.result(), endpoint.receipt.report(), where=endpoint.name)
        for name, want in _expected(current["state"]).items():
            assert torch.equal(getattr(endpoint.engine, name).data, want), name
    sender.close()

    refusing = _MappedEndpoint("c", refuse=True)
    sender = _staged_sender(monkeypatch, lambda: _trainer_state(9), refusing)
    sender.send("run:0")
    sender.send("run:1")
    sender.send("run:2")
    assert sender.ipc_path == "staged" and "VMM allocator" in (sender.mapping_refused or "")
    assert refusing.calls == ["checkpoint", "map", "attach", "sync", "sync"] and refusing.tag == "run:2"
    assert torch.equal(refusing.engine.w13.data, _expected(_trainer_state(9))["w13"])
    sender.close()
