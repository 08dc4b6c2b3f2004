"""On-volume format and store for routing data (``.r3r`` files); see docs/routing-format.md.

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

Format version 2 is the same layout with header ``"encoding": "rank"``: the payload is the bit-packed
combinatorial rank of each (token, layer) row (``packing.py``), ``ceil(rows * rank_bits / 8)`` bytes. Raw
files are still written as version 1, byte for byte as before, so older readers keep reading them; older
readers reject version 2 explicitly instead of misreading it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import secrets
import shutil
import struct
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from r3operator.routing.codec import ROUTE_DTYPES, RoutedExperts, decode, routes_from_array, validate_routes
from r3operator.routing.errors import RoutingDataError, RoutingFileError, RoutingFileMissingError
from r3operator.routing.packing import decode_ranks, encode_ranks, rank_bits, rank_supported

MAGIC = b"\x89R3R\r\n\x1a\n"  # PNG-style: non-ASCII first byte, CRLF and ^Z catch text-mode mangling
FORMAT_VERSION = 1  # raw payload
FORMAT_VERSION_RANK = 2  # same layout, "rank" payload encoding named in the header
SUPPORTED_VERSIONS = (FORMAT_VERSION, FORMAT_VERSION_RANK)
Encoding = Literal["raw", "rank"]
ENCODINGS: tuple[str, ...] = ("raw", "rank")
SUFFIX = ".r3r"
_PREFIX = struct.Struct("<8sHHII")  # magic, format_version, flags, header_len, header_crc32
_ALIGN = 64  # payload offset alignment: lets readers mmap / O_DIRECT the payload and keeps SIMD loads aligned
_MAX_HEADER_LEN = 64 * 1024
_CHUNK_BYTES = 8 * 1024 * 1024  # write in bounded chunks: no giant single syscalls, no payload copy
_SAMPLE_ID_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._:=+@-]{0,199}")
_STEP_DIR_RE = re.compile(r"\d{6,}")
TEMP_MARKER = ".tmp-"


@dataclass(frozen=True)
class RoutingHeader:
    """Metadata of one routing-data file.

    ``checksum`` is ``"crc32:<8 hex>"``: zlib (IEEE 802.3) CRC-32 of the payload bytes as stored (packed
    for ``encoding="rank"``). ``payload_bytes`` is the stored payload length.
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
    encoding: str = "raw"
    payload_bytes: int = 0

    def to_json_dict(self) -> dict[str, Any]:
        extra: dict[str, Any] = {"encoding": self.encoding, "payload_bytes": self.payload_bytes}
        if self.encoding == "rank":
            extra["rank_bits"] = rank_bits(self.num_experts, self.shape[2])
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
            **extra,
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


def validate_sample_id(sample_id: str) -> str:
    if not isinstance(sample_id, str) or not _SAMPLE_ID_RE.fullmatch(sample_id):
        raise RoutingDataError(
            f"sample id {sample_id!r} must be 1-200 chars of [A-Za-z0-9._:=+@-], not starting with '.' or '-'"
        )
    return sample_id


def _header_bytes(header: RoutingHeader) -> bytes:
    body = header.to_json_dict()
    del body["format_version"]  # lives in the fixed prefix; one source of truth
    del body["payload_bytes"]  # implied by shape/dtype (raw) or shape/num_experts (rank)
    if header.encoding == "raw":  # version-1 files stay byte-identical to what older writers produced
        del body["encoding"]
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8")


def _payload_offset(header_len: int) -> int:
    return -(-(_PREFIX.size + header_len) // _ALIGN) * _ALIGN


def _write_all(fd: int, data: memoryview) -> None:
    for begin in range(0, data.nbytes, _CHUNK_BYTES):
        chunk = data[begin : begin + _CHUNK_BYTES]
        while chunk.nbytes:
            written = os.write(fd, chunk)
            chunk = chunk[written:]


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(
    path: Path,
    routes: RoutedExperts,
    *,
    num_experts: int,
    policy_version: int,
    step: int,
    sample_id: str,
    durable: bool = True,
    validate: bool = True,
    encoding: Encoding = "raw",
) -> str:
    """Atomically write ``routes`` to ``path``: temp file in the same dir, fsync, ``os.replace``, fsync dir.

    Readers see either the previous complete file or the new complete file, never a partial one. With
    ``durable=False`` the fsyncs are skipped (still atomic for concurrent readers, not against power loss).
    ``validate`` checks ids against ``num_experts`` so bad data never reaches the volume.

    ``encoding="rank"`` stores each row as its bit-packed combinatorial rank (format version 2; rows read
    back sorted). When C(num_experts, top_k) is too large for it, the file is written raw instead. Returns
    the encoding actually written.
    """
    path = Path(path)
    validate_sample_id(sample_id)
    for name, value in (("num_experts", num_experts), ("policy_version", policy_version), ("step", step)):
        if not isinstance(value, int) or value < 0 or (name == "num_experts" and value == 0):
            raise RoutingDataError(f"{name} must be a {'positive' if name == 'num_experts' else 'non-negative'} int")
    if encoding not in ENCODINGS:
        raise RoutingDataError(f"encoding must be one of {ENCODINGS}, got {encoding!r}")
    if validate:
        validate_routes(decode(routes, validate=False), num_experts=num_experts)
    if encoding == "rank" and not rank_supported(num_experts, routes.top_k):
        encoding = "raw"  # documented fallback: C(E, k) >= 2**63 (or k > E) cannot be rank-encoded
    if encoding == "rank":
        # encode_ranks re-checks range and distinctness itself, so even validate=False cannot store a payload
        # that decodes to different routes.
        payload = memoryview(encode_ranks(decode(routes, validate=False), num_experts=num_experts))
    else:
        payload = memoryview(routes.data)  # the raw little-endian bytes, written as they are (no copy)
        if payload.ndim != 1 or payload.format != "B":
            payload = payload.cast("B")
    header = RoutingHeader(
        format_version=FORMAT_VERSION_RANK if encoding == "rank" else FORMAT_VERSION,
        shape=routes.shape,
        dtype=routes.dtype,
        start=routes.start,
        num_experts=num_experts,
        policy_version=policy_version,
        step=step,
        sample_id=sample_id,
        checksum=payload_checksum(payload),
        encoding=encoding,
        payload_bytes=payload.nbytes,
    )
    head = _header_bytes(header)
    prefix = _PREFIX.pack(MAGIC, header.format_version, 0, len(head), zlib.crc32(head) & 0xFFFFFFFF)
    padding = b"\0" * (_payload_offset(len(head)) - _PREFIX.size - len(head))
    tmp = path.with_name(f".{path.name}{TEMP_MARKER}{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        try:
            _write_all(fd, memoryview(prefix + head + padding))
            _write_all(fd, payload)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    if durable:
        _fsync_dir(path.parent)
    return encoding


def _fail(path: Path, why: str) -> RoutingFileError:
    return RoutingFileError(f"{path}: {why}")


def _payload_nbytes(path: Path, header: RoutingHeader) -> int:
    if header.encoding == "raw":
        return math.prod(header.shape) * np.dtype(header.dtype).itemsize
    try:
        return math.ceil(math.prod(header.shape[:2]) * rank_bits(header.num_experts, header.shape[2]) / 8)
    except RoutingDataError as exc:
        raise _fail(path, f"header describes a rank payload that cannot exist ({exc})") from exc


def _parse_encoding(path: Path, body: dict[str, Any], version: int) -> str:
    encoding = body.get("encoding", "raw" if version == FORMAT_VERSION else None)
    if version == FORMAT_VERSION and encoding != "raw":
        raise _fail(path, f"format version 1 holds raw payloads only, header says encoding {encoding!r}")
    if encoding not in ENCODINGS:
        raise _fail(path, f"header encoding {encoding!r} is not one of {ENCODINGS}")
    return encoding


def _parse_header(path: Path, raw: bytes, version: int) -> RoutingHeader:
    try:
        body = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _fail(path, f"header is not valid JSON ({exc})") from exc
    if not isinstance(body, dict):
        raise _fail(path, "header is not a JSON object")
    try:
        shape = body["shape"]
        if not (isinstance(shape, list) and len(shape) == 3 and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise _fail(path, f"header shape {shape!r} is not 3 non-negative ints")
        if body["dtype"] not in ROUTE_DTYPES:
            raise _fail(path, f"header dtype {body['dtype']!r} is not one of {ROUTE_DTYPES}")
        ints = {k: body[k] for k in ("start", "num_experts", "policy_version", "step")}
        bad = [k for k, v in ints.items() if not isinstance(v, int) or isinstance(v, bool) or v < 0]
        if bad:
            raise _fail(path, f"header field(s) {bad} are not non-negative ints")
        if not isinstance(body["sample_id"], str) or not isinstance(body["checksum"], str):
            raise _fail(path, "header sample_id/checksum are not strings")
        header = RoutingHeader(
            format_version=version,
            shape=(shape[0], shape[1], shape[2]),
            dtype=body["dtype"],
            sample_id=body["sample_id"],
            checksum=body["checksum"],
            encoding=_parse_encoding(path, body, version),
            **ints,
        )
    except KeyError as exc:
        raise _fail(path, f"header lacks field {exc.args[0]!r}") from exc
    payload_bytes = _payload_nbytes(path, header)
    if header.encoding == "rank" and body.get("rank_bits") != rank_bits(header.num_experts, header.shape[2]):
        raise _fail(path, f"header rank_bits {body.get('rank_bits')!r} does not match num_experts and top_k")
    return dataclasses.replace(header, payload_bytes=payload_bytes)


def read_stored(path: Path) -> tuple[RoutingHeader, memoryview]:
    """The header and the payload bytes **as stored** (packed for ``encoding="rank"``), unverified.

    Checks magic, version, flags, header CRC and exact file size; raises :class:`RoutingFileError` naming the
    file otherwise (:class:`RoutingFileMissingError` when it does not exist).
    """
    path = Path(path)
    try:
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            fixed = f.read(_PREFIX.size)
            if len(fixed) < len(MAGIC) or fixed[: len(MAGIC)] != MAGIC:
                raise _fail(path, "not an R3 routing-data file (bad magic)")
            if len(fixed) < _PREFIX.size:
                raise _fail(path, f"truncated: {size} bytes, shorter than the {_PREFIX.size}-byte prefix")
            _, version, flags, header_len, header_crc = _PREFIX.unpack(fixed)
            if version not in SUPPORTED_VERSIONS:
                raise _fail(path, f"unsupported format version {version} (this reader supports {SUPPORTED_VERSIONS})")
            if flags:
                raise _fail(path, f"unsupported flags 0x{flags:04x} for format version {version}")
            if header_len > _MAX_HEADER_LEN:
                raise _fail(path, f"header length {header_len} exceeds {_MAX_HEADER_LEN}")
            raw_header = f.read(header_len)
            if len(raw_header) < header_len:
                raise _fail(path, f"truncated inside the header ({size} bytes)")
            if zlib.crc32(raw_header) & 0xFFFFFFFF != header_crc:
                raise _fail(path, "header checksum mismatch (corrupt header)")
            header = _parse_header(path, raw_header, version)
            offset = _payload_offset(header_len)
            nbytes = header.payload_bytes
            if size < offset + nbytes:
                raise _fail(path, f"truncated: {size} bytes, expected {offset + nbytes}")
            if size > offset + nbytes:
                raise _fail(path, f"{size - offset - nbytes} unexpected trailing bytes (expected {offset + nbytes})")
            f.seek(offset)
            # np.empty, not bytearray(n): skips zero-filling memory that readinto overwrites anyway. The
            # memoryview is writable, so decode() stays zero-copy.
            data = memoryview(np.empty(nbytes, dtype=np.uint8))
            view = data
            filled = 0
            while filled < nbytes:
                got = f.readinto(view[filled:])
                if not got:
                    raise _fail(path, f"truncated while reading payload at byte {offset + filled}")
                filled += got
    except FileNotFoundError as exc:
        raise RoutingFileMissingError(f"{path}: no such routing-data file") from exc
    except IsADirectoryError as exc:
        raise _fail(path, "is a directory") from exc
    return header, data


def read_file(path: Path, *, verify: bool = True) -> RoutingRecord:
    """Read one file. Raises :class:`RoutingFileError` naming the file on bad magic, unsupported version or
    flags, header damage, truncation / trailing bytes, (with ``verify``) a payload checksum mismatch, or a
    rank payload holding an invalid code. Rank payloads are decoded transparently (rows come back sorted)."""
    path = Path(path)
    header, data = read_stored(path)
    if verify and payload_checksum(data) != header.checksum:
        raise _fail(path, f"payload checksum mismatch (header {header.checksum}, data {payload_checksum(data)})")
    try:
        if header.encoding == "rank":
            array = decode_ranks(data, header.shape, header.dtype, num_experts=header.num_experts)
            routes = routes_from_array(array, start=header.start)
        else:
            routes = RoutedExperts(data=data, shape=header.shape, dtype=header.dtype, start=header.start)
    except RoutingDataError as exc:
        raise _fail(path, str(exc)) from exc
    return RoutingRecord(header=header, routes=routes)


class RoutingStore:
    """Routing data on a shared volume: ``root/steps/<step, 6+ digits>/<sample id>.r3r``.

    Many writers (inference pods) and readers (trainer ranks) may use one store concurrently: every file is
    published by an atomic rename, so a reader sees a complete file or none.
    """

    def __init__(self, root: Path, *, durable: bool = True) -> None:
        self.root = Path(root)
        self.durable = durable

    @property
    def steps_dir(self) -> Path:
        return self.root / "steps"

    def step_dir(self, step: int) -> Path:
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise RoutingDataError(f"step must be a non-negative int, got {step!r}")
        return self.steps_dir / f"{step:06d}"

    def path_for(self, *, step: int, sample_id: str) -> Path:
        return self.step_dir(step) / f"{validate_sample_id(sample_id)}{SUFFIX}"

    def put(
        self,
        *,
        step: int,
        sample_id: str,
        routes: RoutedExperts,
        num_experts: int,
        policy_version: int,
        encoding: Encoding = "raw",
    ) -> Path:
        """Publish one sample atomically; ``encoding="rank"`` stores the compact rank payload (see
        :func:`write_file`, including its raw fallback)."""
        path = self.path_for(step=step, sample_id=sample_id)
        if not path.parent.is_dir():
            path.parent.mkdir(parents=True, exist_ok=True)
            if self.durable:  # make the new step directory itself survive a crash
                _fsync_dir(path.parent.parent)
        write_file(
            path,
            routes,
            num_experts=num_experts,
            policy_version=policy_version,
            step=step,
            sample_id=sample_id,
            durable=self.durable,
            encoding=encoding,
        )
        return path

    def get(self, *, step: int, sample_id: str, verify: bool = True) -> RoutingRecord:
        path = self.path_for(step=step, sample_id=sample_id)
        record = read_file(path, verify=verify)
        if record.header.step != step or record.header.sample_id != sample_id:
            raise _fail(
                path,
                f"holds step {record.header.step} sample {record.header.sample_id!r}, "
                f"expected step {step} sample {sample_id!r} (misplaced file)",
            )
        return record

    def get_batch(self, *, step: int, sample_ids: Sequence[str], verify: bool = True) -> list[RoutingRecord]:
        return [self.get(step=step, sample_id=sample_id, verify=verify) for sample_id in sample_ids]

    def sample_ids(self, *, step: int) -> list[str]:
        """Sample ids with a published file in ``step`` (temp files of writers are not listed)."""
        directory = self.step_dir(step)
        if not directory.is_dir():
            return []
        return sorted(
            p.name[: -len(SUFFIX)]
            for p in directory.iterdir()
            if p.name.endswith(SUFFIX) and not p.name.startswith(".")
        )

    def steps(self) -> list[int]:
        if not self.steps_dir.is_dir():
            return []
        return sorted(int(p.name) for p in self.steps_dir.iterdir() if _STEP_DIR_RE.fullmatch(p.name) and p.is_dir())

    def gc(self, *, keep_last_steps: int, temp_max_age_s: float = 3600.0) -> int:
        """Delete all steps but the newest ``keep_last_steps``; also delete writers' temp files older than
        ``temp_max_age_s`` (left by crashed writers). Returns the number of files removed.

        Temp files younger than ``temp_max_age_s`` belong to live writers and are never touched; a step
        directory holding one is kept until a later gc.
        """
        if not isinstance(keep_last_steps, int) or keep_last_steps < 1:
            raise ValueError(f"keep_last_steps must be an int >= 1 (newest step always kept), got {keep_last_steps!r}")
        steps = self.steps()
        keep = set(steps[-keep_last_steps:])
        now = time.time()
        removed = 0
        for step in steps:
            directory = self.step_dir(step)
            live_writer = False
            try:
                entries = list(directory.iterdir())
            except FileNotFoundError:  # another gc got there first
                continue
            for entry in entries:
                is_temp = TEMP_MARKER in entry.name and entry.name.startswith(".")
                if step in keep and not is_temp:
                    continue
                if is_temp:
                    try:
                        age = now - entry.stat().st_mtime
                    except FileNotFoundError:  # its writer renamed or removed it meanwhile
                        continue
                    if age < temp_max_age_s:
                        live_writer = True
                        continue
                if entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)
                    continue
                with contextlib.suppress(FileNotFoundError):
                    entry.unlink()
                    removed += 1
            if step not in keep and not live_writer:
                with contextlib.suppress(OSError):  # not empty: a writer published meanwhile; next gc
                    directory.rmdir()
        return removed
