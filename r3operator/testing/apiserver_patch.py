"""Patch content types of the API-server emulator.

* `application/merge-patch+json`: RFC 7386.
* `application/json-patch+json`: RFC 6902 via `jsonpatch`.
* `application/strategic-merge-patch+json`, built-in kinds only (the real server refuses it for custom
  resources with 415, so does the emulator). A documented SUBSET: merge patch, except that lists of
  objects under the keys in NAME_MERGED_LISTS are merged by their `name`; `$patch: delete` on such an
  element removes it; `$patch: replace` on a map replaces it; `$setElementOrder/...` is ignored;
  `$deleteFromPrimitiveList/...` removes values. Any other directive -> 415 (never a silent merge).
* Everything else (server-side apply `application/apply-patch+yaml`, ...) -> 415.
"""

from __future__ import annotations

import copy
from typing import Any

import jsonpatch

from r3operator.testing.apiserver_errors import ApiError

MERGE = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
NAME_MERGED_LISTS = frozenset(
    {"containers", "initContainers", "ephemeralContainers", "env", "ports", "volumes", "volumeMounts"}
)


def merge_patch(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _unsupported_directive(key: str) -> ApiError:
    return ApiError(
        415,
        "UnsupportedMediaType",
        f"strategic merge patch directive {key!r} is not emulated (see NOT EMULATED in docs/testing.md)",
    )


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$setElementOrder/"):
            continue  # ordering hint only
        if key.startswith("$deleteFromPrimitiveList/"):
            name = key.split("/", 1)[1]
            result[name] = [v for v in result.get(name) or [] if v not in value]
            continue
        if key.startswith("$"):
            raise _unsupported_directive(key)
        if value is None:
            result.pop(key, None)
        elif (
            key in NAME_MERGED_LISTS
            and isinstance(value, list)
            and all(isinstance(v, dict) and "name" in v for v in value)
        ):
            result[key] = _merge_named_list(result.get(key) or [], value)
        elif isinstance(value, dict):
            result[key] = strategic_merge_patch(result.get(key), value)
        else:
            result[key] = copy.deepcopy(value)
    return result


def _merge_named_list(current: list[Any], patch: list[dict[str, Any]]) -> list[Any]:
    merged = [copy.deepcopy(item) for item in current]
    index = {item.get("name"): i for i, item in enumerate(merged) if isinstance(item, dict)}
    removed: set[str] = set()
    for item in patch:
        directive = item.get("$patch")
        if directive == "delete":
            removed.add(item["name"])
            continue
        if directive is not None:
            raise _unsupported_directive(f"$patch: {directive}")
        if item["name"] in index:
            merged[index[item["name"]]] = strategic_merge_patch(merged[index[item["name"]]], item)
        else:
            index[item["name"]] = len(merged)
            merged.append(copy.deepcopy(item))
    return [m for m in merged if not (isinstance(m, dict) and m.get("name") in removed)]


def apply_patch(current: dict[str, Any], patch: Any, content_type: str, is_custom: bool) -> dict[str, Any]:
    accepted = (JSON_PATCH, MERGE) if is_custom else (JSON_PATCH, MERGE, STRATEGIC)
    if content_type == MERGE:
        return merge_patch(current, patch)
    if content_type == JSON_PATCH:
        if not isinstance(patch, list):
            raise ApiError.bad_request("json patch must be a list of operations")
        try:
            return jsonpatch.apply_patch(current, patch)
        except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
            message = f"the server rejected our request due to an error in our request: {exc}"
            raise ApiError(422, "Invalid", message) from exc
    if content_type == STRATEGIC and not is_custom:
        return strategic_merge_patch(current, patch)
    raise ApiError.unsupported_media_type(content_type, accepted)
