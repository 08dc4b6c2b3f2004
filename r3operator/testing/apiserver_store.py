"""Resource registry, object store, selectors and watch fan-out of the API-server emulator.

Everything here runs on the emulator's event loop thread only, so there are no locks.
"""

from __future__ import annotations

import asyncio
import re
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from r3operator.testing.apiserver_errors import ApiError

ALL_VERBS = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")


@dataclass
class ResourceType:
    """One served resource of one group/version (a CRD with two versions gives two of these)."""

    group: str
    version: str
    plural: str
    singular: str
    kind: str
    namespaced: bool
    short_names: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    has_status: bool = False
    # "all": bump on any change outside metadata/status (custom resources, like the real server);
    # "spec": bump on .spec change (apps/v1 kinds); "none": no metadata.generation (ConfigMap, ...).
    generation: str = "none"
    printer_columns: list[dict[str, Any]] = field(default_factory=list)
    schema: dict[str, Any] | None = None  # CRD openAPIV3Schema; None for built-ins
    crd_name: str | None = None
    storage_version: str = ""

    @property
    def group_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def qualified(self) -> str:
        """`configmaps` or `trainjobs.example.com`, as in real error messages."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def is_custom(self) -> bool:
        return self.crd_name is not None

    @property
    def storage_key(self) -> tuple[str, str]:
        return (self.group, self.plural)


def _builtin(group: str, version: str, kind: str, plural: str, namespaced: bool, **kw: Any) -> ResourceType:
    return ResourceType(group, version, plural, kind.lower(), kind, namespaced, storage_version=version, **kw)


BUILTIN_TYPES: list[ResourceType] = [
    _builtin("", "v1", "Namespace", "namespaces", False, short_names=("ns",), has_status=True),
    _builtin("", "v1", "ConfigMap", "configmaps", True, short_names=("cm",)),
    _builtin("", "v1", "Secret", "secrets", True),
    _builtin("", "v1", "Service", "services", True, short_names=("svc",), has_status=True),
    _builtin("", "v1", "ServiceAccount", "serviceaccounts", True, short_names=("sa",)),
    _builtin("", "v1", "PersistentVolumeClaim", "persistentvolumeclaims", True, short_names=("pvc",),
             has_status=True),
    _builtin("", "v1", "Pod", "pods", True, short_names=("po",), has_status=True, categories=("all",)),
    _builtin("", "v1", "Event", "events", True, short_names=("ev",)),
    _builtin("apps", "v1", "StatefulSet", "statefulsets", True, short_names=("sts",), has_status=True,
             generation="spec", categories=("all",)),
    _builtin("apps", "v1", "Deployment", "deployments", True, short_names=("deploy",), has_status=True,
             generation="spec", categories=("all",)),
    _builtin("apiextensions.k8s.io", "v1", "CustomResourceDefinition", "customresourcedefinitions", False,
             short_names=("crd", "crds"), has_status=True, generation="spec"),
    _builtin("coordination.k8s.io", "v1", "Lease", "leases", True),
    _builtin("rbac.authorization.k8s.io", "v1", "Role", "roles", True),
    _builtin("rbac.authorization.k8s.io", "v1", "RoleBinding", "rolebindings", True),
    _builtin("rbac.authorization.k8s.io", "v1", "ClusterRole", "clusterroles", False),
    _builtin("rbac.authorization.k8s.io", "v1", "ClusterRoleBinding", "clusterrolebindings", False),
    _builtin("events.k8s.io", "v1", "Event", "events", True, short_names=("ev",)),
]  # fmt: skip

# Field selectors the real server accepts per resource (beyond metadata.name / metadata.namespace).
FIELD_SELECTORS: dict[tuple[str, str], tuple[str, ...]] = {
    ("", "events"): ("involvedObject.kind", "involvedObject.namespace", "involvedObject.name",
                     "involvedObject.uid", "involvedObject.apiVersion", "involvedObject.resourceVersion",
                     "involvedObject.fieldPath", "reason", "reportingComponent", "source", "type"),
    ("events.k8s.io", "events"): ("regarding.kind", "regarding.namespace", "regarding.name",
                                  "regarding.uid", "reason", "type"),
    ("", "pods"): ("spec.nodeName", "spec.restartPolicy", "spec.schedulerName", "spec.serviceAccountName",
                   "status.phase", "status.podIP", "status.nominatedNodeName"),
    ("", "secrets"): ("type",),
    ("", "namespaces"): ("status.phase",),
}  # fmt: skip


# ----------------------------------------------------------------------------------- selectors

_REQUIREMENT = re.compile(
    r"^\s*(?P<neg>!)?\s*(?P<key>[A-Za-z0-9_./-]+)\s*"
    r"(?:(?P<op>==|=|!=)\s*(?P<value>[A-Za-z0-9_.-]*)|\s(?P<setop>in|notin)\s*\((?P<values>[^)]*)\))?\s*$"
)


def _split_selector(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for char in text:
        depth += char == "("
        depth -= char == ")"
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return [p for p in parts if p.strip()]


def label_selector_matcher(text: str | None) -> Callable[[dict[str, str]], bool]:
    """Equality (`a=b`, `a==b`, `a!=b`), set-based (`a in (x,y)`, `a notin (x)`), existence (`a`, `!a`)."""
    if not text:
        return lambda labels: True
    checks: list[Callable[[dict[str, str]], bool]] = []
    for part in _split_selector(text):
        match = _REQUIREMENT.match(part)
        if not match:
            raise ApiError.bad_request(f"unable to parse requirement: {part!r}")
        key, op, value, setop = match["key"], match["op"], match["value"], match["setop"]
        if match["neg"]:
            if op or setop:
                raise ApiError.bad_request(f"unable to parse requirement: {part!r}")
            checks.append(lambda labels, k=key: k not in labels)
        elif op in ("=", "=="):
            checks.append(lambda labels, k=key, v=value: labels.get(k) == v)
        elif op == "!=":
            checks.append(lambda labels, k=key, v=value: labels.get(k) != v)
        elif setop:
            values = {v.strip() for v in match["values"].split(",") if v.strip()}
            if setop == "in":
                checks.append(lambda labels, k=key, vs=values: labels.get(k) in vs)
            else:
                checks.append(lambda labels, k=key, vs=values: labels.get(k) not in vs)
        else:
            checks.append(lambda labels, k=key: k in labels)
    return lambda labels: all(check(labels) for check in checks)


def _dotted(obj: dict[str, Any], path: str) -> str:
    value: Any = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return "" if value is None else str(value)


def field_selector_matcher(text: str | None, rtype: ResourceType) -> Callable[[dict[str, Any]], bool]:
    if not text:
        return lambda obj: True
    allowed = ("metadata.name", "metadata.namespace", *FIELD_SELECTORS.get(rtype.storage_key, ()))
    checks: list[Callable[[dict[str, Any]], bool]] = []
    for part in _split_selector(text):
        match = re.match(r"^\s*([A-Za-z0-9_.]+)\s*(==|=|!=)\s*(.*?)\s*$", part)
        if not match:
            raise ApiError.bad_request(f"invalid selector: {part!r}; can't understand {part!r}")
        path, op, value = match.groups()
        if path not in allowed:
            raise ApiError.bad_request(f"field label not supported: {path}")
        if op == "!=":
            checks.append(lambda obj, p=path, v=value: _dotted(obj, p) != v)
        else:
            checks.append(lambda obj, p=path, v=value: _dotted(obj, p) == v)
    return lambda obj: all(check(obj) for check in checks)


# ------------------------------------------------------------------------------------- store


@dataclass
class WatchEvent:
    resource_version: int
    type: str  # ADDED / MODIFIED / DELETED
    storage_key: tuple[str, str]
    obj: dict[str, Any]


@dataclass(eq=False)  # identity hash: watchers live in a set
class Watcher:
    storage_key: tuple[str, str]
    namespace: str | None
    accepts: Callable[[dict[str, Any]], bool]
    queue: asyncio.Queue[WatchEvent | None] = field(default_factory=asyncio.Queue)


class Store:
    """Objects keyed by (group, plural) -> (namespace, name); one global resourceVersion counter."""

    def __init__(self, history_limit: int = 10_000) -> None:
        self.resource_version = 0
        self.objects: dict[tuple[str, str], dict[tuple[str, str], dict[str, Any]]] = {}
        self.history: deque[WatchEvent] = deque(maxlen=history_limit)
        # Watches from an RV at or below this one get 410 Gone (history compacted away).
        self.compacted_below = 0
        self.watchers: set[Watcher] = set()

    def next_resource_version(self) -> int:
        self.resource_version += 1
        return self.resource_version

    def bucket(self, storage_key: tuple[str, str]) -> dict[tuple[str, str], dict[str, Any]]:
        return self.objects.setdefault(storage_key, {})

    def get(self, storage_key: tuple[str, str], namespace: str, name: str) -> dict[str, Any] | None:
        return self.bucket(storage_key).get((namespace, name))

    def list(self, storage_key: tuple[str, str], namespace: str | None) -> list[dict[str, Any]]:
        items = [obj for (ns, _), obj in self.bucket(storage_key).items() if namespace is None or ns == namespace]
        return sorted(items, key=lambda o: (o["metadata"].get("namespace", ""), o["metadata"]["name"]))

    def put(self, storage_key: tuple[str, str], obj: dict[str, Any], event_type: str) -> None:
        meta = obj["metadata"]
        self.bucket(storage_key)[(meta.get("namespace", ""), meta["name"])] = obj
        self._emit(WatchEvent(int(meta["resourceVersion"]), event_type, storage_key, obj))

    def remove(self, storage_key: tuple[str, str], obj: dict[str, Any]) -> None:
        """Delete. The caller gives `obj` a fresh resourceVersion (as etcd-backed k8s does)."""
        meta = obj["metadata"]
        self.bucket(storage_key).pop((meta.get("namespace", ""), meta["name"]), None)
        self._emit(WatchEvent(int(meta["resourceVersion"]), "DELETED", storage_key, obj))

    def _emit(self, event: WatchEvent) -> None:
        if len(self.history) == self.history.maxlen and self.history:
            self.compacted_below = self.history[0].resource_version
        self.history.append(event)
        for watcher in list(self.watchers):
            if watcher.storage_key == event.storage_key and self._visible(watcher, event):
                watcher.queue.put_nowait(event)

    @staticmethod
    def _visible(watcher: Watcher, event: WatchEvent) -> bool:
        namespace = event.obj["metadata"].get("namespace", "")
        return (watcher.namespace is None or namespace == watcher.namespace) and watcher.accepts(event.obj)

    def events_since(self, watcher: Watcher, resource_version: int) -> Iterable[WatchEvent]:
        for event in self.history:
            if (
                event.resource_version > resource_version
                and event.storage_key == watcher.storage_key
                and self._visible(watcher, event)
            ):
                yield event

    def compact(self) -> None:
        """Forget the watch history: watches from any older resourceVersion now get 410 Gone."""
        self.history.clear()
        self.compacted_below = self.resource_version

    def close_watchers(self) -> None:
        for watcher in list(self.watchers):
            watcher.queue.put_nowait(None)
