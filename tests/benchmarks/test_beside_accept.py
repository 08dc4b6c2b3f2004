"""benchmarks/peers/beside-accept.sh's chains, with `python3`, `taskset` and the TE build replaced by recorders: which
parts run on which GPUs, in which order, and that the 4-GPU comparison starts only after both 2-GPU lanes (rows
included) have ended. The GPU machine runs the same script with the real programs."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from tests.benchmarks.stand_ins import env_with_stand_ins

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "peers" / "beside-accept.sh"


def _fakes(tmp_path: Path) -> dict[str, str]:
    calls = tmp_path / "calls"
    # Each "python3" records its GPUs and arguments when it ends; `prepare` takes longest, as the real one does.
    python3 = (
        '#!/bin/bash\ncase "$*" in *"--parts prepare"*) sleep 1 ;; *) sleep 0.2 ;; esac\n'
        f'echo "$CUDA_VISIBLE_DEVICES|$*" >> {calls}\n'
    )
    taskset = '#!/bin/bash\nshift 2\nexec "$@"\n'  # bash keeps the exported functions
    setup = tmp_path / "verl-setup.sh"
    setup.write_text("#!/bin/bash\nexit 0\n")
    setup.chmod(0o755)
    return env_with_stand_ins(
        tmp_path,
        {"python3": python3, "taskset": taskset},
        BESIDE_ROOT=str(tmp_path / "root"),
        BESIDE_TMP=str(tmp_path / "tmp"),
        VERL_SETUP=str(setup),
        R3_SITE=str(tmp_path / "site"),
    )


def _run(env: dict[str, str], *args: str) -> str:
    """The script's output; it returns at once, its chains run on detached."""
    return subprocess.run(
        ["bash", str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True, check=True
    ).stdout


def _calls(tmp_path: Path, done: str, timeout_s: float = 60) -> list[tuple[str, str]]:
    marker = tmp_path / "root" / "bg" / done
    deadline = time.monotonic() + timeout_s
    while not marker.exists():
        assert time.monotonic() < deadline, f"{done} never written"
        time.sleep(0.1)
    lines = (tmp_path / "calls").read_text().splitlines()
    return [(gpus, args) for gpus, _, args in (line.partition("|") for line in lines)]


def _part(args: str) -> str:
    """What a recorded call ran: the comparison's parts, or the acceptance rows."""
    if "benchmarks.gpu_accept" in args:
        return "rows " + args.split("--rows ")[1]
    return args.split("--parts ")[1]


@pytest.mark.timeout(120)
def test_start_runs_both_lanes_then_the_four_gpu_comparison_after_both(tmp_path: Path) -> None:
    env = _fakes(tmp_path)
    env.update(VERL_PARTS="verl-R3", R3_OPTS="--r3-fast --skip-r3-disabled")
    (tmp_path / "root" / "peer" / "inputs").mkdir(parents=True)
    started = _run(env, "start", "20", "receipt_cuda", "sync_layouts_a3b", "12")
    assert "4 GPUs after both: 12 steps" in started
    calls = _calls(tmp_path, "four.rc")
    lane_a = [_part(a) for g, a in calls if g == "0,1"]
    lane_b = [_part(a) for g, a in calls if g == "2,3"]
    four = [(_part(a), a) for g, a in calls if g == "0,1,2,3"]
    assert lane_a == ["prepare", "verl-R3", "table", "rows receipt_cuda"]
    assert lane_b == ["r3 --r3-fast --skip-r3-disabled", "table", "rows sync_layouts_a3b"]
    assert [part for part, _ in four] == ["verl-R3", "r3 --skip-r3-disabled", "table"]
    assert all("--gpus 4 --steps 12" in args for _, args in four)
    assert all("--gpus 2 --steps 20" in a for g, a in calls if g in ("0,1", "2,3") and "gpu_accept" not in a)
    first_four = next(i for i, (g, _) in enumerate(calls) if g == "0,1,2,3")
    assert all(g == "0,1,2,3" for g, _ in calls[first_four:])  # nothing of a lane after the 4-GPU chain began
    assert (tmp_path / "root" / "peer4" / "inputs").is_dir()  # the 2-GPU run's inputs, copied, not made again


@pytest.mark.timeout(120)
def test_four_runs_only_the_four_gpu_comparison(tmp_path: Path) -> None:
    env = _fakes(tmp_path)
    _run(env, "four", "12")
    _calls(tmp_path, "rows-A.rc")
    calls = _calls(tmp_path, "rows-B.rc")
    assert [(g, _part(a)) for g, a in calls] == [
        ("0,1,2,3", "prepare"),
        ("0,1,2,3", "verl-R3"),
        ("0,1,2,3", "r3 --skip-r3-disabled"),
        ("0,1,2,3", "table"),
    ]


@pytest.mark.timeout(120)
def test_four_then_rows_on_two_gpus_each_only_after_the_comparison(tmp_path: Path) -> None:
    env = _fakes(tmp_path)
    env["R3_OPTS4"] = "--r3-fast --skip-r3-disabled"
    started = _run(env, "four", "12", "sync_layouts_x16l,receipt_cuda", "sync_layouts_a3b")
    assert "'sync_layouts_x16l,receipt_cuda' on GPUs 0,1" in started
    _calls(tmp_path, "rows-A.rc")
    calls = _calls(tmp_path, "rows-B.rc")
    parts = [(g, _part(a)) for g, a in calls]
    assert parts[:4] == [("0,1,2,3", p) for p in ("prepare", "verl-R3", "r3 --r3-fast --skip-r3-disabled", "table")]
    assert sorted(parts[4:]) == [("0,1", "rows sync_layouts_x16l,receipt_cuda"), ("2,3", "rows sync_layouts_a3b")]


def test_an_unknown_command_says_how_to_call_it(tmp_path: Path) -> None:
    out = subprocess.run(["bash", str(SCRIPT), "go"], cwd=REPO, env=_fakes(tmp_path), capture_output=True, text=True)
    assert out.returncode == 2 and "four STEPS4" in out.stderr


@pytest.mark.timeout(120)
def test_a_warm_start_reaches_every_part_and_r3operator_waits_for_prepare(tmp_path: Path) -> None:
    env = _fakes(tmp_path)
    env.update(VERL_PARTS="verl-R3", R3_OPTS="--skip-r3-disabled", WARM_START_STEPS="3", WARM_START_LR="5e-05")
    _run(env, "start", "20", "", "", "12")
    calls = _calls(tmp_path, "four.rc")
    comparison = [a for _, a in calls if "verl_vs_r3" in a]
    assert comparison and all("--warm-start-steps 3 --warm-start-lr 5e-05" in a for a in comparison)
    parts = [_part(a) for _, a in calls]
    assert parts.index("prepare") < parts.index("r3 --skip-r3-disabled")  # the warmed model exists first
