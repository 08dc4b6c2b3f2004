"""The worker extension on a kernel-format native sync (engine/worker.py `r3_before_native_weight_update(
"kernel")`), without vLLM: a transfer engine and a worker `update_weights` written as vLLM 0.22.1's are
(`Worker.update_weights` with `is_checkpoint_format=False` hands `receive_weights` its own direct-copy
loader, `model.get_parameter(name).copy_(weight)`, instead of `model.load_weights`). The receipt must still
see every tensor, the driver's comparison must catch one that never arrived, and the copies must land."""

from __future__ import annotations

import enum
from contextlib import ExitStack
from typing import Any

import pytest
import torch

from r3operator.engine import plugin
from r3operator.engine.worker import WeightSyncWorkerExtension, WeightUpdateStateError
from r3operator.wire.receipt import FingerprintLog, ReceiptMismatchError, compare_receipt


class Model(torch.nn.Module):
    """Parameters as vLLM builds them: a fused block and a norm weight (a plain, grad-requiring Parameter)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(4, 6, bias=False, dtype=torch.bfloat16)
        self.norm = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))

    def load_weights(self, weights: Any) -> set[str]:  # the checkpoint path: must not be called here
        raise AssertionError("a kernel-format sync never calls model.load_weights")


class Receiver:
    """vLLM 0.22.1's transfer engine as the worker drives it: one `load_weights(batch)` per received batch."""

    def __init__(self, batches: list[list[tuple[str, Any]]]) -> None:
        self.batches = batches

    def receive_weights(self, update_info: Any, load_weights: Any) -> None:
        for batch in self.batches:
            load_weights(batch)


class Receiver030:
    """vLLM 0.30's receiver: no loader argument (it calls `model.load_weights` itself, always bracketed)."""

    def receive_weights(self, update_info: Any) -> None:
        raise AssertionError("not reached")


def update_weights_022(worker: Any, model: Model) -> None:
    """vLLM 0.22.1's `Worker.update_weights` for kernel-format weights (`_is_checkpoint_format` False)."""

    def load_weights_direct(weights: list[tuple[str, torch.Tensor]]) -> None:
        for name, weight in weights:
            param = model.get_parameter(name)
            param.copy_(weight)

    worker.weight_transfer_engine.receive_weights({}, load_weights=load_weights_direct)


def _worker(receiver: Any) -> tuple[Any, Model]:
    model = Model()

    class Runner:
        def get_model(self) -> Model:
            return model

    class Worker(WeightSyncWorkerExtension):
        model_runner = Runner()
        weight_transfer_engine = receiver

        def _r3_context(self) -> ExitStack:
            return ExitStack()

        def start_weight_update(self, is_checkpoint_format: bool = True) -> None:
            """vLLM 0.22.1's signature: its own kernel-format bracket, whose receiver this file drives."""

    return Worker(), model


def _sent() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        ("qkv.weight", torch.randn(6, 4, generator=gen).to(torch.bfloat16)),
        ("norm", torch.randn(4, generator=gen).to(torch.bfloat16)),
    ]


def _fingerprints(named: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    log = FingerprintLog()
    log.add_many(named)
    return log.result()


@pytest.fixture(autouse=True)
def no_vllm_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plugin, "self_check", lambda: None)  # the plugin's vLLM patches: not under test


def test_a_kernel_sync_is_received_copied_and_in_the_receipt() -> None:
    sent = _sent()
    worker, model = _worker(Receiver([sent[:1], sent[1:]]))
    worker.r3_before_native_weight_update("kernel")
    assert "load_weights" not in model.__dict__  # the checkpoint tap is not in front of load_weights
    update_weights_022(worker, model)
    worker.r3_after_native_weight_update("policy-1")
    assert torch.equal(model.qkv.weight, sent[0][1]) and torch.equal(model.norm, sent[1][1])
    report = worker.r3_sync_receipt()
    compare_receipt(_fingerprints(sent), report, where="engine 0")  # every tensor, the same bytes, applied
    assert report["checked"] == 2 and set(report["engine_seconds"]) == {"receipt", "load", "release", "unchanged"}
    assert worker.r3_policy_tag() == "policy-1"
    assert "receive_weights" not in worker.weight_transfer_engine.__dict__  # untapped after the finish


def test_a_tensor_that_never_arrived_fails_the_receipt() -> None:
    sent = _sent()
    worker, model = _worker(Receiver([sent[:1]]))  # the second batch is lost
    worker.r3_before_native_weight_update("kernel")
    update_weights_022(worker, model)
    worker.r3_after_native_weight_update("policy-1")
    with pytest.raises(ReceiptMismatchError, match=r"received 1 of the 2 tensors sent; missing: norm"):
        compare_receipt(_fingerprints(sent), worker.r3_sync_receipt(), where="engine 0")


def test_vllms_direct_copy_needs_the_no_grad_the_tap_adds() -> None:
    """The reason for the tap's `no_grad`: vLLM 0.22.1's loader alone fails on a grad-requiring Parameter."""
    sent = _sent()
    worker, model = _worker(Receiver([sent]))
    with pytest.raises(RuntimeError, match="requires grad"):
        update_weights_022(worker, model)  # no tap: vLLM's loader as it is


def test_a_receiver_without_the_loader_argument_is_refused_by_name() -> None:
    worker, _model = _worker(Receiver030())
    worker.r3_before_native_weight_update("kernel")
    with pytest.raises(WeightUpdateStateError, match=r"weightSync\.layout: use checkpoint"):
        worker.weight_transfer_engine.receive_weights({})


def test_an_abort_removes_the_tap_and_keeps_the_tag_stale() -> None:
    worker, _model = _worker(Receiver([_sent()]))
    worker._r3_policy_tag = "old"
    worker.r3_before_native_weight_update("kernel")
    worker._r3_restore_loading_layers = lambda: 0  # no vLLM layerwise state on the kernel path
    worker.r3_abort_native_weight_update()
    assert "receive_weights" not in worker.weight_transfer_engine.__dict__
    assert worker.r3_policy_tag() is None


def test_the_parameter_metadata_is_what_the_planner_reads() -> None:
    worker, _ = _worker(Receiver([]))
    answer = worker.r3_parameter_metadata()
    assert sorted(answer["parameters"]) == [["norm", "bfloat16", [4]], ["qkv.weight", "bfloat16", [6, 4]]]
    assert answer["refused"] is None
    with pytest.raises(ValueError, match=r"weightSync\.layout must be checkpoint or kernel"):
        worker.r3_before_native_weight_update("fused")


class _Backend(enum.Enum):  # vLLM's UnquantizedMoeBackend members (names and values as in 0.22.1)
    TRITON = "TRITON"
    FLASHINFER_CUTLASS = "FlashInfer CUTLASS"


class UnquantizedFusedMoEMethod:
    def __init__(self, backend: _Backend) -> None:
        self.unquantized_backend = backend


class Fp8MoEMethod:
    pass


@pytest.mark.parametrize(
    ("method", "named"),
    [
        (UnquantizedFusedMoEMethod(_Backend.TRITON), None),
        (UnquantizedFusedMoEMethod(_Backend.FLASHINFER_CUTLASS), "experts runs the FlashInfer CUTLASS MoE backend"),
        (Fp8MoEMethod(), "experts is loaded by Fp8MoEMethod"),
    ],
)
def test_an_engine_that_lays_weights_out_again_refuses_the_kernel_layout(method: Any, named: str | None) -> None:
    worker, model = _worker(Receiver([]))
    model.experts = torch.nn.Module()
    model.experts.quant_method = method
    answer = worker.r3_parameter_metadata()
    if named is None:
        assert answer["refused"] is None
        worker.r3_before_native_weight_update("kernel")
        return
    assert named in answer["refused"]  # answered to the sender, which refuses before any bracket
    with pytest.raises(WeightUpdateStateError, match=named):
        worker.r3_before_native_weight_update("kernel")
    worker.r3_before_native_weight_update("checkpoint")  # the checkpoint layout is right everywhere


class VllmBracket:
    """vLLM 0.22.1's `Worker.start_weight_update` / `finish_weight_update` state, written out from its source
    (v1/worker/gpu_worker.py): one bracket at a time, its format remembered until the finish."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bool]] = []
        self._weight_update_active = False
        self._is_checkpoint_format = True

    def start_weight_update(self, is_checkpoint_format: bool = True) -> None:
        if self._weight_update_active:
            raise RuntimeError("start_weight_update called while a weight update is already active.")
        self._weight_update_active, self._is_checkpoint_format = True, is_checkpoint_format
        self.calls.append(("start", is_checkpoint_format))

    def finish_weight_update(self) -> None:
        if not self._weight_update_active:
            raise RuntimeError("start_weight_update must be called before finish_weight_update.")
        self.calls.append(("finish", self._is_checkpoint_format))
        self._weight_update_active, self._is_checkpoint_format = False, True


def _bracketed_worker(receiver: Any) -> tuple[Any, Model]:
    worker, model = _worker(receiver)

    class Worker(VllmBracket, type(worker)):  # type: ignore[misc]  # vLLM's bracket over the stand-in's
        def __init__(self) -> None:
            VllmBracket.__init__(self)

    return Worker(), model


def test_one_round_trip_opens_vllms_kernel_bracket_after_our_hook_and_one_closes_it() -> None:
    sent = _sent()
    worker, model = _bracketed_worker(Receiver([sent]))
    worker._r3_policy_tag = "policy-0"
    worker.r3_native_begin("kernel")
    assert worker.calls == [("start", False)]  # vLLM's bracket, in the kernel format
    assert worker.r3_policy_tag() is None  # in flux from the start
    assert "receive_weights" in worker.weight_transfer_engine.__dict__  # our tap is in place for the receive
    update_weights_022(worker, model)
    worker.r3_native_end("policy-1")
    assert worker.calls == [("start", False), ("finish", False)]
    assert worker.r3_policy_tag() == "policy-1"
    compare_receipt(_fingerprints(sent), worker.r3_sync_receipt(), where="engine 0")
    assert torch.equal(model.norm, sent[1][1])


def test_the_checkpoint_layout_opens_vllms_default_bracket() -> None:
    worker, _ = _bracketed_worker(Receiver([]))
    worker.r3_native_begin("checkpoint")
    assert worker.calls == [("start", True)]
    assert "load_weights" in worker._r3_model().__dict__  # the checkpoint tap, in front of load_weights
    worker.r3_native_end(None)
    assert worker.calls == [("start", True), ("finish", True)]


def test_a_refused_finish_stamps_no_policy() -> None:
    worker, _ = _bracketed_worker(Receiver([]))
    worker._r3_policy_tag = "policy-0"
    with pytest.raises(RuntimeError, match="before finish_weight_update"):
        worker.r3_native_end("policy-1")  # no bracket open: vLLM refuses, ours never runs
    assert worker.r3_policy_tag() == "policy-0"
    worker.r3_native_begin("kernel")
    with pytest.raises(RuntimeError, match="already active"):
        worker.r3_native_begin("kernel")  # vLLM refuses a second bracket; the weights stay unstamped
    assert worker.r3_policy_tag() is None
