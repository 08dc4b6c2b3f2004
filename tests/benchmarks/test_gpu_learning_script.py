"""scripts/gpu-learning.sh across calls, with `python3` replaced by a stand-in of benchmarks.learning: `start`
returns at once while the run goes on detached, `status` reads its steps and held-out rewards, and `collect` stops it,
summarises with the start's flags and brings the figures back. The GPU machine runs the same script with the real
benchmark."""

from __future__ import annotations

import subprocess
import tarfile
import time
from pathlib import Path

from tests.benchmarks.stand_ins import env_with_stand_ins

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu-learning.sh"

# The stand-in: a run writes a step a second into Disabled's metrics.csv and never ends by itself; a summary writes
# the JSON, with the arguments it was given.
FAKE_LEARNING = """#!/bin/bash
out=$4
if [[ "$*" == *"--parts summary"* ]]; then
  echo "{\\"args\\": \\"$*\\"}" > "$out/learning-2026-12-06-h100.json"; exit 0
fi
mkdir -p "$out/runs/learning-disabled" "$out/jobs"
printf 'step,policy_version,eval_reward_mean\\n0,1,0.25\\n' > "$out/runs/learning-disabled/eval.csv"
echo "== Disabled: python3 -m r3operator run $out/jobs/disabled.yaml"
echo step > "$out/runs/learning-disabled/metrics.csv"
for i in $(seq 1 600); do echo "$i" >> "$out/runs/learning-disabled/metrics.csv"; sleep 1; done
"""


def _env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "root").mkdir()
    return env_with_stand_ins(
        tmp_path, {"python3": FAKE_LEARNING}, LEARNING_ROOT=str(tmp_path / "root"), R3_SITE=str(tmp_path / "site")
    )


def _script(env: dict[str, str], *args: str) -> str:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True, check=True, timeout=120
    ).stdout


def test_start_status_collect(tmp_path: Path) -> None:
    env = _env(tmp_path)
    begin = time.monotonic()
    assert "learning run started" in _script(env, "start", "--modes", "Disabled,R3", "--micro-batch-tokens", "4096")
    assert time.monotonic() - begin < 60  # the copy of the tree, not the run
    metrics = tmp_path / "root" / "learn" / "runs" / "learning-disabled" / "metrics.csv"
    deadline = time.monotonic() + 30
    while not metrics.is_file() or len(metrics.read_text().splitlines()) < 3:
        assert time.monotonic() < deadline, "the detached run wrote no step"
        time.sleep(0.2)
    status = _script(env, "status", str(tmp_path / "so-far"))
    assert "learning-disabled: " in status and "held-out 0=0.25" in status and status.rstrip().endswith("running")
    assert "== Disabled: python3 -m r3operator run" in status
    with tarfile.open(tmp_path / "so-far" / "learning.tgz") as tar:  # the figures so far, the run going on
        assert "./runs/learning-disabled/metrics.csv" in tar.getnames()

    dest = tmp_path / "out"
    _script(env, "collect", str(dest))
    steps = len(metrics.read_text().splitlines())
    time.sleep(2.5)
    assert len(metrics.read_text().splitlines()) == steps  # stopped
    summary = (dest / "learning-2026-12-06-h100.json").read_text()
    # The summary part ran with the start's flags, from the copy of the tree.
    assert "--modes Disabled,R3 --micro-batch-tokens 4096 --parts summary" in summary
    with tarfile.open(dest / "learning.tgz") as tar:
        names = tar.getnames()
    assert "./runs/learning-disabled/metrics.csv" in names and "./learning-2026-12-06-h100.json" in names


def test_an_unknown_command_says_how_to_call_it(tmp_path: Path) -> None:
    done = subprocess.run(["bash", str(SCRIPT), "go"], cwd=REPO, env=_env(tmp_path), capture_output=True, text=True)
    assert done.returncode == 2 and "usage: bash scripts/gpu-learning.sh start" in done.stderr
