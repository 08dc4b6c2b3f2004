"""The real kopf operator (KopfRunner) on the real control plane, driven with the real kubectl.

One operator for the module; each test uses its own RLJob name in namespace `rl`. The StatefulSet
controller, the scheduler, kwok's fake kubelets, KubeRay and the garbage collector are all real; what
the operator wrote is read from the apiserver's audit log (`operator_writes`), since controllers write
status to the same objects.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterator
from typing import Any

import pytest
from kopf.testing import KopfRunner
from operator_harness import (
    EXAMPLE,
    METRICS_NAMESPACE,
    OPERATOR_NAMESPACE,
    Cluster,
    all_children,
    children,
    example,
    operator_writes,
    paths,
    running_operator,
    wait_condition,
    wait_for,
    wait_passes,
)

from r3operator.operator.hashing import engine_spec_hash
from r3operator.operator.upgrade_record import read_record

NS = "rl"


@pytest.fixture(scope="module")
def operator(cluster: Cluster) -> Iterator[KopfRunner]:
    with running_operator(cluster, NS) as runner:
        yield runner


def _children(cluster: Cluster, job: str) -> dict[str, dict[str, Any] | None]:
    return children(cluster, NS, job)


def _all_children(cluster: Cluster, job: str) -> dict[str, dict[str, Any]]:
    return all_children(cluster, NS, job)


def _uid(obj: dict[str, Any]) -> str:
    return obj["metadata"]["uid"]


def _cond(cluster: Cluster, job: str, ctype: str, status: str, reason: str | None = None) -> dict[str, Any]:
    return wait_condition(cluster, NS, job, ctype, status, reason)


def _events(cluster: Cluster, job: str, reason: str) -> list[dict[str, Any]]:
    items = cluster.get(f"/api/v1/namespaces/{NS}/events")["items"]
    return [e for e in items if e["involvedObject"]["name"] == job and e["reason"] == reason]


def test_apply_example_creates_children_with_vllm_flags_and_gpu_requests(cluster: Cluster, operator: KopfRunner):
    cluster.kubectl("apply", "-f", str(EXAMPLE))
    kids = _all_children(cluster, "qwen3-30b-a3b-r3")
    sts = kids["sts"]
    container = sts["spec"]["template"]["spec"]["containers"][0]
    command = container["command"]
    assert command[:3] == ["vllm", "serve", "/mnt/model/hf/Qwen/Qwen3-30B-A3B/main"]
    # The model-fetch Job fills the model cache once; each engine only verifies that copy.
    (verify,) = sts["spec"]["template"]["spec"]["initContainers"]
    assert verify["command"] == [
        "r3operator",
        "fetch",
        "hf://Qwen/Qwen3-30B-A3B",
        "/mnt/model",
        "--revision",
        "main",
        "--verify",
    ]
    for flag in ("--enable-return-routed-experts", "--enable-expert-parallel"):
        assert flag in command
    joined = shlex.join(command)
    assert "--distributed-executor-backend mp" in joined
    assert "--tensor-parallel-size 2" in joined and "--data-parallel-size 2" in joined
    assert container["resources"]["requests"]["nvidia.com/gpu"] == "4"  # tp 2 x pp 1 x dp-local 2
    # Scaled up once kwok has completed the fetch Job's pod.
    wait_for(lambda: cluster.get(paths(NS, "qwen3-30b-a3b-r3")["sts"])["spec"]["replicas"] == 4, what="4 engines")
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert "/var/lib/r3operator" in mounts
    rljob = cluster.get(paths(NS, "qwen3-30b-a3b-r3")["rljob"])
    for kind in ("sts", "svc", "cm", "rayjob", "sa", "rb"):
        (owner,) = kids[kind]["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["uid"], owner["controller"]) == ("RLJob", rljob["metadata"]["uid"], True)
    assert "ownerReferences" not in kids["pvc"]["metadata"]  # retainPolicy: Retain
    wait_for(
        lambda: not cluster.get(paths(NS, "qwen3-30b-a3b-r3")["rayjob"])["spec"].get("suspend"),
        what="the RayJob resumed after the model fetch",
    )
    ray = cluster.get(paths(NS, "qwen3-30b-a3b-r3")["rayjob"])["spec"]
    assert ray["entrypoint"] == "r3operator run --config /etc/r3operator/config.json"
    assert ray["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"] == 1  # 2 nodes: head + 1 worker
    assert ray.get("suspend", False) is False  # KubeRay rewrites its objects with omitempty
    # The trainer pods run as <job>-trainer, bound to a Role of its own that names only this RLJob.
    pods = [ray["rayClusterSpec"]["headGroupSpec"]["template"]] + [
        g["template"] for g in ray["rayClusterSpec"]["workerGroupSpecs"]
    ]
    assert {p["spec"]["serviceAccountName"] for p in pods} == {"qwen3-30b-a3b-r3-trainer"}
    assert kids["rb"]["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "qwen3-30b-a3b-r3-trainer",
    }
    assert kids["rb"]["subjects"] == [{"kind": "ServiceAccount", "name": "qwen3-30b-a3b-r3-trainer", "namespace": NS}]

    _cond(cluster, "qwen3-30b-a3b-r3", "Valid", "True")
    # The real StatefulSet controller makes the 4 engine pods; the scheduler puts them on the tainted GPU
    # nodes (4 GPUs each); kwok runs them: ENGINES goes to 4/4. The trainer never reports a running job
    # (kwok runs no Ray), so READY stays False.
    table = wait_for(
        lambda: (out := cluster.kubectl("get", "rlj", "-n", NS).stdout) and "4/4" in out and out,
        timeout=60,
        what="printer columns with the engines Ready",
    )
    header, row = table.splitlines()[0].split(), table.splitlines()[1].split()
    assert header == ["NAME", "READY", "REASON", "REPLAY", "HEALTHY", "ENGINES", "TRAINER", "STEP", "UPGRADE", "AGE"]
    # HEALTHY: no step has reported yet, so ReplayHealthy is Unknown (NoStepYet)
    assert row[:7] == ["qwen3-30b-a3b-r3", "False", row[2], "R3", "Unknown", "4/4", "FSDP"]
    engine_pods = _pods(cluster, "qwen3-30b-a3b-r3", "statefulset.kubernetes.io/pod-name")
    assert len(engine_pods) == 4
    assert all(p["spec"]["nodeName"].startswith("gpu-node-") for p in engine_pods)
    wide = cluster.kubectl("get", "rlj", "-n", NS, "-o", "wide").stdout
    assert "0.22.1" in wide and "ghcr.io/r3operator/engine:0.1.0-vllm0.22.1" in wide


def test_cel_rule_is_refused_by_kubectl_apply(cluster: Cluster, operator: KopfRunner):
    bad = example("bad-cel", NS, **{"inference.executorBackend": "ray"})
    result = cluster.apply(bad, check=False)
    assert result.returncode != 0
    assert "routingReplay.mode R3 needs inference.executorBackend mp, got ray" in result.stderr
    assert cluster.get(paths(NS, "bad-cel")["rljob"]) is None


def test_python_only_rule_gives_valid_false_one_event_and_no_children_then_valid_edit_proceeds(
    cluster: Cluster, operator: KopfRunner
):
    job = "old-vllm"
    cluster.apply(example(job, NS, **{"inference.image": "vllm/vllm-openai:v0.13.0"}))
    cond = _cond(cluster, job, "Valid", "False", "IncompatibleSettings")
    assert "R3-VLLM-MIN-VERSION" in cond["message"]
    ready = _cond(cluster, job, "Ready", "False", "IncompatibleSettings")
    assert ready["observedGeneration"] == 1
    # Several timer passes later: still no child, still exactly one event for the transition.
    wait_for(lambda: len(_events(cluster, job, "IncompatibleSettings")) == 1, what="the Valid=False event")
    status_path = paths(NS, job)["rljob"] + "/status"
    status_writes = len(operator_writes(cluster.requests(), {status_path}))
    _wait_passes(cluster, job, 3)
    assert len(_events(cluster, job, "IncompatibleSettings")) == 1
    assert len(operator_writes(cluster.requests(), {status_path})) == status_writes
    assert not any(_children(cluster, job).values())

    cluster.apply(example(job, NS, **{"inference.image": "vllm/vllm-openai:v0.22.1"}))
    _all_children(cluster, job)
    _cond(cluster, job, "Valid", "True", "SpecValid")


def _wait_passes(cluster: Cluster, job: str, n: int) -> None:
    """Wait for n more reconcile passes of the job (a clock that needs no sleep)."""
    wait_passes(NS, job, n)


def test_image_upgrade_rolls_only_engines_and_invalid_upgrade_changes_nothing(cluster: Cluster, operator: KopfRunner):
    job = "upgrade"
    no_canary = {"upgradePolicy.canary": False}  # the canary's own flow: test_upgrade_cluster.py
    cluster.apply(example(job, NS, **no_canary))
    before = _all_children(cluster, job)
    _cond(cluster, job, "Progressing", "True", "WaitingForWorkloads")

    # KubeRay creates the head first and the workers after it: wait for the whole RayCluster.
    rayjob = before["rayjob"]["spec"]["rayClusterSpec"]
    want_trainer_pods = 1 + sum(g.get("replicas", 1) for g in rayjob.get("workerGroupSpecs") or [])
    trainer_pods = wait_for(
        lambda: (uids := _pod_uids(cluster, job, "ray.io/node-type")) and len(uids) == want_trainer_pods and uids,
        timeout=60,
        what=f"{want_trainer_pods} trainer pods (KubeRay)",
    )
    engine_pods = wait_for(lambda: _pod_uids(cluster, job, "statefulset.kubernetes.io/pod-name"), what="engine pods")

    # Valid upgrade: only the engine pod template (its spec hash) changes.
    mark = len(cluster.requests())
    cluster.apply(example(job, NS, **no_canary, **{"inference.image": "vllm/vllm-openai:v0.30.0"}))
    new_hash = engine_spec_hash(_spec(example(job, NS, **{"inference.image": "vllm/vllm-openai:v0.30.0"})))

    def rolled() -> dict[str, Any] | None:
        sts = cluster.get(paths(NS, job)["sts"])
        annotations = sts["spec"]["template"]["metadata"]["annotations"]
        return sts if annotations["r3operator.io/spec-hash"] == new_hash else None

    sts = wait_for(rolled, what="engine template hash")
    assert sts["spec"]["template"]["spec"]["containers"][0]["image"] == "vllm/vllm-openai:v0.30.0"
    # The real StatefulSet controller replaces every engine pod; KubeRay's trainer pods keep their UIDs.
    new_image = {"vllm/vllm-openai:v0.30.0"}
    wait_for(lambda: _engine_images(cluster, job) == new_image, timeout=60, what="engine pods rolled")
    # Its record of the rollout, Complete, goes on the StatefulSet once the new pods are ready: a write that must not
    # land in the invalid upgrade's window below (it did, now and then, when the test got there first).
    wait_for(
        lambda: (record := read_record(cluster.get(paths(NS, job)["sts"]))) is not None and record.phase == "Complete",
        what="the upgrade recorded Complete",
    )
    assert not set(_pod_uids(cluster, job, "statefulset.kubernetes.io/pod-name")) & set(engine_pods)
    assert _pod_uids(cluster, job, "ray.io/node-type") == trainer_pods
    after = _children(cluster, job)
    others = {paths(NS, job)[kind] for kind in ("pvc", "svc", "rayjob", "sa", "rb")}
    assert operator_writes(cluster.requests()[mark:], others) == []
    assert after["rayjob"]["metadata"]["uid"] == before["rayjob"]["metadata"]["uid"]

    # Invalid upgrade (R3 on vLLM 0.13): Valid=False and no child changes at all.
    settled = _children(cluster, job)
    mark = len(cluster.requests())
    cluster.apply(example(job, NS, **no_canary, **{"inference.image": "vllm/vllm-openai:v0.13.0"}))
    cond = _cond(cluster, job, "Valid", "False", "IncompatibleSettings")
    assert "R3-VLLM-MIN-VERSION" in cond["message"]
    assert cond["observedGeneration"] == 3
    _wait_passes(cluster, job, 3)
    children = {p for key, p in paths(NS, job).items() if key != "rljob"}
    assert operator_writes(cluster.requests()[mark:], children) == []

    # Trainer-only edit: the RayJob is re-created, the engines are not touched.
    mark = len(cluster.requests())
    cluster.apply(example(job, NS, **{"inference.image": "vllm/vllm-openai:v0.30.0", "algorithm.learningRate": 2e-6}))
    wait_for(
        lambda: (r := cluster.get(paths(NS, job)["rayjob"])) and _uid(r) != _uid(settled["rayjob"]),
        what="trainer re-created",
    )
    assert operator_writes(cluster.requests()[mark:], {paths(NS, job)["sts"]}) == []


def _pods(cluster: Cluster, job: str, label: str) -> list[dict[str, Any]]:
    items = cluster.get(f"/api/v1/namespaces/{NS}/pods")["items"]
    return [
        p
        for p in items
        if label in p["metadata"].get("labels", {})
        and job in p["metadata"]["name"]
        and not p["metadata"].get("deletionTimestamp")
    ]


def _pod_uids(cluster: Cluster, job: str, label: str) -> list[str]:
    return sorted(p["metadata"]["uid"] for p in _pods(cluster, job, label))


def _engine_images(cluster: Cluster, job: str) -> set[str]:
    pods = _pods(cluster, job, "statefulset.kubernetes.io/pod-name")
    return {c["image"] for p in pods for c in p["spec"]["containers"]} if len(pods) == 4 else set()


def _spec(doc: dict[str, Any]) -> Any:
    from r3operator.api.load import parse_rljob

    return parse_rljob(doc).spec


def test_suspend_and_resume(cluster: Cluster, operator: KopfRunner):
    job = "pause"
    cluster.apply(example(job, NS))
    _all_children(cluster, job)
    # The trainer driver reports its progress in <job>-progress; the operator copies it into status.progress.
    report = {"data": {"progress": json.dumps({"step": 7, "totalSteps": 500})}}
    cluster.http("PATCH", f"/api/v1/namespaces/{NS}/configmaps/{job}-progress", report, "application/merge-patch+json")

    cluster.apply(example(job, NS, **{"runPolicy.suspend": True}))
    _cond(cluster, job, "Suspended", "True", "Suspended")
    assert cluster.get(paths(NS, job)["sts"])["spec"]["replicas"] == 0
    assert cluster.get(paths(NS, job)["rayjob"])["spec"]["suspend"] is True
    assert _cond(cluster, job, "Ready", "False")["reason"] == "Suspended"

    cluster.apply(example(job, NS, **{"runPolicy.suspend": False}))
    _cond(cluster, job, "Suspended", "False", "Active")
    wait_for(lambda: cluster.get(paths(NS, job)["sts"])["spec"]["replicas"] == 4, what="engines restored")
    assert cluster.get(paths(NS, job)["rayjob"])["spec"]["suspend"] is False
    assert cluster.get(paths(NS, job)["rljob"])["status"]["progress"]["step"] == 7
    row = cluster.kubectl("get", "rlj", job, "-n", NS, "--no-headers").stdout.split()
    assert row[7] == "7"  # the STEP printer column


def test_child_deleted_by_hand_is_recreated(cluster: Cluster, operator: KopfRunner):
    job = "heal"
    cluster.apply(example(job, NS))
    kids = _all_children(cluster, job)
    cluster.kubectl("delete", "statefulset", f"{job}-engine", "-n", NS)
    cluster.kubectl("delete", "configmap", f"{job}-config", "-n", NS)
    healed = _all_children(cluster, job)
    assert healed["sts"]["metadata"]["uid"] != kids["sts"]["metadata"]["uid"]
    assert healed["cm"]["data"] == kids["cm"]["data"]


def test_finished_job_scales_engines_down_and_ttl_deletes_workloads_keeping_retained_pvc(
    cluster: Cluster, operator: KopfRunner
):
    job = "done"
    cluster.apply(example(job, NS, **{"runPolicy.ttlSecondsAfterFinished": 0}))
    kids = _all_children(cluster, job)
    # KubeRay learns a job's end from the Ray dashboard, which kwok's pods do not run: with KubeRay paused,
    # the test writes the status KubeRay writes for a finished job.
    with cluster.api.paused("kuberay-operator"):
        status = {"jobStatus": "SUCCEEDED", "jobDeploymentStatus": "Complete"}
        cluster.patch_status(paths(NS, job)["rayjob"], status)
        _cond(cluster, job, "Succeeded", "True", "TrainerSucceeded")
        # The RayJob goes last: its status is the record that the job ended.
    wait_for(lambda: not cluster.get(paths(NS, job)["rayjob"]), timeout=60, what="workloads deleted after TTL")
    left = _children(cluster, job)
    assert left["pvc"] is not None and _uid(left["pvc"]) == _uid(kids["pvc"])
    assert left["cm"] is None and left["svc"] is None and left["rayjob"] is None
    assert left["sa"] is None and left["rb"] is None and left["np"] is None
    assert cluster.get(paths(NS, job)["rljob"]) is not None
    # Sticky: the trainer is gone, Succeeded stays True.
    _cond(cluster, job, "Succeeded", "True")
    _cond(cluster, job, "Progressing", "False", "WorkloadsDeleted")


def test_delete_with_retain_keeps_the_pvc_without_owner(cluster: Cluster, operator: KopfRunner):
    job = "keep"
    cluster.apply(example(job, NS))
    _all_children(cluster, job)
    cluster.apply(example("drop", NS, **{"storage.retainPolicy": "Delete"}))
    dropped = _all_children(cluster, "drop")
    assert dropped["pvc"]["metadata"]["ownerReferences"][0]["kind"] == "RLJob"  # the GC deletes it

    cluster.kubectl("delete", "rlj", job, "-n", NS, "--wait=false")
    wait_for(lambda: cluster.get(paths(NS, job)["rljob"]) is None, what="finalizer released")
    pvc = cluster.get(paths(NS, job)["pvc"])
    assert pvc is not None and not pvc["metadata"].get("ownerReferences")
    assert pvc["metadata"]["annotations"]["r3operator.io/retained-from-uid"]


def _selected_pods(cluster: Cluster, match_labels: dict[str, str]) -> list[dict[str, Any]]:
    """The pods the API server itself returns for a label selector (what a CNI would match)."""
    selector = ",".join(f"{k}={v}" for k, v in sorted(match_labels.items()))
    items = cluster.get(f"/api/v1/namespaces/{NS}/pods?labelSelector={selector}")["items"]
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def test_engine_network_policy_selects_this_jobs_engine_pods_and_admits_its_trainer_pods(
    cluster: Cluster, operator: KopfRunner
):
    job = "fence"
    cluster.apply(example(job, NS))
    cluster.apply(example("walled", NS))
    kids = _all_children(cluster, job)
    policy = kids["np"]
    rljob = cluster.get(paths(NS, job)["rljob"])
    (owner,) = policy["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["uid"], owner["controller"]) == ("RLJob", rljob["metadata"]["uid"], True)
    assert policy["spec"]["policyTypes"] == ["Ingress"]

    # The selector picks exactly this job's engine pods, made by the real StatefulSet controller.
    engine_names = wait_for(
        lambda: (
            (names := sorted(p["metadata"]["name"] for p in _pods(cluster, job, "statefulset.kubernetes.io/pod-name")))
            and len(names) == 4
            and names
        ),
        timeout=60,
        what="the 4 engine pods",
    )
    selected = _selected_pods(cluster, policy["spec"]["podSelector"]["matchLabels"])
    assert sorted(p["metadata"]["name"] for p in selected) == engine_names
    assert all(p["metadata"]["name"].startswith(f"{job}-engine-") for p in selected)

    # Peers of the all-ports rule: this job's trainer pods (made by the real KubeRay) and its engine pods.
    same_job, namespaces = policy["spec"]["ingress"]
    assert "ports" not in same_job
    peer_selectors = [peer["podSelector"]["matchLabels"] for peer in same_job["from"]]
    assert all("namespaceSelector" not in peer for peer in same_job["from"])
    trainer_pods = wait_for(
        lambda: [
            p
            for sel in peer_selectors
            for p in _selected_pods(cluster, sel)
            if "ray.io/node-type" in p["metadata"]["labels"]
        ],
        timeout=60,
        what="KubeRay's trainer pods selected by a peer",
    )
    assert {p["metadata"]["labels"]["ray.io/node-type"] for p in trainer_pods} >= {"head"}
    # KubeRay read our rayVersion and injected httpGet probes: its wget exec probes would fail in our image.
    for pod in trainer_pods:
        ray_container = pod["spec"]["containers"][0]
        for kind in ("readinessProbe", "livenessProbe"):
            assert ray_container[kind]["httpGet"]["path"] == "/api/healthz" and "exec" not in ray_container[kind]
    admitted = {p["metadata"]["name"] for sel in peer_selectors for p in _selected_pods(cluster, sel)}
    assert set(engine_names) <= admitted
    assert not any(name.startswith("walled-") for name in admitted)  # another job's pods stay out

    # The operator's namespace (canary) and the admitted metrics namespace reach only the engine port.
    [peer] = namespaces["from"]
    [expr] = peer["namespaceSelector"]["matchExpressions"]
    assert expr == {
        "key": "kubernetes.io/metadata.name",
        "operator": "In",
        "values": sorted([METRICS_NAMESPACE, OPERATOR_NAMESPACE]),
    }
    assert namespaces["ports"] == [{"protocol": "TCP", "port": 8000}]
    # The API server labels every namespace with its name, which is what that selector matches on.
    assert cluster.get(f"/api/v1/namespaces/{NS}")["metadata"]["labels"]["kubernetes.io/metadata.name"] == NS


def test_disaggregated_job_renders_both_roles_reports_each_and_upgrades_both(cluster: Cluster, operator: KopfRunner):
    job = "pd"
    one_gpu = {"inference.tensorParallelSize": 1, "inference.dataParallelSize": 1, "inference.replicas": 2}
    disaggregated = {"inference.disaggregation": {"connector": "nixl", "prefill": {"replicas": 1}}}
    # The only KV connector R3 stitches is a prefill/decode split: kubectl apply says so, naming the field.
    refused = cluster.apply(example("pd-kv", NS, **{"inference.kvConnector": "nixl"}), check=False)
    assert refused.returncode != 0 and "spec.inference.kvConnector" in refused.stderr
    assert "set inference.disaggregation (connector nixl or storage)" in refused.stderr

    cluster.apply(example(job, NS, **one_gpu, **disaggregated, **{"upgradePolicy.canary": False}))
    prefill_path = f"/apis/apps/v1/namespaces/{NS}/statefulsets/{job}-prefill"
    wait_for(lambda: (cluster.get(prefill_path) or {}).get("spec", {}).get("replicas") == 1, what="the prefill role")
    wait_for(lambda: cluster.get(paths(NS, job)["sts"])["spec"]["replicas"] == 2, what="the decode role")
    prefill = cluster.get(prefill_path)
    assert cluster.get(f"/api/v1/namespaces/{NS}/services/{job}-prefill") is not None
    command = prefill["spec"]["template"]["spec"]["containers"][0]["command"]
    assert '{"kv_connector":"NixlConnector","kv_role":"kv_producer"}' in command
    # Readiness per role: the real StatefulSet controller, scheduler and kwok's kubelets run both roles' pods.
    table = wait_for(
        lambda: (out := cluster.kubectl("get", "rlj", job, "-n", NS).stdout) and "P 1/1 D 2/2" in out and out,
        timeout=90,
        what="the ENGINES column per role",
    )
    assert "P 1/1 D 2/2" in table
    status = cluster.get(paths(NS, job)["rljob"])["status"]
    assert status["prefillEngines"]["readyReplicas"] == 1 and status["engines"]["readyReplicas"] == 2
    fence = cluster.get(paths(NS, job)["np"])["spec"]["podSelector"]
    assert fence["matchExpressions"][0]["values"] == ["engine", "prefill"]

    # An image upgrade moves both roles; the record says Complete once both StatefulSets rolled.
    new = "vllm/vllm-openai:v0.30.0"
    cluster.apply(
        example(job, NS, **one_gpu, **disaggregated, **{"upgradePolicy.canary": False, "inference.image": new})
    )
    for path in (prefill_path, paths(NS, job)["sts"]):
        wait_for(
            lambda path=path: cluster.get(path)["spec"]["template"]["spec"]["containers"][0]["image"] == new,
            what=f"{path} on the new image",
        )
    wait_for(
        lambda: (record := read_record(cluster.get(paths(NS, job)["sts"]))) is not None and record.phase == "Complete",
        timeout=90,
        what="the upgrade recorded Complete",
    )
    images = {
        c["image"] for p in _pods(cluster, job, "statefulset.kubernetes.io/pod-name") for c in p["spec"]["containers"]
    }
    assert images == {new}
