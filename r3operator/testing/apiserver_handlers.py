"""Request handling of the API-server emulator: CRUD, status subresource, finalizers, watch."""

from __future__ import annotations

import asyncio
import copy
import datetime as dt
import json
import secrets
import uuid
from typing import Any

from aiohttp import web

from r3operator.testing import apiserver_openapi as openapi
from r3operator.testing import apiserver_tables as tables
from r3operator.testing import apiserver_validation as validation
from r3operator.testing.apiserver_errors import ApiError, Cause
from r3operator.testing.apiserver_patch import apply_patch
from r3operator.testing.apiserver_store import (
    BUILTIN_TYPES,
    ResourceType,
    Store,
    Watcher,
    field_selector_matcher,
    label_selector_matcher,
)

CRD_KEY = ("apiextensions.k8s.io", "customresourcedefinitions")
NAMESPACE_KEY = ("", "namespaces")


def now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _comparable(obj: dict[str, Any]) -> dict[str, Any]:
    """The object minus what a write does not 'change' (resourceVersion, managedFields)."""
    clone = copy.deepcopy(obj)
    clone["metadata"].pop("resourceVersion", None)
    clone["metadata"].pop("managedFields", None)
    return clone


class Server:
    """State and request handlers; lives on the emulator's event loop."""

    def __init__(self, cel_engine: str = "cel", history_limit: int = 10_000) -> None:
        self.store = Store(history_limit)
        self.cel_engine = cel_engine
        self.types: dict[tuple[str, str, str], ResourceType] = {}
        for rtype in BUILTIN_TYPES:
            self.types[(rtype.group, rtype.version, rtype.plural)] = rtype

    # ------------------------------------------------------------------------------ registry

    def served(self) -> list[ResourceType]:
        return list(self.types.values())

    def register_crd(self, crd: dict[str, Any]) -> None:
        self.unregister_crd(crd["metadata"]["name"])
        spec, names = crd["spec"], crd["spec"]["names"]
        storage = next(v["name"] for v in spec["versions"] if v.get("storage"))
        for version in spec["versions"]:
            if not version.get("served", True):
                continue
            rtype = ResourceType(
                group=spec["group"],
                version=version["name"],
                plural=names["plural"],
                singular=names.get("singular") or names["kind"].lower(),
                kind=names["kind"],
                namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                short_names=tuple(names.get("shortNames") or ()),
                categories=tuple(names.get("categories") or ()),
                has_status="status" in (version.get("subresources") or {}),
                generation="all",
                printer_columns=list(version.get("additionalPrinterColumns") or []),
                schema=(version.get("schema") or {}).get("openAPIV3Schema"),
                crd_name=crd["metadata"]["name"],
                storage_version=storage,
            )
            self.types[(rtype.group, rtype.version, rtype.plural)] = rtype

    def unregister_crd(self, crd_name: str) -> None:
        for key in [k for k, t in self.types.items() if t.crd_name == crd_name]:
            del self.types[key]

    # ---------------------------------------------------------------------------- responses

    @staticmethod
    def for_version(rtype: ResourceType, obj: dict[str, Any]) -> dict[str, Any]:
        """Output copy in the requested version (CRD conversion strategy None: only apiVersion)."""
        out = copy.deepcopy(obj)
        out["apiVersion"], out["kind"] = rtype.group_version, rtype.kind
        return out

    def render(self, request: web.Request, rtype: ResourceType, obj: dict[str, Any], status: int = 200,
               warnings: list[str] | None = None) -> web.Response:  # fmt: skip
        body: dict[str, Any] = self.for_version(rtype, obj)
        if tables.wants_table(request.headers.get("Accept", "")):
            body = tables.table(rtype, [body], str(self.store.resource_version), _include(request))
        headers = {"Warning": ", ".join(f'299 - "{w}"' for w in warnings)} if warnings else None
        return web.json_response(body, status=status, headers=headers)

    # ------------------------------------------------------------------------------ reading

    def lookup(self, rtype: ResourceType, namespace: str, name: str) -> dict[str, Any]:
        obj = self.store.get(rtype.storage_key, namespace, name)
        if obj is None:
            raise ApiError.not_found(rtype.qualified, name)
        return obj

    def matching(self, request: web.Request, rtype: ResourceType, namespace: str | None) -> list[dict[str, Any]]:
        labels = label_selector_matcher(request.query.get("labelSelector"))
        fields = field_selector_matcher(request.query.get("fieldSelector"), rtype)
        return [
            o
            for o in self.store.list(rtype.storage_key, namespace)
            if labels(o["metadata"].get("labels") or {}) and fields(o)
        ]

    def list(self, request: web.Request, rtype: ResourceType, namespace: str | None) -> web.Response:
        items = [self.for_version(rtype, o) for o in self.matching(request, rtype, namespace)]
        rv = str(self.store.resource_version)
        if tables.wants_table(request.headers.get("Accept", "")):
            return web.json_response(tables.table(rtype, items, rv, _include(request)))
        return web.json_response(
            {"kind": f"{rtype.kind}List", "apiVersion": rtype.group_version, "metadata": {"resourceVersion": rv},
             "items": items}
        )  # fmt: skip

    async def watch(self, request: web.Request, rtype: ResourceType, namespace: str | None) -> web.StreamResponse:
        labels = label_selector_matcher(request.query.get("labelSelector"))
        fields = field_selector_matcher(request.query.get("fieldSelector"), rtype)
        watcher = Watcher(
            rtype.storage_key, namespace, lambda o: labels(o["metadata"].get("labels") or {}) and fields(o)
        )
        as_table = tables.wants_table(request.headers.get("Accept", ""))
        since = request.query.get("resourceVersion", "")
        initial = request.query.get("sendInitialEvents") == "true"
        backlog: list[tuple[str, dict[str, Any]]] = []
        expired = False
        # Registration and backlog are computed without an await in between, so no event is lost or doubled.
        if initial or since in ("", "0"):
            backlog = [("ADDED", o) for o in self.matching(request, rtype, namespace)]
        elif int(since) < self.store.compacted_below:
            expired = True
        else:
            backlog = [(e.type, e.obj) for e in self.store.events_since(watcher, int(since))]
        self.store.watchers.add(watcher)
        response = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        first = True

        async def send(event_type: str, obj: dict[str, Any]) -> None:
            nonlocal first
            payload: dict[str, Any] = self.for_version(rtype, obj) if event_type != "ERROR" else obj
            if as_table and event_type not in ("ERROR", "BOOKMARK"):
                payload = tables.table(rtype, [payload], obj["metadata"]["resourceVersion"], _include(request),
                                       with_columns=first)  # fmt: skip
                first = False
            await response.write(json.dumps({"type": event_type, "object": payload}).encode() + b"\n")

        try:
            if expired:
                error = ApiError.expired(f"too old resource version: {since} ({self.store.compacted_below})")
                await send("ERROR", error.status())
                return response
            for event_type, obj in backlog:
                await send(event_type, obj)
            if initial:
                bookmark = {
                    "kind": rtype.kind,
                    "apiVersion": rtype.group_version,
                    "metadata": {
                        "resourceVersion": str(self.store.resource_version),
                        "annotations": {"k8s.io/initial-events-end": "true"},
                    },
                }
                await response.write(json.dumps({"type": "BOOKMARK", "object": bookmark}).encode() + b"\n")
            timeout = float(request.query["timeoutSeconds"]) if "timeoutSeconds" in request.query else None
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout if timeout is not None else None
            while True:
                remaining = None if deadline is None else deadline - loop.time()
                if remaining is not None and remaining <= 0:
                    break
                try:
                    event = await asyncio.wait_for(watcher.queue.get(), remaining)
                except TimeoutError:
                    break
                if event is None:
                    break
                await send(event.type, event.obj)
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self.store.watchers.discard(watcher)
        return response

    # ------------------------------------------------------------------------------ writing

    def create(self, request: web.Request, rtype: ResourceType, namespace: str | None, body: Any) -> web.Response:
        if not isinstance(body, dict):
            raise ApiError.bad_request("the request body must be a JSON object")
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if body.get("kind") not in (None, rtype.kind):
            raise ApiError.bad_request(f"the API version in the data ({body.get('kind')}) does not match {rtype.kind}")
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + secrets.token_hex(3)[:5]
        if not meta.get("name"):
            raise ApiError.invalid(rtype.kind, rtype.group, "", [Cause("FieldValueRequired", "Required value: name "
                                   "or generateName is required", "metadata.name")])  # fmt: skip
        self._check_namespace(rtype, namespace, meta)
        if self.store.get(rtype.storage_key, meta.get("namespace", ""), meta["name"]) is not None:
            raise ApiError.already_exists(rtype.qualified, meta["name"])
        for server_field in ("resourceVersion", "deletionTimestamp", "deletionGracePeriodSeconds", "managedFields"):
            meta.pop(server_field, None)
        meta["uid"], meta["creationTimestamp"] = str(uuid.uuid4()), now()
        if rtype.generation != "none":
            meta["generation"] = 1
        obj["apiVersion"], obj["kind"] = rtype.group_version, rtype.kind
        if rtype.has_status:
            obj.pop("status", None)
        warnings = self._validate(request, rtype, obj, None)
        if rtype.storage_key == CRD_KEY:
            obj["status"] = _crd_status(obj)
        elif rtype.storage_key == NAMESPACE_KEY:
            obj["status"] = {"phase": "Active"}
        if _dry_run(request):
            return self.render(request, rtype, obj, 201, warnings)
        meta["resourceVersion"] = str(self.store.next_resource_version())
        self.store.put(rtype.storage_key, obj, "ADDED")
        if rtype.storage_key == CRD_KEY:
            self.register_crd(obj)
        return self.render(request, rtype, obj, 201, warnings)

    def update(self, request: web.Request, rtype: ResourceType, namespace: str, name: str, body: Any,
               subresource: str | None) -> web.Response:  # fmt: skip
        current = self.lookup(rtype, namespace, name)
        if not isinstance(body, dict):
            raise ApiError.bad_request("the request body must be a JSON object")
        body_meta = body.get("metadata") or {}
        if body_meta.get("name") not in (None, name):
            raise ApiError.bad_request(
                f"the name of the object ({body_meta.get('name')}) does not match the name on the URL ({name})"
            )
        sent_rv = body_meta.get("resourceVersion")
        if sent_rv and sent_rv != current["metadata"]["resourceVersion"]:
            raise ApiError.conflict(rtype.qualified, name)
        return self._write(request, rtype, current, copy.deepcopy(body), subresource)

    def patch(self, request: web.Request, rtype: ResourceType, namespace: str, name: str, patch: Any,
              subresource: str | None) -> web.Response:  # fmt: skip
        current = self.lookup(rtype, namespace, name)
        content_type = request.headers.get("Content-Type", "").split(";")[0].strip()
        patched = apply_patch(current, patch, content_type, rtype.is_custom)
        meta = patched.get("metadata") or {}
        if meta.get("resourceVersion") != current["metadata"]["resourceVersion"]:
            raise ApiError.conflict(rtype.qualified, name)
        if meta.get("uid") != current["metadata"]["uid"]:
            raise ApiError(409, "Conflict", f"Precondition failed: UID in precondition: {meta.get('uid')}, "
                           f"UID in object meta: {current['metadata']['uid']}")  # fmt: skip
        return self._write(request, rtype, current, patched, subresource)

    def _write(self, request: web.Request, rtype: ResourceType, current: dict[str, Any], new: dict[str, Any],
               subresource: str | None) -> web.Response:  # fmt: skip
        if subresource == "status":
            status = new.get("status")
            new = copy.deepcopy(current)
            new.pop("status", None)
            if status is not None:
                new["status"] = status
        elif subresource is not None:
            raise ApiError.not_found(f"{rtype.qualified}/{subresource}", current["metadata"]["name"])
        elif rtype.has_status:
            new.pop("status", None)
            if "status" in current:
                new["status"] = copy.deepcopy(current["status"])
        meta = new.setdefault("metadata", {})
        for kept in ("uid", "creationTimestamp", "name", "namespace", "deletionTimestamp",
                     "deletionGracePeriodSeconds", "generation", "resourceVersion"):  # fmt: skip
            if kept in current["metadata"]:
                meta[kept] = current["metadata"][kept]
            else:
                meta.pop(kept, None)
        new["apiVersion"], new["kind"] = rtype.group_version, rtype.kind
        if current["metadata"].get("deletionTimestamp"):
            added = set(meta.get("finalizers") or []) - set(current["metadata"].get("finalizers") or [])
            if added:
                raise ApiError.invalid(rtype.kind, rtype.group, meta["name"], [Cause("FieldValueForbidden",
                    f"Forbidden: no new finalizers can be added if the object is being deleted, found new "
                    f"finalizers {sorted(added)}", "metadata.finalizers")])  # fmt: skip
        warnings = self._validate(request, rtype, new, current)
        if rtype.generation == "all":
            changed = {k: v for k, v in new.items() if k not in ("metadata", "status")} != {
                k: v for k, v in current.items() if k not in ("metadata", "status")
            }
        else:
            changed = rtype.generation == "spec" and new.get("spec") != current.get("spec")
        if changed:
            meta["generation"] = int(meta.get("generation", 0)) + 1
        if _comparable(new) == _comparable(current) or _dry_run(request):
            return self.render(request, rtype, new if _dry_run(request) else current, 200, warnings)
        meta["resourceVersion"] = str(self.store.next_resource_version())
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            self._remove(rtype, new)
        else:
            self.store.put(rtype.storage_key, new, "MODIFIED")
            if rtype.storage_key == CRD_KEY:
                self.register_crd(new)
        return self.render(request, rtype, new, 200, warnings)

    def delete(self, request: web.Request, rtype: ResourceType, namespace: str, name: str,
               options: dict[str, Any]) -> web.Response:  # fmt: skip
        current = self.lookup(rtype, namespace, name)
        preconditions = options.get("preconditions") or {}
        for key in ("resourceVersion", "uid"):
            if preconditions.get(key) and preconditions[key] != current["metadata"].get(key):
                raise ApiError.conflict(rtype.qualified, name)
        if _dry_run(request):
            return self.render(request, rtype, current)
        meta = current["metadata"]
        if meta.get("finalizers"):
            if meta.get("deletionTimestamp"):
                return self.render(request, rtype, current, 202)
            obj = copy.deepcopy(current)
            obj["metadata"].update(deletionTimestamp=now(), deletionGracePeriodSeconds=0)
            obj["metadata"]["resourceVersion"] = str(self.store.next_resource_version())
            self.store.put(rtype.storage_key, obj, "MODIFIED")
            return self.render(request, rtype, obj, 202)
        obj = copy.deepcopy(current)
        obj["metadata"]["resourceVersion"] = str(self.store.next_resource_version())
        self._remove(rtype, obj)
        if rtype.is_custom or rtype.storage_key == CRD_KEY:
            return self.render(request, rtype, obj)
        return web.json_response({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
            "details": {"name": name, "group": rtype.group, "kind": rtype.plural, "uid": meta["uid"]},
        })  # fmt: skip

    def delete_collection(self, request: web.Request, rtype: ResourceType, namespace: str | None) -> web.Response:
        for obj in self.matching(request, rtype, namespace):
            self.delete(request, rtype, obj["metadata"].get("namespace", ""), obj["metadata"]["name"], {})
        return self.list(request, rtype, namespace)

    def _remove(self, rtype: ResourceType, obj: dict[str, Any]) -> None:
        self.store.remove(rtype.storage_key, obj)
        if rtype.storage_key == CRD_KEY:
            # The real server's customresourcecleanup finalizer deletes every CR first.
            served = [t for t in self.served() if t.crd_name == obj["metadata"]["name"]]
            if served:
                for instance in self.store.list(served[0].storage_key, None):
                    gone = copy.deepcopy(instance)
                    gone["metadata"]["resourceVersion"] = str(self.store.next_resource_version())
                    self.store.remove(served[0].storage_key, gone)
            self.unregister_crd(obj["metadata"]["name"])

    # ---------------------------------------------------------------------------- helpers

    def _check_namespace(self, rtype: ResourceType, namespace: str | None, meta: dict[str, Any]) -> None:
        if not rtype.namespaced:
            meta.pop("namespace", None)
            return
        meta.setdefault("namespace", namespace)
        if namespace is None:
            raise ApiError.bad_request("namespaced resources must be created under /namespaces/{namespace}")
        if meta["namespace"] != namespace:
            raise ApiError.bad_request(
                "the namespace of the provided object does not match the namespace sent on the request"
            )
        if self.store.get(NAMESPACE_KEY, "", namespace) is None:
            raise ApiError.not_found("namespaces", namespace)

    def _validate(self, request: web.Request, rtype: ResourceType, obj: dict[str, Any],
                  old: dict[str, Any] | None) -> list[str]:  # fmt: skip
        mode = request.query.get("fieldValidation", "Warn")
        if old is None:
            validation.check_metadata(rtype, obj)
        if rtype.is_custom:
            return validation.validate_custom(rtype, obj, old, mode, self.cel_engine)
        if rtype.storage_key == CRD_KEY:
            validation.validate_crd(obj)
        validation.validate_builtin(rtype, obj, mode)
        return []

    def discovery(self, group: str, version: str) -> dict[str, Any]:
        members = [t for t in self.served() if t.group == group and t.version == version]
        if not members:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        return openapi.api_resource_list(members[0].group_version, members)


def _include(request: web.Request) -> str:
    return request.query.get("includeObject", "Metadata")


def _dry_run(request: web.Request) -> bool:
    return request.query.get("dryRun") == "All"


def _crd_status(crd: dict[str, Any]) -> dict[str, Any]:
    stamp = now()
    conditions = [
        {"type": t, "status": "True", "reason": r, "message": m, "lastTransitionTime": stamp}
        for t, r, m in (
            ("NamesAccepted", "NoConflicts", "no conflicts found"),
            ("Established", "InitialNamesAccepted", "the initial names have been accepted"),
        )
    ]
    storage = [v["name"] for v in crd["spec"]["versions"] if v.get("storage")]
    return {"conditions": conditions, "acceptedNames": crd["spec"]["names"], "storedVersions": storage}
