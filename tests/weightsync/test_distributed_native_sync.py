"""vLLM's native sync from a trainer over ranks (weightsync/rank_sync.py), on 2 gloo ranks: every rank takes
part in the gather, rank 0 sends what a one-process read of the same weights holds, its sender (where the NCCL
group would live) is kept across syncs and made again for other engines, and a send that fails leaves every
rank free for the retry. vLLM's NCCL sender itself needs GPUs: rank 0 sends with a recording stand-in of
`NativeInstall`'s shape here, and with `NativeInstall` in the GPU rows (docs/gpu.md)."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tiny_moe import r3_batch  # noqa: E402

from r3operator.api.enums import ReplayMode  # noqa: E402
from r3operator.api.weight_transfer import TransferMethod  # noqa: E402
from r3operator.weightsync import rank_sync  # noqa: E402
from r3operator.weightsync.endpoints import SyncCounts  # noqa: E402
from r3operator.weightsync.rank_sync import RankNativeInstall  # noqa: E402
from r3operator.wire.receipt import FingerprintLog, fingerprint  # noqa: E402
from r3operator.wire.sync_messages import BeginNative, BracketLayout  # noqa: E402
from r3operator.wire.sync_phases import SyncPhases  # noqa: E402

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Endpoint:
    """An engine as the rank sees it: only its name and address matter to the sender's bookkeeping."""

    name: str
    base_url: str


class RecordingSync:
    """`NativeInstall`'s shape: fingerprints what it would send, fails on the tag "fail"."""

    def __init__(
        self,
        method: TransferMethod,
        *,
        state_dict: Callable[[], Mapping[str, Any]],
        dtype: Any,
        buffer_size_bytes: int,
        master_address: str,
        phases: SyncPhases,
        bracket: BeginNative,
    ) -> None:
        self.serial = uuid.uuid4().hex
        self.state_dict, self.dtype, self.phases, self.bracket = state_dict, dtype, phases, bracket
        self.sent = FingerprintLog()
        self.master_address = master_address
        self.syncs: list[tuple[tuple[str, ...], str]] = []
        self.closed = False

    def __call__(self, engines: Sequence[Any], tag: str) -> SyncCounts:
        self.syncs.append((tuple(e.name for e in engines), tag))
        if tag == "fail":
            raise RuntimeError("engine-1 went away mid-sync")
        state = self.state_dict()
        with self.phases("transfer"):
            self.sent.clear()
            for name, tensor in state.items():
                assert tensor.dtype == self.dtype, name
                self.sent.add(name, tensor)
            self.sent.result()
        return SyncCounts(tensors=len(state), bytes=sum(t.numel() * t.element_size() for t in state.values()))

    def close(self) -> None:
        self.closed = True


def rank0_sender(_trainer: Any, rank: int, install: str) -> dict[str, Any] | None:
    """What rank 0's process holds for `install`."""
    if rank != 0:
        return None
    sender = rank_sync._SENDERS.get(install)
    if sender is None:
        return {"sender": None}
    sync: Any = sender.sync
    return {"serial": sync.serial, "syncs": list(sync.syncs), "layout": sync.bracket.layout, "kept": sender.weights}


def expected(state: Mapping[str, Any]) -> dict[str, tuple[int, int, int]]:
    return {name: fingerprint(t.to(torch.bfloat16)) for name, t in state.items()}


def test_rank_zero_sends_what_the_ranks_hold_keeps_its_sender_and_survives_a_failed_send(
    tiny_moe_dir: Path, ray_started: None
) -> None:
    from ray import cloudpickle

    from r3operator.trainer.distributed import DistributedTrainer, PolicyOptions

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the stand-ins travel to the rank actors
    options = PolicyOptions(learning_rate=1e-3, seed=0, compute_dtype="float32")
    ranks = DistributedTrainer(tiny_moe_dir, world_size=2, device="cpu", options=options)
    sent, phases = FingerprintLog(), SyncPhases()
    install = RankNativeInstall(
        TransferMethod.NCCL,
        ranks=ranks,
        dtype=torch.bfloat16,
        buffer_size_bytes=1 << 20,
        sent=sent,
        phases=phases,
        bracket=BeginNative(BracketLayout.KERNEL),
        make=RecordingSync,
    )
    engines = [Endpoint("engine-0", "http://127.0.0.1:8000"), Endpoint("engine-1", "http://127.0.0.1:8001")]
    assert install.describe() == "sent from trainer rank 0 of 2"
    try:
        before = ranks.model_state_dict()  # the whole weights, read another way (FSDP's full state dict)
        assert install(engines, "v1") == SyncCounts(
            tensors=len(before),
            bytes=sum(t.numel() * 2 for t in before.values()),
        )
        assert sent.result() == expected(before)
        assert phases.seconds["gather"] > 0 and "transfer" in phases.seconds

        batch = r3_batch()
        old = ranks.old_logprobs(batch, ReplayMode.R3)
        ranks.update(batch, old, mini_batches=1, clip_low=0.2, clip_high=0.28)
        after = ranks.model_state_dict()
        assert expected(after) != expected(before)  # it trained
        with pytest.raises(RuntimeError, match="engine-1 went away mid-sync"):
            install(engines, "fail")
        # Every rank had finished its gather before rank 0 sent: the retry's collectives find them all free.
        install(engines, "v2")
        assert sent.result() == expected(after)
        held = ranks.on_every_rank(rank0_sender, install.install)
        assert held[1] is None
        # One sender made all three syncs: the rendezvous is kept (the failed one's sender closes and remakes
        # its own group, as in a one-process run).
        assert held[0]["syncs"] == [(("engine-0", "engine-1"), t) for t in ("v1", "fail", "v2")]
        assert held[0]["layout"] is BracketLayout.KERNEL
        assert held[0]["kept"] == {}  # the copy is let go after each sync

        install(engines[:1], "v3")  # another set of engines: a new sender
        first, held = held[0]["serial"], ranks.on_every_rank(rank0_sender, install.install)
        assert held[0]["serial"] != first and held[0]["syncs"] == [(("engine-0",), "v3")]
        install.close()
        assert ranks.on_every_rank(rank0_sender, install.install)[0]["sender"] is None
    finally:
        ranks.close()


def test_an_engine_reached_over_http_travels_to_rank_zero_whole() -> None:
    """The request carries the driver's engines to rank 0 by pickle (Ray): an `HTTPEngine` must survive it."""
    import http.server
    import json
    import pickle
    import threading

    from ray import cloudpickle

    from r3operator.rollout.engines import HTTPEngine

    class Models(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # /health and /v1/models
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(json.dumps({"data": [{"id": "tiny"}]}).encode())

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Models)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        engine = HTTPEngine(f"http://127.0.0.1:{server.server_address[1]}", staging_dir=Path("/unused"), num_experts=8)
        copy = pickle.loads(cloudpickle.dumps(engine))
        assert rank_sync.engines_key([copy]) == rank_sync.engines_key([engine]) == ((engine.name, engine.base_url),)
        assert copy.client.model == "tiny" and copy.client.base_url == engine.client.base_url
    finally:
        server.shutdown()


def test_the_copy_stays_on_the_gpu_only_while_it_fits_its_free_memory() -> None:
    state = {"a": torch.zeros(1000, dtype=torch.float32), "b": torch.zeros(24, 10, dtype=torch.float32)}
    assert rank_sync.nbytes(state, torch.bfloat16) == 2 * 1240
    assert rank_sync.nbytes(state, None) == 4 * 1240
    assert rank_sync.copy_device(8_000, 10_000) is None  # within the headroom: where it was gathered
    assert rank_sync.copy_device(8_001, 10_000) == "cpu"
    assert rank_sync.copy_device(10**12, None) is None  # no GPU: a CPU run keeps it where it is
    kept = rank_sync.gather_weights(state, dtype=torch.bfloat16, keep=True, device="cpu")
    assert {n: (t.dtype, t.shape) for n, t in kept.items()} == {
        "a": (torch.bfloat16, (1000,)),
        "b": (torch.bfloat16, (24, 10)),
    }
    assert rank_sync.gather_weights(state, dtype=torch.bfloat16, keep=False) == {}
