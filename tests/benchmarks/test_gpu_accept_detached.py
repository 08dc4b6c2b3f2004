"""scripts/gpu-accept-detached.sh across calls, with `python3` replaced by a stand-in of benchmarks.gpu_accept:
`start` returns at once while the rows go on detached, `wait` packs what is there so far and says whether the run
ended (and how), and a second `start` while one runs is refused. The GPU machine runs the same script with the real
acceptance run."""

from __future__ import annotations

import subprocess
import tarfile
import time
from pathlib import Path

from tests.benchmarks.stand_ins import env_with_stand_ins

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu-accept-detached.sh"

# The stand-in: one row that writes the record, then waits for a file the test creates, then fails (exit 1).
FAKE_ACCEPT = """#!/bin/bash
out=$3; shift 3
mkdir -p "$out" "$ACCEPT_WORK/row_a"
echo "== row_a (part 1, ~1 s): args $* budget $ACCEPT_BUDGET_S"
echo '{"rows": []}' > "$out/accept.json"
echo "a row's log" > "$ACCEPT_WORK/row_a.log"
while [ ! -f "$RELEASE" ]; do sleep 0.2; done
echo "   fail: the stand-in's row"
exit 1
"""


def _env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "root").mkdir()
    return env_with_stand_ins(
        tmp_path,
        {"python3": FAKE_ACCEPT},
        ACCEPT_DETACHED_ROOT=str(tmp_path / "root"),
        ACCEPT_WORK=str(tmp_path / "work"),
        R3_SITE=str(tmp_path / "site"),
        RELEASE=str(tmp_path / "release"),
    )


def _script(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True, check=False, timeout=120
    )


def _names(archive: Path) -> set[str]:
    with tarfile.open(archive) as tar:
        return {Path(name).name for name in tar.getnames()}


def test_start_wait_and_pack_across_calls(tmp_path: Path) -> None:
    env = _env(tmp_path)
    started = _script(env, "start", "--rows", "row_a", "--beside", "learning (e)")
    assert started.returncode == 0 and "acceptance run started" in started.stdout, started.stderr
    again = _script(env, "start", "--rows", "row_a")
    assert again.returncode == 2 and "already going" in again.stderr

    deadline = time.monotonic() + 30
    while True:  # the row has begun once its log says so
        running = _script(env, "wait", "1", str(tmp_path / "first"))
        if "== row_a" in running.stdout:
            break
        assert time.monotonic() < deadline, running.stdout
    assert running.returncode == 3 and running.stdout.rstrip().endswith("running")
    assert "args --rows row_a --beside learning (e) budget 1500" in running.stdout
    assert {"accept.json", "accept.log", "row_a.log"} <= _names(tmp_path / "first" / "accept.tgz")

    (tmp_path / "release").touch()
    ended = _script(env, "wait", "60", str(tmp_path / "last"))
    assert ended.returncode == 0, ended.stdout
    assert "   fail: the stand-in's row" in ended.stdout and ended.stdout.rstrip().endswith("ended: exit 1")
    assert {"accept.json", "accept.log", "row_a.log"} <= _names(tmp_path / "last" / "accept.tgz")
