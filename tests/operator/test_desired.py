"""desired() and its builders, hashes and the diff rules: pure, no cluster."""

from __future__ import annotations

import copy
import datetime as dt
from pathlib import Path
from typing import Any

import pytest
import yaml

from r3operator.api.load import load_rljob, parse_rljob
from r3operator.api.v1alpha1 import Condition, RLJob, RLJobStatus
from r3operator.operator.apply import plan_action
from r3operator.operator.builders.engine import model_params_billions, startup_budget_seconds
from r3operator.operator.desired import Facts, desired

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
QWEN = REPO / "examples" / "qwen3-30b-a3b-r3-fsdp.yaml"


def _job(path: Path = QWEN, uid: str | None = "uid-1", **edits: Any) -> RLJob:
    doc = yaml.safe_load(path.read_text())
    doc["metadata"]["uid"] = uid
    for dotted, value in edits.items():
        node = doc["spec"]
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return parse_rljob(doc)


def _by_kind(children: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {c["kind"]: c for c in children}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_example_builds_deterministic_children_with_labels_and_owners(path: Path):
    job = _job(path)
    first, second = desired(job), desired(_job(path))
    assert first == second
    name = job.metadata.name
    kinds = {c["kind"]: c["metadata"]["name"] for c in first}
    assert kinds["ConfigMap"] == f"{name}-config"
    assert kinds["StatefulSet"] == kinds["Service"] == f"{name}-engine"
    assert kinds["RayJob"] == f"{name}-trainer"
    assert kinds["PodMonitor"] == f"{name}-metrics"
    assert kinds["ServiceAccount"] == kinds["RoleBinding"] == f"{name}-trainer"
    for child in first:
        labels = child["metadata"]["labels"]
        assert labels["app.kubernetes.io/managed-by"] == "r3operator"
        assert labels["app.kubernetes.io/instance"] == name
        assert labels["r3operator.io/job"] == name
        assert labels["r3operator.io/role"] == labels["app.kubernetes.io/component"]


def test_engine_statefulset_runs_vllm_with_spec_args_gpus_probes_and_routing_volume():
    # examples/qwen3-30b-a3b-r3-fsdp.yaml: TP2 x DP2 (all local), EP on, mp executor, R3, 4 replicas.
    sts = _by_kind(desired(_job()))["StatefulSet"]
    assert sts["spec"]["replicas"] == 4  # one pod per replica: dataParallelSizeLocal defaults to dataParallelSize
    pod = sts["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == [
        "vllm", "serve", "Qwen/Qwen3-30B-A3B", "--port", "8000", "--revision", "main",
        "--tensor-parallel-size", "2", "--pipeline-parallel-size", "1",
        "--data-parallel-size", "2", "--data-parallel-size-local", "2", "--enable-expert-parallel",
        "--distributed-executor-backend", "mp", "--max-model-len", "8192", "--gpu-memory-utilization", "0.85",
        "--enable-return-routed-experts",
        "--worker-extension-cls", "r3operator.engine.worker.WeightSyncWorkerExtension",
    ]  # fmt: skip
    assert container["resources"]["requests"]["nvidia.com/gpu"] == "4"  # tp 2 x pp 1 x dp-local 2
    assert container["env"] == [{"name": "VLLM_PLUGINS", "value": "r3operator"}]
    assert {"name": "routing", "mountPath": "/var/lib/r3operator"} in container["volumeMounts"]
    assert {"name": "config", "mountPath": "/etc/r3operator", "readOnly": True} in container["volumeMounts"]
    claim = next(v for v in pod["volumes"] if v["name"] == "routing")["persistentVolumeClaim"]["claimName"]
    assert claim == "qwen3-30b-a3b-r3-routing"
    assert container["startupProbe"]["httpGet"]["path"] == "/health"
    # 30B parameters -> 60 GB of bf16 -> 300 s + 6 s/GB x 60 GB = 660 s, probed every 10 s.
    assert container["startupProbe"]["periodSeconds"] == 10
    assert container["startupProbe"]["failureThreshold"] == 66


def test_startup_budget_grows_with_model_size_and_has_a_default():
    assert model_params_billions("hf://Qwen/Qwen3-30B-A3B") == 30
    assert model_params_billions("hf://allenai/OLMoE-1B-7B-0924") == 7
    assert model_params_billions("hf://org/mystery-moe") is None
    small = _job(**{"model.uri": "hf://allenai/OLMoE-1B-7B-0924"})
    big = _job(**{"model.uri": "hf://deepseek-ai/DeepSeek-V3-671B"})
    unknown = _job(**{"model.uri": "hf://org/mystery-moe"})
    assert startup_budget_seconds(small) < startup_budget_seconds(_job()) < startup_budget_seconds(big)
    assert startup_budget_seconds(unknown) == 900
    assert startup_budget_seconds(big) <= 3 * 3600


def test_multi_pod_replica_uses_ordinals_for_dp_ranks_and_headless_followers():
    job = _job(**{"inference.dataParallelSize": 4, "inference.dataParallelSizeLocal": 2, "inference.replicas": 2})
    sts = _by_kind(desired(job))["StatefulSet"]
    assert sts["spec"]["replicas"] == 4  # 2 replicas x 2 pods
    command = sts["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:2] == ["/bin/sh", "-c"]
    assert "--headless" in command[2] and "--data-parallel-address" in command[2]
    assert sts["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/gpu"] == "4"


def test_trainer_rayjob_sizes_groups_mounts_routing_everywhere_and_mirrors_suspend():
    job = _job()
    ray = _by_kind(desired(job))["RayJob"]
    assert ray["apiVersion"] == "ray.io/v1"
    spec = ray["spec"]
    assert spec["entrypoint"] == "r3operator run --config /etc/r3operator/config.json"
    assert spec["suspend"] is False
    head = spec["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    (workers,) = spec["rayClusterSpec"]["workerGroupSpecs"]
    assert workers["replicas"] == 1  # nodes 2 = head + 1 worker
    for pod in (head, workers["template"]["spec"]):
        assert pod["containers"][0]["resources"]["requests"]["nvidia.com/gpu"] == "8"
        assert {"name": "routing", "mountPath": "/var/lib/r3operator"} in pod["containers"][0]["volumeMounts"]
    suspended = _by_kind(desired(_job(**{"runPolicy.suspend": True})))
    assert suspended["RayJob"]["spec"]["suspend"] is True
    assert suspended["StatefulSet"]["spec"]["replicas"] == 0


def test_trainer_pods_run_as_a_per_job_service_account_bound_to_the_trainer_cluster_role():
    job = _job()
    name, namespace = job.metadata.name, job.metadata.namespace
    kids = _by_kind(desired(job, Facts(trainer_cluster_role="r3-r3operator-trainer")))
    sa, rb, ray = kids["ServiceAccount"], kids["RoleBinding"], kids["RayJob"]
    owner = {"apiVersion": "r3operator.io/v1alpha1", "kind": "RLJob", "name": name, "uid": "uid-1",
             "controller": True, "blockOwnerDeletion": True}  # fmt: skip
    for child in (sa, rb):
        assert child["metadata"]["name"] == f"{name}-trainer" and child["metadata"]["namespace"] == namespace
        assert child["metadata"]["ownerReferences"] == [owner]
        assert child["metadata"]["labels"]["r3operator.io/job"] == name
        assert child["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "r3operator"
    assert sa["apiVersion"] == "v1" and set(sa) == {"apiVersion", "kind", "metadata"}
    assert rb["apiVersion"] == "rbac.authorization.k8s.io/v1"
    assert rb["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                             "name": "r3-r3operator-trainer"}  # fmt: skip
    assert rb["subjects"] == [{"kind": "ServiceAccount", "name": f"{name}-trainer", "namespace": namespace}]
    assert _by_kind(desired(job))["RoleBinding"]["roleRef"]["name"] == "r3operator-trainer"  # the default
    cluster = ray["spec"]["rayClusterSpec"]
    pods = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    assert [p["spec"]["serviceAccountName"] for p in pods] == [f"{name}-trainer"] * 2
    kinds = [c["kind"] for c in desired(job)]
    assert kinds.index("ServiceAccount") < kinds.index("RoleBinding") < kinds.index("RayJob")


def test_diff_rules_for_the_trainer_service_account_and_role_binding():
    kids = _by_kind(desired(_job()))
    sa, rb = kids["ServiceAccount"], kids["RoleBinding"]
    observed_sa = copy.deepcopy(sa)
    observed_sa["metadata"].update(uid="x", resourceVersion="1")
    observed_sa["secrets"] = [{"name": "token"}]
    assert plan_action(sa, observed_sa).verb == "none"
    observed_sa["metadata"]["labels"] = {}
    ours = {k: sa["metadata"][k] for k in ("labels", "ownerReferences")}
    assert plan_action(sa, observed_sa).patch == {"metadata": ours}
    assert plan_action(rb, copy.deepcopy(rb)).verb == "none"
    other_role = copy.deepcopy(rb)
    other_role["roleRef"]["name"] = "old-trainer"
    assert plan_action(rb, other_role).verb == "recreate"  # roleRef is immutable
    other_subjects = copy.deepcopy(rb)
    other_subjects["subjects"] = []
    assert plan_action(rb, other_subjects).patch == {"subjects": rb["subjects"]}


def test_pvc_ownership_follows_retain_policy_and_existing_claim_creates_none():
    retain = _by_kind(desired(_job()))["PersistentVolumeClaim"]
    assert "ownerReferences" not in retain["metadata"]
    assert retain["metadata"]["annotations"]["r3operator.io/retained-from-uid"] == "uid-1"
    assert retain["spec"]["accessModes"] == ["ReadWriteMany"]
    delete = _by_kind(desired(_job(**{"storage.retainPolicy": "Delete"})))["PersistentVolumeClaim"]
    assert delete["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    existing = _by_kind(desired(_job(**{"storage.existingClaim": "shared-rwx"})))
    assert "PersistentVolumeClaim" not in existing
    volumes = existing["StatefulSet"]["spec"]["template"]["spec"]["volumes"]
    assert volumes[0]["persistentVolumeClaim"]["claimName"] == "shared-rwx"


def test_render_without_uid_has_no_owner_references_and_pod_monitor_needs_the_crd():
    children = desired(_job(uid=None), Facts(pod_monitor_crd=False))
    assert all("ownerReferences" not in c["metadata"] for c in children)
    assert "PodMonitor" not in _by_kind(children)
    assert "PodMonitor" not in _by_kind(desired(_job(**{"monitoring.enabled": False})))


def _template_hash(job: RLJob) -> str:
    template = _by_kind(desired(job))["StatefulSet"]["spec"]["template"]
    return template["metadata"]["annotations"]["r3operator.io/spec-hash"]


def _trainer_hash(job: RLJob) -> str:
    return _by_kind(desired(job))["RayJob"]["metadata"]["annotations"]["r3operator.io/spec-hash"]


def test_image_edit_changes_only_the_engine_hash_and_trainer_edit_only_the_trainer_hash():
    base = _job()
    image = _job(**{"inference.image": "vllm/vllm-openai:v0.30.0"})
    trainer = _job(**{"algorithm.learningRate": 3e-6, "trainer.image": "ghcr.io/r3operator/trainer:0.2.0"})
    scaled = _job(**{"inference.replicas": 8})
    assert _template_hash(image) != _template_hash(base) and _trainer_hash(image) == _trainer_hash(base)
    assert _trainer_hash(trainer) != _trainer_hash(base) and _template_hash(trainer) == _template_hash(base)
    assert _template_hash(scaled) == _template_hash(base)  # scaling is not a restart
    assert _by_kind(desired(trainer))["StatefulSet"] == _by_kind(desired(base))["StatefulSet"]


def test_diff_rules_never_roll_pods_for_a_template_rendered_differently_with_the_same_hash():
    want = _by_kind(desired(_job()))["StatefulSet"]
    have = copy.deepcopy(want)
    have["spec"]["template"]["spec"]["containers"][0]["env"].append({"name": "OLD_OPERATOR", "value": "1"})
    assert plan_action(want, have).verb == "none"
    have["spec"]["replicas"] = 0
    assert plan_action(want, have).patch == {"spec": {"replicas": 4}}
    new_image = _by_kind(desired(_job(**{"inference.image": "vllm/vllm-openai:v0.30.0"})))["StatefulSet"]
    assert set(plan_action(new_image, want).patch["spec"]) == {"template", "replicas"}
    assert plan_action(want, None).verb == "create"


def test_diff_rules_ignore_server_defaults_and_recreate_a_changed_rayjob():
    service = _by_kind(desired(_job()))["Service"]
    observed = copy.deepcopy(service)
    observed["spec"]["ports"][0]["protocol"] = "TCP"
    observed["spec"]["sessionAffinity"] = "None"
    assert plan_action(service, observed).verb == "none"
    ray = _by_kind(desired(_job()))["RayJob"]
    changed = _by_kind(desired(_job(**{"trainer.nodes": 4})))["RayJob"]
    assert plan_action(changed, ray).verb == "recreate"
    suspended = _by_kind(desired(_job(**{"runPolicy.suspend": True})))["RayJob"]
    assert plan_action(suspended, ray).patch == {"spec": {"suspend": True}}


def test_ttl_after_finish_keeps_only_a_retained_pvc():
    job = _job(**{"runPolicy.ttlSecondsAfterFinished": 60})
    finished = job.model_copy(
        update={
            "status": RLJobStatus(
                conditions=[
                    Condition(type="Succeeded", status="True", reason="TrainerSucceeded", last_transition_time="x")
                ],
                completion_time="2026-01-01T00:00:00Z",
            )
        }
    )
    early = dt.datetime(2026, 1, 1, 0, 0, 30, tzinfo=dt.UTC)
    late = dt.datetime(2026, 1, 1, 0, 1, 0, tzinfo=dt.UTC)
    before = _by_kind(desired(finished, Facts(now=early)))
    assert before["StatefulSet"]["spec"]["replicas"] == 0  # finished: free the GPUs at once
    assert [c["kind"] for c in desired(finished, Facts(now=late))] == ["PersistentVolumeClaim"]


def test_only_r3_engines_capture_routes():
    assert load_rljob(QWEN).metadata.name == "qwen3-30b-a3b-r3"
    for mode, captures in (("R3", True), ("R2", False), ("Disabled", False)):
        template = _by_kind(desired(_job(**{"routingReplay.mode": mode})))["StatefulSet"]["spec"]["template"]
        argv = template["spec"]["containers"][0]["command"]
        assert ("--enable-return-routed-experts" in argv) is captures, mode


def test_pod_monitor_labels_series_with_the_rljob_the_dashboards_select_on():
    [monitor] = [c for c in desired(_job(EXAMPLES[0])) if c["kind"] == "PodMonitor"]
    for endpoint in monitor["spec"]["podMetricsEndpoints"]:
        [relabel] = endpoint["relabelings"]
        # the pod label r3operator.io/job, as Prometheus' service discovery spells it
        assert relabel["sourceLabels"] == ["__meta_kubernetes_pod_label_r3operator_io_job"]
        assert relabel["targetLabel"] == "rljob"
