"""`meta.k8s.io/v1` Table rendering (what `kubectl get` prints) and the JSONPath subset it needs.

JSONPath subset of printer columns: `.a.b`, `.a[0]`, `.a['key.with.dots']`, `.a[*].b`,
`.a[?(@.type=="Ready")].status` (== and != on one field); an optional `{...}` wrapper.
"""

from __future__ import annotations

import datetime as dt
import re
from typing import Any

from r3operator.testing.apiserver_errors import ApiError
from r3operator.testing.apiserver_store import ResourceType

_SEGMENT = re.compile(
    r"""\.(?P<field>[A-Za-z0-9_$-]+)
      | \[(?P<index>-?\d+|\*)\]
      | \[['"](?P<quoted>[^'"]+)['"]\]
      | \[\?\(@\.(?P<ffield>[A-Za-z0-9_.-]+)\s*(?P<op>==|!=)\s*['"]?(?P<fvalue>[^'")]*)['"]?\)\]""",
    re.VERBOSE,
)


def jsonpath(obj: Any, expression: str) -> list[Any]:
    """All matches of a printer-column JSONPath (subset above) in `obj`."""
    expr = expression.strip()
    if expr.startswith("{") and expr.endswith("}"):
        expr = expr[1:-1]
    if expr.startswith("$"):
        expr = expr[1:]
    values, position = [obj], 0
    while position < len(expr):
        match = _SEGMENT.match(expr, position)
        if not match:
            raise ApiError.bad_request(f"unsupported JSONPath {expression!r} at {expr[position:]!r}")
        position = match.end()
        values = [v for value in values for v in _step(value, match)]
    return values


def _step(value: Any, match: re.Match[str]) -> list[Any]:
    if match["field"] is not None or match["quoted"] is not None:
        key = match["field"] if match["field"] is not None else match["quoted"]
        return [value[key]] if isinstance(value, dict) and key in value else []
    if match["index"] is not None:
        if not isinstance(value, list):
            return []
        if match["index"] == "*":
            return list(value)
        index = int(match["index"])
        return [value[index]] if -len(value) <= index < len(value) else []
    if not isinstance(value, list):
        return []
    selected = []
    for item in value:
        found = jsonpath(item, "." + match["ffield"])
        equal = bool(found) and str(found[0]) == match["fvalue"]
        if equal == (match["op"] == "=="):
            selected.append(item)
    return selected


def humanize_age(timestamp: str | None, now: dt.datetime | None = None) -> str:
    """`5s`, `6m`, `3h`, `2d`: the real server's translateTimestampSince (duration.HumanDuration)."""
    if not timestamp:
        return "<unknown>"
    try:
        then = dt.datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    except ValueError:
        return "<invalid>"
    seconds = int(((now or dt.datetime.now(dt.UTC)) - then).total_seconds())
    if seconds < 0:
        return "<invalid>"
    if seconds < 120:
        return f"{seconds}s"
    minutes = seconds // 60
    if minutes < 10:
        return f"{minutes}m{seconds % 60}s" if seconds % 60 else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    hours = minutes // 60
    if hours < 8:
        return f"{hours}h{minutes % 60}m" if minutes % 60 else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    days = hours // 24
    return f"{days}d{hours % 24}h" if days < 8 and hours % 24 else f"{days}d"


_NAME_COLUMN = {
    "name": "Name",
    "type": "string",
    "format": "name",
    "description": "Name must be unique within a namespace.",
    "priority": 0,
}
_AGE_COLUMN = {"name": "Age", "type": "date", "format": "", "description": "CreationTimestamp", "priority": 0}


def column_definitions(rtype: ResourceType) -> list[dict[str, Any]]:
    if not rtype.is_custom:
        return [_NAME_COLUMN, _AGE_COLUMN]
    columns = rtype.printer_columns or [{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}]
    return [_NAME_COLUMN] + [
        {
            "name": c["name"],
            "type": c.get("type", "string"),
            "format": c.get("format", ""),
            "description": c.get("description", ""),
            "priority": c.get("priority", 0),
        }
        for c in columns
    ]


def _cell(column: dict[str, Any], obj: dict[str, Any]) -> Any:
    values = jsonpath(obj, column["jsonPath"])
    if not values:
        return None
    if column.get("type") == "date":
        return humanize_age(str(values[0]))
    if len(values) == 1:
        value = values[0]
        return value if isinstance(value, str | int | float | bool) else _render(value)
    return ",".join(_render(v) for v in values)


def _render(value: Any) -> str:
    import json

    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


def _row(rtype: ResourceType, obj: dict[str, Any], include_object: str) -> dict[str, Any]:
    meta = obj["metadata"]
    if rtype.is_custom:
        columns = rtype.printer_columns or [{"type": "date", "jsonPath": ".metadata.creationTimestamp"}]
        cells = [meta["name"], *(_cell(c, obj) for c in columns)]
    else:
        cells = [meta["name"], humanize_age(meta.get("creationTimestamp"))]
    row: dict[str, Any] = {"cells": cells}
    if include_object == "Object":
        row["object"] = obj
    elif include_object != "None":
        row["object"] = {
            "kind": "PartialObjectMetadata",
            "apiVersion": "meta.k8s.io/v1",
            "metadata": obj["metadata"],
        }
    return row


def table(
    rtype: ResourceType,
    objects: list[dict[str, Any]],
    resource_version: str,
    include_object: str = "Metadata",
    with_columns: bool = True,
) -> dict[str, Any]:
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": resource_version},
        "columnDefinitions": column_definitions(rtype) if with_columns else None,
        "rows": [_row(rtype, obj, include_object) for obj in objects],
    }


def wants_table(accept: str) -> bool:
    """True when the client prefers a Table (kubectl get: `application/json;as=Table;v=v1;g=meta.k8s.io`)."""
    first = accept.split(",")[0] if accept else ""
    return "as=Table" in first and "g=meta.k8s.io" in first
