"""The in-process trainer's process group of one must not depend on a fixed port: on a multi-GPU host two runs
(or a run and a test) each start one, and a fixed MASTER_PORT made the second fail with EADDRINUSE (seen on a
4-GPU machine, 2026-11-26)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

pytest.importorskip("torch")

_JOIN = """
import torch.distributed as dist
from r3operator.trainer.fsdp import init_process_group_if_needed
print(init_process_group_if_needed("cpu"))
dist.destroy_process_group()
"""


OLD_FIXED_PORT = 29511


def test_a_group_of_one_starts_while_another_process_holds_the_old_fixed_port() -> None:
    busy_port = OLD_FIXED_PORT
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            holder.bind(("127.0.0.1", busy_port))
        except OSError:
            pytest.skip(f"port {busy_port} is already taken on this machine")
        holder.listen()
        done = subprocess.run([sys.executable, "-c", _JOIN], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("(0, 1)")
