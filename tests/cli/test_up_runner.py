"""cli/up/runner.py with small stand-in processes (no vLLM): the trainer's exit code is `up`'s, a dead engine
is started again with the same argv and env, and the shutdown leaves nothing of any process group behind."""

from __future__ import annotations

import json
import os
import socket
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

from r3operator.cli.up.plan import ProcessSpec, UpPlan
from r3operator.cli.up.runner import Runner, UpFailed, exit_status

# An engine stand-in: answers GET /health with 200 and starts a grandchild (as vLLM forks its engine core)
# whose pid it records next to itself.
ENGINE = textwrap.dedent("""
    import http.server, os, subprocess, sys
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(os.environ["GRANDCHILD_FILE"], "a").write(f"{child.pid}\\n")
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers()
        def log_message(self, *args):
            pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
""")

# A trainer stand-in that kills engine 0 (as a node loses a pod), waits until `up` has it healthy again,
# then exits with TRAINER_EXIT.
TRAINER_KILLS_ENGINE = textwrap.dedent("""
    import json, os, signal, sys, time, urllib.request
    run_dir, url = sys.argv[1], sys.argv[2]
    print("trainer: up", flush=True)
    first = json.load(open(os.path.join(run_dir, "up.json")))["processes"][0]["starts"][0]["pid"]
    os.killpg(first, signal.SIGKILL)
    for _ in range(600):
        starts = json.load(open(os.path.join(run_dir, "up.json")))["processes"][0]["starts"]
        if len(starts) == 2:
            try:
                urllib.request.urlopen(url, timeout=1)
                break
            except OSError:
                pass
        time.sleep(0.1)
    else:
        sys.exit(99)
    print("trainer: engine is back", flush=True)
    sys.exit(int(os.environ["TRAINER_EXIT"]))
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _plan(tmp_path: Path, trainer_script: str, *, exit_code: int = 0, engine_script: str = ENGINE) -> UpPlan:
    port = _free_port()
    env = {"GRANDCHILD_FILE": str(tmp_path / "grandchildren")}
    engine = ProcessSpec(
        name="engine-0",
        role="engine",
        pod="job-engine-0",
        container="vllm",
        argv=[sys.executable, "-c", engine_script, str(port)],
        env=env,
        rendered_argv=[],
        rendered_env={},
        gpus=[],
        port=port,
        startup_budget_s=60,
        grace_s=5,
    )
    trainer = ProcessSpec(
        name="trainer",
        role="trainer",
        pod="job-trainer-head",
        container="ray-head",
        argv=[sys.executable, "-c", trainer_script, str(tmp_path), f"http://127.0.0.1:{port}/health"],
        env={"TRAINER_EXIT": str(exit_code)},
        rendered_argv=[],
        rendered_env={},
        gpus=[],
        grace_s=5,
    )
    return UpPlan(job="job", run_dir=tmp_path, config_files={}, host_dirs={}, engines=[engine], trainer=trainer)


def _run(plan: UpPlan) -> tuple[int, list[str], bytes, Runner]:
    said: list[str] = []
    echoed: list[bytes] = []
    runner = Runner(plan, environ={"PATH": "/usr/bin:/bin"}, say=said.append, echo=echoed.append)
    runner.prepare()
    try:
        runner.start_engines()
        code = exit_status(runner.run_trainer())
    finally:
        runner.shutdown()
    return code, said, b"".join(echoed), runner


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is dead for our purposes.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(") ", 1)[1][0] != "Z"


def test_a_killed_engine_is_restarted_and_the_trainer_exit_code_is_ups(tmp_path: Path) -> None:
    code, said, output, runner = _run(_plan(tmp_path, TRAINER_KILLS_ENGINE, exit_code=3))
    assert code == 3
    assert output == b"trainer: up\ntrainer: engine is back\n"
    assert (tmp_path / "logs" / "trainer.log").read_bytes().endswith(output)
    manifest = json.loads((tmp_path / "up.json").read_text())
    starts = manifest["processes"][0]["starts"]
    assert len(starts) == 2 and starts[0]["exitCode"] == -9 and starts[0]["pid"] != starts[1]["pid"]
    assert any("engine-0 exited with code -9; restarting it" in line for line in said)
    assert any("engine-0 healthy again" in line for line in said)
    assert runner.engines[0].starts == 2


def test_shutdown_stops_every_process_group_grandchildren_included(tmp_path: Path) -> None:
    code, *_ = _run(_plan(tmp_path, TRAINER_KILLS_ENGINE))
    assert code == 0
    grandchildren = [int(line) for line in (tmp_path / "grandchildren").read_text().split()]
    assert len(grandchildren) == 2  # one per engine start
    assert not [pid for pid in grandchildren if _alive(pid)]


def test_an_engine_that_dies_before_it_is_healthy_fails_up_with_its_log(tmp_path: Path) -> None:
    broken = "import sys; print('no such model: /models/x', flush=True); sys.exit(2)"
    plan = _plan(tmp_path, "import sys; sys.exit(0)", engine_script=broken)
    with pytest.raises(UpFailed, match=r"engine-0 exited with code 2 before it was healthy(.|\n)*no such model"):
        _run(plan)
    assert not (tmp_path / "logs" / "trainer.log").exists()  # the trainer never started


def test_an_engine_that_never_gets_healthy_is_reported_while_up_waits_and_then_fails_up(tmp_path: Path) -> None:
    # vLLM's NixlConnector waits for ever on a side-channel listener that cannot bind: the wait must say what it
    # waits for, with the engine's last line, long before the startup budget runs out.
    stuck = "import time; print('NIXL handshake listener on 127.0.0.1:5600', flush=True); time.sleep(600)"
    plan = _plan(tmp_path, "import sys; sys.exit(0)", engine_script=stuck)
    plan = replace(plan, engines=[replace(plan.engines[0], startup_budget_s=3)])
    said: list[str] = []
    runner = Runner(plan, environ={"PATH": "/usr/bin:/bin"}, say=said.append, echo=lambda b: None, waiting_report_s=0.5)
    runner.prepare()
    try:
        with pytest.raises(UpFailed, match=r"engine-0 not healthy after \d+ s(.|\n)*listener on 127.0.0.1:5600"):
            runner.start_engines()
    finally:
        runner.shutdown()
    reports = [line for line in said if "still waiting for engine-0" in line]
    assert reports and all(line.endswith("NIXL handshake listener on 127.0.0.1:5600") for line in reports[1:])
    assert "of its 3 s" in reports[0]


# A worker stand-in of a LeaderWorkerSet group: no HTTP (a --headless vLLM), it only lives.
WORKER = "import time; time.sleep(600)"

# A trainer stand-in that kills the second engine, waits until `up` has started it again (the engines start in
# order: a group's leader, when it restarts, has by then), and then for the first engine's /health.
TRAINER_KILLS_WORKER = textwrap.dedent("""
    import json, os, signal, sys, time, urllib.request
    run_dir, url = sys.argv[1], sys.argv[2]
    def starts():
        return [p["starts"] for p in json.load(open(os.path.join(run_dir, "up.json")))["processes"][:2]]
    os.killpg(starts()[1][0]["pid"], signal.SIGKILL)
    for _ in range(600):
        if len(starts()[1]) == 2:
            try:
                urllib.request.urlopen(url, timeout=1)
                sys.exit(0)
            except OSError:
                pass
        time.sleep(0.1)
    sys.exit(99)
""")


def test_a_dead_group_member_restarts_its_whole_leader_worker_group(tmp_path: Path) -> None:
    plan = _plan(tmp_path, TRAINER_KILLS_WORKER)
    leader = replace(plan.engines[0], group="job-engine-0")
    worker = replace(leader, name="engine-0-1", pod="job-engine-0-1", argv=[sys.executable, "-c", WORKER], port=None)
    code, said, _, runner = _run(replace(plan, engines=[leader, worker]))
    assert code == 0
    manifest = json.loads((tmp_path / "up.json").read_text())
    leader_starts, worker_starts = (p["starts"] for p in manifest["processes"][:2])
    assert worker_starts[0]["exitCode"] == -9 and len(worker_starts) == 2
    # The leader was alive: up stopped it, as RecreateGroupOnPodRestart recreates the group's pods.
    assert leader_starts[0]["exitCode"] == -9 and len(leader_starts) == 2
    assert any("engine-0 stopped with it: group job-engine-0 restarts whole" in line for line in said)
    assert [c.starts for c in runner.engines] == [2, 2]


def test_engines_outside_a_group_restart_alone(tmp_path: Path) -> None:
    plan = _plan(tmp_path, TRAINER_KILLS_WORKER)
    worker = replace(
        plan.engines[0], name="engine-1", pod="job-engine-1", argv=[sys.executable, "-c", WORKER], port=None
    )
    code, *_ = _run(replace(plan, engines=[plan.engines[0], worker]))
    assert code == 0
    manifest = json.loads((tmp_path / "up.json").read_text())
    assert [len(p["starts"]) for p in manifest["processes"][:2]] == [1, 2]


@pytest.mark.parametrize(("returncode", "status"), [(0, 0), (3, 3), (-9, 137), (-15, 143)])
def test_exit_status_is_the_shells(returncode: int, status: int) -> None:
    assert exit_status(returncode) == status
