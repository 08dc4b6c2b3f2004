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


_BASH_BLOCK = re.compile(r"```bash\n(.*?)```", re.S)
_WATCHED = re.compile(r"watch\.namespaces=\{([^}]*)\}")


@pytest.mark.parametrize("doc", [REPO / "README.md", REPO / "docs/install.md"], ids=lambda p: p.name)
def test_install_commands_create_the_watched_namespaces_before_helm_install(doc: Path) -> None:
    # The chart puts the operator's Role in each watched namespace: `helm install` fails on a missing one
    # (`namespaces "rl" not found`) and leaves a failed release behind, so the namespace comes first.
    installs = 0
    for block in _BASH_BLOCK.findall(doc.read_text()):
        created: set[str] = set()
        for line in block.splitlines():
            created |= set(re.findall(r"kubectl create namespace ([a-z0-9-]+)", line))
            if re.search(r"helm (upgrade --)?install ", line):
                command = line
                for watched in _WATCHED.findall(command + block.split(line, 1)[1].split("\n\n", 1)[0]):
                    installs += 1
                    missing = {n.strip() for n in watched.split(",") if n.strip()} - created
                    assert not missing, f"{doc.name}: helm install watches {missing} before creating them"
    assert installs >= 1
    assert "helm upgrade --install" in doc.read_text()  # how to recover a release left `failed`
