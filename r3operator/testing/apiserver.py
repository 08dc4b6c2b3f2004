"""A Kubernetes API server emulator (aiohttp) for tests: kubectl, the python client and kopf talk to it.

Usage::

    with KubeAPIEmulator() as api:          # 127.0.0.1, ephemeral port, background thread
        api.url, api.kubeconfig_path         # http://127.0.0.1:PORT, a kubeconfig with that server
        api.requests                         # [RequestRecord(method, path, query, content_type, status)]

    python -m r3operator.testing.apiserver --port 8001 [--kubeconfig PATH]

EMULATED (pinned by tests/emulator/test_contract.py, which also runs against a real cluster):
discovery (/version, /api, /apis, /api/v1, /apis/{g}, /apis/{g}/{v}; plain lists, CRD groups appear
when created); OpenAPI v3 (/openapi/v3 root and per group-version, with the PATCH/fieldValidation
trick so kubectl delegates validation, and CRD schemas for `kubectl explain`); /openapi/v2 -> 404;
built-in kinds core/v1 namespaces, configmaps, secrets, services, serviceaccounts,
persistentvolumeclaims, pods, events; apps/v1 statefulsets, deployments; coordination.k8s.io/v1 leases;
rbac.authorization.k8s.io/v1 roles, rolebindings, clusterroles, clusterrolebindings;
events.k8s.io/v1 events; apiextensions.k8s.io/v1 customresourcedefinitions (creating one registers
its served versions with scope, shortNames, categories, status subresource, printer columns; it gets
Established/NamesAccepted conditions at once; deleting it deletes its objects). CRUD for namespaced
and cluster-scoped kinds; namespaces must exist (`default`, `kube-system`, `kube-public` do);
labelSelector (=, ==, !=, in, notin, exists, !exists); fieldSelector (metadata.name,
metadata.namespace, and the per-kind fields the real server supports, e.g. involvedObject.* on
events; others -> 400); watch (newline-delimited JSON over chunked HTTP; from a resourceVersion via an
event history, or synthetic ADDED events when none/0 is given; sendInitialEvents + the
initial-events-end BOOKMARK; timeoutSeconds; 410 Expired ERROR event for resourceVersions older than
the retained history - `api.compact()` forces that); one global monotonic resourceVersion; uid,
creationTimestamp; metadata.generation for custom resources (bumped when anything outside
metadata/status changes, as the real server does for CRs) and apps/v1 + CRDs (bumped on .spec
change) - other built-ins (ConfigMap, Secret, Service, Pod, ...) carry no generation; no-op writes
keep the resourceVersion and send no event; 409 Conflict on a stale resourceVersion (PUT, and patches
whose result carries another metadata.resourceVersion, e.g. a merge patch that sets it) and on
DeleteOptions preconditions; 409 AlreadyExists; 404 NotFound; real Status shapes; status subresource
isolation both ways (main writes keep .status for kinds with the subresource; /status writes change
only .status); finalizers (DELETE sets deletionTimestamp -> MODIFIED + 202; the object goes with
DELETED when the last finalizer is removed; no new finalizers while deleting); DELETE with
propagationPolicy accepted (and ignored); patch types merge-patch, json-patch, and for built-ins a
documented strategic-merge SUBSET (see apiserver_patch.py); dryRun=All; Table output
(`Accept: application/json;as=Table;v=v1;g=meta.k8s.io`) with the CRD's additionalPrinterColumns
(JSONPath subset, see apiserver_tables.py; `date` columns humanised) or Name/Age for built-ins, also
for watch events (one-row Tables; column definitions on the first event); validation on write:
custom resources by the CRD openAPIV3Schema (jsonschema), `default:` values applied on write, unknown
fields rejected under fieldValidation=Strict (kubectl's default) and warned about under Warn (the
default for other clients), CEL x-kubernetes-validations via r3operator.testing.cel (transition rules
with oldSelf on update) -> 422 Invalid with details.causes[].field/reason; built-ins by
kubernetes-validate's Kubernetes 1.35 schemas (strict under Strict); CRD creation checks names,
one storage version, and that every CEL rule compiles (unsupported CEL -> 422); metadata.name must
be a DNS subdomain; a request log (`api.requests`).

NOT EMULATED (never claim test coverage of these): server-side apply (`apply-patch+yaml` -> 415) and
managedFields; full strategic merge patch (only the subset); pruning of unknown fields (the real
server drops them; the emulator keeps them unless Strict rejects them); defaulting on read; CRD
conversion (all served versions share one storage, only apiVersion is rewritten); structural-schema
checks on CRD creation; format validation (int32, date-time, ...); the CEL cost budget and type
checker; garbage collection / ownerReference cascade (adopted children survive their owner);
namespace lifecycle (deleting a namespace leaves its contents); controllers of any kind (no
StatefulSet -> Pod, no Deployment -> ReplicaSet, no endpoints, no PVC binding, no Pod status); the
scheduler and kubelet; admission webhooks and admission plugins (quotas, limit ranges, service
accounts tokens); RBAC, authentication and authorization (any token or none is accepted); watch
BOOKMARK events besides the initial-events-end one (allowWatchBookmarks is ignored); DELETED/ADDED
synthesis when an object leaves/enters a watch's selector; pagination (`limit`/`continue` are
ignored: everything is returned); protobuf and YAML bodies; aggregated discovery (plain lists are
served, kubectl falls back); core/v1 and events.k8s.io/v1 events are separate stores; Lease semantics
beyond CRUD; scale subresources; exec/logs/port-forward/proxy; TLS.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from aiohttp import web

from r3operator.testing import apiserver_openapi as openapi
from r3operator.testing.apiserver_errors import ApiError
from r3operator.testing.apiserver_handlers import NAMESPACE_KEY, Server, now

DEFAULT_NAMESPACES = ("default", "kube-system", "kube-public")


@dataclass(frozen=True)
class RequestRecord:
    method: str
    path: str
    query: dict[str, str]
    content_type: str
    status: int


def build_app(server: Server, requests: list[RequestRecord], server_address: str = "127.0.0.1") -> web.Application:
    async def handle(request: web.Request) -> web.StreamResponse:
        try:
            response = await _dispatch(server, request, server_address)
        except ApiError as exc:
            response = web.json_response(exc.status(), status=exc.code)
        except json.JSONDecodeError as exc:
            response = web.json_response(ApiError.bad_request(f"invalid JSON body: {exc}").status(), status=400)
        except Exception as exc:  # an emulator bug: answer with a Status so that the test shows it
            error = ApiError(500, "InternalError", f"emulator error: {type(exc).__name__}: {exc}")
            response = web.json_response(error.status(), status=500)
        requests.append(
            RequestRecord(
                request.method,
                request.path,
                dict(request.query),
                request.headers.get("Content-Type", ""),
                response.status,
            )
        )
        return response

    app = web.Application(client_max_size=64 * 1024**2)
    app.router.add_route("*", "/{tail:.*}", handle)
    return app


async def _dispatch(server: Server, request: web.Request, server_address: str) -> web.StreamResponse:
    segments = [s for s in request.path.split("/") if s]
    if request.method == "GET":
        if segments == ["version"]:
            return web.json_response(openapi.SERVER_VERSION)
        if segments == ["api"]:
            return web.json_response(openapi.api_versions(server_address))
        if segments == ["apis"]:
            return web.json_response(openapi.api_group_list(server.served()))
        if segments[:2] == ["openapi", "v3"]:
            return _openapi(server, segments[2:])
        if segments in (["healthz"], ["readyz"], ["livez"]):
            return web.Response(text="ok")
    if segments[:2] == ["api", "v1"]:
        group, version, rest = "", "v1", segments[2:]
    elif len(segments) >= 3 and segments[0] == "apis":
        group, version, rest = segments[1], segments[2], segments[3:]
    elif len(segments) == 2 and segments[0] == "apis" and request.method == "GET":
        versions = sorted({t.version for t in server.served() if t.group == segments[1]})
        if not versions:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        return web.json_response(openapi.api_group(segments[1], versions, server.served()))
    else:
        raise ApiError(404, "NotFound", "the server could not find the requested resource")
    if not rest:
        return web.json_response(server.discovery(group, version))
    namespace: str | None = None
    if rest[0] == "namespaces" and len(rest) >= 3 and rest[2] not in ("status", "finalize"):
        namespace, rest = rest[1], rest[2:]
    plural, name = rest[0], rest[1] if len(rest) > 1 else None
    subresource = rest[2] if len(rest) > 2 else None
    rtype = server.types.get((group, version, plural))
    if rtype is None or len(rest) > 3 or (namespace is not None and not rtype.namespaced):
        raise ApiError(404, "NotFound", "the server could not find the requested resource")
    if subresource is not None and (subresource != "status" or not rtype.has_status):
        raise ApiError(404, "NotFound", "the server could not find the requested resource")
    key_namespace = namespace or ""
    if name is not None and rtype.namespaced and namespace is None:
        raise ApiError(404, "NotFound", "the server could not find the requested resource")
    method = request.method
    if name is None:
        if method == "GET":
            if request.query.get("watch") in ("true", "1"):
                return await server.watch(request, rtype, namespace)
            return server.list(request, rtype, namespace)
        if method == "POST":
            return server.create(request, rtype, namespace, await _body(request))
        if method == "DELETE":
            return server.delete_collection(request, rtype, namespace)
    else:
        if method == "GET":
            return server.render(request, rtype, server.lookup(rtype, key_namespace, name))
        if method == "PUT":
            return server.update(request, rtype, key_namespace, name, await _body(request), subresource)
        if method == "PATCH":
            return server.patch(request, rtype, key_namespace, name, await _body(request), subresource)
        if method == "DELETE":
            body = await _body(request) if request.can_read_body else {}
            return server.delete(request, rtype, key_namespace, name, body if isinstance(body, dict) else {})
    raise ApiError.method_not_allowed(f"the server does not allow this method on the requested resource: {method}")


async def _body(request: web.Request) -> Any:
    content_type = request.headers.get("Content-Type", "")
    if any(kind in content_type for kind in ("protobuf", "cbor", "yaml")):
        # Typed client-go clients (e.g. `kubectl create configmap`) send protobuf; server-side apply sends
        # apply-patch+yaml. Neither is emulated: refuse loudly rather than guess.
        raise ApiError.unsupported_media_type(content_type, ("application/json",))
    raw = await request.read()
    return json.loads(raw) if raw.strip() else {}


def _openapi(server: Server, rest: list[str]) -> web.Response:
    types = server.served()
    if not rest:
        return web.json_response(openapi.openapi_root(types))
    if rest[:2] == ["api", "v1"] and len(rest) == 2:
        members = [t for t in types if t.group == ""]
    elif rest[0] == "apis" and len(rest) == 3:
        members = [t for t in types if t.group == rest[1] and t.version == rest[2]]
    else:
        members = []
    if not members:
        raise ApiError(404, "NotFound", "the server could not find the requested resource")
    return web.json_response(openapi.openapi_group_version(members))


def _seed_namespaces(server: Server, names: tuple[str, ...]) -> None:
    import uuid

    for name in names:
        obj = {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {
                "name": name,
                "uid": str(uuid.uuid4()),
                "creationTimestamp": now(),
                "labels": {"kubernetes.io/metadata.name": name},
                "resourceVersion": str(server.store.next_resource_version()),
            },
            "spec": {"finalizers": ["kubernetes"]},
            "status": {"phase": "Active"},
        }
        server.store.put(NAMESPACE_KEY, obj, "ADDED")


def write_kubeconfig(path: Path, url: str, namespace: str = "default") -> Path:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "emulator", "cluster": {"server": url}}],
        "users": [{"name": "emulator", "user": {"token": "emulator-token"}}],
        "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "emulator",
                                                      "namespace": namespace}}],
        "current-context": "emulator",
    }  # fmt: skip
    path.write_text(json.dumps(config, indent=2))  # JSON is valid YAML
    return path


class KubeAPIEmulator:
    """The emulator on 127.0.0.1 in a background thread with its own event loop.

    Args:
        port: 0 (default) picks a free ephemeral port.
        host: loopback only by design; kept as a parameter for the CLI.
        kubeconfig_dir: where kubeconfig is written (default: a fresh temp dir, removed on stop).
        cel_engine: "cel" (common-expression-language), "celpy", or "cross-check" (both; a
            disagreement becomes a 500 so dialect drift cannot pass silently).
        namespaces: namespaces that exist from the start.
        history_limit: watch events kept; watches from older resourceVersions get 410 Expired.
    """

    def __init__(
        self,
        *,
        port: int = 0,
        host: str = "127.0.0.1",
        kubeconfig_dir: str | Path | None = None,
        cel_engine: str = "cel",
        namespaces: tuple[str, ...] = DEFAULT_NAMESPACES,
        history_limit: int = 10_000,
    ) -> None:
        if cel_engine not in ("cel", "celpy", "cross-check"):
            raise ValueError(f"cel_engine must be 'cel', 'celpy' or 'cross-check', not {cel_engine!r}")
        self.host, self._port = host, port
        self.server = Server(cel_engine=cel_engine, history_limit=history_limit)
        _seed_namespaces(self.server, namespaces)
        self.requests: list[RequestRecord] = []
        self._tempdir: tempfile.TemporaryDirectory[str] | None = None
        self._kubeconfig_dir = Path(kubeconfig_dir) if kubeconfig_dir else None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self.kubeconfig_path: Path | None = None

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self._port}"

    def start(self) -> Self:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self._port))
        self._port = sock.getsockname()[1]
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()
        failure: list[BaseException] = []

        async def startup() -> None:
            app = build_app(self.server, self.requests, f"{self.host}:{self._port}")
            self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=1.0, access_log=None)
            await self._runner.setup()
            await web.SockSite(self._runner, sock).start()

        def run() -> None:
            assert self._loop is not None
            asyncio.set_event_loop(self._loop)
            try:
                self._loop.run_until_complete(startup())
            except BaseException as exc:  # surfaced to start()'s caller
                failure.append(exc)
                ready.set()
                return
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="kube-api-emulator", daemon=True)
        self._thread.start()
        ready.wait(timeout=30)
        if failure:
            raise RuntimeError(f"API emulator failed to start on {self.url}") from failure[0]
        if self._kubeconfig_dir is None:
            self._tempdir = tempfile.TemporaryDirectory(prefix="kube-api-emulator-")
            self._kubeconfig_dir = Path(self._tempdir.name)
        self.kubeconfig_path = write_kubeconfig(self._kubeconfig_dir / "kubeconfig", self.url)
        return self

    def call(self, function: Any, *args: Any) -> Any:
        """Run `function(*args)` on the emulator's loop (its state is not thread-safe) and return the result."""
        assert self._loop is not None, "emulator not started"

        async def invoke() -> Any:
            return function(*args)

        return asyncio.run_coroutine_threadsafe(invoke(), self._loop).result(timeout=30)

    def compact(self) -> None:
        """Drop the watch history: watches from any earlier resourceVersion now get 410 Expired."""
        self.call(self.server.store.compact)

    @property
    def resource_version(self) -> int:
        return self.server.store.resource_version

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self.call(self.server.store.close_watchers)
            if self._runner is not None:
                asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=30)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
            self._loop.close()
            self._loop = self._thread = None
        if self._tempdir is not None:
            self._tempdir.cleanup()
            self._tempdir = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:  # fmt: skip
        self.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Kubernetes API server emulator for tests (loopback only)")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--kubeconfig", type=Path, help="write a kubeconfig pointing at the emulator here")
    parser.add_argument("--cel-engine", default="cel", choices=["cel", "celpy", "cross-check"])
    args = parser.parse_args(argv)
    emulator = KubeAPIEmulator(port=args.port, cel_engine=args.cel_engine)
    emulator.start()
    if args.kubeconfig:
        write_kubeconfig(args.kubeconfig, emulator.url)
    print(f"Kubernetes API emulator on {emulator.url}; kubeconfig {args.kubeconfig or emulator.kubeconfig_path}",
          flush=True)  # fmt: skip
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        emulator.stop()


if __name__ == "__main__":
    main()
