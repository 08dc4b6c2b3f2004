"""`r3operator up` as a subprocess, for the end-to-end tests of tests/up: the small local job, the run's
paths, the metrics rows, and a process that never outlives its test."""

from __future__ import annotations

import csv
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
LOCAL = REPO / "examples" / "rljob-local.yaml"
JOB = "tiny-count-r3"


def small_local_job(tmp_path: Path, **inference: Any) -> tuple[Path, dict[str, Any]]:
    """The local example with a smaller batch (2 shared CPU cores) and ``inference`` fields changed: the same
    engine and trainer pods otherwise."""
    doc = yaml.safe_load(LOCAL.read_text())
    doc["spec"]["inference"].update(inference)
    doc["spec"]["rollout"].update(promptsPerStep=4, groupSize=4)
    doc["spec"]["algorithm"].update(sftWarmupSteps=0)
    doc["spec"]["checkpoint"].update(intervalSteps=2)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path, doc


def free_port_offset(*ports: int) -> int:
    """An offset at which every one of ``ports`` is free on this host: a run started with ``port_offset`` listens
    on its ports plus the offset."""
    for offset in range(20000, 50000, 97):
        if all(_free(port + offset) for port in ports):
            return offset
    raise AssertionError(f"no offset frees all of ports {ports}")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "runs" / JOB


def metrics_csv(tmp_path: Path) -> Path:
    return run_dir(tmp_path) / "volumes" / f"{JOB}-routing" / "runs" / JOB / "metrics.csv"


def metrics_rows(tmp_path: Path) -> list[dict[str, str]]:
    path = metrics_csv(tmp_path)
    if not path.is_file():
        return []
    with path.open() as f:
        return list(csv.DictReader(f))


def up_output(tmp_path: Path) -> str:
    return (tmp_path / "up.out").read_text()


@contextmanager
def up_process(
    tmp_path: Path, job: Path, *, steps: int, port_offset: int, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """`r3operator up JOB` on CPU into ``tmp_path/runs``, its output in ``tmp_path/up.out``; stopped with
    SIGTERM (its whole session) if it still runs when the block ends."""
    with (tmp_path / "up.out").open("wb") as out:
        up = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "r3operator",
                "up",
                str(job),
                "--out-dir",
                str(tmp_path / "runs"),
                "--steps",
                str(steps),
                "--port-offset",
                str(port_offset),
                "--gpus",
                "none",
            ],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            yield up
        finally:
            if up.poll() is None:
                os.killpg(up.pid, signal.SIGTERM)
                up.wait(timeout=120)
