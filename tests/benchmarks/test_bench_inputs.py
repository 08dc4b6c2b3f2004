"""The benchmarks' own checks of their inputs (benchmarks/bench_fidelity.py, bench_temperature.py,
bench_megatron.py and bench_weight_sync.py run them before any GPU work): a sample without engine routes and a
trainer whose weights the weight-sync benchmark cannot perturb are errors that say what is wrong."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from benchmarks.bench_fidelity import fidelity_batch  # noqa: E402
from r3operator.routing.codec import RoutedExperts, encode  # noqa: E402
from r3operator.routing.sample import RolloutSample  # noqa: E402
from r3operator.trainer.batch import build_batch  # noqa: E402


def _sample(sample_id: str, routes: RoutedExperts | None, routes_error: str | None = None) -> RolloutSample:
    return RolloutSample(
        sample_id=sample_id,
        prompt_index=0,
        choice_index=0,
        prompt_token_ids=(5, 6, 7),
        token_ids=(8, 9),
        logprobs=np.array([-0.5, -0.25], dtype=np.float32),
        routes=routes,
        routes_error=routes_error,
    )


def _routes(seed: int) -> RoutedExperts:
    # [4 positions, 2 layers, top-2] of 4 experts: every position but the last (it is never fed back)
    ids = np.array([[[seed % 4, (seed + 1) % 4], [(seed + 2) % 4, (seed + 3) % 4]]] * 4, dtype=np.int64)
    return encode(ids, num_experts=4)


def test_fidelity_batch_names_the_samples_without_routes() -> None:
    samples = [_sample("q0-c0", _routes(0)), _sample("q0-c1", None, "the engine returned no routed_experts")]
    with pytest.raises(ValueError, match=r"q0-c1.*the engine returned no routed_experts"):
        fidelity_batch(samples, pad_id=0)


def test_fidelity_batch_places_each_samples_own_routes() -> None:
    r0, r1 = _routes(0), _routes(1)
    batch = fidelity_batch([_sample("q0-c0", r0), _sample("q0-c1", r1)], pad_id=None)
    expected = build_batch([_sample("q0-c0", r0), _sample("q0-c1", r1)], [0.0, 0.0], routes=[r0, r1], pad_id=0)
    assert batch.engine_routes is not None and expected.engine_routes is not None
    assert torch.equal(batch.engine_routes, expected.engine_routes)
    assert not torch.equal(batch.engine_routes[0], batch.engine_routes[1])


def test_weight_sync_bench_refuses_to_perturb_a_trainer_it_cannot_reach() -> None:
    pytest.importorskip("transformers")
    from benchmarks.bench_weight_sync import new_policy

    run: Any = SimpleNamespace(trainer=SimpleNamespace(pad_id=0))  # a trainer with no in-process HF model
    with pytest.raises(TypeError, match="--sft-steps 0"):
        new_policy(run, sft_steps=0)


def test_weight_sync_bench_measures_the_layouts_named_in_their_order_and_refuses_others() -> None:
    from benchmarks.bench_weight_sync import parse_layouts

    assert parse_layouts("kernel,checkpoint") == ["kernel", "checkpoint"]
    assert parse_layouts("both") == ["checkpoint", "kernel"]
    assert parse_layouts("checkpoint") == ["checkpoint"]
    with pytest.raises(ValueError, match="--layout: fused is not a layout"):
        parse_layouts("kernel,fused")
    with pytest.raises(ValueError, match="names a layout twice"):
        parse_layouts("kernel,kernel")


def test_sync_host_bench_names_a_bad_scale_or_repeat_count(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.bench_sync_host import main

    for argv in (["--scale", "0"], ["--repeats", "-1"]):
        with pytest.raises(SystemExit):
            main(argv)
        assert "--scale and --repeats must be >= 1" in capsys.readouterr().err
