"""The canary's position check (exact and near-tie modes), the Megatron backend's missing-package error,
and the packed weight-sync buffers."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pytest

from r3operator.weightsync.canary import (
    CanaryMismatchError,
    CanaryTolerance,
    canary_tolerance,
    check_engine_greedy,
)

EXACT = CanaryTolerance(epsilon=0.0, logprob=1e-3)
NEAR_TIE = CanaryTolerance(epsilon=0.5, logprob=0.25)

EOS = 2


def logits_table(rows: dict[int, list[float]], length: int, vocab: int = 6):
    """logits_fn whose row t (next-token logits after position t) is `rows[t]`, else argmax token 5."""

    def fn(sequence):
        assert len(sequence) == length
        out = np.zeros((len(sequence), vocab), dtype=np.float32)
        out[:, 5] = 10.0
        for t, row in rows.items():
            out[t] = row
        return out

    return fn


def test_exact_mode_fails_on_any_difference_with_position() -> None:
    # prompt [1, 1] + engine [5, 4]: position 1 (token 5) is the argmax, position 2 (token 4) is not.
    near = {2: [0, 0, 0, 0, 9.99, 10.0]}
    with pytest.raises(CanaryMismatchError, match=r"prompt 0 \[1, 1\]: first difference at generated token 1"):
        check_engine_greedy(logits_table(near, 4), [[1, 1]], [[5, 4]], tolerance=EXACT, eos_id=EOS, max_tokens=2)


def test_near_tie_mode_accepts_small_gaps_and_counts_them() -> None:
    near = {2: [0, 0, 0, 0, 9.8, 10.0]}  # engine picked the runner-up, 0.2 below the trainer's argmax
    result = check_engine_greedy(
        logits_table(near, 4), [[1, 1]], [[5, 4]], tolerance=NEAR_TIE, eos_id=EOS, max_tokens=2
    )
    assert (result.positions, result.near_ties) == (2, 1)
    assert result.max_gap == pytest.approx(0.2, abs=1e-5)


def test_near_tie_mode_still_fails_on_a_real_difference() -> None:
    far = {1: [0, 0, 0, 0, 3.0, 10.0]}  # gap 7: no bf16 rounding explains this
    with pytest.raises(CanaryMismatchError, match=r"generated token 0: engine chose 4, trainer argmax 5 \(logit gap 7"):
        check_engine_greedy(logits_table(far, 4), [[1, 1]], [[4, 5]], tolerance=NEAR_TIE, eos_id=EOS, max_tokens=2)


def test_engine_stopping_early_needs_eos_as_the_trainers_argmax() -> None:
    with pytest.raises(CanaryMismatchError, match="without <eos>"):
        check_engine_greedy(logits_table({}, 3), [[1, 1]], [[5]], tolerance=EXACT, eos_id=EOS, max_tokens=4)
    # stopped with <eos>, but the trainer would have continued with token 5: a difference at token 0
    with pytest.raises(CanaryMismatchError, match="generated token 0"):
        check_engine_greedy(logits_table({}, 3), [[1, 1]], [[EOS]], tolerance=EXACT, eos_id=EOS, max_tokens=4)


def test_engine_logprobs_must_match_the_trainers_within_delta() -> None:
    # same greedy tokens, but the engine's logprob of token 5 at position 1 is off by 0.01 > δ_exact
    fn = logits_table({}, 4)
    row = fn([0, 0, 0, 0])[1].astype(np.float64)
    lp = float(row[5] - np.log(np.exp(row).sum()))
    ok = check_engine_greedy(
        fn, [[1, 1]], [[5, 5]], engine_logprobs=[[lp, lp]], tolerance=EXACT, eos_id=EOS, max_tokens=2
    )
    assert ok.max_logprob_diff < 1e-6
    with pytest.raises(CanaryMismatchError, match=r"generated token 1 \(5\): engine logprob .* > δ 0\.001"):
        check_engine_greedy(
            fn, [[1, 1]], [[5, 5]], engine_logprobs=[[lp, lp - 0.01]], tolerance=EXACT, eos_id=EOS, max_tokens=2
        )


def test_a_nan_engine_logprob_fails() -> None:
    # NaN compares False with anything: "diff > δ" would let corrupt weights that produce NaN through
    fn = logits_table({}, 4)
    with pytest.raises(CanaryMismatchError, match=r"generated token 0 \(5\): engine logprob nan"):
        check_engine_greedy(
            fn, [[1, 1]], [[5, 5]], engine_logprobs=[[float("nan"), 0.0]], tolerance=EXACT, eos_id=EOS, max_tokens=2
        )


def test_canary_tolerance_by_engine_dtype_and_env(monkeypatch) -> None:
    monkeypatch.delenv("R3OPERATOR_SYNC_CANARY_EPSILON", raising=False)
    monkeypatch.delenv("R3OPERATOR_SYNC_CANARY_LOGPROB_TOL", raising=False)
    assert canary_tolerance("bfloat16", "cuda").epsilon == 0.5  # 128 x bf16's unit roundoff 2^-8
    monkeypatch.setenv("R3OPERATOR_SYNC_CANARY_EPSILON", "0.25")
    assert canary_tolerance("bfloat16", "cuda").epsilon == 0.25
    assert "ε set by R3OPERATOR_SYNC_CANARY_EPSILON" in canary_tolerance("bfloat16", "cuda").describe()
    monkeypatch.setenv("R3OPERATOR_SYNC_CANARY_LOGPROB_TOL", "-1")
    with pytest.raises(ValueError, match="R3OPERATOR_SYNC_CANARY_LOGPROB_TOL"):
        canary_tolerance("bfloat16")


def test_megatron_backend_without_megatron_core_names_the_field_and_package(monkeypatch) -> None:
    from r3operator.trainer.megatron.adapter import MegatronUnavailableError, build_megatron_policy_trainer

    monkeypatch.setitem(sys.modules, "megatron.core", None)  # import megatron.core -> ImportError
    with pytest.raises(MegatronUnavailableError, match=r"spec\.trainer\.backend is Megatron.*megatron-core"):
        build_megatron_policy_trainer(object(), "unused", device="cpu")


@pytest.mark.slow
def test_packed_chunks_round_trip_and_ship_only_their_own_bytes() -> None:
    import torch

    from r3operator.wire.weights import checkpoint_tensors, pack_chunk, unpack_chunk

    fused = torch.randn(8, 6, 4)  # [E, 2I, H]: per-expert gate/up are views of this storage
    state = {"model.layers.0.mlp.experts.gate_up_proj": fused, "lm_head.weight": torch.randn(5, 4)}
    chunk = list(checkpoint_tensors(state, dtype=torch.bfloat16))
    packed = pack_chunk(chunk)
    own_bytes = sum(t.numel() * t.element_size() for _, t in chunk)
    assert packed.nbytes < own_bytes + 64 * len(chunk)  # not 8 x the fused storage per expert view
    back = unpack_chunk(packed.buffer, packed.entries)
    assert [n for n, _ in back] == [n for n, _ in chunk]
    for (_, want), (_, got) in zip(chunk, back, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.slow
def test_http_engine_stages_one_packed_file_that_the_worker_extension_reads_back(tmp_path) -> None:
    """The HTTP weight-sync path: the chunk is written once on the shared volume, the engine-side
    `r3_load_packed_file` turns it back into the same named tensors; the file is gone after release."""
    import torch

    from r3operator.engine.worker import WeightSyncWorkerExtension
    from r3operator.rollout.engines import HTTPEngine
    from r3operator.weightsync.endpoints import EngineEndpoint
    from r3operator.wire.weights import pack_chunk

    loaded: list[tuple[str, torch.Tensor]] = []

    class Worker(WeightSyncWorkerExtension):  # only the model load is replaced: no vLLM model here
        def r3_load_chunk(self, named_tensors):
            loaded.extend((n, t.clone()) for n, t in named_tensors)
            return len(named_tensors)

    chunk = [("a.weight", torch.randn(3, 5, dtype=torch.bfloat16)), ("b.bias", torch.arange(7.0))]
    engine = HTTPEngine.__new__(HTTPEngine)  # no server: the constructor's client would connect
    engine.staging_dir = tmp_path
    calls: list[str] = []

    def rpc_all(message: Any, *, retry: bool) -> list[int]:  # what vLLM's /collective_rpc would run on the worker
        calls.append(message.kind)
        return [Worker().r3_handle(message.encode())]

    engine._rpc_all = rpc_all  # type: ignore[method-assign]
    packed = pack_chunk(chunk)
    EngineEndpoint(engine).load_packed(packed)
    assert calls == ["load_packed_file"]
    assert [n for n, _ in loaded] == ["a.weight", "b.bias"]
    assert all(torch.equal(got, want) for (_, got), (_, want) in zip(loaded, chunk, strict=True))
    packed.release()
    assert not list(tmp_path.iterdir())
