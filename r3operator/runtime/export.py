"""spec.export: the trained policy as a Hugging Face model directory, every `intervalSteps` and after the last step.

An export of step N is `<destination>/step-<N, 6 digits>/`: the weights as safetensors (trainer/hf_export.py: the
tensors the weight sync sends, from either backend, in the engines' dtype unless `export.dtype` says otherwise),
the model's config (its `dtype` set to the weights'), tokenizer and generation config, and the manifest
`r3operator-export.json`, written last:

    {"format": 1, "step", "policyVersion", "dtype", "trainerBackend", "evalReward", "evalStep",
     "rljob": {"name", "namespace", "uid"}, "model": {"uri", "revision"}, "createdAt",
     "files": {"<name>": {"size", "sha256"}, ...}}

A directory (or an object prefix) without the manifest is not an export; `verify_export` checks one against it.

How it is written, so that no reader ever sees a partial export as complete and a failure never touches an
earlier export:

1. at the step boundary (the driver waits for this part: the weights change with the next update) the weights
   are gathered and written with the model's files into a staging directory on the run's volume
   (`<run dir>/export-staging/`), and checked: a NaN or an infinity refuses the export (NonFiniteWeights);
2. in the background the staged files are published, with the manifest last: pvc:// and file:// into a hidden
   `.tmp-step-N-*` directory beside the exports (renamed there when it is on the same filesystem, copied
   otherwise) that one `rename` makes `step-N`; s3:// and gs:// as objects under `step-N/`, any manifest of an
   earlier attempt at the same step deleted first and the new one uploaded last;
3. a failed publish (the store unreachable, wrong credentials, the claim full) is retried `maxAttempts` times with
   exponential backoff and reported meanwhile (`status.progress.exportFailure`: the operator's `Exported=False`
   with the reason, and a Warning event); training goes on unless `onFailure: Fail`, and a newer export that is
   due gives up an older one still being retried.

The driver reports through `status.progress` (`exports`, `lastExportStep`, `exportFailure`); the operator turns
that into the `Exported` condition and an Event per export.
"""

from __future__ import annotations

import datetime as dt
import errno
import json
import logging
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from r3operator.api.enums import ExportFailurePolicy
from r3operator.api.sources import SourceURI, parse_source_uri
from r3operator.api.v1alpha1 import ExportFailure, ExportFailureReason, ExportRecord, ExportSpec, Progress, RLJob
from r3operator.runtime.config import RunSettings
from r3operator.runtime.evaluation import EvalResult
from r3operator.runtime.fetch import S3Options, file_sha256, s3_client
from r3operator.settings import EXPORT_MOUNT, RuntimeSettings, runtime_settings
from r3operator.trainer.base import Trainer
from r3operator.trainer.hf_export import NonFiniteWeightsError, trainer_tensors, write_safetensors

log = logging.getLogger("r3operator.export")

MANIFEST = "r3operator-export.json"
FORMAT = 1
RECORDS_KEPT = 5
"""status.progress.exports holds the latest this many."""
STAGING_DIR = "export-staging"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
_NOT_COPIED = frozenset({"r3_reference_spec.json"})
"""Files of the model directory that describe its weights, not the model: not part of an export."""
_STORE_TIMEOUT_S = 30.0
_STORE_REQUEST_TRIES = 2
"""botocore's own tries of one request: the export's backoff (maxAttempts) is what waits out an outage."""


class ExportError(RuntimeError):
    """An export that failed for good under `onFailure: Fail`; the message names the step and the reason."""


class ExportNotComplete(Exception):
    """A directory or prefix that is not a complete export: no manifest, a file missing or changed."""


class _Cancelled(Exception):
    """A newer export took this one's place."""


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# ------------------------------------------------------------------------------------------ where it goes


@dataclass(frozen=True)
class Destination:
    """Where exports go: a local directory (pvc://, file://) or an object-store prefix (s3://, gs://)."""

    uri: str
    source: SourceURI
    local_root: Path | None = None
    s3: S3Options = field(default_factory=S3Options)
    credentials: tuple[str, str, str | None] | None = None

    def uri_of(self, step: int) -> str:
        return f"{self.uri.rstrip('/')}/{step_name(step)}"

    def key_of(self, step: int, name: str) -> str:
        return "/".join(p for p in (self.source.path, step_name(step), name) if p)


def destination(spec: ExportSpec, env: RuntimeSettings | None = None) -> Destination:
    """`spec.destination` as this process reaches it: pvc://claim/path under EXPORT_MOUNT (where the operator
    mounts the claim), file:///path as it is (through `R3OPERATOR_MOUNTS` outside a pod), s3:// and gs:// with
    `spec.s3`/`spec.gcs` and the credentials the operator put in the environment."""
    env = env or runtime_settings()
    source = parse_source_uri(spec.destination)
    if source.scheme == "pvc":
        if not env.in_cluster and env.host_path(EXPORT_MOUNT) == Path(EXPORT_MOUNT):
            raise ValueError(
                f"spec.export.destination {spec.destination}: a claim is mounted at {EXPORT_MOUNT} in the trainer's "
                f"head pod only; outside a pod use file:///path, or set {RuntimeSettings.env_name('mounts')}="
                f"{EXPORT_MOUNT}=DIR to the claim's directory here"
            )
        return Destination(spec.destination, source, local_root=env.host_path(Path(EXPORT_MOUNT) / source.path))
    if source.scheme == "file":
        return Destination(spec.destination, source, local_root=env.host_path(source.location))
    if source.scheme in ("s3", "gs"):
        access = spec.s3 if source.scheme == "s3" else spec.gcs
        options = S3Options(
            endpoint_url=access.endpoint_url if access is not None else None,
            region=spec.s3.region if source.scheme == "s3" and spec.s3 is not None else None,
        )
        credentials = None
        if env.export_aws_access_key_id is not None and env.export_aws_secret_access_key is not None:
            token = env.export_aws_session_token
            credentials = (
                env.export_aws_access_key_id.get_secret_value(),
                env.export_aws_secret_access_key.get_secret_value(),
                token.get_secret_value() if token is not None else None,
            )
        return Destination(spec.destination, source, s3=options, credentials=credentials)
    raise ValueError(f"export.destination {spec.destination}: use pvc://, s3://, gs:// or file://")


# ------------------------------------------------------------------------------------------ staging


@dataclass(frozen=True)
class Staged:
    """One export written into its staging directory, manifest not yet written."""

    step: int
    directory: Path
    manifest: dict[str, Any]

    @property
    def files(self) -> list[str]:
        return sorted(self.manifest["files"])


def model_files(model_dir: Path) -> list[Path]:
    """What of the model's directory goes into an export besides the weights: config, tokenizer, generation config,
    chat template, custom code (every top-level file but weights, their index, hidden files and
    `r3_reference_spec.json`)."""
    return sorted(
        p
        for p in model_dir.iterdir()
        if p.is_file()
        and not p.name.startswith(".")
        and not p.name.endswith(_WEIGHT_SUFFIXES)
        and not p.name.endswith(".index.json")
        and p.name not in _NOT_COPIED
    )


def _write_model_files(model_dir: Path, directory: Path, dtype: str) -> None:
    for path in model_files(model_dir):
        if path.name == "config.json":
            config = json.loads(path.read_text())
            config["dtype"] = dtype
            if "torch_dtype" in config:
                config["torch_dtype"] = dtype
            (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        else:
            shutil.copyfile(path, directory / path.name)
    if not (directory / "generation_config.json").exists():
        from transformers import GenerationConfig, PretrainedConfig

        config = PretrainedConfig.from_dict(json.loads((directory / "config.json").read_text()))
        GenerationConfig.from_model_config(config).save_pretrained(directory)


def stage(
    trainer: Trainer,
    *,
    step: int,
    staging_root: Path,
    model_dir: Path,
    dtype: str,
    chunk_size_mb: int,
    about: Mapping[str, Any],
    max_shard_bytes: int | None = None,
) -> Staged:
    """Write the trainer's current weights and the model's files into a new directory under `staging_root` and
    describe them (the manifest `publish` writes last). `about`: the manifest's other fields. Nothing is left
    behind when it raises."""
    import torch

    staging_root.mkdir(parents=True, exist_ok=True)
    directory = staging_root / f"{step_name(step)}-{secrets.token_hex(4)}"
    directory.mkdir()
    try:
        tensors = trainer_tensors(trainer, dtype=getattr(torch, dtype), chunk_size_mb=chunk_size_mb)
        shard = {} if max_shard_bytes is None else {"max_shard_bytes": max_shard_bytes}
        write_safetensors(tensors, directory, **shard)
        _write_model_files(model_dir, directory, dtype)
        files = {p.name: {"size": p.stat().st_size, "sha256": file_sha256(p)} for p in sorted(directory.iterdir())}
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    manifest = {"format": FORMAT, "step": step, "dtype": dtype, **about, "files": files}
    return Staged(step, directory, manifest)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------------ publishing


def publish_local(staged: Staged, root: Path, *, cancel: threading.Event | None = None) -> Path:
    """`staged` as `root/step-N`: into a hidden sibling (renamed when on the same filesystem, else copied), the
    manifest last, then one rename. The staged files stay where they were if it raises (the next try needs them)."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_name(staged.step)
    tmp = root / f".tmp-{step_name(staged.step)}-{secrets.token_hex(4)}"
    moved = False
    try:
        moved = _move_or_copy(staged, tmp, cancel)
        _write_manifest_file(tmp, staged.manifest)
        _fsync(tmp)
        aside = None
        if final.exists():  # the same step again (a resumed run repeated it): the older copy goes once this is in
            aside = root / f".old-{step_name(staged.step)}-{secrets.token_hex(4)}"
            os.rename(final, aside)
        os.rename(tmp, final)
        _fsync(root)
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
    except BaseException:
        if moved and tmp.exists():
            (tmp / MANIFEST).unlink(missing_ok=True)
            os.rename(tmp, staged.directory)  # back where the next try finds it
        else:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _move_or_copy(staged: Staged, tmp: Path, cancel: threading.Event | None) -> bool:
    """The staged files into `tmp`: renamed (True) where both are on one filesystem, else copied."""
    try:
        os.rename(staged.directory, tmp)
        return True
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
    tmp.mkdir()
    for name in staged.files:
        if cancel is not None and cancel.is_set():
            raise _Cancelled()
        shutil.copyfile(staged.directory / name, tmp / name)
        _fsync(tmp / name)
    return False


def _write_manifest_file(directory: Path, manifest: Mapping[str, Any]) -> None:
    part = directory / f".{MANIFEST}.tmp"
    part.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    _fsync(part)
    os.replace(part, directory / MANIFEST)


def _store_client(where: Destination) -> Any:
    """The object store's client for an export's requests: bounded retries and timeouts, the job's credentials."""
    return s3_client(
        where.source, where.s3, attempts=_STORE_REQUEST_TRIES, credentials=where.credentials, timeout_s=_STORE_TIMEOUT_S
    )


def publish_object_store(staged: Staged, where: Destination, *, cancel: threading.Event | None = None) -> None:
    """`staged` as objects under `<prefix>/step-N/`: a manifest an earlier attempt left there is deleted first (the
    prefix stops being an export until this one is complete), every file is uploaded, the manifest last."""
    client = _store_client(where)
    bucket = where.source.location
    client.delete_object(Bucket=bucket, Key=where.key_of(staged.step, MANIFEST))
    for name in staged.files:
        if cancel is not None and cancel.is_set():
            raise _Cancelled()
        client.upload_file(str(staged.directory / name), bucket, where.key_of(staged.step, name))
    body = json.dumps(staged.manifest, indent=2, sort_keys=True).encode() + b"\n"
    client.put_object(Bucket=bucket, Key=where.key_of(staged.step, MANIFEST), Body=body)


# ------------------------------------------------------------------------------------------ reading


def verify_export(directory: Path, *, checksums: bool = True) -> dict[str, Any]:
    """The manifest of the complete export in `directory`; ExportNotComplete if it has none or a file does not
    match it (`checksums`: each file's sha256, else its size)."""
    path = directory / MANIFEST
    if not path.is_file():
        raise ExportNotComplete(f"{directory} has no {MANIFEST}: not a complete export")
    manifest: dict[str, Any] = json.loads(path.read_text())
    for name, facts in manifest["files"].items():
        file = directory / name
        if not file.is_file():
            raise ExportNotComplete(f"{file} is listed in {MANIFEST} but missing")
        if file.stat().st_size != facts["size"] or (checksums and file_sha256(file) != facts["sha256"]):
            raise ExportNotComplete(f"{file} does not match {MANIFEST}")
    return manifest


def existing_exports(where: Destination, *, uid: str | None, name: str) -> list[ExportRecord]:
    """The complete exports already at `where` that this RLJob made (its uid in the manifest, or its name where the
    uid is not known), oldest first, at most RECORDS_KEPT."""
    manifests: list[dict[str, Any]] = []
    if where.local_root is not None:
        for step in local_exports(where.local_root):
            manifests.append(json.loads((where.local_root / step_name(step) / MANIFEST).read_text()))
    else:
        client = _store_client(where)
        prefix = f"{where.source.path}/" if where.source.path else ""
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=where.source.location, Prefix=prefix)
        keys = sorted(o["Key"] for page in pages for o in page.get("Contents", []) if o["Key"].endswith("/" + MANIFEST))
        for key in keys[-4 * RECORDS_KEPT :]:
            body = client.get_object(Bucket=where.source.location, Key=key)["Body"].read()
            manifests.append(json.loads(body))
    key, value = ("uid", uid) if uid is not None else ("name", name)
    mine = [m for m in manifests if (m.get("rljob") or {}).get(key) == value]
    records = [
        ExportRecord(
            step=int(m["step"]),
            uri=where.uri_of(int(m["step"])),
            eval_reward=m.get("evalReward"),
            finished_at=m.get("createdAt"),
        )
        for m in mine
    ]
    return sorted(records, key=lambda r: r.step)[-RECORDS_KEPT:]


def local_exports(root: Path) -> list[int]:
    """The steps of the complete exports under `root` (manifest present), oldest first."""
    if not root.is_dir():
        return []
    steps = []
    for path in root.iterdir():
        if path.is_dir() and path.name.startswith("step-") and (path / MANIFEST).is_file():
            steps.append(int(path.name.removeprefix("step-")))
    return sorted(steps)


# ------------------------------------------------------------------------------------------ failures


def classify(exc: BaseException) -> tuple[ExportFailureReason, str]:
    """The reason (status.progress.exportFailure.reason) and a one-line message of a failed export."""
    if isinstance(exc, NonFiniteWeightsError):
        return "NonFiniteWeights", str(exc)
    try:
        from boto3.exceptions import S3UploadFailedError
        from botocore.exceptions import (
            ClientError,
            ConnectionClosedError,
            ConnectTimeoutError,
            EndpointConnectionError,
            NoCredentialsError,
            PartialCredentialsError,
            ReadTimeoutError,
        )
    except ImportError:  # pragma: no cover - boto3 ships with the trainer image
        pass
    else:
        if isinstance(exc, EndpointConnectionError | ConnectTimeoutError | ReadTimeoutError | ConnectionClosedError):
            return "StoreUnreachable", str(exc)
        if isinstance(exc, NoCredentialsError | PartialCredentialsError):
            return "AccessDenied", f"no usable credentials: {exc}"
        if isinstance(exc, ClientError):
            code = str(exc.response.get("Error", {}).get("Code", ""))
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
            if status in (401, 403) or code in _DENIED_CODES:
                return "AccessDenied", str(exc)
            return "WriteFailed", str(exc)
        if isinstance(exc, S3UploadFailedError):  # boto3 wraps an upload's ClientError in it
            cause = exc.__cause__ or exc.__context__
            return (classify(cause)[0] if cause is not None else "WriteFailed"), str(exc)
    if isinstance(exc, OSError):
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return "NoSpace", str(exc)
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return "AccessDenied", str(exc)
    return "WriteFailed", f"{type(exc).__name__}: {exc}"


_DENIED_CODES = frozenset(
    {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken", "Forbidden"}
)


# ------------------------------------------------------------------------------------------ the driver's part


@dataclass
class _Publish:
    staged: Staged
    cancel: threading.Event
    thread: threading.Thread | None = None


class Exporter:
    """One run's exports: `after_step` at every step boundary, `finish` at the end (runtime/loop.py)."""

    def __init__(
        self,
        spec: ExportSpec,
        *,
        job: RLJob,
        run_dir: Path,
        model_dir: Path,
        last_step: int,
        engine_dtype: str,
        chunk_size_mb: int,
        env: RuntimeSettings | None = None,
        max_shard_bytes: int | None = None,
    ) -> None:
        self.env = env or runtime_settings()
        self.spec, self.job = spec, job
        self.where = destination(spec, self.env)
        self.staging_root = run_dir / STAGING_DIR
        self.model_dir, self.last_step = model_dir, last_step
        self.dtype = spec.dtype.value if spec.dtype is not None else engine_dtype
        self.chunk_size_mb, self.max_shard_bytes = chunk_size_mb, max_shard_bytes
        self._lock = threading.Lock()
        self._records: list[ExportRecord] = []
        self._failure: ExportFailure | None = None
        self._changed = False
        self._fatal: ExportError | None = None
        self._current: _Publish | None = None
        shutil.rmtree(self.staging_root, ignore_errors=True)  # what a killed driver staged is not worth publishing
        if self.where.local_root is not None:
            _clear_leftovers(self.where.local_root)
        # A driver that starts again (a resume, a RayJob retry) reports the exports its earlier runs made: the progress
        # report starts empty. Read in the background: an object store may be slow or away.
        self._seeding = threading.Thread(target=self._seed, name="export-seed", daemon=True)
        self._seeding.start()

    # -- when
    def due(self, step: int) -> bool:
        interval = self.spec.interval_steps
        return (interval is not None and step % interval == 0) or (self.spec.at_end and step == self.last_step)

    # -- the loop's calls
    def after_step(
        self,
        step: int,
        trainer: Trainer,
        policy_version: int,
        *,
        evaluation: EvalResult | None,
        push: Callable[[dict[str, Any]], Any],
    ) -> None:
        """Stage this step's export when one is due (the publish goes on in the background), report what changed
        since the last call, and raise ExportError when an export failed for good under `onFailure: Fail`.
        `evaluation`: the last held-out evaluation (its reward goes into the manifest)."""
        if self.due(step):
            self.export(
                step,
                trainer,
                policy_version=policy_version,
                eval_reward=None if evaluation is None else evaluation.reward_mean,
                eval_step=None if evaluation is None else evaluation.step,
            )
        self.report(push)
        self.raise_if_fatal()

    def export(
        self,
        step: int,
        trainer: Trainer,
        *,
        policy_version: int,
        eval_reward: float | None = None,
        eval_step: int | None = None,
    ) -> None:
        about = {
            "policyVersion": policy_version,
            "trainerBackend": self.job.spec.trainer.backend.value,
            "evalReward": eval_reward,
            "evalStep": eval_step,
            "rljob": {
                "name": self.job.metadata.name,
                "namespace": self.job.metadata.namespace or self.env.rljob_namespace,
                "uid": self.job.metadata.uid,
            },
            "model": {"uri": self.job.spec.model.uri, "revision": self.job.spec.model.revision},
            "createdAt": _now(),
        }
        begin = time.perf_counter()
        try:
            staged = stage(
                trainer,
                step=step,
                staging_root=self.staging_root,
                model_dir=self.model_dir,
                dtype=self.dtype,
                chunk_size_mb=self.chunk_size_mb,
                about=about,
                max_shard_bytes=self.max_shard_bytes,
            )
        except Exception as exc:  # the weights move on with the next update: there is nothing to retry with
            self._failed(step, exc, attempts=1, retrying=False)
            return
        size = sum(int(f["size"]) for f in staged.manifest["files"].values())
        log.info(
            "staged the export of step %d: %d files, %.2f GB in %.1f s; publishing to %s",
            step,
            len(staged.files),
            size / 1e9,
            time.perf_counter() - begin,
            self.where.uri_of(step),
        )
        self._supersede(step)
        job = _Publish(staged, threading.Event())
        job.thread = threading.Thread(target=self._publish, args=(job,), name=f"export-{step}", daemon=True)
        with self._lock:
            self._current = job
        job.thread.start()

    def report(self, push: Callable[[dict[str, Any]], Any]) -> None:
        """Push the exports and the last failure when they changed since the last report."""
        with self._lock:
            if not self._changed:
                return
            self._changed = False
            records, failure = list(self._records), self._failure
        push(progress_patch(records, failure))

    def raise_if_fatal(self) -> None:
        with self._lock:
            fatal = self._fatal
        if fatal is not None:
            raise fatal

    def finish(self, push: Callable[[dict[str, Any]], Any]) -> None:
        """Wait for the export being published (its retries included), report, and raise ExportError when an export
        failed for good under `onFailure: Fail`."""
        self._seeding.join()
        with self._lock:
            current = self._current
        if current is not None and current.thread is not None:
            current.thread.join()
        self.report(push)
        self.raise_if_fatal()

    def abandon(self) -> None:
        """The run is ending on an error: give up the publish in flight."""
        with self._lock:
            current = self._current
        if current is not None:
            current.cancel.set()

    @property
    def records(self) -> list[ExportRecord]:
        with self._lock:
            return list(self._records)

    @property
    def failure(self) -> ExportFailure | None:
        with self._lock:
            return self._failure

    # -- the background part
    def _seed(self) -> None:
        try:
            found = existing_exports(self.where, uid=self.job.metadata.uid, name=self.job.metadata.name)
        except Exception as exc:  # the store away at the start: the next export is reported all the same
            log.warning("the exports already in %s could not be listed: %s", self.where.uri, exc)
            return
        if not found:
            return
        with self._lock:
            known = {r.step for r in self._records}
            merged = sorted([*self._records, *(r for r in found if r.step not in known)], key=lambda r: r.step)
            self._records = merged[-RECORDS_KEPT:]
            self._changed = True

    def _supersede(self, step: int) -> None:
        with self._lock:
            older = self._current
        if older is None or older.thread is None or not older.thread.is_alive():
            return
        older.cancel.set()
        log.warning("export of step %d: given up for the export of step %d", older.staged.step, step)

    def _publish(self, job: _Publish) -> None:
        staged, attempts = job.staged, self.spec.max_attempts
        uri = self.where.uri_of(staged.step)
        try:
            for attempt in range(1, attempts + 1):
                if job.cancel.is_set():
                    return
                try:
                    if self.where.local_root is not None:
                        publish_local(staged, self.where.local_root, cancel=job.cancel)
                    else:
                        publish_object_store(staged, self.where, cancel=job.cancel)
                except _Cancelled:
                    return
                except Exception as exc:
                    if job.cancel.is_set():  # given up for a newer export: that one reports
                        return
                    retrying = attempt < attempts
                    self._failed(staged.step, exc, attempts=attempt, retrying=retrying)
                    if not retrying or job.cancel.wait(self._delay(attempt - 1)):
                        return
                    continue
                self._succeeded(staged, uri)
                return
        finally:
            shutil.rmtree(staged.directory, ignore_errors=True)

    def _delay(self, retry: int) -> float:
        return float(min(self.env.export_retry_cap_s, self.env.export_retry_base_s * 2.0**retry))

    def _succeeded(self, staged: Staged, uri: str) -> None:
        record = ExportRecord(
            step=staged.step,
            uri=uri,
            eval_reward=staged.manifest.get("evalReward"),
            finished_at=_now(),
        )
        log.info("exported step %d to %s (%d files)", staged.step, uri, len(staged.files))
        with self._lock:
            self._records = [*[r for r in self._records if r.step != staged.step], record][-RECORDS_KEPT:]
            if self._failure is not None and self._failure.step <= staged.step:
                self._failure = None
            self._changed = True

    def _failed(self, step: int, exc: BaseException, *, attempts: int, retrying: bool) -> None:
        reason, message = classify(exc)
        uri = self.where.uri_of(step)
        last = self.records[-1].uri if self.records else None
        kept = f"; the last complete export ({last}) is untouched" if last else ""
        if retrying:
            text = f"export of step {step} to {uri}: attempt {attempts} of {self.spec.max_attempts} failed ({reason}): "
            log.warning("%s%s", text, message)
        else:
            text = f"export of step {step} to {uri} failed after {attempts} attempt(s) ({reason}): "
            log.error("%s%s%s", text, message, kept)
        failure = ExportFailure(step=step, reason=reason, message=message[:1024], attempts=attempts, retrying=retrying)
        with self._lock:
            self._failure = failure
            self._changed = True
            if not retrying and self.spec.on_failure is ExportFailurePolicy.FAIL:
                self._fatal = ExportError(f"{text}{message} (spec.export.onFailure is Fail)")


def _clear_leftovers(root: Path) -> None:
    """Hidden directories a killed publish left beside the exports."""
    if not root.is_dir():
        return
    for path in root.iterdir():
        if path.is_dir() and path.name.startswith((".tmp-step-", ".old-step-")):
            shutil.rmtree(path, ignore_errors=True)


def progress_patch(records: list[ExportRecord], failure: ExportFailure | None) -> dict[str, Any]:
    """The progress report's export fields (`StatusPusher.push`'s shape); a null clears the last failure."""

    def plain(model: ExportRecord | ExportFailure) -> dict[str, Any]:
        return model.model_dump(mode="json", by_alias=True, exclude_none=True)

    body = {
        "exports": [plain(r) for r in records] or None,
        "lastExportStep": records[-1].step if records else None,
        "exportFailure": plain(failure) if failure is not None else None,
    }
    Progress.model_validate({k: v for k, v in body.items() if v is not None})  # what the operator takes
    return {"status": {"progress": body}}


def build_exporter(settings: RunSettings, *, model_dir: Path) -> Exporter | None:
    """The run's Exporter, or None without spec.export."""
    job = settings.job
    spec = job.spec.export
    if spec is None:
        return None
    return Exporter(
        spec,
        job=job,
        run_dir=settings.run_dir,
        model_dir=model_dir,
        last_step=settings.steps,
        engine_dtype=settings.engine_dtype,
        chunk_size_mb=job.spec.weight_sync.chunk_size_mb,
    )
