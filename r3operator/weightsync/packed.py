"""The packed path: the trainer's weights as packed chunks through the worker extension, inside ONE layerwise-reload
bracket per engine (engine/worker.py). The fallback where vLLM's native transfer is not used (CPU engines, a
trainer without CUDA, an engine whose vLLM differs)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from r3operator.weightsync.endpoints import EngineEndpoint, SyncCounts
from r3operator.wire.sync_phases import SyncPhases, chunk_seconds
from r3operator.wire.weights import PackedChunk

log = logging.getLogger(__name__)


def install_packed(
    engines: Sequence[EngineEndpoint],
    chunks: Iterable[PackedChunk],
    *,
    policy_tag: str | None = None,
    phases: SyncPhases | None = None,
) -> SyncCounts:
    """ONE layerwise-reload bracket per engine: begin once, every chunk, finish once, which stamps the engine with
    `policy_tag` (then its requests are salted with it). Each chunk is packed once and shipped to every engine; a
    failure aborts every bracket without finalising it (`r3_abort_weight_update`). `phases` gets the seconds of each
    phase (wire/sync_phases.py)."""
    clock = phases if phases is not None else SyncPhases()
    with clock("begin"):
        for engine in engines:
            engine.begin_weight_update()
    count, nbytes = 0, 0
    try:
        for chunk in clock.timed("produce", chunks):
            # The chunk says what it spent on the trainer's side; the rest of producing it (a trainer rank's chunk
            # crossing Ray) counts as gathering.
            own = chunk_seconds(chunk)
            clock.merge(own)
            clock.add("gather", clock.seconds.pop("produce", 0.0) - sum(own.values()))
            try:
                with clock("transfer"):
                    for engine in engines:
                        engine.load_packed(chunk)
            finally:  # a failed chunk's staged file must not outlive the attempt either
                chunk.release()
            count, nbytes = count + 1, nbytes + chunk.nbytes
        clock.add("gather", clock.seconds.pop("produce", 0.0))
        with clock("finish"):
            loaded = [engine.finish_weight_update(policy_tag) for engine in engines]
    except BaseException:
        for engine in engines:
            try:
                engine.abort_weight_update()
            except Exception as exc:  # keep the original error; the engine is probably gone
                log.error("aborting the weight update on %s failed: %s", engine.name, exc)
        raise
    return SyncCounts(tensors=loaded[0].tensors if loaded else 0, bytes=nbytes, chunks=count)
