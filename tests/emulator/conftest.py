"""Fixtures for the API-server emulator tests.

By default everything runs against r3operator.testing.apiserver.KubeAPIEmulator. With
`--real-cluster` the contract tests (test_contract.py) run against the cluster of $KUBECONFIG
instead (kind/k3d on a machine with Docker), and the emulator-only tests are skipped.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
import yaml
from kubernetes import client, config

from r3operator.testing.apiserver import KubeAPIEmulator

HERE = Path(__file__).parent
SAMPLE_CRD = HERE / "sample_crd.yaml"
GROUP, VERSION, PLURAL = "example.r3.dev", "v1", "trainjobs"
EMULATOR_ONLY_FILES = ("test_kubectl.py", "test_kopf.py", "test_emulator.py")
TABLE_ACCEPT = "application/json;as=Table;v=v1;g=meta.k8s.io,application/json"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--real-cluster",
        action="store_true",
        default=False,
        help="run tests/emulator/test_contract.py against the cluster of $KUBECONFIG instead of the emulator",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "emulator_only: behaviour that differs from a real cluster by design")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--real-cluster"):
        return
    skip = pytest.mark.skip(reason="emulator-only test (running with --real-cluster)")
    for item in items:
        path = Path(str(item.fspath))
        if path.parent == HERE and ("emulator_only" in item.keywords or path.name in EMULATOR_ONLY_FILES):
            item.add_marker(skip)


@dataclass
class RawResponse:
    status: int
    body: bytes
    headers: dict[str, str]

    def json(self) -> Any:
        return json.loads(self.body)

    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.body.splitlines() if line.strip()]


class Cluster:
    """A base URL + kubeconfig target: the python client plus raw HTTP (with the client's auth)."""

    def __init__(self, kubeconfig: Path, emulator: KubeAPIEmulator | None) -> None:
        self.kubeconfig = kubeconfig
        self.emulator = emulator
        self.api_client = config.new_client_from_config(config_file=str(kubeconfig))
        self.custom = client.CustomObjectsApi(self.api_client)
        self.core = client.CoreV1Api(self.api_client)
        self.crds = client.ApiextensionsV1Api(self.api_client)

    @property
    def url(self) -> str:
        return self.api_client.configuration.host

    def raw(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        query: dict[str, Any] | None = None,
        content_type: str = "application/json",
        accept: str = "application/json",
    ) -> RawResponse:
        headers = {"Accept": accept, "Content-Type": content_type}
        queries: list[tuple[str, Any]] = list((query or {}).items())
        self.api_client.update_params_for_auth(headers, queries, ["BearerToken"], path, method, body)
        url = self.url + path + ("?" + urlencode(queries) if queries else "")
        # The client's REST layer JSON-encodes dict/list bodies itself and sends str/bytes as they are.
        response = self.api_client.rest_client.request(method, url, headers=headers, body=body)
        data = response.read()
        return RawResponse(response.status, data, dict(response.getheaders()))

    def cr_path(self, namespace: str, name: str = "", subresource: str = "") -> str:
        path = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}"
        return path + (f"/{name}" if name else "") + (f"/{subresource}" if subresource else "")


@pytest.fixture(scope="session")
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if request.config.getoption("--real-cluster"):
        kubeconfig = Path(os.environ.get("KUBECONFIG", Path.home() / ".kube" / "config"))
        if not kubeconfig.is_file():
            pytest.exit(f"--real-cluster: no kubeconfig at {kubeconfig} (set KUBECONFIG)", returncode=4)
        yield Cluster(kubeconfig, None)
        return
    with KubeAPIEmulator(kubeconfig_dir=tmp_path_factory.mktemp("kube")) as emulator:
        assert emulator.kubeconfig_path is not None
        yield Cluster(emulator.kubeconfig_path, emulator)


def wait_for(predicate: Any, timeout: float = 15.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@pytest.fixture(scope="session")
def sample_crd(cluster: Cluster) -> Iterator[dict[str, Any]]:
    """The sample TrainJob CRD, created once and served (discovery lists it) before tests use it."""
    crd = yaml.safe_load(SAMPLE_CRD.read_text())
    existing = cluster.raw("GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd['metadata']['name']}")
    if existing.status == 404:
        created = cluster.raw("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)
        assert created.status == 201, created.body
    wait_for(lambda: cluster.raw("GET", f"/apis/{GROUP}/{VERSION}").status == 200, what="CRD to be served")
    yield crd


@pytest.fixture
def namespace(cluster: Cluster) -> Iterator[str]:
    name = f"r3-test-{uuid.uuid4().hex[:8]}"
    cluster.core.create_namespace({"metadata": {"name": name}})
    yield name
    cluster.raw("DELETE", f"/api/v1/namespaces/{name}")


def trainjob(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "TrainJob",
        "metadata": {"name": name},
        "spec": {"model": "tiny", **spec},
    }
