"""Fetch an hf://, s3:// or gs:// source into ``<root>/<cache key>`` once, and verify a fetched copy: the I/O half of
the one resolver (api/sources.py parses). ``r3operator fetch`` runs it in the model-fetch Job and the dataset
init container, the engines' and trainer's ``verify-model`` init containers run ``r3operator fetch --verify``,
and the driver calls it for a local run, so every reader sees one layout and one readiness test.

A copy is complete or absent, never half there: files go to a hidden sibling directory, the ready marker
(every file's size and sha256, and a digest of the marker itself) is written into it last, and one
``rename`` makes it the cache directory. Readers only accept a directory whose marker checks out, so a
fetch killed halfway, a full disk or two fetches racing into one shared cache never serve a partial model.

Credentials come from the environment only, the way each client library reads them: ``HF_TOKEN`` for the
Hub, ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN`` for S3 (the operator sets them
from Secrets with ``secretKeyRef``). Nothing here prints or records them.

gs:// goes through Google Cloud Storage's XML API, which speaks the S3 protocol to an HMAC key (Google's
"simple migration from Amazon S3"): the same boto3 code with the endpoint https://storage.googleapis.com,
the HMAC access ID and secret as the AWS variables, SigV4 with region ``auto``, and checksums only where
an operation requires them (boto3 >= 1.36 otherwise adds ``x-amz-checksum-*`` headers other stores refuse).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from r3operator.api.sources import SourceURI, parse_source_uri

log = logging.getLogger("r3operator.fetch")

READY_FILE = ".r3operator-ready.json"
"""The marker inside a complete copy; the directory has no other file of ours."""
MARKER_VERSION = 1
_CHUNK = 8 << 20


class SourceNotReady(Exception):
    """A cache directory that is missing, half written or changed since its fetch; the message says which."""


class FetchError(Exception):
    """A fetch that could not complete (nothing found under the URI, a refused request); names the URI."""


GCS_ENDPOINT = "https://storage.googleapis.com"
GCS_REGION = "auto"
"""What Cloud Storage's XML API accepts as the SigV4 region whatever the bucket's location."""


@dataclass(frozen=True, slots=True)
class S3Options:
    endpoint_url: str | None = None
    """An S3-compatible store; None: AWS S3 (or ``AWS_ENDPOINT_URL`` from the environment); for gs://,
    Cloud Storage's XML API (GCS_ENDPOINT)."""
    region: str | None = None


def _store_options(source: SourceURI, options: S3Options) -> tuple[S3Options, bool]:
    """The endpoint and region to use for ``source``, and whether checksums go only where required."""
    if source.scheme == "gs":
        return S3Options(options.endpoint_url or GCS_ENDPOINT, options.region or GCS_REGION), True
    return options, False


@dataclass(frozen=True, slots=True)
class Fetched:
    path: Path
    """What readers open: the directory, or the one file an s3:// URI named."""
    directory: Path
    """The cache directory (``<root>/<cache key>``), holding the marker."""
    files: int
    bytes: int


def target_directory(source: SourceURI, root: Path) -> Path:
    return root / source.cache_key


def fetch(
    uri: str, root: Path, *, revision: str | None = None, s3: S3Options | None = None, checksums: bool = False
) -> Fetched:
    """Fill ``<root>/<cache key>`` from ``uri`` unless a verified copy is there already.

    ``checksums``: re-read every file of an existing copy against its sha256 (slow for large models);
    otherwise an existing copy is checked by the marker and the file sizes.
    """
    source = parse_source_uri(uri, revision=revision)
    target = target_directory(source, root)
    try:
        return verify(target, checksums=checksums)
    except SourceNotReady as why:
        log.info("fetching %s into %s (%s)", uri, target, why)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.parent / f".{target.name}.partial-{uuid.uuid4().hex[:12]}"
    started = time.monotonic()
    try:
        partial.mkdir()
        if source.scheme == "hf":
            entry = _fetch_hf(source, partial)
        elif source.scheme in ("s3", "gs"):
            entry = _fetch_s3(source, partial, s3 or S3Options())
        else:
            raise FetchError(f"{uri}: {source.scheme}:// is not fetched (only hf://, s3:// and gs:// are)")
        marker = _write_marker(partial, uri=uri, source=source, entry=entry)
        _publish(partial, target, checksums=checksums)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    done = verify(target)
    log.info(
        "fetched %s: %d files, %.2f GB in %.1f s",
        uri,
        len(marker["files"]),
        done.bytes / 1e9,
        time.monotonic() - started,
    )
    return done


def verify(directory: Path, *, checksums: bool = False) -> Fetched:
    """The copy in ``directory`` as its marker describes it; SourceNotReady if it is not complete."""
    marker_path = directory / READY_FILE
    if not marker_path.is_file():
        what = "has no ready marker (a fetch is running, failed or never ran)" if directory.is_dir() else "is absent"
        raise SourceNotReady(f"{directory} {what}")
    try:
        marker = json.loads(marker_path.read_text())
        body = {k: v for k, v in marker.items() if k != "digest"}
        intact = marker.get("digest") == _digest(body)
    except (ValueError, AttributeError):
        intact = False
    if not intact:
        raise SourceNotReady(f"{marker_path} is damaged (its digest does not match its content)")
    total = 0
    for rel, facts in marker["files"].items():
        path = directory / rel
        if not path.is_file():
            raise SourceNotReady(f"{path} is listed in {READY_FILE} but missing")
        size = path.stat().st_size
        if size != facts["size"]:
            raise SourceNotReady(f"{path} has {size} bytes, {READY_FILE} says {facts['size']}")
        if checksums and file_sha256(path) != facts["sha256"]:
            raise SourceNotReady(f"{path} does not match its sha256 in {READY_FILE}")
        total += size
    entry = directory / marker["entry"] if marker["entry"] != "." else directory
    return Fetched(path=entry, directory=directory, files=len(marker["files"]), bytes=total)


def _fetch_hf(source: SourceURI, dest: Path) -> str:
    # Imported here: the engine image's verify step needs neither client.
    from huggingface_hub import snapshot_download

    try:
        snapshot_download(source.location, revision=source.revision, local_dir=dest)
    except Exception as exc:  # the Hub client raises a dozen types; all end the fetch the same way
        raise FetchError(f"hf://{source.location} (revision {source.revision or 'default'}): {exc}") from exc
    # huggingface_hub's download bookkeeping for local_dir, not part of the model.
    shutil.rmtree(dest / ".cache", ignore_errors=True)
    return "."


def s3_client(
    source: SourceURI,
    options: S3Options,
    *,
    attempts: int = 10,
    credentials: tuple[str, str, str | None] | None = None,
    timeout_s: float | None = None,
) -> Any:
    """A boto3 S3 client for the store of ``source`` (s3:// or gs://, see the module docstring). ``attempts``: the
    client's own tries of one request; ``credentials``: (access key, secret key, session token) to use instead of
    the environment's; ``timeout_s``: connect and read timeouts (None: botocore's)."""
    import boto3
    from botocore.config import Config

    options, only_required_checksums = _store_options(source, options)
    config = Config(retries={"max_attempts": attempts, "mode": "standard"})
    if timeout_s is not None:
        config = config.merge(Config(connect_timeout=timeout_s, read_timeout=timeout_s))
    if only_required_checksums:
        config = config.merge(
            Config(request_checksum_calculation="when_required", response_checksum_validation="when_required")
        )
    keys: dict[str, Any] = {}
    if credentials is not None:
        keys = {
            "aws_access_key_id": credentials[0],
            "aws_secret_access_key": credentials[1],
            "aws_session_token": credentials[2],
        }
    # A session of its own: boto3's default session keeps the credentials it resolved first, and a fetch must
    # use the environment it runs with.
    return boto3.session.Session(**keys).client(
        "s3", endpoint_url=options.endpoint_url, region_name=options.region, config=config
    )


def _fetch_s3(source: SourceURI, dest: Path, options: S3Options) -> str:
    from botocore.exceptions import BotoCoreError, ClientError

    uri = f"{source.scheme}://{source.location}/{source.path}"
    client = s3_client(source, options)
    prefix = source.path
    try:
        keys = [
            obj["Key"]
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=source.location, Prefix=prefix)
            for obj in page.get("Contents", [])
        ]
        under = [k for k in keys if not prefix or k.startswith(prefix + "/")]
        files = [k for k in under if not k.endswith("/")]  # "folder" placeholder objects hold nothing
        if files:
            for key in files:
                client.download_file(source.location, key, str(_inside(dest, key[len(prefix) :].lstrip("/"), uri)))
            return "."
        if prefix in keys:
            name = prefix.rsplit("/", 1)[-1]
            client.download_file(source.location, prefix, str(_inside(dest, name, uri)))
            return name
    except (BotoCoreError, ClientError) as exc:
        raise FetchError(f"{uri}: {exc}") from exc
    raise FetchError(f"{uri}: no objects under this prefix")


def _inside(dest: Path, rel: str, uri: str) -> Path:
    path = (dest / rel).resolve()
    if not path.is_relative_to(dest.resolve()) or not rel:
        raise FetchError(f"{uri}: object key {rel!r} would be written outside the cache directory")
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _write_marker(directory: Path, *, uri: str, source: SourceURI, entry: str) -> dict[str, Any]:
    files = {
        str(p.relative_to(directory)): {"size": p.stat().st_size, "sha256": file_sha256(p)}
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }
    if not files:
        raise FetchError(f"{uri}: the fetch wrote no files")
    body = {"version": MARKER_VERSION, "uri": uri, "revision": source.revision, "entry": entry, "files": files}
    marker = {**body, "digest": _digest(body)}
    tmp = directory / (READY_FILE + ".tmp")
    tmp.write_text(json.dumps(marker, indent=1, sort_keys=True))
    os.replace(tmp, directory / READY_FILE)
    return marker


def _publish(partial: Path, target: Path, *, checksums: bool) -> None:
    """Move the complete copy into place; a copy already there (a concurrent fetch) wins if it passes the check
    that sent this fetch to the source (``checksums``)."""
    try:
        os.rename(partial, target)
        return
    except OSError:
        pass  # target exists: a complete copy from a concurrent fetch, or a leftover without a marker
    try:
        verify(target, checksums=checksums)
        return
    except SourceNotReady:
        pass
    # A copy that fails the check is not to be read: move it aside and take its place.
    stale = target.parent / f".{target.name}.stale-{uuid.uuid4().hex[:12]}"
    os.rename(target, stale)
    os.rename(partial, target)
    shutil.rmtree(stale, ignore_errors=True)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _digest(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
