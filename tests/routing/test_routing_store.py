"""On-volume format: round trips, corruption detection, directory layout, retention."""

from __future__ import annotations

import errno
import os
import struct
import time
from pathlib import Path

import numpy as np
import pytest
from r3r_test_helpers import make_routes

from r3operator.routing import (
    RoutingDataError,
    RoutingFileError,
    RoutingFileMissingError,
    RoutingStore,
    encode,
    read_file,
    write_file,
)
from r3operator.routing.store import MAGIC


def _write(path: Path, *, tokens: int = 40, num_experts: int = 128, seed: int = 0) -> np.ndarray:
    arr = make_routes(tokens, 6, 8, num_experts, seed=seed)
    write_file(
        path,
        encode(arr, start=2, num_experts=num_experts),
        num_experts=num_experts,
        policy_version=7,
        step=42,
        sample_id="s-1",
    )
    return arr


@pytest.mark.parametrize(("num_experts", "dtype"), [(128, "uint8"), (512, "uint16"), (70_000, "int32")])
def test_file_round_trip(tmp_path: Path, num_experts: int, dtype: str) -> None:
    path = tmp_path / "a.r3r"
    arr = _write(path, num_experts=num_experts)
    record = read_file(path)
    header = record.header
    assert (header.format_version, header.shape, header.dtype, header.start) == (1, (40, 6, 8), dtype, 2)
    assert (header.num_experts, header.policy_version, header.step, header.sample_id) == (
        num_experts,
        7,
        42,
        "s-1",
    )
    assert header.checksum.startswith("crc32:")
    out = record.array()
    assert out.flags.writeable
    np.testing.assert_array_equal(out, arr)
    assert (path.stat().st_size - record.routes.nbytes) % 64 == 0  # payload starts on a 64-byte boundary


def test_empty_routes_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "e.r3r"
    write_file(path, encode(np.zeros((0, 4, 2), np.int32)), num_experts=8, policy_version=0, step=0, sample_id="e")
    assert read_file(path).array().shape == (0, 4, 2)


def test_write_rejects_ids_beyond_num_experts(tmp_path: Path) -> None:
    routes = encode(make_routes(5, 2, 4, 300))
    with pytest.raises(RoutingDataError, match="out of range"):
        write_file(tmp_path / "x.r3r", routes, num_experts=200, policy_version=0, step=0, sample_id="x")
    assert not list(tmp_path.iterdir())  # nothing, not even a temp file, reached the volume


@pytest.mark.parametrize("cut", [4, 15, 30, "payload"])
def test_truncated_file_names_the_file(tmp_path: Path, cut) -> None:
    path = tmp_path / "t.r3r"
    _write(path)
    data = path.read_bytes()
    keep = len(data) - 1 if cut == "payload" else cut
    path.write_bytes(data[:keep])
    with pytest.raises(RoutingFileError, match=r"t\.r3r.*(truncated|magic)"):
        read_file(path)


def test_trailing_bytes_rejected(tmp_path: Path) -> None:
    path = tmp_path / "t.r3r"
    _write(path)
    with open(path, "ab") as f:
        f.write(b"\0")
    with pytest.raises(RoutingFileError, match="trailing"):
        read_file(path)


def test_flipped_payload_bit_fails_checksum(tmp_path: Path) -> None:
    path = tmp_path / "f.r3r"
    _write(path)
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01
    path.write_bytes(data)
    with pytest.raises(RoutingFileError, match=r"f\.r3r: payload checksum mismatch"):
        read_file(path)
    assert read_file(path, verify=False).header.sample_id == "s-1"  # verify=False skips only the payload crc


def test_flipped_header_bit_fails_header_checksum(tmp_path: Path) -> None:
    path = tmp_path / "h.r3r"
    _write(path)
    data = bytearray(path.read_bytes())
    data[30] ^= 0x04  # inside the JSON header
    path.write_bytes(data)
    with pytest.raises(RoutingFileError, match="header checksum"):
        read_file(path, verify=False)


@pytest.mark.parametrize(
    "content",
    [b"\x89PNG\r\n\x1a\n" + b"\0" * 64, b"\x93NUMPY\x01\x00" + b"\0" * 64, b"", b"hello"],
)
def test_foreign_file_rejected(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "foreign.r3r"
    path.write_bytes(content)
    with pytest.raises(RoutingFileError, match=r"foreign\.r3r: not an R3 routing-data file"):
        read_file(path)


def test_newer_format_version_and_unknown_flags_rejected(tmp_path: Path) -> None:
    path = tmp_path / "v.r3r"
    _write(path)
    data = bytearray(path.read_bytes())
    struct.pack_into("<H", data, len(MAGIC), 2)  # 2 was a bit-packed "rank" payload; this reader refuses it
    path.write_bytes(data)
    with pytest.raises(RoutingFileError, match=r"unsupported format version 2 \(this reader supports \(1,\)\)"):
        read_file(path)
    struct.pack_into("<HH", data, len(MAGIC), 1, 1)
    path.write_bytes(data)
    with pytest.raises(RoutingFileError, match="unsupported flags"):
        read_file(path)


def test_missing_file_is_distinguishable(tmp_path: Path) -> None:
    with pytest.raises(RoutingFileMissingError, match="nope"):
        read_file(tmp_path / "nope.r3r")
    assert issubclass(RoutingFileMissingError, FileNotFoundError)


def test_store_layout_and_batch(tmp_path: Path) -> None:
    store = RoutingStore(tmp_path)
    arrays = {f"sample-{i}": make_routes(10 + i, 3, 2, 16, seed=i) for i in range(3)}
    for sid, arr in arrays.items():
        path = store.put(step=42, sample_id=sid, routes=encode(arr, num_experts=16), num_experts=16, policy_version=5)
        assert path == tmp_path / "steps" / "000042" / f"{sid}.r3r"
    records = store.get_batch(step=42, sample_ids=list(arrays))
    for record, (sid, arr) in zip(records, arrays.items(), strict=True):
        assert record.header.sample_id == sid
        np.testing.assert_array_equal(record.array(), arr)
    assert store.steps() == [42]
    assert store.sample_ids(step=42) == sorted(arrays)
    with pytest.raises(RoutingFileMissingError):
        store.get(step=42, sample_id="absent")


@pytest.mark.parametrize("bad", ["", "a/b", "../x", ".hidden", "x" * 201, "a\0b", "-flag"])
def test_unsafe_sample_ids_rejected(tmp_path: Path, bad: str) -> None:
    with pytest.raises(RoutingDataError, match="sample id"):
        RoutingStore(tmp_path).path_for(step=1, sample_id=bad)


def test_misplaced_file_detected(tmp_path: Path) -> None:
    store = RoutingStore(tmp_path)
    src = store.put(step=1, sample_id="a", routes=encode(make_routes(3, 2, 2, 8)), num_experts=8, policy_version=0)
    dst = store.path_for(step=1, sample_id="b")
    os.replace(src, dst)
    with pytest.raises(RoutingFileError, match="misplaced"):
        store.get(step=1, sample_id="b")


def test_gc_keeps_newest_steps_and_live_temp_files(tmp_path: Path) -> None:
    store = RoutingStore(tmp_path, durable=False)
    routes = encode(make_routes(3, 2, 2, 8))
    for step in (1, 2, 3, 10):
        for sid in ("a", "b"):
            store.put(step=step, sample_id=sid, routes=routes, num_experts=8, policy_version=step)
    live_tmp = store.step_dir(2) / ".a.r3r.tmp-999-live"
    live_tmp.write_bytes(b"partial")
    stale_tmp = store.step_dir(10) / ".b.r3r.tmp-998-dead"
    stale_tmp.write_bytes(b"partial")
    old = time.time() - 7200
    os.utime(stale_tmp, (old, old))
    with pytest.raises(ValueError, match="keep_last_steps"):
        store.gc(keep_last_steps=0)
    removed = store.gc(keep_last_steps=2)
    # steps 1 and 2 go (2 files each) except step 2's young temp file; the stale temp in kept step 10 goes.
    assert removed == 5
    assert store.steps() == [2, 3, 10]  # step 2's dir survives only because a live writer is in it
    assert live_tmp.exists() and not stale_tmp.exists()
    assert store.sample_ids(step=3) == ["a", "b"] and store.sample_ids(step=10) == ["a", "b"]
    assert store.gc(keep_last_steps=2, temp_max_age_s=0) == 1
    assert store.steps() == [3, 10]


def test_ids_out_of_range_are_refused_on_read(tmp_path: Path) -> None:
    """A writer that skipped validation (or a foreign one) stores ids >= num_experts with a valid checksum:
    the reader refuses them, naming the file, before any expert is gathered by them."""
    path = tmp_path / "wide.r3r"
    routes = encode(make_routes(5, 2, 4, 300))
    write_file(path, routes, num_experts=200, policy_version=0, step=0, sample_id="wide", validate=False)
    with pytest.raises(RoutingFileError, match=rf"{path}: expert id \d+ at .* out of range for num_experts=200"):
        read_file(path)
    within = tmp_path / "ok.r3r"
    write_file(within, routes, num_experts=300, policy_version=0, step=0, sample_id="ok")
    np.testing.assert_array_equal(read_file(within).array(), make_routes(5, 2, 4, 300))


@pytest.mark.parametrize(("err", "text"), [(errno.EACCES, "Permission denied"), (errno.EIO, "Input/output error")])
def test_unreadable_file_is_a_routing_file_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, err: int, text: str
) -> None:
    from r3operator.routing import RoutingFileUnreadableError, fileformat

    path = tmp_path / "s.r3r"
    _write(path)
    real_open = os.open

    def failing_open(p, flags, *args):  # root ignores chmod 000, so the OS error is injected at open
        if Path(p) == path:
            raise OSError(err, os.strerror(err), str(p))
        return real_open(p, flags, *args)

    monkeypatch.setattr(fileformat.os, "open", failing_open)
    with pytest.raises(RoutingFileUnreadableError, match=f"{path}: unreadable \\({text}\\)"):
        read_file(path)
    assert issubclass(RoutingFileUnreadableError, RoutingFileError)  # callers that drop bad files drop these too
