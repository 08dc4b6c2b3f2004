"""The worker extension's engine-side timing of a sync (engine/worker.py `_timed_load`, wire/receipt.py
`engine_seconds`), without vLLM: a model whose `load_weights` and a receipt whose `record` advance a driven
clock by known amounts, so each part's seconds are known exactly."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import pytest
import torch

from r3operator.engine import worker as worker_module
from r3operator.engine.worker import WeightSyncWorkerExtension
from r3operator.wire.receipt import SyncReceipt

LOAD_S = 2.5  # what one `load_weights` call costs on the driven clock
RECORD_S = 0.25  # what one receipt record costs


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Model:
    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.batches: list[list[str]] = []

    def load_weights(self, weights: Any) -> set[str]:
        names = [name for name, _ in weights]
        self.batches.append(names)
        self.clock.now += LOAD_S
        return set(names)


class TimedReceipt(SyncReceipt):
    clock: Clock | None = None

    def record(self, named: Any) -> None:
        super().record(named)
        assert self.clock is not None
        self.clock.now += RECORD_S


class BrokenModel(Model):
    def load_weights(self, weights: Any) -> set[str]:
        self.clock.now += LOAD_S
        raise RuntimeError("engine out of memory")


def _worker(clock: Clock, model_cls: type[Model] = Model) -> tuple[WeightSyncWorkerExtension, Model, TimedReceipt]:
    model = model_cls(clock)
    receipt = TimedReceipt()
    receipt.clock = clock

    class Runner:
        def get_model(self) -> Model:
            return model

    class Worker(WeightSyncWorkerExtension):
        model_runner = Runner()

        def _r3_context(self) -> ExitStack:  # no vLLM config to make current here
            return ExitStack()

    worker = Worker()
    worker._r3_receipt_state = receipt
    return worker, model, receipt


BATCHES = [
    [("a.weight", torch.ones(2, 3)), ("b.weight", torch.zeros(4))],
    [("c.weight", torch.arange(5.0))],
]


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    driven = Clock()
    monkeypatch.setattr(worker_module, "_clock", driven, raising=False)  # fail on behaviour, not setup
    return driven


def test_native_tap_reports_the_engine_load_and_receipt_seconds_of_a_bracket(clock: Clock) -> None:
    worker, model, receipt = _worker(clock)
    receipt.begin([])
    worker._r3_tap_load_weights()
    for batch in BATCHES:
        model.load_weights(batch)  # what vLLM's receiver calls, once per unpacked batch
    report = worker.r3_sync_receipt()
    assert report["engine_seconds"] == {"receipt": len(BATCHES) * RECORD_S, "load": len(BATCHES) * LOAD_S}
    assert model.batches == [["a.weight", "b.weight"], ["c.weight"]]  # still loaded, in order
    assert sorted(report["received"]) == ["a.weight", "b.weight", "c.weight"]

    receipt.begin([])  # the next bracket counts from zero
    model.load_weights(BATCHES[1])
    assert worker.r3_sync_receipt()["engine_seconds"] == {"receipt": RECORD_S, "load": LOAD_S}
    worker._r3_untap_load_weights()


def test_packed_path_chunks_report_the_same_split(clock: Clock) -> None:
    worker, model, receipt = _worker(clock)
    receipt.begin([])
    worker._r3_update_active = True  # the bracket's vLLM side is not under test here
    counts = [worker.r3_load_chunk(batch) for batch in BATCHES]
    assert counts == [2, 1]
    assert model.batches == [["a.weight", "b.weight"], ["c.weight"]]
    assert worker.r3_sync_receipt()["engine_seconds"] == {
        "receipt": len(BATCHES) * RECORD_S,
        "load": len(BATCHES) * LOAD_S,
    }


def test_a_failing_load_still_counts_its_seconds(clock: Clock) -> None:
    worker, model, receipt = _worker(clock, BrokenModel)
    receipt.begin([])
    worker._r3_tap_load_weights()
    with pytest.raises(RuntimeError, match="out of memory"):
        model.load_weights(BATCHES[0])
    assert receipt.engine_seconds == {"receipt": RECORD_S, "load": LOAD_S}


def test_the_bracket_close_gives_the_sync_buffers_back_and_reports_it(
    clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    from r3operator.wire import cuda_cache

    released: list[int] = []

    def release(min_idle_bytes: int | None = None) -> cuda_cache.Release:
        released.append(min_idle_bytes)
        return cuda_cache.Release(freed_bytes=5 << 30, seconds=0.125)

    monkeypatch.setattr(cuda_cache, "release_cached_blocks", release)
    worker, model, _ = _worker(clock)
    monkeypatch.setattr("r3operator.engine.plugin.self_check", lambda: None)  # the plugin's vLLM patches
    monkeypatch.setattr(worker, "_r3_parameters", lambda: [])  # the test model has none to fingerprint
    worker.r3_before_native_weight_update("checkpoint")
    model.load_weights(BATCHES[0])
    worker.r3_after_native_weight_update("policy-1")
    report = worker.r3_sync_receipt()
    assert released == [None]  # once per bracket, after it closed, at the default threshold
    assert report["released_bytes"] == 5 << 30
    assert report["engine_seconds"]["release"] == 0.125

    worker.r3_before_native_weight_update("checkpoint")  # the next bracket starts from nothing released
    assert worker.r3_sync_receipt()["released_bytes"] == 0
