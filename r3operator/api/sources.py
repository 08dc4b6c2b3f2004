"""Model and dataset URIs → where their files live: the parsing half of the one resolver. Pure, no I/O.

The operator renders pods and the fetch step from this (``operator/builders/model.py``, ``model_cache.py``),
and the runtime fetches and verifies with it (``runtime/fetch.py``), so the directory a fetch fills is the
directory the engines and the trainer read: ``<root>/<cache_key>``.

Schemes:
- ``hf://org/name`` or ``hf://org/name@revision``: a Hugging Face Hub repository, fetched;
- ``s3://bucket/prefix``: every object under the prefix (or the one object the key names), fetched;
- ``gs://bucket/prefix``: the same from Google Cloud Storage, through its S3-compatible XML API;
- ``pvc://claim/path``: a PersistentVolumeClaim, mounted as it is (nothing fetched);
- ``file:///path`` or a plain absolute or relative path: already on the pod's or the machine's disk;
- ``r3operator://reference/<name>``: a generated reference model (``r3operator.models``);
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Scheme = Literal["hf", "s3", "gs", "pvc", "file", "r3operator"]
SCHEMES: tuple[Scheme, ...] = ("hf", "s3", "gs", "pvc", "file", "r3operator")
FETCHED_SCHEMES: frozenset[str] = frozenset({"hf", "s3", "gs"})
"""Copied into a local directory (the model cache, a data directory) before anything reads them."""
DEFAULT_HF_REVISION = "main"
"""The Hub's default branch: what an unpinned hf:// URI fetches, and the cache directory it fills."""


class SourceURIError(ValueError):
    """A URI the resolver cannot parse; the message names the URI and what is wrong with it."""


@dataclass(frozen=True, slots=True)
class SourceURI:
    scheme: Scheme
    location: str
    """hf: ``org/name``; s3 and gs: the bucket; pvc: the claim; file: the path; r3operator: the model name."""
    path: str = ""
    """s3 and gs: the key prefix; pvc: the directory inside the claim; empty otherwise."""
    revision: str | None = None
    """hf only: the pinned commit, tag or branch (None: the default branch)."""

    @property
    def fetched(self) -> bool:
        return self.scheme in FETCHED_SCHEMES

    @property
    def cache_key(self) -> str:
        """The relative directory a fetch fills under its root, the same in every pod and on every machine.

        It names the revision, so one shared cache holds several revisions side by side and a new pin never
        reads an old copy. An unpinned hf:// URI is keyed ``main``: a later fetch into the same cache finds
        that copy and does not look at the Hub again; pin the revision to move on.
        """
        if self.scheme == "hf":
            return f"hf/{self.location}/{self.revision or DEFAULT_HF_REVISION}"
        if self.scheme in ("s3", "gs"):
            return "/".join(p for p in (self.scheme, self.location, self.path) if p)
        raise SourceURIError(f"{self.scheme}:// sources are not fetched and have no cache directory")


def parse_source_uri(uri: str, *, revision: str | None = None) -> SourceURI:
    """``revision`` (``model.revision``) pins an hf:// URI that carries no ``@revision`` of its own.

    A URI that pins another revision than ``revision`` is refused: which of the two wins would be a guess.
    """
    if "://" not in uri:
        if not uri:
            raise SourceURIError("an empty path is not a source")
        return SourceURI("file", uri)
    scheme, _, rest = uri.partition("://")
    if scheme not in SCHEMES:
        raise SourceURIError(f"{uri}: unknown scheme {scheme}://, expected one of " + ", ".join(SCHEMES))
    if scheme == "file":
        return SourceURI("file", rest if rest.startswith("/") else "/" + rest)
    if scheme == "r3operator":
        kind, _, name = rest.partition("/")
        if kind != "reference" or not name or "/" in name:
            raise SourceURIError(f"{uri}: expected r3operator://reference/<name>")
        return SourceURI("r3operator", name)
    if scheme == "hf":
        return _hf(uri, rest, revision)
    head, _, tail = rest.partition("/")
    if not head:
        raise SourceURIError(f"{uri}: expected {scheme}://{'claim' if scheme == 'pvc' else 'bucket'}/path")
    if any(part in (".", "..") for part in tail.split("/")):
        raise SourceURIError(f"{uri}: '.' and '..' are not allowed in the path")
    return SourceURI(scheme, head, tail.strip("/"))


def _hf(uri: str, rest: str, revision: str | None) -> SourceURI:
    repo, at, pinned = rest.partition("@")
    parts = repo.split("/")
    if len(parts) != 2 or not all(parts) or any(p in (".", "..") for p in parts):
        raise SourceURIError(f"{uri}: expected hf://org/name or hf://org/name@revision")
    if at and not pinned:
        raise SourceURIError(f"{uri}: '@' must be followed by a revision")
    if at and revision and pinned != revision:
        raise SourceURIError(f"{uri} pins revision {pinned} but model.revision is {revision}: set one of them")
    if "/" in (pinned or revision or ""):
        # The revision is one directory of the cache key; a branch name with '/' would nest it.
        raise SourceURIError(f"{uri}: pin a commit or a tag without '/' (got revision {pinned or revision})")
    return SourceURI("hf", repo, revision=pinned or revision)
