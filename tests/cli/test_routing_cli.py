"""`routing` CLI: inspect/encode/decode and one-line errors for bad files."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from r3r_test_helpers import make_routes
from typer.testing import CliRunner

from r3operator.cli.routing import app

runner = CliRunner()


def _encode(tmp_path: Path, *extra: str) -> tuple[Path, np.ndarray]:
    arr = make_routes(30, 4, 8, 300, seed=3)
    npy = tmp_path / "in.npy"
    np.save(npy, arr)
    out = tmp_path / "sample-7.r3r"
    result = runner.invoke(app, ["encode", "--npy", str(npy), "--out", str(out), *extra])
    assert result.exit_code == 0, result.output
    return out, arr


def test_encode_inspect_decode_round_trip(tmp_path: Path) -> None:
    out, arr = _encode(tmp_path, "--start", "2", "--num-experts", "320", "--step", "9", "--policy-version", "4")
    result = runner.invoke(app, ["inspect", str(out)])
    assert result.exit_code == 0, result.output
    header = json.loads(result.stdout)
    assert header["checksum_ok"] is True
    assert (header["shape"], header["dtype"], header["start"]) == ([30, 4, 8], "uint16", 2)
    assert (header["num_experts"], header["step"], header["policy_version"]) == (320, 9, 4)
    assert header["sample_id"] == "sample-7"  # defaults to the output file's stem
    back = tmp_path / "back.npy"
    result = runner.invoke(app, ["decode", str(out), "--npy", str(back)])
    assert result.exit_code == 0, result.output
    np.testing.assert_array_equal(np.load(back), arr)


def test_inspect_flipped_bit_prints_checksum_false_and_exits_1(tmp_path: Path) -> None:
    out, _ = _encode(tmp_path)
    data = bytearray(out.read_bytes())
    data[-3] ^= 0x10
    out.write_bytes(data)
    result = runner.invoke(app, ["inspect", str(out)])
    assert result.exit_code == 1
    assert json.loads(result.stdout)["checksum_ok"] is False
    assert result.stderr.count("\n") == 1 and str(out) in result.stderr
    decoded = runner.invoke(app, ["decode", str(out), "--npy", str(tmp_path / "x.npy")])
    assert decoded.exit_code == 1 and "checksum mismatch" in decoded.stderr


@pytest.mark.parametrize(
    ("content", "why"),
    [(b"\x89PNG\r\n\x1a\n" + bytes(100), "bad magic"), (None, "truncated"), ("missing", "no such")],
)
def test_bad_files_exit_1_with_one_line(tmp_path: Path, content, why: str) -> None:
    path = tmp_path / "bad.r3r"
    if content is None:
        good, _ = _encode(tmp_path)
        path.write_bytes(good.read_bytes()[:-10])
    elif isinstance(content, bytes):
        path.write_bytes(content)
    for args in (["inspect", str(path)], ["decode", str(path), "--npy", str(tmp_path / "o.npy")]):
        result = runner.invoke(app, args)
        assert result.exit_code == 1
        assert result.stderr.count("\n") == 1, result.stderr
        assert str(path) in result.stderr and why in result.stderr
        assert "Traceback" not in result.output


def test_encode_rejects_bad_input(tmp_path: Path) -> None:
    text = tmp_path / "notes.npy"
    text.write_text("not numpy")
    result = runner.invoke(app, ["encode", "--npy", str(text), "--out", str(tmp_path / "o.r3r")])
    assert result.exit_code == 1 and str(text) in result.stderr and result.stderr.count("\n") == 1
    dup = tmp_path / "dup.npy"
    np.save(dup, np.ones((3, 2, 2), np.int32))  # expert 1 twice per row
    result = runner.invoke(app, ["encode", "--npy", str(dup), "--out", str(tmp_path / "o.r3r")])
    assert result.exit_code == 1 and "duplicate" in result.stderr
    assert not (tmp_path / "o.r3r").exists()


def test_the_r3operator_command_reports_a_corrupt_file(tmp_path: Path) -> None:
    path = tmp_path / "corrupt.r3r"
    path.write_bytes(b"GIF89a" + bytes(50))
    proc = subprocess.run(
        [sys.executable, "-m", "r3operator", "routing", "inspect", str(path)], capture_output=True, text=True
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [f"error: {path}: not an R3 routing-data file (bad magic)"]


def test_inspect_refuses_a_fifo_instead_of_hanging(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.r3r"
    os.mkfifo(fifo)
    for args in (["inspect", str(fifo)], ["decode", str(fifo), "--npy", str(tmp_path / "o.npy")]):
        # A reader that opens the FIFO blocks until a writer appears: the timeout turns a hang into a failure.
        proc = subprocess.run(
            [sys.executable, "-m", "r3operator", "routing", *args], capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 1
        assert proc.stderr.strip().splitlines() == [f"error: {fifo}: not a regular file (a FIFO)"]
    fifo_npy = tmp_path / "in.npy"
    os.mkfifo(fifo_npy)
    result = runner.invoke(app, ["encode", "--npy", str(fifo_npy), "--out", str(tmp_path / "o.r3r")])
    assert result.exit_code == 1 and f"{fifo_npy}: not a regular file" in result.stderr


def test_decode_on_a_full_disk_leaves_no_partial_npy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out, arr = _encode(tmp_path)
    target = tmp_path / "routes.npy"
    target.write_bytes(b"previous content")
    real_save = np.save

    def save_until_disk_full(fh, array, allow_pickle=False):  # header and a part of the data, then ENOSPC
        real_save(fh, array[:1], allow_pickle=allow_pickle)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(np, "save", save_until_disk_full)
    result = runner.invoke(app, ["decode", str(out), "--npy", str(target)])
    assert result.exit_code == 1
    enospc = f"[Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)}"
    assert result.stderr.strip() == f"error: {target}: cannot write ({enospc})"
    assert target.read_bytes() == b"previous content"  # the old file is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.npy", "routes.npy", "sample-7.r3r"]  # no temp left
    monkeypatch.setattr(np, "save", real_save)
    assert runner.invoke(app, ["decode", str(out), "--npy", str(target)]).exit_code == 0
    np.testing.assert_array_equal(np.load(target), arr)
