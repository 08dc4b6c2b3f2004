"""The diff step: for one desired child and what exists, the single write (if any) that converges it.

Rules per kind (writes are JSON merge-patches; lists are replaced wholesale, which is what we want
for container lists):
- StatefulSet: the pod template is rewritten only when its spec-hash annotation differs (so an
  operator upgrade that renders templates differently never rolls pods); ``replicas`` separately.
- RayJob: a different spec hash means delete-and-recreate (KubeRay fixes a RayJob's cluster per
  run); ``suspend`` is patched in place.
- PVC: only the ownerReference follows retainPolicy (PVC specs are immutable).
- ConfigMap, Service, PodMonitor: patched when a field we set differs (server-side defaults in the
  observed object, such as a Service's clusterIP or port protocol, are ignored).
- ServiceAccount: only our labels and ownerReferences are patched (the server adds the rest).
- RoleBinding: ``roleRef`` is immutable, so a different one means delete-and-recreate; ``subjects``,
  labels and ownerReferences are patched in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from r3operator.operator import meta


@dataclass(frozen=True, slots=True)
class Action:
    verb: Literal["create", "patch", "recreate", "none"]
    patch: dict[str, Any] | None = None


def is_subset(want: Any, have: Any) -> bool:
    """Every field set in ``want`` has the same value in ``have`` (extra server-set fields allowed)."""
    if isinstance(want, dict):
        return isinstance(have, dict) and all(is_subset(v, have.get(k)) for k, v in want.items())
    if isinstance(want, list):
        return isinstance(have, list) and len(want) == len(have) and all(map(is_subset, want, have))
    return want == have


def _hash(obj: dict[str, Any], *path: str) -> str | None:
    node: Any = obj
    for key in path:
        node = (node or {}).get(key)
    return ((node or {}).get("annotations") or {}).get(meta.ANNOTATION_SPEC_HASH)


def _owner_patch(want: dict[str, Any], have: dict[str, Any]) -> dict[str, Any] | None:
    wanted = want["metadata"].get("ownerReferences")
    current = have["metadata"].get("ownerReferences")
    if wanted and not is_subset(wanted, current):
        return {"metadata": {"ownerReferences": wanted}}
    if not wanted and current:
        ours = [r for r in current if r.get("kind") != "RLJob"]
        return {"metadata": {"ownerReferences": ours or None}}
    return None


def _metadata_patch(want: dict[str, Any], have: dict[str, Any]) -> dict[str, Any] | None:
    """Our labels and ownerReferences, when the observed object lacks them."""
    meta_want = {k: want["metadata"][k] for k in ("labels", "ownerReferences") if k in want["metadata"]}
    return None if is_subset(meta_want, have.get("metadata")) else {"metadata": meta_want}


def plan_action(want: dict[str, Any], have: dict[str, Any] | None) -> Action:
    if have is None:
        return Action("create")
    kind = want["kind"]
    if kind == "StatefulSet":
        if _hash(want, "spec", "template", "metadata") != _hash(have, "spec", "template", "metadata"):
            spec = want["spec"]
            return Action("patch", {"spec": {"template": spec["template"], "replicas": spec["replicas"]}})
        if want["spec"]["replicas"] != (have.get("spec") or {}).get("replicas"):
            return Action("patch", {"spec": {"replicas": want["spec"]["replicas"]}})
        return Action("none")
    if kind == "RayJob":
        if _hash(want, "metadata") != _hash(have, "metadata"):
            return Action("recreate")
        if bool(want["spec"]["suspend"]) != bool((have.get("spec") or {}).get("suspend")):
            return Action("patch", {"spec": {"suspend": want["spec"]["suspend"]}})
        return Action("none")
    if kind == "PersistentVolumeClaim":
        patch = _owner_patch(want, have)
        return Action("patch", patch) if patch else Action("none")
    if kind == "ServiceAccount":
        patch = _metadata_patch(want, have)
        return Action("patch", patch) if patch else Action("none")
    if kind == "RoleBinding":
        if want["roleRef"] != have.get("roleRef"):
            return Action("recreate")
        patch = _metadata_patch(want, have) or {}
        if not is_subset(want["subjects"], have.get("subjects")):
            patch["subjects"] = want["subjects"]
        return Action("patch", patch) if patch else Action("none")
    if kind == "ConfigMap":
        return Action("none") if want["data"] == have.get("data") else Action("patch", {"data": want["data"]})
    if is_subset(want["spec"], have.get("spec")):
        return Action("none")
    return Action("patch", {"spec": want["spec"]})
