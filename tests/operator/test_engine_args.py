"""api/vllm_args.py: the vLLM command line and environment derived from the spec."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import yaml
from spec_edits import apply_edits

from r3operator.api.load import parse_rljob
from r3operator.api.v1alpha1 import RLJobSpec
from r3operator.api.vllm_args import WORKER_EXTENSION_CLS, model_path, vllm_env, vllm_serve_args

QWEN = Path(__file__).resolve().parents[2] / "examples" / "qwen3-30b-a3b-r3-fsdp.yaml"


def _spec(**edits: object) -> RLJobSpec:
    doc = yaml.safe_load(QWEN.read_text())
    apply_edits(doc, edits)
    return parse_rljob(doc).spec


def _pairs(args: list[str]) -> dict[str, str]:
    return {a: b for a, b in itertools.pairwise(args) if a.startswith("--") and not b.startswith("--")}


def test_r3_args_capture_routes_with_mp_and_the_spec_parallelism():
    args = vllm_serve_args(_spec(), model_path="Qwen/Qwen3-30B-A3B")
    pairs = _pairs(args)
    assert args[:3] == ["vllm", "serve", "Qwen/Qwen3-30B-A3B"]
    assert "--enable-return-routed-experts" in args and "--enable-expert-parallel" in args
    assert pairs["--distributed-executor-backend"] == "mp"
    assert (pairs["--tensor-parallel-size"], pairs["--pipeline-parallel-size"]) == ("2", "1")
    assert (pairs["--data-parallel-size"], pairs["--data-parallel-size-local"]) == ("2", "2")
    assert (pairs["--max-model-len"], pairs["--gpu-memory-utilization"], pairs["--port"]) == ("8192", "0.85", "8000")
    assert pairs["--worker-extension-cls"] == WORKER_EXTENSION_CLS
    assert "--revision" not in args  # the revision is pinned by the download; vLLM loads a local copy


@pytest.mark.parametrize("mode", ["R2", "Disabled"])
def test_r2_and_disabled_never_turn_route_capture_on(mode: str):
    args = vllm_serve_args(_spec(**{"routingReplay.mode": mode}), model_path="m")
    assert not any("routed-experts" in a for a in args)


def test_extra_args_come_last_and_optional_features_map_to_flags():
    spec = _spec(
        **{
            "inference.extraArgs": ["--enable-prefix-caching", "--max-num-seqs=64"],
            "inference.asyncScheduling": True,
            "routingReplay.mode": "Disabled",
            "inference.kvConnector": "nixl",
            "inference.speculativeDecoding": {"method": "mtp", "numSpeculativeTokens": 1},
        }
    )
    args = vllm_serve_args(spec, model_path="m")
    assert args[-2:] == ["--enable-prefix-caching", "--max-num-seqs=64"]
    assert "--async-scheduling" in args
    assert _pairs(args)["--kv-transfer-config"] == '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'
    assert _pairs(args)["--speculative-config"] == '{"method":"mtp","num_speculative_tokens":1}'


def test_env_allowlists_our_plugin_and_sets_mrv2_only_when_asked():
    # The engine reads no R3OPERATOR_* variable; dev mode serves /collective_rpc for HTTP weight sync.
    assert vllm_env(_spec()) == {"VLLM_PLUGINS": "r3operator", "VLLM_SERVER_DEV_MODE": "1"}
    assert vllm_env(_spec(**{"inference.modelRunnerV2": True}))["VLLM_USE_V2_MODEL_RUNNER"] == "1"


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        ("hf://Qwen/Qwen3-30B-A3B", "/mnt/model/hf/Qwen/Qwen3-30B-A3B/main"),
        ("hf://Qwen/Qwen3-30B-A3B@0a1b2c", "/mnt/model/hf/Qwen/Qwen3-30B-A3B/0a1b2c"),
        ("file:///models/q", "/models/q"),
        ("pvc://weights/qwen/v1", "/mnt/model/qwen/v1"),
        ("r3operator://reference/tiny", "/var/lib/r3operator/models/tiny"),
        ("s3://bucket/models/qwen3", "/mnt/model/s3/bucket/models/qwen3"),
        ("gs://bucket/model", "/mnt/model/gs/bucket/model"),
    ],
)
def test_model_path_per_uri_scheme(uri: str, expected: str):
    assert model_path(_spec(**{"model.uri": uri, "model.revision": None})) == expected


def test_engine_args_name_the_worker_extension_that_exists():
    """args.py stays import-light (no torch/vLLM), so it spells the class path; it must match the class."""
    from r3operator.api import vllm_args as args
    from r3operator.engine import worker

    assert args.WORKER_EXTENSION_CLS == worker.WORKER_EXTENSION_CLS
    module, _, name = args.WORKER_EXTENSION_CLS.rpartition(".")
    assert module == worker.__name__ and hasattr(worker, name)


def test_engines_report_logprobs_after_temperature_and_users_cannot_turn_that_off():
    from r3operator.api.rules import errors, evaluate

    pairs = _pairs(vllm_serve_args(_spec(), model_path="m"))
    assert pairs["--logprobs-mode"] == "processed_logprobs"  # the trainer scores logits / T (trainer/batch.py)
    found = errors(evaluate(_spec(**{"inference.extraArgs": ["--logprobs-mode", "raw_logprobs"]})))
    assert [f.rule for f in found] == ["EXTRA-ARGS-DERIVED"]
