"""Concurrent writers and crashed writers: readers only ever see complete files."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from r3r_test_helpers import make_routes

from r3operator.routing import RoutingFileMissingError, RoutingStore, encode

NUM_EXPERTS = 128
SHAPE = (2048, 48, 8)  # 768 KiB per file: large enough that writes overlap with reads


def _expected(version: int) -> np.ndarray:
    return make_routes(*SHAPE, NUM_EXPERTS, seed=version, dtype="uint8")


def _writer(root: str, writer_id: int, rounds: int) -> None:
    store = RoutingStore(Path(root), durable=False)
    for i in range(rounds):
        version = writer_id * 1000 + i
        routes = encode(_expected(version), num_experts=NUM_EXPERTS)
        # every writer races on "shared"; each also owns one sample of its own
        for sid in ("shared", f"own-{writer_id}"):
            store.put(step=1, sample_id=sid, routes=routes, num_experts=NUM_EXPERTS, policy_version=version)


def test_concurrent_writers_readers_never_see_partial(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    writers = [ctx.Process(target=_writer, args=(str(tmp_path), w, 12)) for w in range(3)]
    for proc in writers:
        proc.start()
    store = RoutingStore(tmp_path)
    complete_reads = 0
    while any(p.is_alive() for p in writers) or complete_reads == 0:
        for sid in ("shared", "own-0", "own-1", "own-2"):
            try:
                record = store.get(step=1, sample_id=sid)  # verifies crc: a torn file would raise here
            except RoutingFileMissingError:
                continue
            np.testing.assert_array_equal(record.array(), _expected(record.header.policy_version))
            complete_reads += 1
    for proc in writers:
        proc.join(timeout=60)
        assert proc.exitcode == 0
    assert complete_reads > 0
    final = {sid: store.get(step=1, sample_id=sid).header.policy_version for sid in store.sample_ids(step=1)}
    assert final == {"shared": final["shared"], "own-0": 11, "own-1": 1011, "own-2": 2011}
    assert final["shared"] in (11, 1011, 2011)  # last writer wins, whole
    assert not [p for p in store.step_dir(1).iterdir() if p.name.startswith(".")]  # no temp files left


_SLOW_WRITER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    import numpy as np
    from r3operator.routing import RoutingStore, encode
    from r3operator.routing import store as store_module

    store_module._CHUNK_BYTES = 4096      # many small writes ...
    real_write = os.write
    def slow_write(fd, data):             # ... each one slow, so the kill lands mid-file
        time.sleep(0.002)
        return real_write(fd, data)
    os.write = slow_write

    arr = np.full((2048, 48, 8), 0, np.uint8) + np.arange(8, dtype=np.uint8) + 100
    print("writing", flush=True)
    RoutingStore(Path(sys.argv[1])).put(step=5, sample_id="victim", routes=encode(arr, num_experts=128),
                                        num_experts=128, policy_version=2)
    print("finished", flush=True)
    """
)


@pytest.mark.parametrize("had_old_version", [True, False])
def test_sigkilled_writer_leaves_old_file_or_nothing(tmp_path: Path, had_old_version: bool) -> None:
    store = RoutingStore(tmp_path)
    old = make_routes(64, 48, 8, NUM_EXPERTS, seed=1)
    if had_old_version:
        store.put(step=5, sample_id="victim", routes=encode(old, num_experts=128), num_experts=128, policy_version=1)
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
        deadline = time.monotonic() + 60
        temp: list[Path] = []
        while time.monotonic() < deadline:  # wait until the temp file holds a partial payload
            step_dir = store.step_dir(5)
            temp = [p for p in step_dir.iterdir() if p.name.startswith(".victim.r3r")] if step_dir.is_dir() else []
            if temp and temp[0].stat().st_size > 64 * 1024:
                break
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert len(temp) == 1 and 0 < temp[0].stat().st_size < 2048 * 48 * 8  # killed mid-write
    if had_old_version:
        record = store.get(step=5, sample_id="victim")
        assert record.header.policy_version == 1
        np.testing.assert_array_equal(record.array(), old)
    else:
        with pytest.raises(RoutingFileMissingError):
            store.get(step=5, sample_id="victim")
    assert store.sample_ids(step=5) == (["victim"] if had_old_version else [])
    assert store.gc(keep_last_steps=1) == 0  # a young temp file might be a live writer: kept
    assert store.gc(keep_last_steps=1, temp_max_age_s=0) == 1
    assert not temp[0].exists()
