"""On CUDA, a sender's fingerprints on the log's own stream (`FingerprintLog(own_stream=True)`) are those of
the tensors as they were added, written out in Python integers, while the stream that made the tensors moves on:
vLLM's packed producer makes each tensor on a side stream of its own, drops it once packed, and reuses its
memory for the next. The log's stream is held back here (`torch.cuda._sleep`), so a fingerprint that read
memory the producer had already reused, or a tensor the producer had not yet written, would differ."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from r3operator.wire import receipt as receipt_module  # noqa: E402
from r3operator.wire.receipt import FingerprintLog  # noqa: E402
from tests.runtime.test_sync_receipt import _reference_fingerprint  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

HOLD_CYCLES = 200_000_000
"""How long the log's stream is held before its first fingerprint: ~0.1 s at ~2 GHz, long enough for the
producer to have reused every dropped tensor's memory several times over."""


def _produce(stream: torch.cuda.Stream, seed: int, numel: int) -> torch.Tensor:
    """A fresh bf16 tensor made on `stream` (as vLLM's producer casts a trainer tensor on its buffer's stream)."""
    with torch.cuda.stream(stream):
        g = torch.Generator(device="cuda").manual_seed(seed)
        return torch.randn(numel, device="cuda", generator=g).to(torch.bfloat16)


def _hold(log: FingerprintLog) -> None:
    """Queue a wait on the log's own stream (made on first use) before its first fingerprint."""
    device = torch.device("cuda", torch.cuda.current_device())
    own = log._own.setdefault(device, torch.cuda.Stream(device))
    with torch.cuda.stream(own):
        torch.cuda._sleep(HOLD_CYCLES)


@pytest.mark.parametrize("bucket_bytes", [1 << 20, 0], ids=["buckets", "one-by-one"])
def test_own_stream_fingerprints_what_was_added_while_the_producer_reuses_its_memory(bucket_bytes: int) -> None:
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    log = FingerprintLog(bucket_bytes=bucket_bytes, own_stream=True)
    _hold(log)
    expected = {}
    for i in range(12):
        stream = streams[i % 2]
        tensor = _produce(stream, seed=i, numel=4096 + 7 * i)
        with torch.cuda.stream(stream):
            log.add(f"t{i}", tensor)
            expected[f"t{i}"] = _reference_fingerprint(tensor.cpu())  # waits for this tensor only (its stream)
            # the producer drops the tensor and writes its next one, in the memory the dropped one had
            del tensor
            torch.full((4096 + 7 * i,), 3.0, device="cuda", dtype=torch.bfloat16)
    assert log.result() == expected


def test_own_stream_is_not_the_producers_stream_and_waits_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fingerprints are queued on the log's stream, never on the producer's (which would put them between
    the producer's packing and its broadcast)."""
    producer = torch.cuda.Stream()
    launched_on: list[torch.cuda.Stream] = []
    real = receipt_module.fingerprint_device

    def recorded(tensor: torch.Tensor) -> torch.Tensor:
        launched_on.append(torch.cuda.current_stream())
        return real(tensor)

    monkeypatch.setattr(receipt_module, "fingerprint_device", recorded)
    log = FingerprintLog(bucket_bytes=0, own_stream=True)
    _hold(log)
    tensor = _produce(producer, seed=1, numel=1 << 16)
    with torch.cuda.stream(producer):
        log.add("w", tensor)
        expected = _reference_fingerprint(tensor.cpu())
    assert launched_on and all(s != producer for s in launched_on)
    assert log.result() == {"w": expected}
