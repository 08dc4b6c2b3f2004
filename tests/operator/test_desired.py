"""desired() and its builders, hashes and the diff rules: pure, no cluster."""

from __future__ import annotations

import copy
import datetime as dt
from pathlib import Path
from typing import Any

import pytest
import yaml
from spec_edits import apply_edits

from r3operator.api.engine_layout import engine_layout
from r3operator.api.load import load_rljob, parse_rljob
from r3operator.api.sizing import model_params_billions
from r3operator.api.v1alpha1 import Condition, RLJob, RLJobStatus
from r3operator.operator.apply import plan_action
from r3operator.operator.builders.engine import startup_budget_seconds
from r3operator.operator.desired import Facts, desired

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
QWEN = REPO / "examples" / "qwen3-30b-a3b-r3-fsdp.yaml"


def _job(path: Path = QWEN, uid: str | None = "uid-1", **edits: Any) -> RLJob:
    doc = yaml.safe_load(path.read_text())
    doc["metadata"]["uid"] = uid
    apply_edits(doc, edits)
    return parse_rljob(doc)


def _by_kind(children: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The first child of each kind (the routing claim comes before the model cache claim)."""
    out: dict[str, dict[str, Any]] = {}
    for c in children:
        out.setdefault(c["kind"], c)
    return out


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_example_builds_deterministic_children_with_labels_and_owners(path: Path):
    job = _job(path)
    first, second = desired(job), desired(_job(path))
    assert first == second
    name = job.metadata.name
    kinds = {c["kind"]: c["metadata"]["name"] for c in first if c["metadata"]["name"] != f"{name}-progress"}
    assert kinds["ConfigMap"] == f"{name}-config"
    # The trainer's progress report: a ConfigMap the operator makes empty (operator/progress.py).
    [report] = [c for c in first if c["metadata"]["name"] == f"{name}-progress"]
    assert report["kind"] == "ConfigMap" and "data" not in report
    # One StatefulSet of single-pod replicas, or a LeaderWorkerSet when a replica spans pods (never both).
    workload = "LeaderWorkerSet" if engine_layout(job.spec).multi_pod else "StatefulSet"
    assert kinds[workload] == kinds["Service"] == f"{name}-engine"
    assert ({"StatefulSet", "LeaderWorkerSet"} - {workload}).isdisjoint(kinds)
    assert kinds["RayJob"] == f"{name}-trainer"
    assert kinds["PodMonitor"] == f"{name}-metrics"
    assert kinds["ServiceAccount"] == kinds["RoleBinding"] == f"{name}-trainer"
    assert kinds["NetworkPolicy"] == f"{name}-engine"
    for child in first:
        labels = child["metadata"]["labels"]
        assert labels["app.kubernetes.io/managed-by"] == "r3operator"
        assert labels["r3operator.io/role"] == labels["app.kubernetes.io/component"]
        if "r3operator.io/model-cache" in labels:  # a model's cache, shared by jobs: it names none of them
            assert "app.kubernetes.io/instance" not in labels and labels["r3operator.io/job"] == ""
            continue
        assert labels["app.kubernetes.io/instance"] == name
        assert labels["r3operator.io/job"] == name


def test_engine_statefulset_runs_vllm_with_spec_args_gpus_probes_and_routing_volume():
    # examples/qwen3-30b-a3b-r3-fsdp.yaml: TP2 x DP2 (all local), EP on, mp executor, R3, 4 replicas.
    sts = _by_kind(desired(_job()))["StatefulSet"]
    assert sts["spec"]["replicas"] == 4  # one pod per replica: dataParallelSizeLocal defaults to dataParallelSize
    pod = sts["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == [
        # hf://Qwen/Qwen3-30B-A3B (revision main) is fetched into the model cache; vLLM loads that copy.
        "vllm",
        "serve",
        "/mnt/model/hf/Qwen/Qwen3-30B-A3B/main",
        "--port",
        "8000",
        "--tensor-parallel-size",
        "2",
        "--pipeline-parallel-size",
        "1",
        "--data-parallel-size",
        "2",
        "--data-parallel-size-local",
        "2",
        "--enable-expert-parallel",
        "--distributed-executor-backend",
        "mp",
        "--max-model-len",
        "8192",
        "--gpu-memory-utilization",
        "0.85",
        # logprobs of the distribution sampled from (after temperature): what the trainer scores
        "--logprobs-mode",
        "processed_logprobs",
        "--enable-return-routed-experts",
        # R3 before vLLM 0.30: the Triton fused MoE, whose routing the capture sees (docs/rules.md, R3-MOE-BACKEND)
        "--moe-backend",
        "triton",
        # vLLM 0.22.1 (the image tag) has the native NCCL transfer; engines and trainer hold separate GPUs
        "--weight-transfer-config",
        '{"backend":"nccl"}',
        "--worker-extension-cls",
        "r3operator.engine.worker.WeightSyncWorkerExtension",
    ]
    assert container["resources"]["requests"]["nvidia.com/gpu"] == "4"  # tp 2 x pp 1 x dp-local 2
    assert container["env"] == [
        {"name": "VLLM_PLUGINS", "value": "r3operator"},
        {"name": "VLLM_SERVER_DEV_MODE", "value": "1"},
    ]
    # Engines only read the routing volume; the trainer writes it.
    assert {"name": "routing", "mountPath": "/var/lib/r3operator", "readOnly": True} in container["volumeMounts"]
    assert {"name": "config", "mountPath": "/etc/r3operator", "readOnly": True} in container["volumeMounts"]
    claim = next(v for v in pod["volumes"] if v["name"] == "routing")["persistentVolumeClaim"]
    assert claim == {"claimName": "qwen3-30b-a3b-r3-routing", "readOnly": True}
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


def test_single_pod_replicas_probe_health_over_http():
    container = _by_kind(desired(_job()))["StatefulSet"]["spec"]["template"]["spec"]["containers"][0]
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[kind]["httpGet"] == {"path": "/health", "port": "http"}


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
    # KubeRay injects httpGet probes (not wget exec probes, which the trainer image cannot run) for Ray >= 2.53.
    assert spec["rayClusterSpec"]["rayVersion"] == "2.60.0"
    suspended = _by_kind(desired(_job(**{"runPolicy.suspend": True})))
    assert suspended["RayJob"]["spec"]["suspend"] is True
    assert suspended["StatefulSet"]["spec"]["replicas"] == 0


def test_trainer_pods_run_as_a_per_job_service_account_whose_role_names_only_its_own_rljob():
    job = _job()
    name, namespace = job.metadata.name, job.metadata.namespace
    kids = _by_kind(desired(job))
    sa, role, rb, ray = kids["ServiceAccount"], kids["Role"], kids["RoleBinding"], kids["RayJob"]
    owner = {
        "apiVersion": "r3operator.io/v1alpha1",
        "kind": "RLJob",
        "name": name,
        "uid": "uid-1",
        "controller": True,
        "blockOwnerDeletion": True,
    }
    for child in (sa, role, rb):
        assert child["metadata"]["name"] == f"{name}-trainer" and child["metadata"]["namespace"] == namespace
        assert child["metadata"]["ownerReferences"] == [owner]
        assert child["metadata"]["labels"]["r3operator.io/job"] == name
    assert sa["apiVersion"] == "v1" and set(sa) == {"apiVersion", "kind", "metadata"}
    # One rule: this job's progress report, by name. Nothing on any RLJob or its status, nothing of another job.
    report = {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": [f"{name}-progress"]}
    assert role["rules"] == [{**report, "verbs": ["get", "patch"]}]
    assert rb["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": f"{name}-trainer"}
    assert rb["subjects"] == [{"kind": "ServiceAccount", "name": f"{name}-trainer", "namespace": namespace}]
    cluster = ray["spec"]["rayClusterSpec"]
    pods = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    assert [p["spec"]["serviceAccountName"] for p in pods] == [f"{name}-trainer"] * 2
    kinds = [c["kind"] for c in desired(job)]
    assert kinds.index("ServiceAccount") < kinds.index("Role") < kinds.index("RoleBinding") < kinds.index("RayJob")


def test_engine_and_trainer_pods_meet_the_restricted_pod_security_level():
    kids = _by_kind(desired(_job()))
    cluster = kids["RayJob"]["spec"]["rayClusterSpec"]
    pods = [kids["StatefulSet"]["spec"]["template"], cluster["headGroupSpec"]["template"]]
    pods += [g["template"] for g in cluster["workerGroupSpecs"]]
    assert pods[0]["spec"]["automountServiceAccountToken"] is False  # engines never call the API
    for pod in pods:
        spec = pod["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] > 0
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for container in spec["containers"]:
            assert container["securityContext"] == {
                "allowPrivilegeEscalation": False,
                "capabilities": {"drop": ["ALL"]},
            }
        # restricted allows only these volume types
        assert {next(k for k in v if k != "name") for v in spec["volumes"]} <= {
            "persistentVolumeClaim",
            "configMap",
            "emptyDir",
        }


def _observed(obj: dict[str, Any], **metadata: Any) -> dict[str, Any]:
    have = copy.deepcopy(obj)
    have["metadata"].update(uid="child-uid", resourceVersion="1", **metadata)
    return have


def test_diff_rules_for_the_trainer_identity_compare_only_the_fields_we_set():
    kids = _by_kind(desired(_job()))
    sa, rb = kids["ServiceAccount"], kids["RoleBinding"]
    observed_sa = _observed(sa)
    observed_sa["secrets"] = [{"name": "token"}]
    observed_sa["metadata"]["labels"]["team"] = "theirs"  # a foreign label is not a difference
    assert plan_action(sa, observed_sa, job_uid="uid-1").verb == "none"
    observed_sa["metadata"]["labels"] = {}
    action = plan_action(sa, observed_sa, job_uid="uid-1")
    assert (action.verb, action.body, action.force) == ("apply", sa, True)
    assert plan_action(rb, _observed(rb), job_uid="uid-1").verb == "none"
    other_role = _observed(rb)
    other_role["roleRef"]["name"] = "old-trainer"
    assert plan_action(rb, other_role, job_uid="uid-1").verb == "recreate"  # roleRef is immutable
    other_subjects = _observed(rb)
    other_subjects["subjects"] = []
    assert plan_action(rb, other_subjects, job_uid="uid-1").body == rb


@pytest.mark.parametrize("kind", ["RoleBinding", "Service", "ConfigMap", "StatefulSet", "RayJob", "ServiceAccount"])
def test_an_object_under_a_child_name_that_this_rljob_does_not_control_is_a_conflict(kind: str):
    want = _by_kind(desired(_job()))[kind]
    foreign = _observed(want, ownerReferences=[])
    assert plan_action(want, foreign, job_uid="uid-1").verb == "conflict"
    other_job = _observed(want)
    other_job["metadata"]["ownerReferences"][0]["uid"] = "uid-of-another-rljob"
    action = plan_action(want, other_job, job_uid="uid-1")
    assert action.verb == "conflict" and "uid-of-another-rljob" in action.why
    # A matching label is no claim: only the controller reference is.
    labelled = _observed(want, ownerReferences=None)
    assert labelled["metadata"]["labels"]["r3operator.io/job"] == "qwen3-30b-a3b-r3"
    assert plan_action(want, labelled, job_uid="uid-1").verb == "conflict"


def test_a_conflicting_object_that_is_being_deleted_is_reported_as_terminating():
    # A same-named RLJob deleted and applied again: the old claim waits for its pods before it goes.
    want = _by_kind(desired(_job()))["PersistentVolumeClaim"]
    old = _observed(want, deletionTimestamp="2026-11-26T07:00:00Z")
    ref = {"apiVersion": "r3operator.io/v1alpha1", "kind": "RLJob", "name": "qwen3-30b-a3b-r3", "uid": "uid-old"}
    old["metadata"]["ownerReferences"] = [{**ref, "controller": True}]
    action = plan_action(want, old, job_uid="uid-new")
    assert action.verb == "conflict"
    assert action.why == (
        "controlled by RLJob/qwen3-30b-a3b-r3 (uid uid-old), terminating since 2026-11-26T07:00:00Z: "
        "retrying until it is gone"
    )


def test_a_foreign_key_in_our_config_map_is_not_a_difference_and_a_changed_key_of_ours_is():
    want = _by_kind(desired(_job()))["ConfigMap"]
    have = _observed(want)
    have["data"]["extra.json"] = "{}"
    have["metadata"]["annotations"] = {"someone/else": "x"}
    assert plan_action(want, have, job_uid="uid-1").verb == "none"
    have["data"]["config.json"] = "{}"
    action = plan_action(want, have, job_uid="uid-1")
    assert (action.verb, action.body, action.force) == ("apply", want, True)


def test_an_engine_image_edited_by_hand_is_taken_back_with_the_hash_unchanged():
    want = _by_kind(desired(_job()))["StatefulSet"]
    have = _observed(want)
    have["spec"]["template"]["spec"]["containers"][0]["image"] = "attacker/vllm:evil"
    action = plan_action(want, have, job_uid="uid-1")
    assert (action.verb, action.body, action.force) == ("apply", want, True)
    assert "image" in action.why


def test_pvc_ownership_follows_retain_policy_and_existing_claim_creates_none():
    retain = _by_kind(desired(_job()))["PersistentVolumeClaim"]
    assert "ownerReferences" not in retain["metadata"]
    assert retain["metadata"]["annotations"]["r3operator.io/retained-from-uid"] == "uid-1"
    assert retain["spec"]["accessModes"] == ["ReadWriteMany"]
    delete = _by_kind(desired(_job(**{"storage.retainPolicy": "Delete"})))["PersistentVolumeClaim"]
    assert delete["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    existing = _by_kind(desired(_job(**{"storage.existingClaim": "shared-rwx", "model.uri": "pvc://w/q"})))
    assert "PersistentVolumeClaim" not in existing
    volumes = existing["StatefulSet"]["spec"]["template"]["spec"]["volumes"]
    assert volumes[0]["persistentVolumeClaim"] == {"claimName": "shared-rwx", "readOnly": True}


def test_a_retained_claim_is_ours_by_its_annotation_and_its_spec_is_never_rewritten():
    retain = _by_kind(desired(_job()))["PersistentVolumeClaim"]
    have = _observed(retain)
    have["spec"]["volumeName"] = "pv-1"
    assert plan_action(retain, have, job_uid="uid-1").verb == "none"
    # retainPolicy Delete: our controller reference is added; a bigger size in the spec is not applied
    delete = _by_kind(desired(_job(**{"storage.retainPolicy": "Delete", "storage.size": "9Ti"})))
    action = plan_action(delete["PersistentVolumeClaim"], have, job_uid="uid-1")
    assert action.verb == "apply" and action.body["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert action.body["spec"] == {k: have["spec"][k] for k in ("accessModes", "resources", "storageClassName")}
    # and back to Retain: the apply leaves the reference out, which removes it
    owned = _observed(delete["PersistentVolumeClaim"])
    assert plan_action(retain, owned, job_uid="uid-1").body["metadata"].get("ownerReferences") is None
    stranger = _observed(retain, annotations={})
    assert plan_action(retain, stranger, job_uid="uid-1").verb == "conflict"


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
    have = _observed(want)
    have["spec"]["template"]["spec"]["containers"][0]["env"].append({"name": "OLD_OPERATOR", "value": "1"})
    assert plan_action(want, have, job_uid="uid-1").verb == "none"
    have["spec"]["replicas"] = 0
    scale = plan_action(want, have, job_uid="uid-1")
    # replicas alone, under a field manager of its own: the template is not part of that write
    assert scale.manager == "r3operator-scale" and scale.body["spec"] == {"replicas": 4}
    new_image = _by_kind(desired(_job(**{"inference.image": "vllm/vllm-openai:v0.30.0"})))["StatefulSet"]
    assert plan_action(new_image, _observed(want), job_uid="uid-1").body == new_image
    created = plan_action(want, None, job_uid="uid-1")
    assert (created.verb, created.force) == ("apply", False)


def test_diff_rules_ignore_server_defaults_and_recreate_a_changed_rayjob():
    service = _by_kind(desired(_job()))["Service"]
    observed = _observed(service)
    observed["spec"]["ports"][0]["protocol"] = "TCP"
    observed["spec"]["sessionAffinity"] = "None"
    assert plan_action(service, observed, job_uid="uid-1").verb == "none"
    ray = _observed(_by_kind(desired(_job()))["RayJob"])
    changed = _by_kind(desired(_job(**{"trainer.nodes": 4})))["RayJob"]
    assert plan_action(changed, ray, job_uid="uid-1").verb == "recreate"
    suspended = _by_kind(desired(_job(**{"runPolicy.suspend": True})))["RayJob"]
    assert plan_action(suspended, ray, job_uid="uid-1").body["spec"] == {"suspend": True}


def test_finished_stops_engines_and_ttl_expiry_keeps_only_a_retained_pvc():
    job = _job(**{"runPolicy.ttlSecondsAfterFinished": 60})
    finished = _by_kind(desired(job, Facts(finished=True)))
    assert finished["StatefulSet"]["spec"]["replicas"] == 0  # finished: free the GPUs at once
    assert [c["kind"] for c in desired(job, Facts(finished=True, expired=True))] == ["PersistentVolumeClaim"]
    delete = _job(**{"runPolicy.ttlSecondsAfterFinished": 0, "storage.retainPolicy": "Delete"})
    assert desired(delete, Facts(finished=True, expired=True)) == []


def _with_status(job: RLJob, completion: str | None, *conditions: tuple[str, str]) -> RLJob:
    status = RLJobStatus(
        conditions=[Condition(type=t, status=s, reason="X", last_transition_time="x") for t, s in conditions],
        completion_time=completion,
    )
    return job.model_copy(update={"status": status})


def _ray(deployment: str, job_status: str = "", end: str | None = None) -> dict[str, Any]:
    status = {"jobDeploymentStatus": deployment, "jobStatus": job_status}
    return {"kind": "RayJob", "status": status | ({"endTime": end} if end else {})}


def test_a_forged_terminal_status_neither_finishes_nor_expires_a_job_whose_rayjob_runs():
    from r3operator.operator.lifecycle import observed_finish, ttl_expired

    job = _job(**{"runPolicy.ttlSecondsAfterFinished": 0, "storage.retainPolicy": "Delete"})
    forged = _with_status(job, "2020-01-01T00:00:00Z", ("Succeeded", "True"))
    now = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    finish = observed_finish(_ray("Running", "RUNNING"))
    assert finish is None and not ttl_expired(forged, finish, now)
    kids = _by_kind(desired(forged, Facts(finished=finish is not None, expired=ttl_expired(forged, finish, now))))
    assert kids["StatefulSet"]["spec"]["replicas"] == 4  # not stopped: 4 replicas of one pod each
    assert set(kids) >= {"PersistentVolumeClaim", "RayJob", "ConfigMap", "Service", "Role", "RoleBinding"}


def test_ttl_counts_from_the_rayjobs_end_time():
    from r3operator.operator.lifecycle import observed_finish, ttl_expired

    job = _job(**{"runPolicy.ttlSecondsAfterFinished": 60})
    finish = observed_finish(_ray("Complete", "SUCCEEDED", "2026-01-01T00:00:00Z"))
    assert finish is not None and finish.succeeded
    # an earlier completionTime written into the status does not bring the deletion forward
    forged = _with_status(job, "2020-01-01T00:00:00Z", ("Succeeded", "True"))
    assert not ttl_expired(forged, finish, dt.datetime(2026, 1, 1, 0, 0, 30, tzinfo=dt.UTC))
    assert ttl_expired(forged, finish, dt.datetime(2026, 1, 1, 0, 1, 0, tzinfo=dt.UTC))
    failed = observed_finish(_ray("Failed", "FAILED"))
    assert failed is not None and not failed.succeeded


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


def test_driver_metrics_port_leaves_kubernetes_metrics_name_to_ray_and_is_scraped_with_its_own_labels():
    job = _job(EXAMPLES[0])
    children = _by_kind(desired(job))
    head = children["RayJob"]["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    assert ports["metrics"] == 8080  # Ray's own metrics export, the name KubeRay's head Service uses
    assert ports["r3-metrics"] == job.spec.monitoring.port
    assert len(ports) == len(head["ports"]) and all(len(name) <= 15 for name in ports)  # IANA_SVC_NAME
    endpoints = {e["port"]: e for e in children["PodMonitor"]["spec"]["podMetricsEndpoints"]}
    assert set(endpoints) == {"http", "r3-metrics"}
    assert endpoints["r3-metrics"]["honorLabels"] is True and "honorLabels" not in endpoints["http"]
    assert {e["interval"] for e in endpoints.values()} == {"30s"}


def test_trust_remote_code_left_at_false_keeps_the_hashes_of_existing_jobs():
    from r3operator.operator.hashing import engine_hash_input, trainer_hash_input

    spec = _job().spec
    assert "trustRemoteCode" not in engine_hash_input(spec)["model"]
    assert "trustRemoteCode" not in trainer_hash_input(spec)["model"]
    trusted = _job(**{"model.trustRemoteCode": True})
    assert _template_hash(trusted) != _template_hash(_job()) and _trainer_hash(trusted) != _trainer_hash(_job())
    assert (
        "--trust-remote-code"
        in _by_kind(desired(trusted))["StatefulSet"]["spec"]["template"]["spec"]["containers"][0]["command"]
    )


def test_engine_network_policy_admits_the_engine_port_only_from_this_job_and_the_operator_namespace():
    job = _job()
    facts = Facts(operator_namespace="r3operator-system", engine_ingress_namespaces=("monitoring",))
    children = _by_kind(desired(job, facts))
    policy, sts = children["NetworkPolicy"], children["StatefulSet"]
    assert policy["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    engine_pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    selected = policy["spec"]["podSelector"]["matchLabels"]
    assert selected.items() <= engine_pod_labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    same_job, namespaces = policy["spec"]["ingress"]
    # Every port from this job's trainer pods (HTTP weight sync + NCCL) and its engine pods (DP traffic).
    trainer_labels = children["RayJob"]["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["metadata"]["labels"]
    worker_template = children["RayJob"]["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]
    peers = [p["podSelector"]["matchLabels"] for p in same_job["from"]]
    assert "ports" not in same_job and all("namespaceSelector" not in p for p in same_job["from"])
    assert any(p.items() <= trainer_labels.items() for p in peers)
    assert any(p.items() <= worker_template["metadata"]["labels"].items() for p in peers)
    assert any(p.items() <= engine_pod_labels.items() for p in peers)
    # No peer selects another job's pods or pods of this job in another role.
    other = _job(uid="uid-2")
    other.metadata.name = "someone-else"
    other_labels = _by_kind(desired(other))["StatefulSet"]["spec"]["template"]["metadata"]["labels"]
    assert not any(p.items() <= other_labels.items() for p in peers)
    # The operator's namespace (canary) and the admitted ones reach only the engine port.
    [peer] = namespaces["from"]
    [expr] = peer["namespaceSelector"]["matchExpressions"]
    admitted = ["monitoring", "r3operator-system"]
    assert expr == {"key": "kubernetes.io/metadata.name", "operator": "In", "values": admitted}
    assert namespaces["ports"] == [{"protocol": "TCP", "port": job.spec.inference.port}]
    assert sts["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] == job.spec.inference.port


def test_engine_network_policy_without_an_operator_namespace_admits_only_the_job():
    policy = _by_kind(desired(_job()))["NetworkPolicy"]
    assert len(policy["spec"]["ingress"]) == 1 and "ports" not in policy["spec"]["ingress"][0]


def test_engines_run_in_vllm_dev_mode_for_http_weight_sync():
    container = _by_kind(desired(_job()))["StatefulSet"]["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "VLLM_SERVER_DEV_MODE", "value": "1"} in container["env"]


def _pod_specs(children: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    ray = children["RayJob"]["spec"]["rayClusterSpec"]
    return {
        "engine": children["StatefulSet"]["spec"]["template"]["spec"],
        "head": ray["headGroupSpec"]["template"]["spec"],
        "worker": ray["workerGroupSpecs"][0]["template"]["spec"],
    }


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_pvc_model_is_mounted_read_only_in_engines_and_trainer_at_the_path_each_loads():
    children = _by_kind(desired(_job(**{"model.uri": "pvc://weights/qwen/v1", "model.revision": None})))
    engine_command = children["StatefulSet"]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert engine_command[2] == "/mnt/model/qwen/v1"
    for role, pod in _pod_specs(children).items():
        [volume] = [v for v in pod["volumes"] if v["name"] == "model"]
        assert volume["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}, role
        (container,) = pod["containers"]
        assert {"name": "model", "mountPath": "/mnt/model", "readOnly": True} in container["volumeMounts"], role
        assert "initContainers" not in pod, role
        if role != "engine":
            assert _env(container)["R3OPERATOR_MODEL_DIR"] == "/mnt/model/qwen/v1"


def test_hf_model_is_fetched_once_into_a_cache_claim_that_every_pod_mounts_read_only_after_a_verify_step():
    secret = {"name": "hf-token", "key": "hf"}
    children = desired(_job(**{"model.tokenSecretRef": secret}))
    by_kind = _by_kind(children)
    engine_command = by_kind["StatefulSet"]["spec"]["template"]["spec"]["containers"][0]["command"]
    # revision main (the example pins it) is a directory of the cache: a new pin never reads an old copy.
    assert engine_command[2] == "/mnt/model/hf/Qwen/Qwen3-30B-A3B/main" and "--revision" not in engine_command
    [cache] = [c for c in children if c["metadata"]["name"] == _shared_name("hf/Qwen/Qwen3-30B-A3B/main")]
    assert cache["kind"] == "PersistentVolumeClaim" and cache["spec"]["accessModes"] == ["ReadWriteMany"]
    assert cache["spec"]["resources"]["requests"]["storage"] == "200Gi"
    # Kept by default and shared by source: no ownerReference for the garbage collector, the model recorded.
    assert "ownerReferences" not in cache["metadata"]
    assert cache["metadata"]["annotations"] == {"r3operator.io/model-source": "hf://Qwen/Qwen3-30B-A3B@main"}
    fetch_pod = by_kind["Job"]["spec"]["template"]["spec"]
    (fetch,) = fetch_pod["containers"]
    assert fetch["command"] == ["r3operator", "fetch", "hf://Qwen/Qwen3-30B-A3B", "/mnt/model", "--revision", "main"]
    assert (
        fetch["image"]
        == by_kind["RayJob"]["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["image"]
    )  # the trainer image ships the fetch clients
    assert {"name": "model", "mountPath": "/mnt/model"} in fetch["volumeMounts"]  # writable for the fill
    assert {"name": "model", "persistentVolumeClaim": {"claimName": cache["metadata"]["name"]}} in fetch_pod["volumes"]
    assert fetch_pod["restartPolicy"] == "Never" and fetch_pod["automountServiceAccountToken"] is False
    env = _env(fetch)
    assert env["HF_TOKEN"] == {"secretKeyRef": {"name": "hf-token", "key": "hf"}}
    assert env["HF_HOME"].startswith("/mnt/model/")  # the image's home may be read-only
    for role, pod in _pod_specs(by_kind).items():
        [volume] = [v for v in pod["volumes"] if v["name"] == "model"]
        assert volume["persistentVolumeClaim"] == {"claimName": cache["metadata"]["name"], "readOnly": True}, role
        (verify,) = pod["initContainers"]
        assert verify["image"] == pod["containers"][0]["image"]  # an engine edit never touches trainer pods
        assert verify["command"] == [
            "r3operator",
            "fetch",
            "hf://Qwen/Qwen3-30B-A3B",
            "/mnt/model",
            "--revision",
            "main",
            "--verify",
        ]
        assert {"name": "model", "mountPath": "/mnt/model", "readOnly": True} in verify["volumeMounts"], role
        assert "env" not in verify, role  # no credentials outside the fetch Job
        assert verify["securityContext"] == pod["containers"][0]["securityContext"]
        (container,) = pod["containers"]
        assert {"name": "model", "mountPath": "/mnt/model", "readOnly": True} in container["volumeMounts"], role
        if role != "engine":
            assert _env(container)["R3OPERATOR_MODEL_DIR"] == "/mnt/model/hf/Qwen/Qwen3-30B-A3B/main"


def test_engines_and_trainer_wait_while_the_model_cache_fills():
    filling = _by_kind(desired(_job(), Facts(model_fetched=False)))
    assert filling["StatefulSet"]["spec"]["replicas"] == 0
    assert filling["RayJob"]["spec"]["suspend"] is True
    assert "Job" in filling  # the fill itself is there
    filled = _by_kind(desired(_job(), Facts(model_fetched=True)))
    assert filled["StatefulSet"]["spec"]["replicas"] == 4 and filled["RayJob"]["spec"]["suspend"] is False
    # A model that is not fetched never waits for the fact.
    pvc = _by_kind(desired(_job(**{"model.uri": "pvc://weights/qwen/v1"}), Facts(model_fetched=False)))
    assert "Job" not in pvc and pvc["StatefulSet"]["spec"]["replicas"] == 4


def test_a_shared_cache_claim_is_mounted_and_never_created():
    children = desired(_job(**{"model.cache": {"claimName": "team-models"}}))
    assert [c["metadata"]["name"] for c in children if c["kind"] == "PersistentVolumeClaim"] == [
        "qwen3-30b-a3b-r3-routing"
    ]
    fetch_volumes = _by_kind(children)["Job"]["spec"]["template"]["spec"]["volumes"]
    assert fetch_volumes == [{"name": "model", "persistentVolumeClaim": {"claimName": "team-models"}}]


def test_s3_model_credentials_reach_only_the_fetch_container_as_secret_references():
    s3 = {"credentialsSecret": "store-creds", "endpointURL": "http://minio.storage:9000", "region": "eu-1"}
    children = _by_kind(desired(_job(**{"model.uri": "s3://models/qwen3", "model.revision": None, "model.s3": s3})))
    (fetch,) = children["Job"]["spec"]["template"]["spec"]["containers"]
    assert fetch["command"] == [
        "r3operator",
        "fetch",
        "s3://models/qwen3",
        "/mnt/model",
        "--endpoint-url",
        "http://minio.storage:9000",
        "--region",
        "eu-1",
    ]
    env = _env(fetch)
    assert env["AWS_ACCESS_KEY_ID"] == {"secretKeyRef": {"name": "store-creds", "key": "AWS_ACCESS_KEY_ID"}}
    assert env["AWS_SECRET_ACCESS_KEY"] == {"secretKeyRef": {"name": "store-creds", "key": "AWS_SECRET_ACCESS_KEY"}}
    assert env["AWS_SESSION_TOKEN"] == {
        "secretKeyRef": {"name": "store-creds", "key": "AWS_SESSION_TOKEN", "optional": True}
    }
    for role, pod in _pod_specs(children).items():
        every_env = [e for c in [*pod["containers"], *pod.get("initContainers", [])] for e in c.get("env", [])]
        assert not [e for e in every_env if e["name"].startswith("AWS_")], role
        if role != "engine":
            assert _env(pod["containers"][0])["R3OPERATOR_MODEL_DIR"] == "/mnt/model/s3/models/qwen3"


def test_gs_model_and_dataset_fetch_with_the_hmac_key_and_cloud_storages_endpoint():
    gcs = {"credentialsSecret": "gcs-hmac"}
    children = _by_kind(
        desired(
            _job(
                **{
                    "model.uri": "gs://models/qwen3",
                    "model.revision": None,
                    "model.gcs": gcs,
                    "task.datasetPath": "gs://data/train.jsonl",
                    "task.gcs": {**gcs, "endpointURL": "https://storage-psc.p.googleapis.com"},
                }
            )
        )
    )
    (fetch,) = children["Job"]["spec"]["template"]["spec"]["containers"]
    # No endpoint flag: the fetch's own default is https://storage.googleapis.com.
    assert fetch["command"] == ["r3operator", "fetch", "gs://models/qwen3", "/mnt/model"]
    env = _env(fetch)
    assert env["AWS_ACCESS_KEY_ID"] == {"secretKeyRef": {"name": "gcs-hmac", "key": "AWS_ACCESS_KEY_ID"}}
    assert env["AWS_SECRET_ACCESS_KEY"] == {"secretKeyRef": {"name": "gcs-hmac", "key": "AWS_SECRET_ACCESS_KEY"}}
    assert "AWS_SESSION_TOKEN" not in env  # an HMAC key has none
    head = children["RayJob"]["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    assert _env(head["containers"][0])["R3OPERATOR_MODEL_DIR"] == "/mnt/model/gs/models/qwen3"
    data = next(c for c in head["initContainers"] if c["name"] == "fetch-dataset")
    assert data["command"] == [
        "r3operator",
        "fetch",
        "gs://data/train.jsonl",
        "/mnt/data",
        "--endpoint-url",
        "https://storage-psc.p.googleapis.com",
    ]
    assert _env(data)["AWS_ACCESS_KEY_ID"]["secretKeyRef"]["name"] == "gcs-hmac"


def test_s3_dataset_is_fetched_by_the_trainer_head_only():
    s3 = {"credentialsSecret": "data-creds"}
    children = _by_kind(desired(_job(**{"task.datasetPath": "s3://data/math/train.jsonl", "task.s3": s3})))
    cluster = children["RayJob"]["spec"]["rayClusterSpec"]
    head = cluster["headGroupSpec"]["template"]["spec"]
    fetch = next(c for c in head["initContainers"] if c["name"] == "fetch-dataset")
    assert fetch["command"] == ["r3operator", "fetch", "s3://data/math/train.jsonl", "/mnt/data"]
    assert _env(fetch)["AWS_ACCESS_KEY_ID"] == {"secretKeyRef": {"name": "data-creds", "key": "AWS_ACCESS_KEY_ID"}}
    assert {"name": "data", "emptyDir": {}} in head["volumes"]
    assert {"name": "data", "mountPath": "/mnt/data", "readOnly": True} in head["containers"][0]["volumeMounts"]
    worker = cluster["workerGroupSpecs"][0]["template"]["spec"]
    assert all(c["name"] != "fetch-dataset" for c in worker.get("initContainers", []))


def test_an_s3_eval_dataset_is_fetched_beside_the_training_file_with_the_tasks_credentials():
    s3 = {"credentialsSecret": "data-creds", "endpointURL": "http://minio.storage:9000"}
    local_train = {"task.name": "dataset", "task.reward": "math", "task.datasetPath": "/data/train.jsonl"}
    eval_s3 = {**local_train, "task.s3": s3, "evaluation": {"datasetPath": "s3://data/math/test.jsonl"}}
    children = _by_kind(desired(_job(**eval_s3)))
    head = children["RayJob"]["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    # The training file is a path: only the eval file is fetched, into the same emptyDir the driver reads.
    [fetch] = [c for c in head["initContainers"] if c["name"].startswith("fetch-")]
    assert fetch["name"] == "fetch-eval-dataset"
    assert fetch["command"] == [
        "r3operator",
        "fetch",
        "s3://data/math/test.jsonl",
        "/mnt/data",
        "--endpoint-url",
        "http://minio.storage:9000",
    ]
    assert _env(fetch)["AWS_SECRET_ACCESS_KEY"] == {
        "secretKeyRef": {"name": "data-creds", "key": "AWS_SECRET_ACCESS_KEY"}
    }
    assert {"name": "data", "mountPath": "/mnt/data", "readOnly": True} in head["containers"][0]["volumeMounts"]
    # Both fetched: one container each, the eval file from its own store (task.gcs).
    both_fetched = {
        **eval_s3,
        "task.datasetPath": "s3://data/math/train.jsonl",
        "task.gcs": {"credentialsSecret": "hmac"},
        "evaluation": {"datasetPath": "gs://held/out.jsonl"},
    }
    both = _by_kind(desired(_job(**both_fetched)))
    head = both["RayJob"]["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    fetches = [c for c in head["initContainers"] if c["name"].startswith("fetch-")]
    assert [c["name"] for c in fetches] == ["fetch-dataset", "fetch-eval-dataset"]
    assert fetches[1]["command"] == ["r3operator", "fetch", "gs://held/out.jsonl", "/mnt/data"]
    assert _env(fetches[1])["AWS_ACCESS_KEY_ID"]["secretKeyRef"]["name"] == "hmac"


def test_reference_model_mounts_nothing_extra():
    children = _by_kind(desired(_job(REPO / "examples" / "rljob-local.yaml")))
    for pod in _pod_specs(children).values():
        assert "initContainers" not in pod and all(v["name"] != "model" for v in pod["volumes"])
        assert "R3OPERATOR_MODEL_DIR" not in _env(pod["containers"][0])


def test_a_model_cache_with_retain_policy_delete_goes_with_the_rljob():
    children = desired(_job(**{"model.cache": {"retainPolicy": "Delete"}}))
    [cache] = [c for c in children if c["metadata"]["name"] == "qwen3-30b-a3b-r3-model-cache"]
    assert cache["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert "r3operator.io/retained-from-uid" not in cache["metadata"]["annotations"]


def _shared_name(cache_dir: str, endpoint: str | None = None) -> str:
    """model-cache-<the first 16 hex digits of the sha256 of the copy's directory and store endpoint>."""
    import hashlib
    import json

    text = json.dumps({"endpoint": endpoint, "source": cache_dir}, sort_keys=True, separators=(",", ":"))
    return "model-cache-" + hashlib.sha256(text.encode()).hexdigest()[:16]


def _claims(children: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {c["metadata"]["name"]: c for c in children if c["kind"] == "PersistentVolumeClaim"}


def _model_claims_mounted(children: list[dict[str, Any]]) -> set[str]:
    """The claim behind every ``model`` volume of the engine, trainer and fetch pods."""
    by_kind = _by_kind(children)
    pods = [*_pod_specs(by_kind).values(), by_kind["Job"]["spec"]["template"]["spec"]]
    return {v["persistentVolumeClaim"]["claimName"] for p in pods for v in p["volumes"] if v["name"] == "model"}


def test_rljobs_of_the_same_model_source_and_revision_share_one_kept_cache_claim():
    first = desired(_job(uid="uid-1"))
    other = _job(uid="uid-2", **{"model.uri": "hf://Qwen/Qwen3-30B-A3B@main", "model.revision": None})
    other = other.model_copy(update={"metadata": other.metadata.model_copy(update={"name": "another-job"})})
    second = desired(other)
    name = _shared_name("hf/Qwen/Qwen3-30B-A3B/main")
    # The same claim, object for object: nothing in it names one of the jobs, so neither rewrites it.
    assert _claims(first)[name] == _claims(second)[name]
    claim = _claims(first)[name]
    assert claim["metadata"]["labels"]["r3operator.io/model-cache"] == name.removeprefix("model-cache-")
    assert claim["metadata"]["labels"]["r3operator.io/job"] == ""  # in the operator's watch, no one job's
    assert "ownerReferences" not in claim["metadata"]
    assert _model_claims_mounted(first) == _model_claims_mounted(second) == {name}
    # The other job applies it: the existing claim (made by the first) is its own to use, not a NameConflict.
    made = {**claim, "metadata": {**claim["metadata"], "uid": "pvc-1"}, "status": {"phase": "Bound"}}
    assert plan_action(_claims(second)[name], made, job_uid="uid-2").verb == "none"


def test_another_revision_or_store_endpoint_is_another_cache_claim():
    rev2 = desired(_job(**{"model.revision": "r2"}))
    assert _model_claims_mounted(rev2) == {_shared_name("hf/Qwen/Qwen3-30B-A3B/r2")}
    s3 = {"model.uri": "s3://models/qwen3", "model.revision": None, "model.s3": {"credentialsSecret": "store"}}
    at_aws = desired(_job(**s3))
    at_minio = desired(_job(**s3, **{"model.s3.endpointURL": "http://minio.storage:9000"}))
    assert _model_claims_mounted(at_aws) == {_shared_name("s3/models/qwen3")}
    assert _model_claims_mounted(at_minio) == {_shared_name("s3/models/qwen3", "http://minio.storage:9000")}


def test_a_kept_read_write_once_cache_is_named_by_source_and_revision_apart_from_the_read_write_many_one():
    # Kept, so the next job of the model finds it by name; a claim of its own access mode (-rwo), which a
    # ReadWriteMany job never mounts. Which job holds it is recorded on the claim apart (model_cache_hold.py).
    children = desired(_job(**{"model.cache": {"accessMode": "ReadWriteOnce"}}))
    name = _shared_name("hf/Qwen/Qwen3-30B-A3B/main") + "-rwo"
    claim = _claims(children)[name]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"] and "ownerReferences" not in claim["metadata"]
    assert claim["metadata"]["labels"]["r3operator.io/job"] == ""
    assert "r3operator.io/model-cache-holder" not in claim["metadata"]["annotations"]
    assert _model_claims_mounted(children) == {name}
    # A job that already has its own <job>-model-cache (an operator before kept ReadWriteOnce caches) keeps it.
    own = desired(_job(**{"model.cache": {"accessMode": "ReadWriteOnce"}}), Facts(own_model_cache=True))
    assert _model_claims_mounted(own) == {"qwen3-30b-a3b-r3-model-cache"} and name not in _claims(own)
    # retainPolicy Delete: the job's own claim, which goes with it.
    gone = desired(_job(**{"model.cache": {"accessMode": "ReadWriteOnce", "retainPolicy": "Delete"}}))
    assert _model_claims_mounted(gone) == {"qwen3-30b-a3b-r3-model-cache"}
    assert _claims(gone)["qwen3-30b-a3b-r3-model-cache"]["metadata"]["ownerReferences"]


def test_a_job_whose_read_write_once_cache_another_job_holds_writes_no_claim_or_fetch_and_runs_nothing():
    children = desired(_job(**{"model.cache": {"accessMode": "ReadWriteOnce"}}), Facts(model_cache_holder="first"))
    by_kind = _by_kind(children)
    assert not any(c["metadata"]["name"].startswith("model-cache-") for c in children)
    assert "Job" not in by_kind  # no fetch pod mounts the claim another node holds
    assert by_kind["StatefulSet"]["spec"]["replicas"] == 0 and by_kind["RayJob"]["spec"]["suspend"] is True


def test_a_job_that_has_its_own_cache_claim_keeps_reading_it_and_its_pods_keep_their_template():
    job = _job()
    shared = desired(job)
    own = desired(job, Facts(own_model_cache=True))
    assert "qwen3-30b-a3b-r3-model-cache" in _claims(own)
    assert not any(n.startswith("model-cache-") for n in _claims(own))
    assert _model_claims_mounted(own) == {"qwen3-30b-a3b-r3-model-cache"}
    # An operator upgrade rolls no pod and restarts no fetch: the hashes stay what they were.
    for kind in ("StatefulSet", "RayJob", "Job"):
        before, after = _by_kind(shared)[kind], _by_kind(own)[kind]
        assert before["metadata"].get("annotations") == after["metadata"].get("annotations"), kind
    sts = _by_kind(own)["StatefulSet"]["spec"]["template"]["metadata"]["annotations"]
    assert sts == _by_kind(shared)["StatefulSet"]["spec"]["template"]["metadata"]["annotations"]
