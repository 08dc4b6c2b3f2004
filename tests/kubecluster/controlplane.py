"""A real Kubernetes control plane on this machine, for tests and for people (`make cluster-up`).

etcd + kube-apiserver (RBAC authorization, service-account token signing, the default admission chain)
+ kube-controller-manager (garbage collector, StatefulSet, Job, namespace, service-account controllers)
+ kube-scheduler + kwok (fake nodes, pod lifecycles) + the KubeRay operator, all built from pinned Go
modules by scripts/install-cluster.sh. Every process listens on 127.0.0.1 only, on free ports.

There is no kubelet: kwok plays every node. It marks scheduled pods Running/Ready, completes pods owned by
a Job, and fails pods that carry the label in `FAIL_LABEL` (how tests drive a RayJob submitter to failure).
KubeRay's submitter pod keeps running, as `ray job submit` does while a Ray job trains, in the namespace
`KEEP_TRAINING_NAMESPACE`, or everywhere with `ControlPlane(keep_submitters_running=True)` (`make cluster-up`):
had it completed, KubeRay would fail the RayJob ~30 s later, as no Ray dashboard reports the job. The test
session leaves it off, so that its jobs end and hand their fake GPUs back.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
STAGES = Path(__file__).with_name("kwok-stages.yaml")
GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT = "NVIDIA-H100-80GB-HBM3"
"""The `nvidia.com/gpu.product` label of the fake GPU nodes (as the GPU Operator's feature discovery sets it)."""
# Pods with this label are failed by kwok instead of completed (see kwok-stages.yaml).
FAIL_LABEL = "kwok.r3operator.io/fail"
# Pods owned by a Job in this namespace exit 1 instead of completing (a RayJob submitter that fails).
FAIL_JOBS_NAMESPACE = "kwok-fail-jobs"
KEEP_TRAINING_NAMESPACE = "kwok-keep-training"
"""KubeRay's submitter pods here keep running (a RayJob stays Running) whatever `keep_submitters_running` says."""
SUBMITTER_CONTAINER = "ray-job-submitter"
"""The container KubeRay (v1.6) names in the submitter Job it makes for a RayJob's `ray job submit`."""
ADMIN_USER = "r3-admin"
KUEUE_NAMESPACE = "kueue-system"
KUEUE_WEBHOOK_SERVICE = "kueue-webhook-service"
KUEUE_CERT_SECRET = "kueue-webhook-server-cert"
KUEUE_RLJOB_FRAMEWORK = "RLJob.v1alpha1.r3operator.io"
"""The RLJob as Kueue's configuration names an external framework (Kind.version.group)."""
KUEUE_CONVERTED = frozenset({"localqueues", "clusterqueues", "cohorts", "workloads", "multikueueclusters"})
"""The CRDs Kueue converts by webhook (its config/components/crd kustomization; the others convert with None)."""

LWS_NAMESPACE = "lws-system"
LWS_WEBHOOK_SERVICE = "lws-webhook-service"
LWS_CERT_SECRET = "lws-webhook-server-cert"
LWS_MUTATING = "lws-mutating-webhook-configuration"
LWS_VALIDATING = "lws-validating-webhook-configuration"
"""The names LWS's cert rotator injects its CA into (sigs.k8s.io/lws pkg/cert)."""
LWS_SET_LABEL = "leaderworkerset.sigs.k8s.io/name"
"""LWS's pod webhooks see only pods that carry this label (the objectSelector its config/webhook patches add)."""


class ControlPlaneError(RuntimeError):
    """A component did not build, start or become ready; the message names it and its log."""


@dataclass(frozen=True)
class Fleet:
    """The fake GPU nodes: labelled and tainted the way GPU operators and cloud providers do it."""

    nodes: int = 16
    gpus_per_node: int = 8
    cpu: str = "96"
    memory: str = "1Ti"
    taint_gpu: bool = True
    cpu_nodes: int = 2
    """Untainted nodes without GPUs, where the operator and other CPU-only pods run, as on real clusters."""

    def all_nodes(self) -> list[dict[str, Any]]:
        return [self.node(i) for i in range(self.nodes)] + [self.node(i, gpu=False) for i in range(self.cpu_nodes)]

    def node(self, index: int, *, gpu: bool = True) -> dict[str, Any]:
        name = f"{'gpu' if gpu else 'cpu'}-node-{index:03d}"
        taints = [{"key": GPU_RESOURCE, "value": "present", "effect": "NoSchedule"}] if gpu and self.taint_gpu else []
        capacity = {"cpu": self.cpu, "memory": self.memory, "pods": "110"}
        gpu_labels = {}
        if gpu:
            capacity[GPU_RESOURCE] = str(self.gpus_per_node)
            gpu_labels = {
                "nvidia.com/gpu.present": "true",
                "nvidia.com/gpu.product": GPU_PRODUCT,
                "nvidia.com/gpu.count": str(self.gpus_per_node),
            }
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
                "labels": {
                    "kubernetes.io/hostname": name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    "type": "kwok",
                    "topology.kubernetes.io/zone": f"zone-{index % 2}",
                    **gpu_labels,
                },
            },
            "spec": {"taints": taints},
            "status": {"allocatable": capacity, "capacity": capacity},
        }


def kwok_stages(*, keep_submitters_running: bool) -> str:
    """kwok-stages.yaml as kwok gets it: with `keep_submitters_running`, its pod-complete stage leaves KubeRay's
    submitter pods running in every namespace (not only in `KEEP_TRAINING_NAMESPACE`)."""
    text = STAGES.read_text()
    if not keep_submitters_running:
        return text
    stages = list(yaml.safe_load_all(text))
    complete = next(s for s in stages if s["metadata"]["name"] == "pod-complete")
    complete["spec"]["selector"]["matchExpressions"].append(
        {"key": ".spec.containers.[0].name", "operator": "NotIn", "values": [SUBMITTER_CONTAINER]}
    )
    return yaml.safe_dump_all(stages, sort_keys=False)


def binaries_dir() -> Path:
    """Build (once per version; a no-op when cached) and return the directory holding the binaries."""
    tools = Path(os.environ.get("R3_CLUSTER_TOOLS", REPO / ".tools"))
    result = subprocess.run(
        ["bash", str(REPO / "scripts" / "install-cluster.sh"), str(tools)], capture_output=True, text=True
    )
    if result.returncode != 0:
        raise ControlPlaneError(f"scripts/install-cluster.sh failed:\n{result.stderr[-4000:]}")
    return Path(result.stdout.strip().splitlines()[-1]) / "bin"


def kubectl_binary() -> str:
    local = REPO / ".tools" / "bin" / "kubectl"
    found = str(local) if local.exists() else shutil.which("kubectl")
    if found is None:
        raise ControlPlaneError("kubectl not found: run `make tools` (installs the pinned kubectl into .tools/bin)")
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class _Process:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path


@dataclass
class ControlPlane:
    """Start with `start()` (or as a context manager); `kubeconfig` is the admin's."""

    workdir: Path
    bin_dir: Path
    fleet: Fleet = field(default_factory=Fleet)
    with_kuberay: bool = True
    keep_submitters_running: bool = False
    """KubeRay's submitter pods keep running in every namespace, so every RayJob stays Running until deleted (what
    a person's cluster wants); off, only in `KEEP_TRAINING_NAMESPACE` (what a test opts into)."""
    audit_mode: str = "blocking"
    """kube-apiserver's --audit-log-mode: "blocking" writes each request's audit event before answering it (what
    tests that count requests right after making them rely on); "batch" writes from a buffer, off the request
    (the scale benchmark's comparison: the log is complete once the apiserver has flushed it)."""
    processes: dict[str, _Process] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.pki = self.workdir / "pki"
        self.logs = self.workdir / "logs"
        self.kubeconfig = self.workdir / "kubeconfig"
        self.etcd_port = _free_port()
        self.etcd_peer_port = _free_port()
        self.api_port = _free_port()
        self.admin_token = os.urandom(16).hex()
        self.url = f"https://127.0.0.1:{self.api_port}"

    # ------------------------------------------------------------------------------------------ start/stop

    def __enter__(self) -> ControlPlane:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        started = time.monotonic()
        self.logs.mkdir(exist_ok=True)
        self._make_pki()
        self._start_etcd()
        self.start_apiserver()
        self._write_kubeconfig()
        self._start_controllers()
        self._wait_for_default_service_account()
        self.add_nodes(self.fleet)
        self._start_provisioner()
        if self.with_kuberay:
            self._start_kuberay()
        self.startup_seconds = time.monotonic() - started

    def stop(self) -> None:
        for proc in reversed(list(self.processes.values())):
            self._terminate(proc)
        self.processes.clear()

    def restart_apiserver(self) -> None:
        """Stop and start kube-apiserver on the same port and etcd: watches break, clients must reconnect."""
        self._terminate(self.processes.pop("kube-apiserver"))
        self.start_apiserver()

    @contextlib.contextmanager
    def paused(self, name: str) -> Iterator[None]:
        """SIGSTOP a controller for the block (e.g. KubeRay, to write the RayJob status it would write)."""
        proc = self.processes[name].popen
        proc.send_signal(signal.SIGSTOP)
        try:
            yield
        finally:
            proc.send_signal(signal.SIGCONT)

    def _terminate(self, proc: _Process) -> None:
        if proc.popen.poll() is None:
            proc.popen.send_signal(signal.SIGTERM)
            try:
                proc.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait()

    # ------------------------------------------------------------------------------------------ components

    def _spawn(self, name: str, args: Sequence[str], env: dict[str, str] | None = None) -> _Process:
        log = self.logs / f"{name}.log"
        with open(log, "ab") as handle:
            popen = subprocess.Popen(
                list(args),
                stdout=handle,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **(env or {})},
                start_new_session=True,  # Ctrl-C in a test run must not reach the control plane first
            )
        proc = _Process(name, popen, log)
        self.processes[name] = proc
        return proc

    def _wait(self, what: str, proc: _Process, ready: Any, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.popen.poll() is not None:
                raise ControlPlaneError(
                    f"{what} exited with {proc.popen.returncode}; log {proc.log}:\n{_tail(proc.log)}"
                )
            with contextlib.suppress(Exception):
                if ready():
                    return
            time.sleep(0.2)
        raise ControlPlaneError(f"{what} not ready after {timeout:.0f}s; log {proc.log}:\n{_tail(proc.log)}")

    def _make_pki(self) -> None:
        self.pki.mkdir(exist_ok=True)
        sa_key = self.pki / "sa.key"
        if not sa_key.exists():
            _run(["openssl", "genrsa", "-out", str(sa_key), "2048"])
            _run(["openssl", "rsa", "-in", str(sa_key), "-pubout", "-out", str(self.pki / "sa.pub")])
        tokens = self.pki / "tokens.csv"
        tokens.write_text(f'{self.admin_token},{ADMIN_USER},r3-admin-uid,"system:masters"\n')
        tokens.chmod(0o600)

    def _start_etcd(self) -> None:
        data = self.workdir / "etcd"
        client = f"http://127.0.0.1:{self.etcd_port}"
        peer = f"http://127.0.0.1:{self.etcd_peer_port}"
        proc = self._spawn(
            "etcd",
            [
                str(self.bin_dir / "etcd"),
                "--data-dir",
                str(data),
                "--listen-client-urls",
                client,
                "--advertise-client-urls",
                client,
                "--listen-peer-urls",
                peer,
                "--initial-advertise-peer-urls",
                peer,
                "--initial-cluster",
                f"default={peer}",
                # A throwaway test store: durability buys nothing and fsync dominates write latency.
                "--unsafe-no-fsync",
                "--log-level",
                "warn",
            ],
        )
        self._wait("etcd", proc, lambda: _http_ok(f"{client}/health"))

    def start_apiserver(self) -> None:
        certs = self.pki / "serving"
        proc = self._spawn(
            "kube-apiserver",
            [
                str(self.bin_dir / "kube-apiserver"),
                "--etcd-servers",
                f"http://127.0.0.1:{self.etcd_port}",
                "--bind-address",
                "127.0.0.1",
                "--advertise-address",
                "127.0.0.1",
                "--secure-port",
                str(self.api_port),
                "--cert-dir",
                str(certs),
                "--token-auth-file",
                str(self.pki / "tokens.csv"),
                "--authorization-mode",
                "RBAC",
                "--service-account-issuer",
                "https://kubernetes.default.svc.cluster.local",
                "--service-account-key-file",
                str(self.pki / "sa.pub"),
                "--service-account-signing-key-file",
                str(self.pki / "sa.key"),
                "--service-cluster-ip-range",
                "10.96.0.0/16",
                "--allow-privileged=true",
                # Endpoints may not name a loopback address, and this apiserver has no other.
                "--endpoint-reconciler-type",
                "none",
                "--profiling=false",
                # Every request, with its user and user agent: what tests count (reconcile passes, status
                # writes) and what the scale benchmark reports as API requests per RLJob.
                "--audit-policy-file",
                str(self._audit_policy()),
                "--audit-log-path",
                str(self.audit_log),
                "--audit-log-format",
                "json",
                "--audit-log-mode",
                self.audit_mode,
                "--v",
                "1",
            ],
        )
        self._wait("kube-apiserver", proc, lambda: self.request("GET", "/readyz") == "ok", timeout=120)

    @property
    def audit_log(self) -> Path:
        return self.logs / "audit.jsonl"

    def _audit_policy(self) -> Path:
        policy = self.workdir / "audit-policy.yaml"
        policy.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "audit.k8s.io/v1",
                    "kind": "Policy",
                    "omitStages": ["RequestReceived", "ResponseStarted"],
                    "rules": [{"level": "Metadata"}],
                }
            )
        )
        return policy

    def requests(self) -> list[AuditRecord]:
        """Every completed request so far, oldest first (from the apiserver's audit log)."""
        records = []
        with contextlib.suppress(FileNotFoundError), open(self.audit_log) as log:
            for line in log:
                if line.endswith("\n"):
                    records.append(AuditRecord.from_event(json.loads(line)))
        return records

    def _write_kubeconfig(self) -> None:
        self.kubeconfig.write_text(yaml.safe_dump(self.kubeconfig_for(ADMIN_USER, self.admin_token)))
        self.kubeconfig.chmod(0o600)

    def kubeconfig_for(self, user: str, token: str, namespace: str = "default") -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "r3-test", "cluster": {"server": self.url, "certificate-authority": str(self.ca)}}],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [{"name": user, "context": {"cluster": "r3-test", "user": user, "namespace": namespace}}],
            "current-context": user,
        }

    @property
    def ca(self) -> Path:
        # kube-apiserver's self-generated serving cert: the file holds the cert and the CA that signed it.
        return self.pki / "serving" / "apiserver.crt"

    def _control_loop_flags(self) -> list[str]:
        """What kube-controller-manager and kube-scheduler share: the admin's credentials for the API and for
        their own authn/authz delegation, one instance (no leader election), a local serving port."""
        kc = str(self.kubeconfig)
        return [
            "--kubeconfig",
            kc,
            "--authentication-kubeconfig",
            kc,
            "--authorization-kubeconfig",
            kc,
            "--leader-elect=false",
            "--bind-address",
            "127.0.0.1",
            "--secure-port",
            str(_free_port()),
            "--v",
            "1",
        ]

    def _start_controllers(self) -> None:
        kc = str(self.kubeconfig)
        self._spawn(
            "kube-controller-manager",
            [
                str(self.bin_dir / "kube-controller-manager"),
                *self._control_loop_flags(),
                "--service-account-private-key-file",
                str(self.pki / "sa.key"),
                "--root-ca-file",
                str(self.ca),
                "--use-service-account-credentials=false",
                # No cloud, no pod CIDRs to hand out, no real kubelets to evict from.
                "--controllers",
                "*,-nodeipam,-cloud-node-lifecycle,-service-lb-controller,-node-route-controller",
                "--concurrent-gc-syncs",
                "10",
            ],
        )
        self._spawn("kube-scheduler", [str(self.bin_dir / "kube-scheduler"), *self._control_loop_flags()])
        self._spawn(
            "kwok",
            [
                str(self.bin_dir / "kwok"),
                "--kubeconfig",
                kc,
                "--config",
                str(self._stages()),
                "--manage-all-nodes=false",
                "--manage-nodes-with-annotation-selector",
                "kwok.x-k8s.io/node=fake",
                "--node-ip",
                "10.200.0.1",
                "--cidr",
                "10.201.0.0/16",
                "--server-address",
                f"127.0.0.1:{_free_port()}",
                # kwok renews each node's Lease, so the node-lifecycle controller keeps them Ready.
                "--node-lease-duration-seconds",
                "40",
            ],
        )

    def _stages(self) -> Path:
        path = self.workdir / "kwok-stages.yaml"
        path.write_text(kwok_stages(keep_submitters_running=self.keep_submitters_running))
        return path

    def _wait_for_default_service_account(self) -> None:
        # Pods are refused until the service-account controller made `default` in their namespace.
        proc = self.processes["kube-controller-manager"]
        self._wait(
            "kube-controller-manager (default ServiceAccount)",
            proc,
            lambda: self.request("GET", "/api/v1/namespaces/default/serviceaccounts/default") is not None,
        )

    def add_nodes(self, fleet: Fleet) -> list[str]:
        return self.add_node_objects(fleet.all_nodes())

    def add_node_objects(self, nodes: list[dict[str, Any]]) -> list[str]:
        """Create these Node objects and wait until kwok has made them Ready."""
        names = []
        for node in nodes:
            self.request("POST", "/api/v1/nodes", node)
            names.append(node["metadata"]["name"])
        proc = self.processes["kwok"]
        self._wait("kwok (nodes Ready)", proc, lambda: self._nodes_ready(names), timeout=120)
        return names

    def _start_provisioner(self) -> None:
        proc = self._spawn(
            "provisioner",
            [sys.executable, "-m", "kubecluster.provisioner", "--kubeconfig", str(self.kubeconfig)],
            env={"PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
        )
        path = "/apis/storage.k8s.io/v1/storageclasses/rwx-nfs"  # the last one it makes
        self._wait("provisioner (StorageClass standard)", proc, lambda: self.request("GET", path) is not None)

    def _nodes_ready(self, names: list[str]) -> bool:
        nodes = self.request("GET", "/api/v1/nodes")["items"]
        ready = {
            n["metadata"]["name"]
            for n in nodes
            if any(c["type"] == "Ready" and c["status"] == "True" for c in n.get("status", {}).get("conditions", []))
        }
        return set(names) <= ready

    def _start_kuberay(self) -> None:
        crds = self.bin_dir.parent / "crds"
        kubectl = kubectl_binary()
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig)}
        # The RayJob/RayCluster CRDs are larger than the last-applied annotation allows: server-side apply.
        _run([kubectl, "apply", "--server-side", "-f", str(crds)], env=env)
        self.wait_established("rayjobs.ray.io", "rayclusters.ray.io")
        proc = self._spawn(
            "kuberay-operator",
            [
                str(self.bin_dir / "kuberay-operator"),
                "--metrics-addr",
                "0",
                "--health-probe-bind-address",
                f"127.0.0.1:{(probe := _free_port())}",
                "--enable-leader-election=false",
            ],
            env={"KUBECONFIG": str(self.kubeconfig)},
        )
        self._wait("kuberay-operator", proc, lambda: _http_ok(f"http://127.0.0.1:{probe}/readyz"))

    def _webhook_service(self, namespace: str, name: str, cert_secret: str, port: int) -> dict[str, Any]:
        """The namespace of a controller with webhooks, the empty Secret its cert rotator fills (release
        manifests ship it; the rotator does not create it), and its webhook Service as an ExternalName for
        localhost, where the controller serves on `port`. Returns the webhook clientConfig's service."""
        if self.request("GET", f"/api/v1/namespaces/{namespace}") is None:
            self.request("POST", "/api/v1/namespaces", {"metadata": {"name": namespace}})
            secret = {"metadata": {"name": cert_secret}, "type": "Opaque"}
            self.request("POST", f"/api/v1/namespaces/{namespace}/secrets", secret)
            external = {"type": "ExternalName", "externalName": "localhost", "ports": [{"port": port}]}
            self.request(
                "POST", f"/api/v1/namespaces/{namespace}/services", {"metadata": {"name": name}, "spec": external}
            )
        return {"namespace": namespace, "name": name, "port": port}

    def _manager_config(
        self,
        name: str,
        api_version: str,
        *,
        probe: int,
        port: int,
        cert_dir: Path,
        service: str,
        cert_secret: str,
        **extra: Any,
    ) -> Path:
        """The Configuration file of a controller-runtime manager with webhooks (Kueue, LWS): probes and
        webhooks on localhost, no metrics, no leader election, and its own cert rotation into `cert_secret`
        for `service`; `extra` holds the controller's own fields."""
        config = {
            "apiVersion": api_version,
            "kind": "Configuration",
            "health": {"healthProbeBindAddress": f"127.0.0.1:{probe}"},
            "metrics": {"bindAddress": "0"},
            "webhook": {"port": port, "host": "127.0.0.1", "certDir": str(cert_dir)},
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": True, "webhookServiceName": service, "webhookSecretName": cert_secret},
            **extra,
        }
        path = self.workdir / f"{name}-config.yaml"
        path.write_text(yaml.safe_dump(config))
        return path

    def start_kueue(self) -> None:
        """Kueue's CRDs, webhooks and controller, once (idempotent): started by the tests that queue jobs.

        Kueue serves v1beta1 and v1beta2 through its conversion webhook, so the apiserver must reach Kueue's
        webhook server: the Service ``kueue-webhook-service`` is an ExternalName for localhost (the apiserver
        dials ``localhost:<port>`` and checks the certificate against the Service's DNS name, which Kueue's
        cert rotator puts in it). Kueue's admission webhooks are registered for its own API group only: the
        ones for Pods, Deployments and Jobs would reach into every other test. Kueue manages only what
        carries a queue name, with the batch/job integration alone, and MultiKueue's generic adapter knows the
        RLJob (used only where a ClusterQueue has a MultiKueue admission check).
        """
        if "kueue" in self.processes:
            return
        kueue_dir = self.bin_dir.parent / "kueue"
        port, probe = _free_port(), _free_port()
        service = self._webhook_service(KUEUE_NAMESPACE, KUEUE_WEBHOOK_SERVICE, KUEUE_CERT_SECRET, port)
        kubectl = kubectl_binary()
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig)}
        manifests = self.workdir / "kueue-manifests"
        manifests.mkdir(exist_ok=True)
        for path in sorted((kueue_dir / "crds").glob("*.yaml")):
            crd = yaml.safe_load(path.read_text())
            if crd["spec"]["names"]["plural"] in KUEUE_CONVERTED:
                crd["spec"]["conversion"] = {
                    "strategy": "Webhook",
                    "webhook": {
                        "clientConfig": {"service": {**service, "path": "/convert"}},
                        "conversionReviewVersions": ["v1"],
                    },
                }
            (manifests / path.name).write_text(yaml.safe_dump(crd))
        for config in yaml.safe_load_all((kueue_dir / "webhooks.yaml").read_text()):
            if not config:
                continue
            kind = "mutating" if config["kind"].startswith("Mutating") else "validating"
            config["metadata"]["name"] = f"kueue-{kind}-webhook-configuration"
            config["webhooks"] = [
                {**hook, "clientConfig": {"service": {**service, "path": hook["clientConfig"]["service"]["path"]}}}
                for hook in config["webhooks"]
                if all(group == "kueue.x-k8s.io" for rule in hook["rules"] for group in rule["apiGroups"])
            ]
            (manifests / f"webhooks-{kind}.yaml").write_text(yaml.safe_dump(config))
        _run([kubectl, "apply", "--server-side", "-f", str(manifests)], env=env)
        self.wait_established("workloads.kueue.x-k8s.io", "clusterqueues.kueue.x-k8s.io", "localqueues.kueue.x-k8s.io")
        cert_dir = self.workdir / "kueue-certs"
        config_path = self._manager_config(
            "kueue",
            "config.kueue.x-k8s.io/v1beta2",
            probe=probe,
            port=port,
            cert_dir=cert_dir,
            service=KUEUE_WEBHOOK_SERVICE,
            cert_secret=KUEUE_CERT_SECRET,
            namespace=KUEUE_NAMESPACE,
            manageJobsWithoutQueueName=False,
            integrations={"frameworks": ["batch/job"]},
            # MultiKueue's generic adapter for RLJobs (Kueue >= 0.15, docs/operator.md "MultiKueue"): it acts only on
            # Workloads of a ClusterQueue with a MultiKueue admission check.
            multiKueue={"externalFrameworks": [{"name": KUEUE_RLJOB_FRAMEWORK}]},
        )
        proc = self._spawn(
            "kueue",
            [str(self.bin_dir / "kueue"), "--config", str(config_path), "--feature-gates", "VisibilityOnDemand=false"],
            env={"KUBECONFIG": str(self.kubeconfig)},
        )

        def ready() -> bool:
            self._mount_secret(KUEUE_NAMESPACE, KUEUE_CERT_SECRET, cert_dir)
            return _http_ok(f"http://127.0.0.1:{probe}/readyz")

        self._wait("kueue", proc, ready, timeout=120)

    def start_lws(self) -> None:
        """LeaderWorkerSet's CRD, webhooks and controller, once (idempotent): started by the tests of multi-node
        engine replicas.

        LWS's webhooks default and validate LeaderWorkerSets and give each of its pods the LWS_* environment
        (leader address, worker index), so the apiserver must reach them: as for Kueue, the Service
        ``lws-webhook-service`` is an ExternalName for localhost and LWS's cert rotator fills the Secret and
        injects the CA into ``lws-{mutating,validating}-webhook-configuration`` (the names it looks for). Its
        pod webhooks get the objectSelector of LWS's own kustomize patches: only pods of a LeaderWorkerSet.
        """
        if "lws" in self.processes:
            return
        lws_dir = self.bin_dir.parent / "lws"
        port, probe = _free_port(), _free_port()
        service = self._webhook_service(LWS_NAMESPACE, LWS_WEBHOOK_SERVICE, LWS_CERT_SECRET, port)
        manifests = self.workdir / "lws-manifests"
        manifests.mkdir(exist_ok=True)
        for path in sorted((lws_dir / "crds").glob("*.yaml")):
            shutil.copy(path, manifests / path.name)
        for config in yaml.safe_load_all((lws_dir / "webhooks.yaml").read_text()):
            if not config:
                continue
            kind = "mutating" if config["kind"].startswith("Mutating") else "validating"
            config["metadata"]["name"] = LWS_MUTATING if kind == "mutating" else LWS_VALIDATING
            hooks = []
            for hook in config["webhooks"]:
                path = hook["clientConfig"]["service"]["path"]
                hook = {**hook, "clientConfig": {"service": {**service, "path": path}}}
                if any(group == "" for rule in hook["rules"] for group in rule["apiGroups"]):
                    hook["objectSelector"] = {"matchExpressions": [{"key": LWS_SET_LABEL, "operator": "Exists"}]}
                hooks.append(hook)
            config["webhooks"] = hooks
            (manifests / f"webhooks-{kind}.yaml").write_text(yaml.safe_dump(config))
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig)}
        # The CRD is larger than the last-applied annotation allows: server-side apply.
        _run([kubectl_binary(), "apply", "--server-side", "-f", str(manifests)], env=env)
        self.wait_established("leaderworkersets.leaderworkerset.x-k8s.io")
        cert_dir = self.workdir / "lws-certs"
        config_path = self._manager_config(
            "lws",
            "config.lws.x-k8s.io/v1alpha1",
            probe=probe,
            port=port,
            cert_dir=cert_dir,
            service=LWS_WEBHOOK_SERVICE,
            cert_secret=LWS_CERT_SECRET,
        )
        proc = self._spawn(
            "lws", [str(self.bin_dir / "lws"), "--config", str(config_path)], env={"KUBECONFIG": str(self.kubeconfig)}
        )

        def ready() -> bool:
            self._mount_secret(LWS_NAMESPACE, LWS_CERT_SECRET, cert_dir)
            hooks = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/" + LWS_MUTATING
            injected = all(h["clientConfig"].get("caBundle") for h in self.request("GET", hooks)["webhooks"])
            return injected and _http_ok(f"http://127.0.0.1:{probe}/readyz")

        self._wait("lws", proc, ready, timeout=120)
        # The CA is injected before the webhook server has loaded the certificate: a LeaderWorkerSet dry run
        # passes through both webhooks once they serve.
        self._wait("lws (webhooks serving)", proc, self._lws_webhooks_serve, timeout=60)

    def _lws_webhooks_serve(self) -> bool:
        container = {"name": "c", "image": "c"}
        probe = {
            "apiVersion": "leaderworkerset.x-k8s.io/v1",
            "kind": "LeaderWorkerSet",
            "metadata": {"name": "webhook-probe", "namespace": "default"},
            "spec": {"leaderWorkerTemplate": {"workerTemplate": {"spec": {"containers": [container]}}}},
        }
        path = "/apis/leaderworkerset.x-k8s.io/v1/namespaces/default/leaderworkersets?dryRun=All"
        try:
            self.request("POST", path, probe)
        except ApiError:
            return False
        return True

    def _mount_secret(self, namespace: str, name: str, directory: Path) -> None:
        """What a kubelet's secret volume does: the Secret's keys as files. Kueue's and LWS's cert rotators
        write their serving certificate into the Secret and wait until it appears in their certDir.

        Each file is replaced whole (written aside, then renamed) and only when it changed, as a kubelet's
        atomic writer does: the webhook server reads the certificate while this runs, and a half-written one
        stops it ("failed to find any PEM data")."""
        secret = self.request("GET", f"/api/v1/namespaces/{namespace}/secrets/{name}") or {}
        directory.mkdir(parents=True, exist_ok=True)
        changed = []
        for key, value in (secret.get("data") or {}).items():
            path, data = directory / key, base64.b64decode(value)
            if not path.exists() or path.read_bytes() != data:
                (directory / f".{key}.tmp").write_bytes(data)
                changed.append(key)
        for key in changed:  # the certificate and its key land together
            os.replace(directory / f".{key}.tmp", directory / key)

    def wait_established(self, *crds: str, timeout: float = 60.0) -> None:
        def established(name: str) -> bool:
            crd = self.request("GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}") or {}
            conditions = crd.get("status", {}).get("conditions") or []
            return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)

        deadline = time.monotonic() + timeout
        while not all(established(name) for name in crds):
            if time.monotonic() > deadline:
                raise ControlPlaneError(f"CRDs {crds} not Established after {timeout:.0f}s")
            time.sleep(0.2)

    # ------------------------------------------------------------------------------------------ API access

    def metrics_text(self, component: str) -> str:
        """The Prometheus text of "kube-apiserver" (/metrics, as the admin) or "etcd" (its client URL)."""
        if component == "kube-apiserver":
            return str(self.request("GET", "/metrics"))
        if component == "etcd":
            with urllib.request.urlopen(f"http://127.0.0.1:{self.etcd_port}/metrics", timeout=30) as resp:
                return str(resp.read().decode())
        raise ValueError(f"component: {component!r} is neither 'kube-apiserver' nor 'etcd'")

    def ssl_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca))

    def request(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json", token: str | None = None
    ) -> Any:
        """One API call as the admin (or `token`); None for a 404 GET, the parsed body otherwise."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Authorization", f"Bearer {token or self.admin_token}")
        req.add_header("Content-Type", content_type)
        try:
            with urllib.request.urlopen(req, timeout=30, context=self.ssl_context()) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            if exc.code == 404 and method == "GET":
                return None
            raise ApiError(exc.code, exc.read().decode(errors="replace"), method, path) from None
        text = raw.decode()
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text

    def token_for(self, namespace: str, service_account: str, *, hours: int = 1) -> str:
        """A bound token of `service_account` (TokenRequest), to act with exactly its RBAC rights."""
        review = self.request(
            "POST",
            f"/api/v1/namespaces/{namespace}/serviceaccounts/{service_account}/token",
            {
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenRequest",
                "spec": {"expirationSeconds": hours * 3600},
            },
        )
        return str(review["status"]["token"])


_HTTP_METHOD = {
    "get": "GET",
    "list": "GET",
    "watch": "GET",
    "create": "POST",
    "update": "PUT",
    "patch": "PATCH",
    "delete": "DELETE",
    "deletecollection": "DELETE",
}


@dataclass(frozen=True)
class AuditRecord:
    """One API request as the apiserver audited it."""

    verb: str  # the Kubernetes verb: get, list, watch, create, update, patch, delete
    method: str  # the HTTP method that verb arrives as
    path: str  # the request path without its query string
    user: str
    user_agent: str
    code: int

    @classmethod
    def from_event(cls, event: dict[str, Any]) -> AuditRecord:
        verb = str(event.get("verb", ""))
        return cls(
            verb=verb,
            method=_HTTP_METHOD.get(verb, verb.upper()),
            path=str(event.get("requestURI", "")).split("?", 1)[0],
            user=str(event.get("user", {}).get("username", "")),
            user_agent=str(event.get("userAgent", "")),
            code=int(event.get("responseStatus", {}).get("code", 0)),
        )


class ApiError(RuntimeError):
    def __init__(self, code: int, body: str, method: str, path: str) -> None:
        super().__init__(f"{method} {path}: HTTP {code}: {body[:2000]}")
        self.code = code
        self.body = body


def _run(args: Sequence[str], env: dict[str, str] | None = None) -> None:
    result = subprocess.run(list(args), capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise ControlPlaneError(f"{' '.join(args)} failed: {result.stderr[-2000:]}")


def _http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=2) as resp:
        return bool(resp.status == 200)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@contextlib.contextmanager
def control_plane(
    workdir: Path | None = None, fleet: Fleet | None = None, with_kuberay: bool = True, audit_mode: str = "blocking"
) -> Iterator[ControlPlane]:
    """A started control plane in `workdir` (a fresh temporary directory by default), stopped on exit."""
    if audit_mode not in ("blocking", "batch"):
        raise ValueError(f"audit_mode: {audit_mode!r} is neither 'blocking' nor 'batch'")
    own = workdir is None
    root = Path(tempfile.mkdtemp(prefix="r3-cluster-")) if workdir is None else workdir
    plane = ControlPlane(root, binaries_dir(), fleet=fleet or Fleet(), with_kuberay=with_kuberay, audit_mode=audit_mode)
    try:
        plane.start()
        yield plane
    finally:
        plane.stop()
        if own:
            shutil.rmtree(root, ignore_errors=True)


def gpu_resource_flavor(name: str = "h100") -> dict[str, Any]:
    """A Kueue ResourceFlavor of the fake GPU nodes: their label and taint (Kueue gives the flavor only to pods
    that select and tolerate them)."""
    return {
        "apiVersion": "kueue.x-k8s.io/v1beta1",
        "kind": "ResourceFlavor",
        "metadata": {"name": name},
        "spec": {
            "nodeLabels": {"nvidia.com/gpu.product": GPU_PRODUCT},
            "nodeTaints": [{"key": GPU_RESOURCE, "value": "present", "effect": "NoSchedule"}],
        },
    }
