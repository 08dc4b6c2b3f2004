"""A real kopf operator (kopf.testing.KopfRunner) against the emulator: handlers, status, finalizers."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kopf
import pytest
import yaml
from kopf.testing import KopfRunner
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from r3operator.testing.apiserver import KubeAPIEmulator

from .conftest import SAMPLE_CRD, trainjob, wait_for

HANDLERS = Path(__file__).with_name("kopf_sample_handlers.py")


@pytest.fixture
def emulator(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[KubeAPIEmulator]:
    with KubeAPIEmulator(kubeconfig_dir=tmp_path) as api:
        monkeypatch.setenv("R3_EMULATOR_URL", api.url)
        monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig_path))
        configuration = client.Configuration()
        configuration.host = api.url
        extensions = client.ApiextensionsV1Api(client.ApiClient(configuration))
        extensions.create_custom_resource_definition(yaml.safe_load(SAMPLE_CRD.read_text()))
        yield api


@contextlib.contextmanager
def _own_default_registry() -> Iterator[kopf.OperatorRegistry]:
    """kopf's default registry is process-wide: handlers another test module imported (r3operator's own,
    with its startup settings) would run in this sample operator too. The sample file is loaded when the
    runner starts, so a fresh registry stays the default until the runner stops."""
    registry, previous = kopf.OperatorRegistry(), kopf.get_default_registry()
    kopf.set_default_registry(registry)
    try:
        yield registry
    finally:
        kopf.set_default_registry(previous)


def test_kopf_operator_handles_create_field_change_and_delete(emulator: KubeAPIEmulator) -> None:
    configuration = client.Configuration()
    configuration.host = os.environ["R3_EMULATOR_URL"]
    api_client = client.ApiClient(configuration)
    custom, core = client.CustomObjectsApi(api_client), client.CoreV1Api(api_client)
    args = ("example.r3.dev", "v1", "default", "trainjobs")

    def get() -> dict[str, Any]:
        return custom.get_namespaced_custom_object(*args, "job")

    with (
        _own_default_registry() as registry,
        KopfRunner(["run", "-A", "--standalone", "--verbose", str(HANDLERS)], timeout=60, registry=registry) as runner,
    ):
        custom.create_namespaced_custom_object(*args, trainjob("job", replicas=1))
        wait_for(lambda: get().get("status", {}).get("phase") == "Created", what="create handler")
        config_map = core.read_namespaced_config_map("job-config", "default")
        owner = config_map.metadata.owner_references[0]
        assert (owner.kind, owner.name, owner.uid) == ("TrainJob", "job", get()["metadata"]["uid"])
        assert get()["status"]["create_fn"] == {"configMap": "job-config"}
        assert "kopf.zalando.org/KopfFinalizerMarker" in get()["metadata"]["finalizers"]

        custom.patch_namespaced_custom_object(*args, "job", {"spec": {"replicas": 3}})
        wait_for(lambda: get().get("status", {}).get("replicas") == 3, what="field handler")
        assert get()["status"]["previousReplicas"] == 1

        custom.delete_namespaced_custom_object(*args, "job")

        def gone() -> bool:
            try:
                get()
            except ApiException as exc:
                return exc.status == 404
            return False

        wait_for(gone, what="kopf to release its finalizer")

    assert runner.exit_code == 0, runner.output
    assert runner.exception is None
    assert "Handler 'create_fn' succeeded" in runner.output
    # Status was written through the status subresource, never through the main resource.
    status_writes = [r for r in emulator.requests if r.method == "PATCH" and r.path.endswith("/job/status")]
    assert status_writes and all(r.status == 200 for r in status_writes)
    # No GC in the emulator (documented): the adopted ConfigMap outlives its owner.
    assert core.read_namespaced_config_map("job-config", "default").metadata.name == "job-config"
