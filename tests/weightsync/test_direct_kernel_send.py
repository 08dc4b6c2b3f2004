"""The kernel layout sent one broadcast per engine parameter and received straight into it (weightsync/direct.py,
engine/worker.py `receive_into_parameters`), on the CPU.

The NCCL communicator is replaced by a pair of stand-ins joined by a queue: the sender's broadcast hands over a
copy of the bytes as they are at that moment (a staging buffer reused too early would show), the receiver's
writes them into its target and checks the byte count (a mismatch hangs or corrupts real NCCL). Trainer and
engine run in two threads, as they do in two processes. The references are written out here (a cat, a stack, a
cast) or are vLLM's own `load_weights` of the checkpoint tensors (the slow test).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar

import pytest
import torch
from runtime_test_helpers import MOE_E, MOE_H, MOE_I, MOE_LAYER_SHAPES

from r3operator.engine.worker import WeightSyncWorkerExtension, WeightUpdateStateError, receive_into_parameters
from r3operator.weightsync.direct import DirectKernelSend
from r3operator.wire.kernel_layout import (
    engine_parameters,
    kernel_metadata,
    plan_kernel_layout,
    trainer_shapes,
)
from r3operator.wire.receipt import FingerprintLog, SyncReceipt, compare_receipt
from r3operator.wire.shards import Shard
from r3operator.wire.sync_phases import SyncPhases


class Wire:
    """Both ends of one broadcast group (src 0 sends, the other receives), in order, one tensor at a time."""

    def __init__(self) -> None:
        self.bytes: queue.Queue[torch.Tensor] = queue.Queue()
        self.sent = 0
        self.committed: bool | None = None

    def sender(self) -> Any:
        wire = self

        class Send:
            def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
                assert src == 0 and tensor.is_contiguous()
                wire.sent += 1
                wire.bytes.put(tensor.detach().clone())

        return Send()

    def receiver(self) -> Any:
        wire = self

        class Receive:
            def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
                got = wire.bytes.get(timeout=30)
                sent = got.reshape(-1).view(torch.uint8)
                assert sent.numel() == tensor.numel() * tensor.element_size(), "byte counts differ: NCCL would hang"
                tensor.view(-1).view(torch.uint8).copy_(sent)

        return Receive()


class Info:
    def __init__(self, meta: list[tuple[str, Any, tuple[int, ...]]]) -> None:
        self.names = [n for n, _, _ in meta]
        self.dtype_names = [str(d).removeprefix("torch.") for _, d, _ in meta]
        self.shapes = [list(s) for _, _, s in meta]
        self.packed = False


E, INTER, H = MOE_E, MOE_I, MOE_H
TRAINER = {**MOE_LAYER_SHAPES, "model.norm.weight": (H,)}


class Engine(torch.nn.Module):
    """The parameters a vLLM 0.22 engine reports for `TRAINER`, bf16, filled with a value nothing sends."""

    def __init__(self) -> None:
        super().__init__()
        shapes = {
            "qkv": (16, H),
            "w13": (E, 2 * INTER, H),
            "w2": (E, H, INTER),
            "norm": (H,),
        }
        for name, shape in shapes.items():
            self.register_parameter(name, torch.nn.Parameter(torch.full(shape, 7.0, dtype=torch.bfloat16)))

    NAMES: ClassVar[dict[str, str]] = {
        "qkv": "model.layers.0.self_attn.qkv_proj.weight",
        "w13": "model.layers.0.mlp.experts.w13_weight",
        "w2": "model.layers.0.mlp.experts.w2_weight",
        "norm": "model.norm.weight",
    }

    def get_parameter(self, target: str) -> torch.nn.Parameter:
        short = {v: k for k, v in self.NAMES.items()}
        if target not in short:
            raise AttributeError(target)
        return super().get_parameter(short[target])

    def reported(self) -> list[list[Any]]:
        return [[self.NAMES[n], "bfloat16", list(p.shape)] for n, p in self.named_parameters()]

    def vllm_named(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The parameters under their vLLM names."""
        return [(self.NAMES[short], param) for short, param in self.named_parameters()]

    def load_checkpoint(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """vLLM's `load_weights` of checkpoint tensors (experts unfused) into these parameters, written out: q, k, v
        rows in turn; each expert's gate rows, then its up rows; each expert's down_proj."""
        rows = {"q_proj": slice(0, 8), "k_proj": slice(8, 12), "v_proj": slice(12, 16)}
        with torch.no_grad():
            for name, tensor in named:
                parts = name.split(".")
                if name == "model.norm.weight":
                    self.norm.copy_(tensor)
                elif parts[3] == "self_attn":
                    self.qkv[rows[parts[4]]] = tensor
                elif parts[6] == "gate_proj":
                    self.w13[int(parts[5]), :INTER] = tensor
                elif parts[6] == "up_proj":
                    self.w13[int(parts[5]), INTER:] = tensor
                else:
                    self.w2[int(parts[5])] = tensor


def _trainer_state(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator) for name, shape in TRAINER.items()}  # fp32: cast on send


def _expected(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The engine's parameters written out: vLLM's fusions (q,k,v rows; gate rows before up) in bf16."""
    attn = "model.layers.0.self_attn"
    return {
        "qkv": torch.cat([state[f"{attn}.{p}_proj.weight"] for p in "qkv"]).to(torch.bfloat16),
        "w13": state["model.layers.0.mlp.experts.gate_up_proj"].to(torch.bfloat16),
        "w2": state["model.layers.0.mlp.experts.down_proj"].to(torch.bfloat16),
        "norm": state["model.norm.weight"].to(torch.bfloat16),
    }


def _sync(
    state: Mapping[str, torch.Tensor],
    engine: Engine,
    *,
    sender: DirectKernelSend | None = None,
    bucket_bytes: int = 64,
    reported: list[list[Any]] | None = None,
    shapes: Mapping[str, tuple[int, ...]] | None = None,
    shards: Mapping[str, Shard] | None = None,
) -> tuple[FingerprintLog, SyncReceipt, BaseException | None, BaseException | None, Wire]:
    """One sync, trainer and engine in two threads; returns what each side raised (or None)."""
    plan = plan_kernel_layout(shapes or trainer_shapes(state), engine_parameters(reported or engine.reported()))
    wire, sent, receipt = Wire(), FingerprintLog(bucket_bytes=bucket_bytes), SyncReceipt()
    receipt.begin(list(engine.named_parameters()))
    outcome: dict[str, object] = {}
    errors: dict[str, BaseException | None] = {"send": None, "receive": None}

    def run(side: str, call: Callable[[], object]) -> None:
        try:
            outcome[side] = call()
        except BaseException as exc:
            errors[side] = exc

    send = sender or DirectKernelSend()
    info = Info(kernel_metadata(plan, dtype=torch.bfloat16))
    threads = [
        threading.Thread(
            target=run,
            args=(
                "send",
                lambda: send.send(wire.sender(), state, plan, device="cpu", sent=sent, phases=SyncPhases()),
            ),
        ),
        threading.Thread(
            target=run,
            args=("receive", lambda: receive_into_parameters(engine, wire.receiver(), info, receipt, shards)),
        ),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert wire.bytes.empty(), "a broadcast was sent that nobody received"
    wire.committed = outcome.get("receive")  # type: ignore[assignment]  # the flag the engine received
    return sent, receipt, errors["send"], errors["receive"], wire


def test_every_parameter_arrives_in_place_as_vllm_fuses_it_and_the_receipt_matches() -> None:
    """Small buckets: the big tensors go through the two staging buffers in turn, so a buffer reused before its
    broadcast would hand over the next tensor's bytes."""
    engine, state = Engine(), _trainer_state()
    held = {name: p.data.data_ptr() for name, p in engine.named_parameters()}
    sent, receipt, send_error, receive_error, wire = _sync(state, engine, bucket_bytes=64)
    assert send_error is None and receive_error is None
    for name, want in _expected(state).items():
        assert torch.equal(getattr(engine, name).data.view(torch.int16), want.view(torch.int16)), name
    assert {name: p.data.data_ptr() for name, p in engine.named_parameters()} == held  # received in place
    assert wire.sent == 4 + 1 and wire.committed is True  # one broadcast per parameter, then the commit flag
    receipt.finish(list(engine.named_parameters()))
    compare_receipt(sent.result(), receipt.report(), where="engine")
    assert set(receipt.engine_seconds) == {"receipt", "load", "unchanged"}


class RankEngine(Engine):
    """Rank 1 of an engine of two ranks holding `Engine`'s parameters in parts: q's second half of the rows and the
    second kv head group of k and v (tensor-parallel attention), experts 2 and 3 of w13 and w2 (expert-parallel), the
    norm whole."""

    SHARDS: ClassVar[dict[str, Shard]] = {
        "model.layers.0.self_attn.qkv_proj.weight": Shard((16, H), (((4, 4), (10, 2), (14, 2)), None)),
        "model.layers.0.mlp.experts.w13_weight": Shard((E, 2 * INTER, H), (((2, 2),), None, None)),
        "model.layers.0.mlp.experts.w2_weight": Shard((E, H, INTER), (((2, 2),), None, None)),
    }

    def __init__(self) -> None:
        torch.nn.Module.__init__(self)
        shapes = {"qkv": (8, H), "w13": (2, 2 * INTER, H), "w2": (2, H, INTER), "norm": (H,)}
        for name, shape in shapes.items():
            self.register_parameter(name, torch.nn.Parameter(torch.full(shape, 7.0, dtype=torch.bfloat16)))


def test_a_rank_of_a_sharded_engine_takes_its_part_of_each_whole_parameter_and_receipts_what_arrived() -> None:
    engine, state = RankEngine(), _trainer_state()
    whole = Engine().reported()  # what every rank reports: the whole parameters
    sent, receipt, send_error, receive_error, wire = _sync(state, engine, reported=whole, shards=RankEngine.SHARDS)
    assert send_error is None and receive_error is None and wire.committed is True
    expected = _expected(state)
    parts = {  # rank 1's part written out: rows 4:8 of q, 10:12 of k, 14:16 of v; experts 2 and 3
        "qkv": torch.cat([expected["qkv"][4:8], expected["qkv"][10:12], expected["qkv"][14:16]]),
        "w13": expected["w13"][2:4],
        "w2": expected["w2"][2:4],
        "norm": expected["norm"],
    }
    for name, want in parts.items():
        assert torch.equal(getattr(engine, name).data.view(torch.int16), want.view(torch.int16)), name
    receipt.finish(list(engine.named_parameters()))
    compare_receipt(sent.result(), receipt.report(), where="engine rank 1")  # the whole tensors that arrived

    # A part that does not fit the rank's parameter is received (the trainer is inside the broadcast) and named.
    wrong = {**RankEngine.SHARDS, "model.layers.0.mlp.experts.w2_weight": Shard((E, H, INTER), (((1, 3),), None, None))}
    *_, receive_error, wire = _sync(state, RankEngine(), reported=whole, shards=wrong)
    assert isinstance(receive_error, WeightUpdateStateError) and "w2_weight" in str(receive_error)
    assert wire.sent == 4 + 1


def test_the_staging_buffers_are_kept_across_syncs_and_the_second_sync_sends_the_new_values() -> None:
    engine, sender = Engine(), DirectKernelSend()
    _sync(_trainer_state(1), engine, sender=sender, bucket_bytes=64)
    staging = [b.data_ptr() for b in sender._staging]
    assert len(staging) == 2 and sender.staged_bytes == E * 2 * INTER * H * 2  # the largest staged tensor, bf16
    state = _trainer_state(2)
    _sync(state, engine, sender=sender, bucket_bytes=64)
    assert [b.data_ptr() for b in sender._staging] == staging
    assert torch.equal(engine.w13.data, _expected(state)["w13"])
    sender.close()
    assert sender._staging == [] and sender.staged_bytes == 0


def test_a_tensor_that_already_is_the_parameter_goes_as_it_is() -> None:
    """A ranked trainer's gathered copy is in the engine's dtype: nothing is built or staged."""
    engine, sender = Engine(), DirectKernelSend()
    state = {name: t.to(torch.bfloat16) for name, t in _trainer_state(3).items()}
    _sync(state, engine, sender=sender, bucket_bytes=300)  # q,k,v (256 bytes built) small, the experts big
    assert sender._staging == []  # the fused experts and the norm went as they were; q,k,v built on its own
    assert torch.equal(engine.w2.data, state["model.layers.0.mlp.experts.down_proj"])


class _FailingAfter(Mapping[str, torch.Tensor]):
    """A trainer whose tensors cannot be read past the first `keep` reads (it died mid-sync)."""

    def __init__(self, inner: Mapping[str, torch.Tensor], keep: int) -> None:
        self.inner, self.left = inner, keep

    def __getitem__(self, key: str) -> torch.Tensor:
        if self.left <= 0:
            raise RuntimeError("injected: the trainer lost its tensors")
        self.left -= 1
        return self.inner[key]

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[str]:
        return iter(self.inner)


def test_a_failure_mid_sync_still_sends_every_announced_broadcast_then_raises() -> None:
    """Otherwise the engine (and the trainer) would wait inside a broadcast forever and the bracket could not be
    aborted. The engine receives zeros for what the trainer could not build, and a commit flag of 0: it aborts
    instead of stamping the policy."""
    engine, state = Engine(), _trainer_state(4)
    failing = _FailingAfter(state, keep=3)  # q, k, v: the qkv parameter is built, the experts are not
    _, _, send_error, receive_error, wire = _sync(failing, engine, shapes=trainer_shapes(state))
    assert isinstance(send_error, RuntimeError) and "injected" in str(send_error)
    assert receive_error is None and wire.sent == 4 + 1 and wire.committed is False
    assert torch.equal(engine.qkv.data, _expected(state)["qkv"])
    assert not engine.w13.data.any() and not engine.norm.data.any()  # zeros, never served: the tag stays None


def test_an_announced_tensor_the_engine_lacks_is_received_and_named() -> None:
    engine = Engine()
    reported = [*engine.reported(), ["model.layers.0.mlp.gate.weight", "bfloat16", [E, H]]]
    state = {**_trainer_state(5), "model.layers.0.mlp.gate.weight": torch.ones(E, H)}
    _, _, send_error, receive_error, wire = _sync(state, engine, reported=reported)
    assert send_error is None and wire.sent == 5 + 1  # every broadcast was met, the flag too
    assert isinstance(receive_error, WeightUpdateStateError)
    assert "model.layers.0.mlp.gate.weight" in str(receive_error)


@pytest.mark.slow
def test_vllms_own_model_receives_what_its_load_weights_makes() -> None:
    """vLLM's `Qwen3MoeForCausalLM` (tiny reference config, CPU) receives a sync from an fp32 trainer state, and
    every parameter equals what vLLM's own `load_weights` makes of the same state's checkpoint tensors."""
    pytest.importorskip("vllm")
    from transformers import Qwen3MoeForCausalLM

    from benchmarks.bench_engine_load import build_engine_model, engine_config
    from r3operator.models.reference import get_spec
    from r3operator.wire.weights import checkpoint_tensors

    with torch.device("meta"):
        hf = Qwen3MoeForCausalLM(get_spec("tiny").hf_config())
    generator = torch.Generator().manual_seed(0)
    state = {n: torch.randn(tuple(t.shape), generator=generator) for n, t in hf.state_dict().items()}
    with engine_config("tiny") as config:
        reference = build_engine_model(config, "cpu")
        reference.load_weights(checkpoint_tensors(state, dtype=torch.bfloat16))
        want = {n: p.detach().clone() for n, p in reference.named_parameters()}
    with engine_config("tiny") as config:
        engine = build_engine_model(config, "cpu")
        for param in engine.parameters():
            param.data.fill_(1234.0)
        reported = [[n, str(p.dtype), list(p.shape)] for n, p in engine.named_parameters()]
        plan = plan_kernel_layout(trainer_shapes(state), engine_parameters(reported))
        wire, sent, receipt = Wire(), FingerprintLog(bucket_bytes=1 << 16), SyncReceipt()
        info = Info(kernel_metadata(plan, dtype=torch.bfloat16))
        receipt.begin(list(engine.named_parameters()))
        receiving = threading.Thread(target=receive_into_parameters, args=(engine, wire.receiver(), info, receipt))
        receiving.start()
        DirectKernelSend().send(wire.sender(), state, plan, device="cpu", sent=sent, phases=SyncPhases())
        receiving.join(timeout=120)
        receipt.finish(list(engine.named_parameters()))
        wrong = [
            n
            for n, p in engine.named_parameters()
            if not torch.equal(p.data.view(torch.int16), want[n].view(torch.int16))
        ]
    assert wrong == []
    compare_receipt(sent.result(), receipt.report(), where="engine")


# ------------------------------------------------------------------ the whole sync in one engine call


class _Worker(WeightSyncWorkerExtension):
    """The worker extension's `r3_direct_sync` on a CPU module: vLLM's bracket calls stand in (recorded), the
    receive, the commit flag and the receipt are the extension's own."""

    def __init__(self, wire: Wire, *, refuse_begin: bool = False) -> None:
        self.engine, self.refuse_begin, self.calls = Engine(), refuse_begin, []
        self.weight_transfer_engine = type("NCCLEngine", (), {"model_update_group": wire.receiver()})()
        self.device = "cpu"

    def _r3_model(self) -> Any:
        return self.engine

    def r3_native_begin(self, layout: str = "checkpoint", in_place: bool = False) -> None:
        if self.refuse_begin:
            raise WeightUpdateStateError("start_weight_update called while a weight update is already active")
        self.calls.append(f"begin {layout}")
        self._r3_receipt().begin(list(self.engine.named_parameters()), in_place=in_place)

    def finish_weight_update(self) -> None:  # vLLM's Worker: closes its bracket
        self.calls.append("finish")

    def r3_abort_native_weight_update(self) -> dict[str, int]:
        self.calls.append("abort")
        self._r3_policy_tag = None
        return {"layers_restored": 0}


def _direct_sync(
    state: Mapping[str, torch.Tensor], worker: _Worker, wire: Wire, *, shapes: Mapping[str, Any] | None = None
) -> tuple[FingerprintLog, BaseException | None, BaseException | None]:
    plan = plan_kernel_layout(shapes or trainer_shapes(state), engine_parameters(worker.engine.reported()))
    meta = kernel_metadata(plan, dtype=torch.bfloat16)
    update = {
        "names": [n for n, _, _ in meta],
        "dtype_names": ["bfloat16"] * len(meta),
        "shapes": [list(s) for _, _, s in meta],
    }
    sent, errors = FingerprintLog(), {}
    engine_side = threading.Thread(
        target=lambda: errors.setdefault("engine", _raised(lambda: worker.r3_direct_sync(update, "run:7")))
    )
    engine_side.start()
    trainer = _raised(
        lambda: DirectKernelSend().send(wire.sender(), state, plan, device="cpu", sent=sent, phases=SyncPhases())
    )
    engine_side.join(timeout=60)
    assert wire.bytes.empty(), "a broadcast was sent that nobody received"
    return sent, trainer, errors["engine"]


def _raised(call: Callable[[], object]) -> BaseException | None:
    try:
        call()
    except BaseException as exc:
        return exc
    return None


def test_one_engine_call_opens_receives_commits_and_stamps() -> None:
    wire = Wire()
    worker, state = _Worker(wire), _trainer_state(11)
    sent, trainer_error, engine_error = _direct_sync(state, worker, wire)
    assert trainer_error is None and engine_error is None
    assert worker.calls == ["begin kernel", "finish"] and worker.r3_policy_tag() == "run:7"
    compare_receipt(sent.result(), worker.r3_sync_receipt(), where="engine")
    assert torch.equal(worker.engine.w13.data, _expected(state)["w13"])


def test_a_trainer_failure_reaches_the_engine_as_the_commit_flag_and_it_aborts_unstamped() -> None:
    wire = Wire()
    worker, state = _Worker(wire), _trainer_state(12)
    _, trainer_error, engine_error = _direct_sync(
        _FailingAfter(state, keep=3), worker, wire, shapes=trainer_shapes(state)
    )
    assert isinstance(trainer_error, RuntimeError) and "injected" in str(trainer_error)
    assert isinstance(engine_error, WeightUpdateStateError) and "commit flag is 0" in str(engine_error)
    assert worker.calls == ["begin kernel", "abort"] and worker.r3_policy_tag() is None


def test_an_engine_that_cannot_open_its_bracket_still_meets_every_broadcast() -> None:
    """Else the trainer would wait inside its broadcasts forever."""
    wire = Wire()
    worker = _Worker(wire, refuse_begin=True)
    _, trainer_error, engine_error = _direct_sync(_trainer_state(13), worker, wire)
    assert trainer_error is None and wire.sent == 4 + 1  # every broadcast met, the flag too
    assert isinstance(engine_error, WeightUpdateStateError) and "already active" in str(engine_error)
    assert worker.calls == [] and not worker.engine.w13.data.ne(7.0).any()  # nothing received into the model


def _plans_trusted(monkeypatch: pytest.MonkeyPatch, sender: Any) -> None:
    """Each new kernel plan's reference (a checkpoint-layout sync through vLLM's packed NCCL sender, CUDA only, then
    the engines' parameters against the plan: tests/weightsync/test_kernel_reference.py) taken as passed: the plan is
    made, then the sync goes on in the kernel layout."""

    def passed(policy_tag: str) -> Any:
        sender.checked_plan = sender.kernel_plan()
        return sender._send(policy_tag)

    monkeypatch.setattr(sender, "_reference_sync", passed)


def test_the_sender_raises_its_own_failure_and_keeps_the_communicator(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed build is met broadcast for broadcast (zeros, flag 0): the engines' errors are theirs to answer, the
    trainer's is the one raised, and no new rendezvous is needed."""
    from r3operator.api.weight_transfer import TransferMethod
    from r3operator.weightsync import transfer
    from r3operator.wire.sync_messages import BeginNative, BracketLayout

    monkeypatch.setattr(transfer, "trainer_vllm_api", lambda: "static")  # vLLM 0.22.1's sender (the GPU image)
    wire = Wire()
    worker = _Worker(wire)

    class Endpoint:
        name = "engine-0"

        def native_parameters(self) -> dict[str, Any]:
            return {"parameters": worker.engine.reported(), "refused": None}

        def native_direct_sync(self, update: dict[str, Any], policy_tag: str | None) -> None:
            worker.r3_direct_sync(update, policy_tag)

    current: dict[str, Mapping[str, torch.Tensor]] = {"state": _trainer_state(14)}
    client = transfer.FanOutClient([Endpoint()], bracket=BeginNative(BracketLayout.KERNEL))  # type: ignore[list-item]
    sender = transfer.NativeSender(
        TransferMethod.NCCL, client, lambda: current["state"], dtype=torch.bfloat16, buffer_size_bytes=1
    )
    sender.device, sender._group = "cpu", wire.sender()
    _plans_trusted(monkeypatch, sender)
    group = sender._group
    sender.send("run:1")
    assert worker.r3_policy_tag() == "run:1"
    compare_receipt(sender.sent.result(), worker.r3_sync_receipt(), where="engine")
    current["state"] = _FailingAfter(_trainer_state(15), keep=3)
    with pytest.raises(RuntimeError, match="injected"):
        sender.send("run:2")
    assert sender._group is group and worker.r3_policy_tag() is None and worker.calls[-1] == "abort"
    assert wire.bytes.empty()


def test_the_engines_are_asked_for_their_parameters_before_they_enter_the_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside its one call an engine's core answers nothing else: a parameter query sent then (the plan made again
    after a new rendezvous) would wait for the sync, which waits for it (2026-11-27 H200: the first a3b-x16l sync
    and the first sync to two engines hung so)."""
    from r3operator.api.weight_transfer import TransferMethod
    from r3operator.weightsync import transfer
    from r3operator.wire.sync_messages import BeginNative, BracketLayout

    monkeypatch.setattr(transfer, "trainer_vllm_api", lambda: "static")
    wire = Wire()
    worker = _Worker(wire)
    inside, asked = threading.Event(), []

    class Endpoint:
        name = "engine-0"

        def native_parameters(self) -> dict[str, Any]:
            if inside.is_set():
                raise RuntimeError("the engine core is inside r3_direct_sync: this query would never be answered")
            asked.append(1)
            return {"parameters": worker.engine.reported(), "refused": None}

        def native_direct_sync(self, update: dict[str, Any], policy_tag: str | None) -> None:
            inside.set()
            try:
                worker.r3_direct_sync(update, policy_tag)
            finally:
                inside.clear()

    client = transfer.FanOutClient([Endpoint()], bracket=BeginNative(BracketLayout.KERNEL))  # type: ignore[list-item]
    state = _trainer_state(16)
    sender = transfer.NativeSender(
        TransferMethod.NCCL, client, lambda: state, dtype=torch.bfloat16, buffer_size_bytes=1
    )
    sender.device = "cpu"
    monkeypatch.setattr(sender, "_static_nccl_init", wire.sender)  # the rendezvous: a new plan is made after it
    _plans_trusted(monkeypatch, sender)
    sender.send("run:1")
    assert worker.r3_policy_tag() == "run:1" and wire.bytes.empty()
    assert torch.equal(worker.engine.w13.data, _expected(state)["w13"])
    assert len(asked) == 1  # the rendezvous first, then the plan once: not made, dropped and made again
    sender._group = None  # a broken broadcast: the next sync meets the engines again and plans again, once
    sender.send("run:2")
    assert len(asked) == 2 and worker.r3_policy_tag() == "run:2"


# ------------------------------------------------------------------ vLLM >= 0.30: no kernel bracket of vLLM's own


class _Worker030(WeightSyncWorkerExtension):
    """The worker extension on a vLLM >= 0.30 Worker: vLLM's bracket calls have 0.30's (and 0.33's) signatures, and
    its `start_weight_update` stands for what it does there, a layerwise reload (the layers' parameters taken away
    until the finish processes them again): a kernel-format sync must not call it. Recorded, as `_Worker`'s are."""

    def __init__(self, wire: Wire) -> None:
        self.engine, self.calls, self.during = Engine(), list[str](), list[bool]()
        self.weight_transfer_engine = type("NCCLEngine", (), {"model_update_group": wire.receiver()})()
        self.device = "cpu"
        self._weight_update_active = False  # vLLM's Worker flag

    def _r3_model(self) -> Any:
        return self.engine

    def _r3_context(self) -> Any:
        from contextlib import ExitStack

        return ExitStack()

    def start_weight_update(self) -> None:  # vLLM >= 0.30: no is_checkpoint_format
        if self._weight_update_active:
            raise RuntimeError("start_weight_update called while a weight update is already active.")
        self.calls.append("vLLM start: layerwise reload")
        self._weight_update_active = True

    def finish_weight_update(self) -> None:
        self.calls.append("vLLM finish: process weights after loading")
        self._weight_update_active = False

    def _r3_restore_loading_layers(self) -> int:
        return 0


def test_on_vllm_0_30_the_kernel_layout_opens_its_own_bracket_and_broadcasts_on_the_factorys_communicator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The trainer on vLLM >= 0.30's sender API ("factory": its NCCL trainer engine's `model_update_group` carries our
    broadcasts) and an engine whose vLLM has no kernel-format bracket: every parameter arrives as vLLM fuses it (the
    written-out `_expected`), no vLLM bracket call is made, vLLM's update flag is held through the sync so that none of
    vLLM's own weight calls can run inside it, and the receipt matches."""
    from r3operator.api.weight_transfer import TransferMethod
    from r3operator.engine import plugin
    from r3operator.weightsync import transfer
    from r3operator.wire.sync_messages import BeginNative, BracketLayout

    monkeypatch.setattr(plugin, "self_check", lambda: None)  # the plugin's vLLM patches: not under test
    monkeypatch.setattr(transfer, "trainer_vllm_api", lambda: "factory")
    wire = Wire()
    worker = _Worker030(wire)

    class Endpoint:
        name = "engine-0"

        def native_parameters(self) -> dict[str, Any]:
            return {"parameters": worker.engine.reported(), "refused": None}

        def native_direct_sync(self, update: dict[str, Any], policy_tag: str | None) -> None:
            receive = receive_into_parameters

            def watched(*args: Any) -> bool:
                worker.during.append(worker._weight_update_active)
                return receive(*args)

            monkeypatch.setattr("r3operator.engine.worker.receive_into_parameters", watched)
            worker.r3_direct_sync(update, policy_tag)

    trainer_engine = type("NCCLTrainerWeightTransferEngine", (), {"model_update_group": wire.sender()})()
    state = _trainer_state(21)
    client = transfer.FanOutClient([Endpoint()], bracket=BeginNative(BracketLayout.KERNEL))  # type: ignore[list-item]
    sender = transfer.NativeSender(
        TransferMethod.NCCL, client, lambda: state, dtype=torch.bfloat16, buffer_size_bytes=1
    )
    sender.device = "cpu"
    monkeypatch.setattr(sender, "_factory_init", lambda: trainer_engine)
    _plans_trusted(monkeypatch, sender)
    sender.send("run:1")
    assert worker.calls == [] and worker.during == [True] and worker._weight_update_active is False
    assert worker.r3_policy_tag() == "run:1" and wire.bytes.empty()
    for name, want in _expected(state).items():
        assert torch.equal(getattr(worker.engine, name).data, want), name
    compare_receipt(sender.sent.result(), worker.r3_sync_receipt(), where="engine")
    worker.start_weight_update()  # vLLM's own bracket opens after ours closed
    assert worker.calls == ["vLLM start: layerwise reload"]


def test_on_vllm_0_30_a_failed_kernel_sync_leaves_vllms_update_flag_clear_and_the_engine_unstamped() -> None:
    wire = Wire()
    worker = _Worker030(wire)
    from r3operator.engine import plugin

    plugin_check, plugin.self_check = plugin.self_check, lambda: None  # type: ignore[assignment]
    try:
        _, trainer_error, engine_error = _direct_sync(
            _FailingAfter(_trainer_state(22), keep=3), worker, wire, shapes=trainer_shapes(_trainer_state(22))
        )
    finally:
        plugin.self_check = plugin_check  # type: ignore[assignment]
    assert isinstance(trainer_error, RuntimeError) and isinstance(engine_error, WeightUpdateStateError)
    assert worker.calls == [] and worker._weight_update_active is False and worker.r3_policy_tag() is None
    worker.start_weight_update()  # the next bracket, vLLM's or ours, can open


def _rank_parts(whole: Mapping[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank` of two (`RankEngine`'s split) of the engine parameters `whole`, written out by hand."""
    q, k, v = (slice(4 * rank, 4 * rank + 4), slice(8 + 2 * rank, 10 + 2 * rank), slice(12 + 2 * rank, 14 + 2 * rank))
    experts = slice(2 * rank, 2 * rank + 2)
    return {
        Engine.NAMES["qkv"]: torch.cat([whole["qkv"][q], whole["qkv"][k], whole["qkv"][v]]),
        Engine.NAMES["w13"]: whole["w13"][experts],
        Engine.NAMES["w2"]: whole["w2"][experts],
        Engine.NAMES["norm"]: whole["norm"],
    }


def _rank_shards(rank: int) -> dict[str, Shard]:
    q, k, v = (4 * rank, 4), (8 + 2 * rank, 2), (12 + 2 * rank, 2)
    return {
        Engine.NAMES["qkv"]: Shard((16, H), ((q, k, v), None)),
        Engine.NAMES["w13"]: Shard((E, 2 * INTER, H), (((2 * rank, 2),), None, None)),
        Engine.NAMES["w2"]: Shard((E, H, INTER), (((2 * rank, 2),), None, None)),
    }


class _ShardedEndpoint:
    """An engine of two ranks after vLLM's own load of the checkpoint: each worker's parts (`_rank_parts` of what
    vLLM's fusions make, written out in `_expected`), reported with the whole parameters and each worker's shards."""

    name = "tp engine"

    def __init__(self, state: Mapping[str, torch.Tensor]) -> None:
        self.parts = [_rank_parts(_expected(state), rank) for rank in (0, 1)]

    def native_parameters(self) -> dict[str, Any]:
        shards = [{name: shard.to_wire() for name, shard in _rank_shards(rank).items()} for rank in (0, 1)]
        return {"parameters": Engine().reported(), "shards": shards, "refused": None}

    def native_parameter_fingerprints(self) -> list[dict[str, tuple[int, int, int]]]:
        logs = []
        for parts in self.parts:
            log = FingerprintLog()
            log.add_many(list(parts.items()))
            logs.append(log.result())
        return logs


def _sharded_sender(monkeypatch: pytest.MonkeyPatch, endpoint: _ShardedEndpoint, method: Any, state: Any) -> Any:
    from r3operator.weightsync import transfer
    from r3operator.wire.sync_messages import BeginNative, BracketLayout

    monkeypatch.setattr(transfer, "trainer_vllm_api", lambda: "static")
    client = transfer.FanOutClient([endpoint], bracket=BeginNative(BracketLayout.KERNEL))  # type: ignore[list-item]
    sender = transfer.NativeSender(method, client, lambda: state, dtype=torch.bfloat16, buffer_size_bytes=1)
    sender.device = "cpu"
    return sender


def test_a_sharded_engines_reference_is_each_ranks_part_of_what_the_builder_makes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from r3operator.api.weight_transfer import TransferMethod
    from r3operator.wire.kernel_layout import KernelLayoutError

    state = _trainer_state(21)
    endpoint = _ShardedEndpoint(state)
    sender = _sharded_sender(monkeypatch, endpoint, TransferMethod.NCCL, state)
    plan = sender.kernel_plan()  # planned on the whole parameters every rank reports
    assert [s.parameter.shape for s in plan] == [tuple(r[2]) for r in Engine().reported()]
    assert sender.client.sharded and sender._reference_mismatch(plan) is None

    # Rank 1 holding other experts than its shard says (vLLM placed them otherwise): the reference names it.
    w2 = Engine.NAMES["w2"]
    endpoint.parts[1][w2] = _expected(state)["w2"][0:2]
    refused = sender._reference_mismatch(plan)
    assert refused is not None and refused.startswith("on tp engine worker 1, 1 of 4 parameter(s)") and w2 in refused

    # Over IPC the trainer writes whole parameters into the engine's memory: a sharded engine is refused, saying so.
    ipc = _sharded_sender(monkeypatch, _ShardedEndpoint(state), TransferMethod.IPC, state)
    with pytest.raises(KernelLayoutError, match="tensor- or expert-parallel engine takes the kernel layout over NCCL"):
        ipc.kernel_plan()
