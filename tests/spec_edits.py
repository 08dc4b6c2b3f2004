"""Dotted edits of an RLJob document's spec for tests (not a test module): {"inference.replicas": 2}."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def apply_edits(doc: dict[str, Any], edits: Mapping[str, Any]) -> dict[str, Any]:
    """Set each dotted spec path (creating the maps on the way) and return the document."""
    for dotted, value in edits.items():
        node = doc["spec"]
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return doc
