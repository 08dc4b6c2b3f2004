"""examples/qwen3-30b-a3b-r3-fsdp-kueue.yaml, the file as shipped, on the real control plane with a real Kueue.

The objects it needs are made the way docs/install.md's walk-through makes them (tests/kubecluster/walkthrough.py
records that walk-through): a ResourceFlavor with the fake GPU nodes' label and taint, a ClusterQueue short of
GPUs, the LocalQueue, the PriorityClass, the image pull Secret and the Hugging Face token Secret. The job must
wait for quota with no pod, run once the queue grows, hand the token only to the model fetch by reference,
and put every engine and trainer pod on a tainted GPU node with the pull secret.

kwok runs no vLLM, so nothing answers the R3 routed-experts canary: the job reports engines and trainer
ready and Ready=False for that one reason (docs/install.md says the same of its transcript).
"""

from __future__ import annotations

import json
from typing import Any

from kubecluster import walkthrough as wt
from kubecluster.controlplane import GPU_PRODUCT
from operator_harness import REPO, Cluster, condition, paths, running_operator, wait_for, written_objects

NS, JOB = wt.NAMESPACE, wt.JOB
KUEUE = "/apis/kueue.x-k8s.io/v1beta1"


def _job_pods(cluster: Cluster, selector: str = "") -> list[dict[str, Any]]:
    query = f"r3operator.io/job={JOB}" + (f",{selector}" if selector else "")
    return cluster.get(f"/api/v1/namespaces/{NS}/pods?labelSelector={query}")["items"]


def _gpus(pod: dict[str, Any]) -> int:
    return sum(int(c["resources"].get("requests", {}).get(wt.GPU, 0)) for c in pod["spec"]["containers"])


def _cond(cluster: Cluster, ctype: str, status: str, reason: str | None = None, text: str = "") -> dict[str, Any]:
    """Wait until the RLJob's condition `ctype` has `status` (and `reason`, and a message containing `text`)."""

    def check() -> dict[str, Any] | None:
        cond = condition(cluster.get(paths(NS, JOB)["rljob"]), ctype)
        if cond and cond["status"] == status and reason in (None, cond["reason"]) and text in cond["message"]:
            return cond
        return None

    return wait_for(check, timeout=90, what=f"{ctype}={status} {reason or ''} saying {text!r}")


def _delete_the_job(cluster: Cluster) -> None:
    """The job and everything it owns go (other modules use namespace rl with a job whose name is a prefix of
    this one's): KubeRay's submitter pod carries none of our labels, hence the name."""
    cluster.kubectl("delete", "rljob", JOB, "-n", NS, "--ignore-not-found", "--wait=false")
    wait_for(
        lambda: (
            not [
                p
                for p in cluster.get(f"/api/v1/namespaces/{NS}/pods")["items"]
                if p["metadata"]["name"].startswith(JOB)
            ]
        ),
        timeout=60,
        what=f"the pods of {JOB} gone",
    )


def test_the_shipped_kueue_example_waits_for_quota_then_runs_on_tainted_gpu_nodes(cluster: Cluster) -> None:
    cluster.api.start_kueue()
    with running_operator(cluster, NS) as runner:
        try:
            for manifest in wt.setup_manifests():
                cluster.apply(manifest)
            for command in wt.secret_commands():
                made = wt.shell(command, cluster.kubeconfig, REPO)
                assert made.returncode == 0, made.stderr
            cluster.apply(wt.EXAMPLE)  # the file as it is in the repository

            _cond(cluster, "Valid", "True", "SpecValid")
            short = _cond(cluster, "Admitted", "False", "WaitingForAdmission", "insufficient quota")
            assert f"insufficient quota for {wt.GPU}" in short["message"], short["message"]
            _cond(cluster, "Suspended", "True", "WaitingForAdmission")
            workload = cluster.get(f"{KUEUE}/namespaces/{NS}/workloads/{JOB}-workload")
            assert workload is not None and workload["spec"]["queueName"] == wt.LOCAL_QUEUE
            assert cluster.get(f"/apis/batch/v1/namespaces/{NS}/jobs/{JOB}-model-fetch")["spec"]["suspend"] is True
            assert _job_pods(cluster) == []  # not even the model fetch runs outside the quota

            cluster.apply(wt.cluster_queue(wt.GPUS_ENOUGH))
            _cond(cluster, "Admitted", "True", "Admitted", f"ClusterQueue {wt.CLUSTER_QUEUE}")
            _cond(cluster, "EnginesReady", "True", "AllReplicasReady", "4/4")
            _cond(cluster, "TrainerReady", "True")
            engines = _job_pods(cluster, "r3operator.io/role=engine")
            trainers = [p for p in _job_pods(cluster, "r3operator.io/role=trainer") if _gpus(p)]  # not Ray's submitter
            [fetch] = _job_pods(cluster, "r3operator.io/role=model-fetch")
            assert (len(engines), sorted(_gpus(p) for p in engines)) == (4, [4, 4, 4, 4])
            assert sorted(_gpus(p) for p in trainers) == [8, 8]  # the head and one worker

            nodes = {n["metadata"]["name"]: n for n in cluster.get("/api/v1/nodes")["items"]}
            gpu_taint = {"key": wt.GPU, "value": "present", "effect": "NoSchedule"}
            for pod in [*engines, *trainers, fetch]:
                name, spec = pod["metadata"]["name"], pod["spec"]
                node = nodes[spec["nodeName"]]
                assert gpu_taint in node["spec"]["taints"], (name, node["metadata"]["name"])
                assert node["metadata"]["labels"]["nvidia.com/gpu.product"] == GPU_PRODUCT, name
                assert spec["imagePullSecrets"] == [{"name": wt.PULL_SECRET}], name
                assert spec["priorityClassName"] == wt.PRIORITY_CLASS, name
                assert {
                    "key": "dedicated",
                    "operator": "Equal",
                    "value": "rl-training",
                    "effect": "NoSchedule",
                } in spec["tolerations"], name

            # The token reaches the fetch container only, by reference.
            token_ref = {"secretKeyRef": {"name": wt.TOKEN_SECRET, "key": wt.TOKEN_KEY}}
            assert [e for e in fetch["spec"]["containers"][0]["env"] if e["name"] == "HF_TOKEN"] == [
                {"name": "HF_TOKEN", "valueFrom": token_ref}
            ]
            for pod in [*engines, *trainers]:
                containers = pod["spec"]["containers"] + pod["spec"].get("initContainers", [])
                assert not [e for c in containers for e in c.get("env", []) if e["name"] == "HF_TOKEN"], pod["metadata"]

            # kwok serves no vLLM: the R3 canary fails, and it is the one thing keeping the job from Ready.
            _cond(cluster, "RoutingReplayActive", "False", "CanaryFailed", "/v1/completions")
            ready = _cond(cluster, "Ready", "False", "CanaryFailed")
            assert ready["message"].startswith("RoutingReplayActive: POST "), ready["message"]
            written = written_objects(cluster, NS, kueue=True)
        finally:
            _delete_the_job(cluster)
    log = runner.output  # complete once the operator has stopped
    dump = json.dumps(written)
    assert '"secretKeyRef": {"key": "token", "name": "hf-token"}' in json.dumps(written["jobs"], sort_keys=True)
    assert written["configmaps"] and written["events"] and written["workloads"]
    assert wt.FAKE_HF_TOKEN not in dump
    assert wt.FAKE_HF_TOKEN not in log
