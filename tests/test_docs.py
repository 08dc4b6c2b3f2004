"""The README and docs/ point only at files that exist and carry no notes meant for the project's own team."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
ROOTS = ("docs/", "scripts/", "charts/", "images/", "examples/", "r3operator/", "tests/", "crds/", "benchmarks/")
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
_CODE = re.compile(r"`([^`\s]+)`")


def _referenced_paths(doc: Path) -> set[str]:
    text = doc.read_text()
    found = set()
    for target in _LINK.findall(text):
        if "://" not in target and not target.startswith("mailto:"):
            found.add(str((doc.parent / target).resolve().relative_to(REPO)))
    for token in _CODE.findall(text):
        token = token.rstrip(".,:;)")
        if token.startswith(ROOTS) and not re.search(r"[*<>{}$]|\.\.\.|…", token):
            found.add(token.split(":", 1)[0])
    return found


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_path_a_doc_names_exists(doc: Path) -> None:
    missing = sorted(p for p in _referenced_paths(doc) if not (REPO / p).exists())
    assert missing == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_no_internal_working_notes(doc: Path) -> None:
    text = doc.read_text()
    for note in ("Command for the lead", "for the lead", "real-vllm.md", ".whl/gpu-setup.sh", "this session"):
        assert note not in text, f"{doc.name}: {note!r}"
