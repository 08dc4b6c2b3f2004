"""A local run's engines read the job's `vllm serve` flags (`spec.inference.extraArgs`) as vLLM reads them.

The reference is written out: what each flag means in vLLM's documentation (`--kv-cache-memory-bytes 1G` is 2**30
bytes), and the engine vLLM builds from them (its own scheduler config).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from r3operator.engine.llm import RUN_FIXED_KWARGS


def test_the_flags_written_are_applied_and_the_parser_defaults_are_not() -> None:
    pytest.importorskip("vllm")
    from r3operator.engine.flags import engine_flag_kwargs

    flags = engine_flag_kwargs(
        ["--max-num-seqs", "7", "--no-enforce-eager", "--kv-cache-memory-bytes", "1G"], fixed=RUN_FIXED_KWARGS
    )
    # `--no-enforce-eager` is the parser's default value, and still counts: the user wrote it (our default is eager).
    assert flags.kwargs == {"max_num_seqs": 7, "enforce_eager": False, "kv_cache_memory_bytes": 2**30}
    assert flags.kept == () and flags.serve_only == ()
    assert engine_flag_kwargs([], fixed=RUN_FIXED_KWARGS).kwargs == {}


def test_a_flag_the_run_fixes_is_kept_and_a_server_flag_is_reported() -> None:
    pytest.importorskip("vllm")
    from r3operator.engine.flags import engine_flag_kwargs

    flags = engine_flag_kwargs(
        ["--dtype", "float32", "--logprobs-mode", "raw_logits", "--port", "8001", "--max-num-seqs", "4"],
        fixed=RUN_FIXED_KWARGS,
    )
    assert flags.kwargs == {"max_num_seqs": 4}
    assert flags.kept == ("dtype", "logprobs_mode")
    assert flags.serve_only == ("--port", "8001")


def test_a_value_vllm_refuses_is_an_error_naming_the_flag() -> None:
    pytest.importorskip("vllm")
    from r3operator.engine.flags import engine_flag_kwargs

    with pytest.raises(ValueError, match=r"spec.inference.extraArgs .*--max-num-seqs: invalid int value: 'x'"):
        engine_flag_kwargs(["--max-num-seqs", "x"], fixed=RUN_FIXED_KWARGS)


@pytest.mark.slow
def test_the_in_process_engine_runs_with_the_jobs_flags(tiny_model_dir: Path) -> None:
    pytest.importorskip("vllm")
    from r3operator.rollout.actor import EngineActor

    kv = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GiB: this module's engine beside the session's
    try:
        actor = EngineActor(
            str(tiny_model_dir),
            device="cpu",
            dtype="float32",
            seed=0,
            max_model_len=512,
            engine_flags=("--max-num-seqs", "3", "--max-num-batched-tokens", "1024", "--dtype", "bfloat16"),
        )
    finally:
        if kv is None:
            os.environ.pop("VLLM_CPU_KVCACHE_SPACE")
        else:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = kv
    try:
        config = actor.llm.llm_engine.vllm_config
        assert config.scheduler_config.max_num_seqs == 3
        assert config.scheduler_config.max_num_batched_tokens == 1024
        assert str(config.model_config.dtype) == "torch.float32"  # the run's dtype, not the flag's
        samples = actor.generate([[1, 2, 3]] * 5, max_tokens=4, temperature=1.0, seed=0, n=1)
        assert len(samples) == 5  # five requests through a batch of at most three
    finally:
        del actor
