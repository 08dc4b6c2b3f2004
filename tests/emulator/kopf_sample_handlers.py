"""A tiny kopf operator for tests/emulator/test_kopf.py (not named operator.py: that shadows the stdlib).

It logs in to the emulator given by $R3_EMULATOR_URL, creates an adopted ConfigMap for each TrainJob,
mirrors spec.replicas into status, and lets kopf's finalizer run on delete.
"""

from __future__ import annotations

import os
from typing import Any

import kopf
from kubernetes import client

GROUP, VERSION, PLURAL = "example.r3.dev", "v1", "trainjobs"


def _core() -> client.CoreV1Api:
    configuration = client.Configuration()
    configuration.host = os.environ["R3_EMULATOR_URL"]
    return client.CoreV1Api(client.ApiClient(configuration))


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.posting.level = 30  # only warnings become Events: keeps the test's traffic small
    settings.watching.server_timeout = 10


@kopf.on.login()
def login(**_: Any) -> kopf.ConnectionInfo:
    return kopf.ConnectionInfo(server=os.environ["R3_EMULATOR_URL"], scheme="Bearer", token="test", insecure=True)


@kopf.on.create(GROUP, VERSION, PLURAL)
def create_fn(body: kopf.Body, spec: kopf.Spec, name: str, namespace: str, patch: kopf.Patch, **_: Any) -> dict:
    config_map: dict[str, Any] = {"metadata": {"name": f"{name}-config"}, "data": {"model": spec["model"]}}
    kopf.adopt(config_map, owner=body)
    _core().create_namespaced_config_map(namespace, config_map)
    patch.status["phase"] = "Created"
    return {"configMap": config_map["metadata"]["name"]}


@kopf.on.field(GROUP, VERSION, PLURAL, field="spec.replicas")
def replicas_fn(old: Any, new: Any, patch: kopf.Patch, **_: Any) -> None:
    patch.status["replicas"] = new
    patch.status["previousReplicas"] = old


@kopf.on.delete(GROUP, VERSION, PLURAL)
def delete_fn(name: str, **_: Any) -> None:
    pass  # its presence makes kopf add (and later remove) its finalizer
