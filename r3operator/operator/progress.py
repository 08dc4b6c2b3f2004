"""The trainer's progress report: the ConfigMap ``<job>-progress``, which the operator creates empty and the
trainer driver fills (runtime.metrics.StatusPusher), and which the operator copies into ``status.progress``.

The trainer pods run the job author's image, so they may write only this one object (their Role names it and
nothing else; they have no right on the RLJob or its status). What they write is checked against the API's own
``Progress`` model before it reaches the status, so a field added to ``Progress`` flows through unchanged:

- the report is the JSON of ``Progress`` under the key ``progress``, at most ``MAX_REPORT_BYTES``;
- a number that is not finite (``NaN``, ``Infinity``, or a literal too large for a float), or an integer beyond
  int64, refuses the report: no such value reaches the status, dashboards or alerts;
- a value ``Progress`` refuses (a string for a step, a 1 MB message) refuses the report;
- a key ``Progress`` does not know (a newer trainer's) is left out, the rest is taken.

A refused report leaves ``status.progress`` as the operator last wrote it, and the reason goes out as one
Warning Event (``ProgressRejected``) per distinct reason; an empty or missing report means no progress yet.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from r3operator.api.v1alpha1 import Progress, RLJob
from r3operator.operator import meta
from r3operator.settings import PROGRESS_KEY

REPORT_KEY = PROGRESS_KEY
MAX_REPORT_BYTES = 16 * 1024
"""Every field of ``Progress`` at its longest is under 2 KiB."""


@dataclass(frozen=True, slots=True)
class ProgressReport:
    """What the trainer reported, as the operator takes it."""

    progress: Progress | None
    """The report (None: none yet), or, when ``refused``, nothing: the status keeps what it had."""
    problem: str | None = None
    """Why the report was refused, or which of its keys were left out."""
    refused: bool = False


def build_progress_config_map(job: RLJob) -> dict[str, Any]:
    """``<job>-progress`` with no data: the operator owns its metadata, the trainer the ``progress`` key (a field
    the operator's server-side apply never sets, so never takes back)."""
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta.object_meta(job, meta.ROLE_PROGRESS)}


class _NotFinite(ValueError):
    pass


def _constant(name: str) -> float:
    raise _NotFinite(f"{name} is not a finite number")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NotFinite(f"{text} is not a finite number")
    return value


INT64 = 2**63


def _unwritable(node: Any, path: str = "") -> str | None:
    """The first field of a validated report the status cannot hold: a float that is not finite (pydantic takes
    "nan" for one), an integer beyond the API's int64."""
    if isinstance(node, float) and not math.isfinite(node):
        return f"{path} is not a finite number"
    if isinstance(node, int) and not isinstance(node, bool) and not -INT64 <= node < INT64:
        return f"{path} is beyond a 64-bit integer"
    if isinstance(node, dict):
        for key, value in node.items():
            if (found := _unwritable(value, f"{path}.{key}" if path else str(key))) is not None:
                return found
    if isinstance(node, list):
        for i, value in enumerate(node):
            if (found := _unwritable(value, f"{path}[{i}]")) is not None:
                return found
    return None


def _known_keys() -> frozenset[str]:
    return frozenset(info.alias or name for name, info in Progress.model_fields.items())


def read_report(config_map: dict[str, Any] | None) -> ProgressReport:
    """The report in ``config_map`` (the operator's ``<job>-progress``, or None when it is not there yet)."""
    text = ((config_map or {}).get("data") or {}).get(REPORT_KEY)
    if not text:
        return ProgressReport(None)
    size = len(text.encode())
    if size > MAX_REPORT_BYTES:
        return _refused(f"the report is {size} bytes, more than {MAX_REPORT_BYTES}")
    try:
        raw = json.loads(text, parse_constant=_constant, parse_float=_float)
    except _NotFinite as exc:
        return _refused(str(exc))
    except ValueError as exc:
        return _refused(f"the report is not JSON: {exc}")
    if not isinstance(raw, dict):
        return _refused(f"the report is a JSON {type(raw).__name__}, not an object")
    known = _known_keys()
    unknown = sorted(k for k in raw if k not in known)
    try:
        progress = Progress.model_validate({k: v for k, v in raw.items() if k in known})
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:5])
        return _refused(f"the report does not fit status.progress: {problems}")
    if (problem := _unwritable(progress.model_dump(mode="python", by_alias=True))) is not None:
        return _refused(problem)
    return ProgressReport(progress, f"left out the unknown keys {', '.join(unknown)}" if unknown else None)


def _refused(why: str) -> ProgressReport:
    return ProgressReport(None, f"{why}; status.progress keeps the last report taken", refused=True)
