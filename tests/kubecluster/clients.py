"""Real clients against the test control plane: the pinned kubectl, and server-side apply over REST."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import yaml

from kubecluster.controlplane import ControlPlane, kubectl_binary

CRD_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"


def kubectl(
    plane: ControlPlane, *args: str, stdin: str | None = None, kubeconfig: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """The real kubectl as the admin (or as whoever `kubeconfig` names); the caller checks returncode."""
    env = {**os.environ, "KUBECONFIG": str(kubeconfig or plane.kubeconfig)}
    return subprocess.run([kubectl_binary(), *args], input=stdin, env=env, capture_output=True, text=True, timeout=120)


def apply_crd(plane: ControlPlane, manifest: Path | dict[str, Any], field_manager: str = "r3-tests") -> dict[str, Any]:
    """Server-side apply of a CRD file (as `kubectl apply --server-side` does); returns it once Established.

    Tests of several modules apply the same CRD into the one session cluster: identical values under
    several field managers are shared ownership, not a conflict."""
    doc = yaml.safe_load(manifest.read_text()) if isinstance(manifest, Path) else manifest
    name = doc["metadata"]["name"]
    applied = plane.request(
        "PATCH",
        f"{CRD_PATH}/{name}?fieldManager={field_manager}&force=true",
        doc,
        content_type="application/apply-patch+yaml",
    )
    plane.wait_established(name)
    return dict(applied)


def create_namespace(plane: ControlPlane, name: str) -> str:
    plane.request("POST", "/api/v1/namespaces", {"metadata": {"name": name}})
    return name
