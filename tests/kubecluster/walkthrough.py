"""The docs/install.md walk-through "On a shared GPU cluster", recorded on the test control plane.

    PYTHONPATH=tests python -m kubecluster walkthrough --out walkthrough.md [--docs docs/install.md]

Starts a control plane (kwok's tainted fake GPU nodes, KubeRay, Kueue), runs `r3operator operator -n rl` as
its own process outside the cluster, then runs each shell command a reader would type, with the real
kubectl (.tools/bin) and bash, and writes the commands with their real output as Markdown. `--docs`
also replaces the part of that file between the WALKTHROUGH markers. The objects it creates first (the
queue, the PriorityClass, the Secrets) are the ones tests/operator/test_kueue_example_cluster.py creates
before it applies the same example file, so the test checks what this records.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kubecluster.controlplane import (
    REPO,
    ControlPlane,
    Fleet,
    binaries_dir,
    gpu_resource_flavor,
    kubectl_binary,
)

EXAMPLE = REPO / "examples" / "qwen3-30b-a3b-r3-fsdp-kueue.yaml"
NAMESPACE = "rl"
JOB = "qwen3-30b-a3b-r3-queued"
GPU = "nvidia.com/gpu"
FLAVOR = "h100"
CLUSTER_QUEUE = "research-gpus"
LOCAL_QUEUE = "gpu-research"
PRIORITY_CLASS = "rl-training"
PULL_SECRET = "ghcr-pull"
TOKEN_SECRET = "hf-token"
TOKEN_KEY = "token"
GPUS_SHORT, GPUS_ENOUGH = 16, 32
"""The queue starts with half of the example's 32 GPUs, then grows to all of them."""
FAKE_HF_TOKEN = "hf_walkthroughNOTaREALtoken0042"
"""What $HF_TOKEN holds in the recording (and in the test): a made-up value to look for in what the operator
writes, never a real credential."""
FAKE_REGISTRY_LOGIN = ("r3-walkthrough", "ghp_walkthroughNOTaREALpassword")

BEGIN_MARK = "<!-- WALKTHROUGH:BEGIN (generated: PYTHONPATH=tests python -m kubecluster walkthrough) -->"
END_MARK = "<!-- WALKTHROUGH:END -->"


def resource_flavor() -> dict[str, Any]:
    return gpu_resource_flavor(FLAVOR)


def cluster_queue(gpus: int) -> dict[str, Any]:
    """Every resource the example's pods request needs quota, not only GPUs (engines ask 16 CPUs and 200Gi)."""
    quota = [
        {"name": GPU, "nominalQuota": gpus},
        {"name": "cpu", "nominalQuota": 512},
        {"name": "memory", "nominalQuota": "4Ti"},
    ]
    return {
        "apiVersion": "kueue.x-k8s.io/v1beta1",
        "kind": "ClusterQueue",
        "metadata": {"name": CLUSTER_QUEUE},
        "spec": {
            "namespaceSelector": {},
            "resourceGroups": [
                {"coveredResources": [GPU, "cpu", "memory"], "flavors": [{"name": FLAVOR, "resources": quota}]}
            ],
        },
    }


def local_queue() -> dict[str, Any]:
    return {
        "apiVersion": "kueue.x-k8s.io/v1beta1",
        "kind": "LocalQueue",
        "metadata": {"name": LOCAL_QUEUE, "namespace": NAMESPACE},
        "spec": {"clusterQueue": CLUSTER_QUEUE},
    }


def priority_class() -> dict[str, Any]:
    return {
        "apiVersion": "scheduling.k8s.io/v1",
        "kind": "PriorityClass",
        "metadata": {"name": PRIORITY_CLASS},
        "value": 1000,
        "description": "RL post-training jobs",
    }


def setup_manifests() -> list[dict[str, Any]]:
    """setup.yaml: what a cluster admin creates once (the Secrets are the namespace owner's, made with kubectl)."""
    return [resource_flavor(), cluster_queue(GPUS_SHORT), local_queue(), priority_class()]


def secret_commands() -> list[str]:
    """The two Secrets the example names, as a reader creates them (values from the shell's environment)."""
    return [
        f"kubectl create secret docker-registry {PULL_SECRET} -n {NAMESPACE} --docker-server=ghcr.io \\\n"
        "    --docker-username=$GHCR_USER --docker-password=$GHCR_TOKEN",
        f"kubectl create secret generic {TOKEN_SECRET} -n {NAMESPACE} --from-literal={TOKEN_KEY}=$HF_TOKEN",
    ]


def secret_env() -> dict[str, str]:
    user, password = FAKE_REGISTRY_LOGIN
    return {"HF_TOKEN": FAKE_HF_TOKEN, "GHCR_USER": user, "GHCR_TOKEN": password}


def shell(command: str, kubeconfig: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`command` as a reader's bash runs it: the real kubectl first on PATH, the Secrets' values in the environment."""
    path = f"{Path(kubectl_binary()).parent}:{os.environ.get('PATH', '')}"
    env = {**os.environ, **secret_env(), "PATH": path, "KUBECONFIG": str(kubeconfig)}
    return subprocess.run(
        ["bash", "-o", "pipefail", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def yaml_stream(docs: list[dict[str, Any]]) -> str:
    return "---\n".join(yaml.safe_dump(d, sort_keys=False) for d in docs)


CONDITIONS = (
    f"kubectl get rlj {JOB} -n {NAMESPACE} \\\n"
    "    -o jsonpath='{range .status.conditions[*]}{.type}={.status} {.reason}: {.message}{\"\\n\"}{end}'"
)


@dataclass
class Recorder:
    """Runs shell commands in `workdir` with the real kubectl first on PATH and keeps them with their output."""

    workdir: Path
    kubeconfig: Path
    parts: list[str] = field(default_factory=list)
    _block: list[str] = field(default_factory=list)

    def sh(self, command: str) -> subprocess.CompletedProcess[str]:
        return shell(command, self.kubeconfig, self.workdir)

    def show(self, command: str) -> str:
        """Run `command` and record it with its output; a failure stops the recording (it would be a lie)."""
        result = self.sh(command)
        if result.returncode != 0:
            raise RuntimeError(f"`{command}` failed ({result.returncode}):\n{result.stdout}{result.stderr}")
        shown = f"$ {command}"
        output = "\n".join(line.rstrip() for line in (result.stdout + result.stderr).rstrip("\n").splitlines())
        self._block.append(shown + ("\n" + output if output else ""))
        return result.stdout

    def until(self, what: str, check: Callable[[], bool], timeout: float = 180.0) -> None:
        """Wait unrecorded: the reader's clock, not a command."""
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")
            time.sleep(1.0)

    def text(self, prose: str) -> None:
        """A paragraph between the console blocks, wrapped like the rest of docs/."""
        self.raw(textwrap.fill(prose, width=110, break_on_hyphens=False, break_long_words=False))

    def raw(self, markdown: str) -> None:
        self._flush()
        self.parts.append(markdown.strip("\n"))

    def _flush(self) -> None:
        if self._block:
            self.parts.append("```console\n" + "\n\n".join(self._block) + "\n```")
            self._block = []

    def markdown(self) -> str:
        self._flush()
        return "\n\n".join(self.parts) + "\n"


def condition_of(recorder: Recorder, ctype: str) -> tuple[str, str, str]:
    """(status, reason, message) of the RLJob's condition `ctype`, or empty strings while it has none."""
    path = f'{{.status.conditions[?(@.type=="{ctype}")]}}'
    out = recorder.sh(f"kubectl get rlj {JOB} -n {NAMESPACE} -o jsonpath='{path}'").stdout
    if not out.strip():
        return "", "", ""
    cond = yaml.safe_load(out)
    return str(cond.get("status", "")), str(cond.get("reason", "")), str(cond.get("message", ""))


@contextlib.contextmanager
def operator_process(plane: ControlPlane, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`r3operator operator -n rl` from this checkout, outside the cluster (as a developer runs it)."""
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "R3OPERATOR_METRICS_PORT": "0",  # no fixed port to collide with on a shared machine
    }
    command = [sys.executable, "-m", "r3operator", "operator", "-n", NAMESPACE, "--liveness", ""]
    command += ["--kubeconfig", str(plane.kubeconfig)]
    with log.open("wb") as out:
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def record(workdir: Path) -> str:
    """The walk-through's Markdown, from a control plane started (and stopped) in `workdir`."""
    workdir.mkdir(parents=True, exist_ok=True)
    plane = ControlPlane(workdir / "cluster", binaries_dir(), fleet=Fleet(nodes=8, cpu_nodes=2), with_kuberay=True)
    shell = workdir / "shell"
    shell.mkdir(exist_ok=True)
    (shell / "examples").symlink_to(REPO / "examples")
    (shell / "setup.yaml").write_text(yaml_stream(setup_manifests()))
    (shell / "research-gpus-32.yaml").write_text(yaml_stream([cluster_queue(GPUS_ENOUGH)]))
    try:
        plane.start()
        plane.start_kueue()
        rec = Recorder(shell, plane.kubeconfig)
        crds = rec.sh(f"kubectl apply --server-side -f {REPO / 'crds'}")
        if crds.returncode != 0:
            raise RuntimeError(crds.stderr)
        plane.wait_established("rljobs.r3operator.io")
        with operator_process(plane, workdir / "operator.log") as operator:
            _steps(rec)
            if operator.poll() is not None:
                raise RuntimeError(f"the operator exited ({operator.returncode}): see {workdir / 'operator.log'}")
        return rec.markdown()
    finally:
        plane.stop()


def _steps(rec: Recorder) -> None:
    rec.show(
        "kubectl get nodes -o custom-columns='NAME:.metadata.name,GPUS:.status.allocatable.nvidia\\.com/gpu,"
        "TAINTS:.spec.taints[*].key,EFFECT:.spec.taints[*].effect'"
    )
    rec.text(
        f"`setup.yaml`, what a cluster admin creates once: the flavor of the GPU nodes (their label and taint), "
        f"a ClusterQueue of {GPUS_SHORT} GPUs with CPU and memory quota (Kueue admits only what every requested "
        "resource has quota for), the LocalQueue and the PriorityClass the example names:"
    )
    rec.raw("```yaml\n" + yaml_stream(setup_manifests()) + "```")
    rec.show(f"kubectl create namespace {NAMESPACE}")
    rec.show("kubectl apply -f setup.yaml")
    for command in secret_commands():
        rec.show(command)
    rec.show(f"kubectl apply -f {EXAMPLE.relative_to(REPO)}")

    def quota_refused() -> bool:
        status, reason, message = condition_of(rec, "Admitted")
        return status == "False" and reason == "WaitingForAdmission" and "insufficient" in message

    rec.until("Kueue's verdict (insufficient quota)", quota_refused)
    rec.show(f"kubectl get rlj -n {NAMESPACE}")
    rec.show(CONDITIONS + " | grep -E '^(Valid|Admitted|Suspended)'")
    rec.show(f"kubectl get workloads -n {NAMESPACE}")
    rec.show(f"kubectl get statefulset,rayjob,job -n {NAMESPACE}")
    rec.show(f"kubectl get pods -n {NAMESPACE}")
    rec.text(
        f"No pod exists while the job waits, not even the model fetch (its Job waits suspended): the "
        f"{GPUS_SHORT} engine GPUs alone would fit, but Kueue admits the {GPUS_ENOUGH}-GPU Workload whole or not "
        f"at all. The queue grows to {GPUS_ENOUGH} GPUs (`research-gpus-32.yaml` is the same ClusterQueue with "
        f"`nominalQuota: {GPUS_ENOUGH}` for `{GPU}`):"
    )
    rec.show("kubectl apply -f research-gpus-32.yaml")

    def engines_ready_and_canaried() -> bool:
        engines = condition_of(rec, "EnginesReady")[0] == "True"
        return engines and condition_of(rec, "RoutingReplayActive")[0] in ("True", "False")

    rec.until("engines ready and the routed-experts canary's verdict", engines_ready_and_canaried)
    rec.show(f"kubectl get workloads -n {NAMESPACE}")
    rec.show(f"kubectl get pods -n {NAMESPACE} -o wide")
    rec.show(
        f"kubectl get pods -n {NAMESPACE} -l r3operator.io/job={JOB} -o custom-columns='POD:.metadata.name,"
        "ROLE:.metadata.labels.r3operator\\.io/role,PULL-SECRETS:.spec.imagePullSecrets[*].name,"
        "TOLERATES:.spec.tolerations[*].key'"
    )
    rec.show(
        f"kubectl get job {JOB}-model-fetch -n {NAMESPACE} -o jsonpath="
        '\'{.spec.template.spec.containers[0].env[?(@.name=="HF_TOKEN")]}{"\\n"}\''
    )
    rec.show(f"kubectl get rlj -n {NAMESPACE}")
    rec.show(CONDITIONS)


def replace_between_marks(document: str, fragment: str) -> str:
    """`document` with the text between BEGIN_MARK and END_MARK replaced by `fragment`."""
    start, end = document.find(BEGIN_MARK), document.find(END_MARK)
    if start < 0 or end < start:
        raise ValueError(f"the document lacks the markers {BEGIN_MARK!r} ... {END_MARK!r}")
    return document[: start + len(BEGIN_MARK)] + "\n" + fragment + document[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kubecluster walkthrough", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="Markdown file to write")
    parser.add_argument("--docs", type=Path, help="also replace the walk-through between the markers in this file")
    parser.add_argument("--workdir", type=Path, help="keep the control plane's files and the operator log here")
    args = parser.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="r3-walkthrough-"))
    fragment = record(workdir.resolve())
    args.out.write_text(fragment)
    if args.docs is not None:
        args.docs.write_text(replace_between_marks(args.docs.read_text(), fragment))
    print(f"wrote {args.out}" + (f" and {args.docs}" if args.docs else "") + f" (logs in {workdir})")
    return 0
