"""On CUDA, the receipt's fingerprints (wire/receipt.py) as vLLM's packed NCCL producer drives them: the sender's
iterator runs under one side stream per buffer, alternating, and each buffer's tensors are new allocations on
that stream. Big tensors (their slices reduced at once, their rests copied into the bucket) and small ones
(bucketed), a big tensor's memory overwritten on its stream right after it was added: every fingerprint is
the written-out definition computed on the CPU. Only a GPU has the streams and the asynchrony."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from r3operator.wire import receipt as receipt_module  # noqa: E402
from r3operator.wire.receipt import GROUP_ROWS, WEIGHT_PERIOD, FingerprintLog  # noqa: E402
from tests.wire.test_sync_receipt import _big_and_small, _reference_fingerprint  # noqa: E402

pytestmark = pytest.mark.gpu

BLOCK = GROUP_ROWS * WEIGHT_PERIOD


def test_fingerprints_on_alternating_side_streams_are_the_written_out_definition(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(receipt_module, "SLICE_BYTES", 2 * BLOCK * 2)  # several slices per big tensor
    named = _big_and_small(torch.Generator().manual_seed(5))
    expected = {name: _reference_fingerprint(t) for name, t in named}
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    log = FingerprintLog(bucket_bytes=4096)
    for i, (name, tensor) in enumerate(named):
        with torch.cuda.stream(streams[(i // 3) % 2]):  # a "buffer" of three tensors per stream, alternating
            on_gpu = tensor.to("cuda", non_blocking=False)
            log.add(name, on_gpu)
            if on_gpu.numel() * on_gpu.element_size() > log.bucket_bytes:  # a small one waits for its bucket
                on_gpu.zero_()  # a big one's memory reused on its stream at once: its sums are already queued
    assert log.result() == expected


def test_a_parameter_composed_from_cast_pieces_is_the_written_out_definition_of_the_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The trainer's side of a kernel-layout receipt on CUDA (wire/kernel_layout.py `add_parameter_pieces`): fp32
    pieces cast to bf16 as they are added, big and small, each rotated to its offset on the device, some at once on a
    side stream, some when the log is read; the whole's fingerprint is the definition computed on the CPU."""
    monkeypatch.setattr(receipt_module, "SLICE_BYTES", 2 * BLOCK * 2)
    generator = torch.Generator().manual_seed(7)
    pieces = [torch.randn(n, generator=generator) for n in (5 * 7, 3 * BLOCK + 17, BLOCK, 2 * 251, 9)]
    whole = torch.cat([p.to(torch.bfloat16) for p in pieces])
    log, offset, stream = FingerprintLog(bucket_bytes=4096), 0, torch.cuda.Stream()
    for i, piece in enumerate(pieces):
        on_gpu = piece.to("cuda")
        if i % 2:
            log.add_part_later("w13", offset, on_gpu, dtype=torch.bfloat16)
        else:
            stream.wait_stream(torch.cuda.current_stream())  # the piece was copied to the GPU on the current stream
            with torch.cuda.stream(stream):
                log.add_part("w13", offset, on_gpu, dtype=torch.bfloat16)
        offset += piece.numel()
    assert log.result() == {"w13": _reference_fingerprint(whole)}
