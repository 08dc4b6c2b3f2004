"""Read RLJob manifests from YAML with errors that name the file and the field."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from r3operator.api.v1alpha1 import API_VERSION, KIND, RLJob


@dataclass(frozen=True, slots=True)
class FieldProblem:
    field: str
    message: str


class RLJobLoadError(Exception):
    """An RLJob could not be read: unreadable file, bad YAML, not an RLJob, or schema errors."""

    def __init__(self, source: str, problems: list[FieldProblem]) -> None:
        self.source = source
        self.problems = problems
        super().__init__(
            "; ".join(f"{source}: {p.field}: {p.message}" if p.field else f"{source}: {p.message}" for p in problems)
        )


def _path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _message(err: Any) -> str:
    if err["type"] == "extra_forbidden":
        return "unknown field"
    if err["type"] == "missing":
        return "required field is missing"
    return str(err["msg"])


def _problems(exc: ValidationError) -> list[FieldProblem]:
    return [FieldProblem(_path(tuple(err["loc"])), _message(err)) for err in exc.errors()]


def parse_rljob(obj: Any, *, source: str = "<object>") -> RLJob:
    """Validate one decoded manifest. Raises RLJobLoadError naming the source and fields."""
    if not isinstance(obj, dict):
        raise RLJobLoadError(source, [FieldProblem("", f"expected a mapping, got {type(obj).__name__}")])
    api_version, kind = obj.get("apiVersion"), obj.get("kind")
    if api_version != API_VERSION or kind != KIND:
        raise RLJobLoadError(
            source,
            [
                FieldProblem(
                    "",
                    f"not an RLJob: apiVersion {api_version!r}, kind {kind!r} (expected {API_VERSION}, {KIND})",
                )
            ],
        )
    try:
        return RLJob.model_validate(obj)
    except ValidationError as exc:
        raise RLJobLoadError(source, _problems(exc)) from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a mapping with a key twice, as kubectl does: PyYAML would keep the last
    value silently, so two manifests pasted without `---` between them would apply only the second's
    fields under the first's metadata."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<:` merge keys may repeat
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key; construct_mapping reports it
                continue
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"duplicate key {key!r} (first at line {first.start_mark.line + 1})",
                    key_node.start_mark,
                )
            seen[key] = key_node
        return super().construct_mapping(node, deep=deep)


STDIN = Path("-")
"""The file name that means standard input (`kubectl get rlj x -o yaml | r3operator explain -`)."""


def source_name(path: Path) -> str:
    return "<stdin>" if path == STDIN else str(path)


def _read(path: Path) -> str:
    if path == STDIN:
        return sys.stdin.read()
    return path.read_text(encoding="utf-8")


def _is_list(doc: Any) -> bool:
    return isinstance(doc, dict) and doc.get("kind") == "List" and doc.get("apiVersion") == "v1"


def load_documents(path: Path) -> list[Any]:
    """The YAML documents of ``path``, or of standard input for ``-``."""
    try:
        text = _read(path)
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise RLJobLoadError(source_name(path), [FieldProblem("", f"cannot read file: {reason}")]) from None
    try:
        docs = [d for d in yaml.load_all(text, Loader=_UniqueKeyLoader) if d is not None]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise RLJobLoadError(source_name(path), [FieldProblem("", f"malformed YAML{where}: {problem}")]) from None
    # `kubectl get rlj -o yaml` without a name prints a List: its items are the objects.
    docs = [item for d in docs for item in ((d.get("items") or []) if _is_list(d) else [d])]
    if not docs:
        raise RLJobLoadError(source_name(path), [FieldProblem("", "no YAML documents in file")])
    return docs


def load_rljobs(path: Path) -> list[RLJob]:
    """All RLJobs in a (possibly multi-document) YAML file."""
    docs = load_documents(path)
    source = source_name(path)
    return [parse_rljob(doc, source=source if len(docs) == 1 else f"{source}#{i}") for i, doc in enumerate(docs)]


def load_rljob(path: Path) -> RLJob:
    jobs = load_rljobs(path)
    if len(jobs) != 1:
        raise RLJobLoadError(source_name(path), [FieldProblem("", f"expected one RLJob, found {len(jobs)} documents")])
    return jobs[0]
