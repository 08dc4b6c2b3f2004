"""On-volume store for routing data (``.r3r`` files): atomic writes, layout, retention.

The file format itself (header, checksums, reading) is in ``fileformat.py``; see docs/routing-format.md.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import time
import zlib
from collections.abc import Sequence
from pathlib import Path

from r3operator.routing.codec import RoutedExperts, decode, validate_routes
from r3operator.routing.errors import RoutingDataError
from r3operator.routing.fileformat import (  # re-exported: callers import the format's names from here
    FORMAT_VERSION,
    MAGIC,
    PREFIX,
    SUPPORTED_VERSIONS,
    RoutingHeader,
    RoutingRecord,
    fail,
    header_bytes,
    payload_checksum,
    payload_offset,
    read_file,
    read_stored,
)

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "SUFFIX",
    "SUPPORTED_VERSIONS",
    "TEMP_MARKER",
    "RoutingHeader",
    "RoutingRecord",
    "RoutingStore",
    "payload_checksum",
    "read_file",
    "read_stored",
    "validate_sample_id",
    "write_file",
]

SUFFIX = ".r3r"
_CHUNK_BYTES = 8 * 1024 * 1024  # write in bounded chunks: no giant single syscalls, no payload copy
_SAMPLE_ID_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._:=+@-]{0,199}")
_STEP_DIR_RE = re.compile(r"\d{6,}")
TEMP_MARKER = ".tmp-"


def validate_sample_id(sample_id: str) -> str:
    if not isinstance(sample_id, str) or not _SAMPLE_ID_RE.fullmatch(sample_id):
        raise RoutingDataError(
            f"sample id {sample_id!r} must be 1-200 chars of [A-Za-z0-9._:=+@-], not starting with '.' or '-'"
        )
    return sample_id


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
) -> None:
    """Atomically write ``routes`` to ``path``: temp file in the same dir, fsync, ``os.replace``, fsync dir.

    Readers see either the previous complete file or the new complete file, never a partial one. With
    ``durable=False`` the fsyncs are skipped (still atomic for concurrent readers, not against power loss).
    ``validate`` checks ids against ``num_experts`` so bad data never reaches the volume.
    """
    path = Path(path)
    validate_sample_id(sample_id)
    for name, value in (("num_experts", num_experts), ("policy_version", policy_version), ("step", step)):
        if not isinstance(value, int) or value < 0 or (name == "num_experts" and value == 0):
            raise RoutingDataError(f"{name} must be a {'positive' if name == 'num_experts' else 'non-negative'} int")
    if validate:
        validate_routes(decode(routes, validate=False), num_experts=num_experts)
    payload = memoryview(routes.data)  # the raw little-endian bytes, written as they are (no copy)
    if payload.ndim != 1 or payload.format != "B":
        payload = payload.cast("B")
    header = RoutingHeader(
        format_version=FORMAT_VERSION,
        shape=routes.shape,
        dtype=routes.dtype,
        start=routes.start,
        num_experts=num_experts,
        policy_version=policy_version,
        step=step,
        sample_id=sample_id,
        checksum=payload_checksum(payload),
        payload_bytes=payload.nbytes,
    )
    head = header_bytes(header)
    prefix = PREFIX.pack(MAGIC, header.format_version, 0, len(head), zlib.crc32(head) & 0xFFFFFFFF)
    padding = b"\0" * (payload_offset(len(head)) - PREFIX.size - len(head))
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
    ) -> Path:
        """Publish one sample atomically (see :func:`write_file`)."""
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
        )
        return path

    def get(self, *, step: int, sample_id: str, verify: bool = True) -> RoutingRecord:
        path = self.path_for(step=step, sample_id=sample_id)
        record = read_file(path, verify=verify)
        if record.header.step != step or record.header.sample_id != sample_id:
            raise fail(
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
