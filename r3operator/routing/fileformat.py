"""The ``.r3r`` file format: header, checksums, and the read side; see docs/routing-format.md.

Layout of one file (all integers little-endian)::

    0   8  magic            b"\\x89R3R\\r\\n\\x1a\\n"
    8   2  format_version   uint16 (1)
    10  2  flags            uint16 (0; non-zero = a feature this reader lacks)
    12  4  header_len       uint32 N
    16  4  header_crc32     uint32, zlib.crc32 of the N header bytes
    20  N  header           UTF-8 JSON object (compact, sorted keys)
    ..     zero padding to the next multiple of 64 bytes (= payload offset)
    ..     payload          prod(shape) * itemsize bytes, C order, little-endian; crc32 in header["checksum"]

The file size must equal payload offset + payload length exactly, so truncation and trailing garbage are
both detected before any checksum is computed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import stat
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from r3operator.routing.codec import ROUTE_DTYPES, RoutedExperts, check_id_range, decode
from r3operator.routing.errors import (
    RoutingDataError,
    RoutingFileError,
    RoutingFileMissingError,
    RoutingFileUnreadableError,
)

MAGIC = b"\x89R3R\r\n\x1a\n"  # PNG-style: non-ASCII first byte, CRLF and ^Z catch text-mode mangling
FORMAT_VERSION = 1
SUPPORTED_VERSIONS = (FORMAT_VERSION,)
PREFIX = struct.Struct("<8sHHII")  # magic, format_version, flags, header_len, header_crc32
_ALIGN = 64  # payload offset alignment: lets readers mmap / O_DIRECT the payload and keeps SIMD loads aligned
_MAX_HEADER_LEN = 64 * 1024


@dataclass(frozen=True)
class RoutingHeader:
    """Metadata of one routing-data file.

    ``checksum`` is ``"crc32:<8 hex>"``: zlib (IEEE 802.3) CRC-32 of the payload bytes. ``payload_bytes``
    is the payload length (implied by shape and dtype; not stored in the header).
    """

    format_version: int
    shape: tuple[int, int, int]
    dtype: str
    start: int
    num_experts: int
    policy_version: int
    step: int
    sample_id: str
    checksum: str
    payload_bytes: int = 0

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "start": self.start,
            "num_experts": self.num_experts,
            "policy_version": self.policy_version,
            "step": self.step,
            "sample_id": self.sample_id,
            "checksum": self.checksum,
            "payload_bytes": self.payload_bytes,
        }


@dataclass(frozen=True)
class RoutingRecord:
    header: RoutingHeader
    routes: RoutedExperts

    def array(self) -> np.ndarray:
        """Writable, zero-copy view of the payload (the record owns a writable buffer)."""
        return decode(self.routes, validate=False)


def payload_checksum(data: bytes | bytearray | memoryview) -> str:
    return f"crc32:{zlib.crc32(data) & 0xFFFFFFFF:08x}"


def header_bytes(header: RoutingHeader) -> bytes:
    body = header.to_json_dict()
    del body["format_version"]  # lives in the fixed prefix; one source of truth
    del body["payload_bytes"]  # implied by shape and dtype
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8")


def payload_offset(header_len: int) -> int:
    return -(-(PREFIX.size + header_len) // _ALIGN) * _ALIGN


def fail(path: Path, why: str) -> RoutingFileError:
    return RoutingFileError(f"{path}: {why}")


def _payload_nbytes(header: RoutingHeader) -> int:
    return math.prod(header.shape) * np.dtype(header.dtype).itemsize


def _parse_header(path: Path, raw: bytes, version: int) -> RoutingHeader:
    try:
        body = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise fail(path, f"header is not valid JSON ({exc})") from exc
    if not isinstance(body, dict):
        raise fail(path, "header is not a JSON object")
    try:
        shape = body["shape"]
        if not (isinstance(shape, list) and len(shape) == 3 and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise fail(path, f"header shape {shape!r} is not 3 non-negative ints")
        if body["dtype"] not in ROUTE_DTYPES:
            raise fail(path, f"header dtype {body['dtype']!r} is not one of {ROUTE_DTYPES}")
        ints = {k: body[k] for k in ("start", "num_experts", "policy_version", "step")}
        bad = [k for k, v in ints.items() if not isinstance(v, int) or isinstance(v, bool) or v < 0]
        if bad:
            raise fail(path, f"header field(s) {bad} are not non-negative ints")
        if not isinstance(body["sample_id"], str) or not isinstance(body["checksum"], str):
            raise fail(path, "header sample_id/checksum are not strings")
        header = RoutingHeader(
            format_version=version,
            shape=(shape[0], shape[1], shape[2]),
            dtype=body["dtype"],
            sample_id=body["sample_id"],
            checksum=body["checksum"],
            **ints,
        )
    except KeyError as exc:
        raise fail(path, f"header lacks field {exc.args[0]!r}") from exc
    return dataclasses.replace(header, payload_bytes=_payload_nbytes(header))


def read_stored(path: Path) -> tuple[RoutingHeader, memoryview]:
    """The header and the payload bytes, unverified.

    Checks magic, version, flags, header CRC and exact file size; raises :class:`RoutingFileError` naming the
    file otherwise (:class:`RoutingFileMissingError` when it does not exist).
    """
    path = Path(path)
    try:
        with _open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            fixed = f.read(PREFIX.size)
            if len(fixed) < len(MAGIC) or fixed[: len(MAGIC)] != MAGIC:
                raise fail(path, "not an R3 routing-data file (bad magic)")
            if len(fixed) < PREFIX.size:
                raise fail(path, f"truncated: {size} bytes, shorter than the {PREFIX.size}-byte prefix")
            _, version, flags, header_len, header_crc = PREFIX.unpack(fixed)
            if version not in SUPPORTED_VERSIONS:
                raise fail(path, f"unsupported format version {version} (this reader supports {SUPPORTED_VERSIONS})")
            if flags:
                raise fail(path, f"unsupported flags 0x{flags:04x} for format version {version}")
            if header_len > _MAX_HEADER_LEN:
                raise fail(path, f"header length {header_len} exceeds {_MAX_HEADER_LEN}")
            raw_header = f.read(header_len)
            if len(raw_header) < header_len:
                raise fail(path, f"truncated inside the header ({size} bytes)")
            if zlib.crc32(raw_header) & 0xFFFFFFFF != header_crc:
                raise fail(path, "header checksum mismatch (corrupt header)")
            header = _parse_header(path, raw_header, version)
            offset = payload_offset(header_len)
            nbytes = header.payload_bytes
            if size < offset + nbytes:
                raise fail(path, f"truncated: {size} bytes, expected {offset + nbytes}")
            if size > offset + nbytes:
                raise fail(path, f"{size - offset - nbytes} unexpected trailing bytes (expected {offset + nbytes})")
            f.seek(offset)
            # np.empty, not bytearray(n): skips zero-filling memory that readinto overwrites anyway. The
            # memoryview is writable, so decode() stays zero-copy.
            data = np.empty(nbytes, dtype=np.uint8).data
            view = data
            filled = 0
            while filled < nbytes:
                got = f.readinto(view[filled:])
                if not got:
                    raise fail(path, f"truncated while reading payload at byte {offset + filled}")
                filled += got
    except FileNotFoundError as exc:
        raise RoutingFileMissingError(f"{path}: no such routing-data file") from exc
    except IsADirectoryError as exc:
        raise fail(path, "is a directory") from exc
    except OSError as exc:  # EACCES, EIO, ...: the file is there but this reader cannot have its bytes
        raise RoutingFileUnreadableError(f"{path}: unreadable ({exc.strerror or exc})") from exc
    return header, data


def _open_regular(path: Path) -> Any:
    """Open for reading, refusing anything but a regular file.

    O_NONBLOCK makes opening a FIFO return at once instead of waiting for a writer (it has no effect on a
    regular file's reads), so the type check below runs on what was actually opened, without a race.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(f"{path} is a directory")
        if not stat.S_ISREG(mode):
            raise RoutingFileUnreadableError(f"{path}: not a regular file ({_file_kind(mode)})")
        return os.fdopen(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise


def _file_kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return kind
    return f"mode 0o{stat.S_IFMT(mode):o}"


def read_file(path: Path, *, verify: bool = True) -> RoutingRecord:
    """Read one file. Raises :class:`RoutingFileError` naming the file on bad magic, unsupported version or
    flags, header damage, truncation / trailing bytes, or (with ``verify``) a payload checksum mismatch."""
    path = Path(path)
    header, data = read_stored(path)
    if verify and payload_checksum(data) != header.checksum:
        raise fail(path, f"payload checksum mismatch (header {header.checksum}, data {payload_checksum(data)})")
    try:
        routes = RoutedExperts(data=data, shape=header.shape, dtype=header.dtype, start=header.start)
        # The checksum proves the bytes are what the writer wrote, not that the writer validated them:
        # ids must lie below the header's num_experts before anything gathers experts by them.
        check_id_range(decode(routes, validate=False), num_experts=header.num_experts)
    except RoutingDataError as exc:
        raise fail(path, str(exc)) from exc
    return RoutingRecord(header=header, routes=routes)
