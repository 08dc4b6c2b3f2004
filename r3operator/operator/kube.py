"""The operator's one Kubernetes client: async REST on aiohttp (get, server-side apply, merge-patch of
/status, delete with preconditions, discovery).

Why this and not the official ``kubernetes`` client: kopf already runs on aiohttp in the same event
loop, so this adds no dependency and no thread pool; the official client is synchronous (every call
would block kopf's loop or need a thread) and large in memory with hundreds of RLJobs. Server-side
apply needs nothing more than a content type and two query parameters. Credentials come from kopf's
login (in-cluster service account or kubeconfig), so the operator and kopf always talk to the same
server as the same user.
"""

from __future__ import annotations

import builtins
import ssl
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from json import loads as json_loads
from typing import Any
from urllib.parse import urlencode

import aiohttp

from r3operator import __version__
from r3operator.api.engine_layout import LWS_API_VERSION, LWS_PLURAL

# Any: a Kubernetes API body is JSON of any kind's shape (the typed ones are in api/), and kubernetes_asyncio's
# connection info is untyped: both are Any here.

MERGE_PATCH = "application/merge-patch+json"
USER_AGENT = f"r3operator/{__version__}"
APPLY_PATCH = "application/apply-patch+yaml"
FIELD_MANAGER = "r3operator"
"""The server-side-apply field manager of every child the operator writes."""
MAX_CONNECTIONS = 64
"""Requests (watches aside) in flight at once; more wait for a free connection. Each connection is a TLS session
holding ~0.3 MB (asyncio's 256 KiB read buffer and OpenSSL's): aiohttp's default of 100, with kopf's own session
beside it, let a standby's first passes over 100 RLJobs hold 131 of them (benchmarks/operator_probe.py). 64 is
about twice what a 5-RLJobs-a-second burst keeps in flight on the benchmark's control plane."""


class KubeError(Exception):
    """A non-2xx answer from the API server, with its status code and Status message."""

    def __init__(self, status: int, message: str, reason: str = "", causes: tuple[str, ...] = ()) -> None:
        super().__init__(f"HTTP {status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message
        self.causes = causes
        """``details.causes[].reason`` of the Status, e.g. ``NamespaceTerminating``."""

    @property
    def namespace_terminating(self) -> bool:
        """A create refused because the namespace is being deleted (403, cause NamespaceTerminating)."""
        return "NamespaceTerminating" in self.causes or (
            self.status == 403 and "because it is being terminated" in self.message
        )


@dataclass(frozen=True, slots=True)
class Kind:
    api_version: str
    plural: str
    namespaced: bool = True

    def path(self, namespace: str | None, name: str | None = None, subresource: str | None = None) -> str:
        base = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        path = f"{base}/namespaces/{namespace}/{self.plural}" if self.namespaced else f"{base}/{self.plural}"
        if name:
            path += f"/{name}"
        if subresource:
            path += f"/{subresource}"
        return path


KINDS: dict[str, Kind] = {
    "PersistentVolumeClaim": Kind("v1", "persistentvolumeclaims"),
    "ConfigMap": Kind("v1", "configmaps"),
    "ServiceAccount": Kind("v1", "serviceaccounts"),
    "Role": Kind("rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": Kind("rbac.authorization.k8s.io/v1", "rolebindings"),
    "Service": Kind("v1", "services"),
    "Event": Kind("v1", "events"),
    "StatefulSet": Kind("apps/v1", "statefulsets"),
    "LeaderWorkerSet": Kind(LWS_API_VERSION, LWS_PLURAL),
    "Pod": Kind("v1", "pods"),
    "NetworkPolicy": Kind("networking.k8s.io/v1", "networkpolicies"),
    "RayJob": Kind("ray.io/v1", "rayjobs"),
    "Job": Kind("batch/v1", "jobs"),
    "PodMonitor": Kind("monitoring.coreos.com/v1", "podmonitors"),
    "RLJob": Kind("r3operator.io/v1alpha1", "rljobs"),
    "Workload": Kind("kueue.x-k8s.io/v1beta1", "workloads"),
    "Secret": Kind("v1", "secrets"),
    "PriorityClass": Kind("scheduling.k8s.io/v1", "priorityclasses", namespaced=False),
}


def kind_of(obj: dict[str, Any]) -> Kind:
    return KINDS[obj["kind"]]


def _write_temp(data: str | bytes) -> str:
    with tempfile.NamedTemporaryFile("wb", delete=False, suffix=".pem") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        return f.name


def _ssl_context(info: Any) -> ssl.SSLContext | bool:
    if not str(info.server).startswith("https"):
        return False
    if info.insecure:
        return False
    ca_data = info.ca_data.decode() if isinstance(info.ca_data, bytes) else info.ca_data
    context = ssl.create_default_context(cafile=info.ca_path or None, cadata=ca_data or None)
    cert, key = info.certificate_path, info.private_key_path
    if info.certificate_data:
        cert = _write_temp(info.certificate_data)
    if info.private_key_data:
        key = _write_temp(info.private_key_data)
    if cert:
        context.load_cert_chain(cert, key)
    return context


class KubeClient:
    """One aiohttp session; create it inside the event loop that uses it."""

    def __init__(self, server: str, *, headers: dict[str, str] | None = None, ssl_context: Any = False) -> None:
        self.server = server.rstrip("/")
        # A name of our own in the apiserver's audit log and its per-client metrics (kopf's watches say kopf/...).
        self._headers = {"User-Agent": USER_AGENT, **(headers or {})}
        self._ssl = ssl_context
        self._session: aiohttp.ClientSession | None = None
        self._watch_session: aiohttp.ClientSession | None = None

    @classmethod
    def from_connection_info(cls, info: Any) -> KubeClient:
        """From a ``kopf.ConnectionInfo`` (what kopf's login handlers return)."""
        headers: dict[str, str] = {}
        if info.token:
            headers["Authorization"] = f"{info.scheme or 'Bearer'} {info.token}"
        elif info.username and info.password:
            headers["Authorization"] = aiohttp.BasicAuth(info.username, info.password).encode()
        return cls(str(info.server), headers=headers, ssl_context=_ssl_context(info))

    async def _request(self, method: str, path: str, *, json: Any = None, content_type: str | None = None) -> Any:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=MAX_CONNECTIONS),
                headers=self._headers,
                # sock_connect, not connect: a wait for a free connection in the pool is no connect timeout.
                timeout=aiohttp.ClientTimeout(total=60, sock_connect=10),
            )
        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        async with self._session.request(method, self.server + path, json=json, headers=headers, ssl=self._ssl) as r:
            text = await r.text()
            # kube-apiserver answers some errors (404 for an unknown group) in plain text, not a Status.
            try:
                body = json_loads(text) if text else None
            except ValueError:
                body = None
            if r.status >= 400:
                status: dict[str, Any] = body if isinstance(body, dict) else {"message": text[:500]}
                details = status.get("details") or {}
                causes = tuple(str(c.get("reason", "")) for c in details.get("causes") or [])
                raise KubeError(r.status, str(status.get("message", "")), str(status.get("reason", "")), causes)
            if text and body is None:
                raise KubeError(r.status, f"not JSON: {text[:200]!r}", "BadResponse")
            return body

    async def request(self, method: str, path: str, body: Any = None) -> Any:
        """A JSON request (POST create, PUT replace) the typed helpers below do not cover."""
        return await self._request(method, path, json=body, content_type="application/json" if body else None)

    async def close(self) -> None:
        for session in (self._session, self._watch_session):
            if session is not None:
                await session.close()
        self._session = self._watch_session = None

    async def get(self, kind: Kind, namespace: str | None, name: str) -> dict[str, Any] | None:
        try:
            return await self._request("GET", kind.path(namespace, name))
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    async def list(self, kind: Kind, namespace: str | None, *, label_selector: str) -> list[dict[str, Any]]:
        path = kind.path(namespace) + "?" + urlencode({"labelSelector": label_selector})
        return list((await self._request("GET", path) or {}).get("items") or [])

    async def list_with_version(
        self, kind: Kind, namespace: str | None, *, label_selector: str, page: int = 500
    ) -> tuple[builtins.list[dict[str, Any]], str]:
        """Every object matching ``label_selector`` (paged) and the list's resourceVersion, where a watch
        resumes. Items of a list carry no ``kind``; it is set here so they look like what a GET returns."""
        items: builtins.list[dict[str, Any]] = []
        query: dict[str, Any] = {"labelSelector": label_selector, "limit": page}
        while True:
            body = await self._request("GET", kind.path(namespace) + "?" + urlencode(query)) or {}
            kind_name = str(body.get("kind") or "").removesuffix("List")
            for item in body.get("items") or []:
                item.setdefault("kind", kind_name)
                item.setdefault("apiVersion", kind.api_version)
                items.append(item)
            metadata = body.get("metadata") or {}
            if not metadata.get("continue"):
                return items, str(metadata.get("resourceVersion") or "")
            query["continue"] = metadata["continue"]

    async def watch(
        self, kind: Kind, namespace: str | None, *, label_selector: str, resource_version: str, timeout_s: int
    ) -> AsyncIterator[dict[str, Any]]:
        """The watch events (``{"type", "object"}``) after ``resource_version``, with bookmarks, until the
        server closes the stream after ``timeout_s``. A 410 Gone arrives as an ``ERROR`` event (or a
        KubeError 410 when the server refuses at once): the caller lists again."""
        query = {
            "watch": "true",
            "labelSelector": label_selector,
            "resourceVersion": resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": timeout_s,
        }
        if self._watch_session is None or self._watch_session.closed:
            # A session of their own: each open watch holds a connection, and the requests' pool (100) must never
            # wait behind them. No total timeout: a stream lives for timeout_s; a silent one ends a minute after.
            self._watch_session = aiohttp.ClientSession(
                headers=self._headers,
                connector=aiohttp.TCPConnector(limit=0),
                timeout=aiohttp.ClientTimeout(total=None, connect=10, sock_read=timeout_s + 60),
            )
        url = self.server + kind.path(namespace) + "?" + urlencode(query)
        async with self._watch_session.get(url, headers={"Accept": "application/json"}, ssl=self._ssl) as r:
            if r.status >= 400:
                text = await r.text()
                try:
                    status = json_loads(text)
                except ValueError:
                    status = {"message": text[:500]}
                raise KubeError(r.status, str(status.get("message", "")), str(status.get("reason", "")))
            # One JSON document per line; lines are split by hand (aiohttp's line reader caps a line at 128 KiB).
            buffer = b""
            async for chunk in r.content.iter_any():
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if line.strip():
                        yield json_loads(line)

    async def apply(self, obj: dict[str, Any], *, force: bool, field_manager: str = FIELD_MANAGER) -> dict[str, Any]:
        """Server-side apply of ``obj`` (creates it when absent). The server merges by the fields each
        manager owns: fields this manager applied before and left out now are removed, fields other
        managers own stay. ``force`` takes over fields another manager set (only on our own objects)."""
        kind = kind_of(obj)
        path = kind.path(obj["metadata"].get("namespace"), obj["metadata"]["name"])
        query = f"?fieldManager={field_manager}&force={'true' if force else 'false'}"
        # JSON is YAML: the apply-patch+yaml body may be sent as JSON.
        return await self._request("PATCH", path + query, json=obj, content_type=APPLY_PATCH)

    async def merge_patch(
        self, kind: Kind, namespace: str | None, name: str, patch: dict[str, Any], *, subresource: str | None = None
    ) -> dict[str, Any]:
        path = kind.path(namespace, name, subresource)
        return await self._request("PATCH", path, json=patch, content_type=MERGE_PATCH)

    async def delete(self, kind: Kind, namespace: str | None, name: str, *, uid: str | None = None) -> bool:
        """False when it was already gone. Background propagation: children go via the GC.

        With ``uid``, the server deletes only that very object (a 409 if the name now holds another)."""
        body: dict[str, Any] = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
        if uid:
            body["preconditions"] = {"uid": uid}
        try:
            await self._request("DELETE", kind.path(namespace, name), json=body)
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    async def serves(self, group_version: str, plural: str) -> bool:
        """Discovery: is ``plural`` served under ``group_version`` (e.g. ray.io/v1, rayjobs)?"""
        try:
            doc = await self._request("GET", f"/apis/{group_version}")
        except KubeError as exc:
            if exc.status in (404, 503):
                return False
            raise
        return any(r.get("name") == plural for r in (doc or {}).get("resources", []))
