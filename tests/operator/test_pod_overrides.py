"""Pod templates merged onto the derived engine and trainer pods (builders/overrides.py), and the rules
that keep derived fields out of them (api/pod_rules.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from r3operator.api import RLJob, RLJobLoadError, evaluate, parse_rljob
from r3operator.api.pod_rules import RESERVED_ENV, RESERVED_ENV_PREFIX, RESERVED_MOUNT_PATHS, RESERVED_VOLUMES
from r3operator.api.pods import PodTemplate
from r3operator.operator.apply import plan_action
from r3operator.operator.builders.overrides import merge_templates
from r3operator.operator.builders.workload import build_workload, pod_sets
from r3operator.operator.desired import Facts, desired
from r3operator.operator.hashing import engine_spec_hash, trainer_spec_hash

QWEN = Path(__file__).resolve().parents[2] / "examples" / "qwen3-30b-a3b-r3-fsdp.yaml"
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


def _job(**spec: Any) -> RLJob:
    doc = yaml.safe_load(QWEN.read_text())
    for dotted, value in spec.items():
        node = doc["spec"]
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return parse_rljob(doc)


def _children(job: RLJob) -> dict[str, dict[str, Any]]:
    return {c["kind"]: c for c in desired(job, Facts())}


def _engine_pod(job: RLJob) -> dict[str, Any]:
    return _children(job)["StatefulSet"]["spec"]["template"]


def _trainer_pods(job: RLJob) -> list[dict[str, Any]]:
    cluster = _children(job)["RayJob"]["spec"]["rayClusterSpec"]
    return [cluster["headGroupSpec"]["template"], *(g["template"] for g in cluster["workerGroupSpecs"])]


SECRET_ENV = {"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {"name": "wandb", "key": "api-key"}}}
JOB_WIDE = {
    "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "pool": "shared"},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "rl", "effect": "NoSchedule"}],
    "labels": {"team": "post-training"},
    "priorityClassName": "rl-batch",
    "imagePullSecrets": [{"name": "registry"}],
    "env": [{"name": "HTTPS_PROXY", "value": "http://proxy:3128"}, {"name": "LOG_LEVEL", "value": "info"}],
}
ENGINE_ONLY = {
    "nodeSelector": {"pool": "inference"},
    "env": [{"name": "LOG_LEVEL", "value": "debug"}, SECRET_ENV],
    "volumes": [{"name": "datasets", "persistentVolumeClaim": {"claimName": "datasets", "readOnly": True}}],
    "volumeMounts": [{"name": "datasets", "mountPath": "/data", "readOnly": True}],
    "resources": {"limits": {"cpu": "32", "ephemeral-storage": "100Gi"}},
    "securityContext": {"readOnlyRootFilesystem": True},
    "annotations": {"example.com/owner": "rl"},
}


def test_engine_pods_get_the_job_wide_and_engine_templates_with_the_role_winning():
    pod = _engine_pod(_job(podTemplate=JOB_WIDE, **{"inference.podTemplate": ENGINE_ONLY}))
    spec, [container] = pod["spec"], pod["spec"]["containers"]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "pool": "inference"}
    assert spec["tolerations"] == [GPU_TOLERATION, JOB_WIDE["tolerations"][0]]  # the GPU toleration stays first
    assert spec["priorityClassName"] == "rl-batch" and spec["imagePullSecrets"] == [{"name": "registry"}]
    env = {e["name"]: e for e in container["env"]}
    assert env["LOG_LEVEL"]["value"] == "debug" and env["HTTPS_PROXY"]["value"] == "http://proxy:3128"
    assert env["WANDB_API_KEY"] == SECRET_ENV
    assert env["VLLM_PLUGINS"]["value"] == "r3operator"  # derived env untouched
    assert {"name": "datasets", "persistentVolumeClaim": {"claimName": "datasets", "readOnly": True}} in spec["volumes"]
    assert {v["name"] for v in spec["volumes"]} >= {"routing", "config", "dshm", "datasets"}
    assert {"name": "datasets", "mountPath": "/data", "readOnly": True} in container["volumeMounts"]
    # GPUs stay derived (TP2 x DP2 = 4); the template adds a CPU limit and ephemeral storage.
    assert container["resources"]["limits"] == {
        "nvidia.com/gpu": "4",
        "memory": "200Gi",
        "cpu": "32",
        "ephemeral-storage": "100Gi",
    }
    assert container["resources"]["requests"]["nvidia.com/gpu"] == "4"
    # securityContext fields merge one by one over the restricted defaults.
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": True,
    }
    labels, annotations = pod["metadata"]["labels"], pod["metadata"]["annotations"]
    assert labels["team"] == "post-training" and labels["r3operator.io/role"] == "engine"
    assert annotations["example.com/owner"] == "rl" and "r3operator.io/spec-hash" in annotations
    # The vLLM command line is the one derived without templates.
    assert container["command"] == _engine_pod(_job())["spec"]["containers"][0]["command"]


def test_trainer_pods_get_the_job_wide_template_but_not_the_engines():
    for pod in _trainer_pods(_job(podTemplate=JOB_WIDE, **{"inference.podTemplate": ENGINE_ONLY})):
        spec, [container] = pod["spec"], pod["spec"]["containers"]
        assert spec["nodeSelector"]["pool"] == "shared"
        assert spec["tolerations"] == [GPU_TOLERATION, JOB_WIDE["tolerations"][0]]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["LOG_LEVEL"] == "info" and "WANDB_API_KEY" not in env
        assert env["R3OPERATOR_RLJOB_NAME"] == "qwen3-30b-a3b-r3"
        assert "datasets" not in {v["name"] for v in spec["volumes"]}


def test_without_templates_pods_keep_the_gpu_toleration_and_nothing_else_is_added():
    pod = _engine_pod(_job())
    assert pod["spec"]["tolerations"] == [GPU_TOLERATION]
    assert not {"nodeSelector", "affinity", "priorityClassName", "imagePullSecrets"} & set(pod["spec"])


TRAINER_ONLY = {
    "nodeSelector": {"pool": "training"},
    "tolerations": [{"key": "team", "operator": "Exists", "effect": "NoSchedule"}],
    "affinity": {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["z1"]}]}
                ]
            }
        }
    },
    "serviceAccountName": "store-reader",
    "podSecurityContext": {"fsGroup": 2000},
    "securityContext": {"readOnlyRootFilesystem": True},
    "annotations": {"example.com/owner": "rl"},
    "env": [{"name": "HF_ENDPOINT", "value": "https://hf-mirror.internal"}, {"name": "HF_HOME", "value": "/tmp/x"}],
    "volumes": [{"name": "ca", "configMap": {"name": "corp-ca"}}],
    "volumeMounts": [{"name": "ca", "mountPath": "/etc/ssl/corp", "readOnly": True}],
    "resources": {"requests": {"cpu": "64", "rdma/ib": "1"}},
}


def _fetch_job(job: RLJob, facts: Facts | None = None) -> dict[str, Any]:
    return {c["kind"]: c for c in desired(job, facts or Facts()) if c["kind"] == "Job"}["Job"]


def test_the_model_fetch_pod_gets_the_trainers_template_but_keeps_its_own_env_and_resources():
    job = _job(
        podTemplate=JOB_WIDE,
        **{
            "trainer.podTemplate": TRAINER_ONLY,
            "inference.podTemplate": ENGINE_ONLY,
            "model.tokenSecretRef": {"name": "hf", "key": "token"},
        },
    )
    pod = _fetch_job(job)["spec"]["template"]
    spec, [container] = pod["spec"], pod["spec"]["containers"]
    # Pulls the trainer image from the private registry and lands where the trainer pods land.
    assert spec["imagePullSecrets"] == [{"name": "registry"}]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "pool": "training"}
    assert spec["tolerations"] == [GPU_TOLERATION, JOB_WIDE["tolerations"][0], TRAINER_ONLY["tolerations"][0]]
    [trainer_head, _] = _trainer_pods(job)
    assert spec["affinity"] == trainer_head["spec"]["affinity"]
    term = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
    assert term["matchExpressions"][0]["values"] == ["z1"]  # a zonal cache claim binds in the readers' zone
    assert spec["priorityClassName"] == "rl-batch"
    assert spec["serviceAccountName"] == "store-reader" and spec["automountServiceAccountToken"] is False
    assert pod["metadata"]["labels"]["team"] == "post-training"
    assert pod["metadata"]["labels"]["r3operator.io/role"] == "model-fetch"  # derived labels win
    assert pod["metadata"]["annotations"] == {"example.com/owner": "rl"}
    assert spec["securityContext"]["fsGroup"] == 2000 and spec["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    env = {e["name"]: e for e in container["env"]}
    assert env["HF_ENDPOINT"]["value"] == "https://hf-mirror.internal" and env["HTTPS_PROXY"]["value"]
    assert env["HF_HOME"]["value"] == "/mnt/model/.hf-home"  # the fetch's own env wins, once
    assert [e["name"] for e in container["env"]].count("HF_HOME") == 1
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "token"}
    assert "WANDB_API_KEY" not in env  # the engines' template is not the fetch's
    assert {"name": "ca", "configMap": {"name": "corp-ca"}} in spec["volumes"]
    assert {"name": "ca", "mountPath": "/etc/ssl/corp", "readOnly": True} in container["volumeMounts"]
    # A training pod's requests are not the fetch's.
    assert container["resources"] == {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "4Gi"}}


def test_the_model_fetch_job_runs_only_while_the_job_may_run():
    assert _fetch_job(_job())["spec"]["suspend"] is False
    assert _fetch_job(_job(queueName="q"), Facts(admitted=False))["spec"]["suspend"] is True
    assert _fetch_job(_job(queueName="q"), Facts(admitted=True))["spec"]["suspend"] is False
    assert _fetch_job(_job(**{"runPolicy.suspend": True}))["spec"]["suspend"] is True


def _observed_job(job: dict[str, Any], *conditions: str, **spec: Any) -> dict[str, Any]:
    status = {"conditions": [{"type": c, "status": "True"} for c in conditions]}
    ref = {"controller": True, "uid": "uid-1"}
    metadata = {**job["metadata"], "ownerReferences": [ref]}
    return {**job, "metadata": metadata, "spec": {**job["spec"], **spec}, "status": status}


def test_a_fetch_job_follows_admission_and_its_pod_template_until_it_completes():
    job = _job()
    job.metadata.uid = "uid-1"
    running = _fetch_job(job)
    assert plan_action(running, _observed_job(running), job_uid="uid-1").verb == "none"
    # Kueue evicts: only suspend is written, under its own field manager.
    held = _fetch_job(
        job.model_copy(update={"spec": job.spec.model_copy(update={"queue_name": "q"})}), Facts(admitted=False)
    )
    action = plan_action(held, _observed_job(running), job_uid="uid-1")
    assert action.verb == "apply" and action.body is not None and action.body["spec"] == {"suspend": True}
    assert action.manager != "r3operator"
    # A toleration added while the fetch pod is Pending replaces the Job; once complete, nothing does.
    tolerant = _job(**{"trainer.podTemplate": {"tolerations": [{"key": "pool", "operator": "Exists"}]}})
    tolerant.metadata.uid = "uid-1"
    fixed = _fetch_job(tolerant)
    assert plan_action(fixed, _observed_job(running), job_uid="uid-1").verb == "recreate"
    assert plan_action(fixed, _observed_job(running, "Failed"), job_uid="uid-1").verb == "recreate"
    assert plan_action(fixed, _observed_job(running, "Complete"), job_uid="uid-1").verb == "none"
    # A Job without the annotation (an older operator's) is not restarted by an operator upgrade.
    old = _observed_job(running)
    old["metadata"] = {**old["metadata"], "annotations": {"r3operator.io/spec-hash": "x"}}
    old_want = {**fixed, "metadata": {**fixed["metadata"], "annotations": {"r3operator.io/spec-hash": "x"}}}
    assert plan_action(old_want, old, job_uid="uid-1").verb == "none"


def test_a_chosen_trainer_service_account_gets_the_jobs_role_and_ours_is_not_created():
    job = _job(**{"trainer.podTemplate": {"serviceAccountName": "team-rl"}})
    kids = _children(job)
    assert "ServiceAccount" not in kids
    assert kids["RoleBinding"]["subjects"][0]["name"] == "team-rl"
    assert {p["spec"]["serviceAccountName"] for p in _trainer_pods(job)} == {"team-rl"}
    # Without a choice: <job>-trainer, created and bound.
    plain = _children(_job())
    assert plain["ServiceAccount"]["metadata"]["name"] == plain["RoleBinding"]["subjects"][0]["name"]


def test_hashes_move_only_for_the_templates_a_component_reads():
    base = _job()
    engine_only = _job(**{"inference.podTemplate": {"nodeSelector": {"pool": "a"}}})
    job_wide = _job(podTemplate={"nodeSelector": {"pool": "a"}})
    assert engine_spec_hash(engine_only.spec) != engine_spec_hash(base.spec)
    assert trainer_spec_hash(engine_only.spec) == trainer_spec_hash(base.spec)
    assert engine_spec_hash(job_wide.spec) != engine_spec_hash(base.spec)
    assert trainer_spec_hash(job_wide.spec) != trainer_spec_hash(base.spec)


def test_merge_replaces_named_entries_and_whole_blocks_by_the_more_specific_template():
    default = PodTemplate.model_validate(
        {
            "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "1"}],
            "affinity": {
                "nodeAffinity": {
                    "preferredDuringSchedulingIgnoredDuringExecution": [
                        {
                            "weight": 1,
                            "preference": {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
                        }
                    ]
                }
            },
            "podSecurityContext": {"runAsUser": 2000, "fsGroup": 2000},
            "resources": {"limits": {"cpu": "8", "memory": "1Gi"}},
        }
    )
    own = PodTemplate.model_validate(
        {
            "env": [{"name": "B", "value": "2"}],
            "podSecurityContext": {"fsGroup": 3000},
            "resources": {"limits": {"cpu": "16"}},
        }
    )
    merged = merge_templates(default, own)
    assert [(e.name, e.value) for e in merged.env] == [("A", "1"), ("B", "2")]
    assert merged.affinity == default.affinity
    assert merged.pod_security_context is not None
    assert (merged.pod_security_context.run_as_user, merged.pod_security_context.fs_group) == (2000, 3000)
    assert merged.resources is not None and merged.resources.limits == {"cpu": "16", "memory": "1Gi"}


CONFIG_SUBDIR = {"name": "x", "mountPath": "/etc/r3operator/c"}


@pytest.mark.parametrize(
    ("template", "named"),
    [
        ({"env": [{"name": "VLLM_PLUGINS", "value": "x"}]}, "env VLLM_PLUGINS"),
        ({"env": [{"name": "R3OPERATOR_RLJOB_NAME", "value": "x"}]}, "env R3OPERATOR_RLJOB_NAME"),
        ({"resources": {"limits": {"nvidia.com/gpu": "8"}}}, "resources.limits nvidia.com/gpu"),
        ({"volumes": [{"name": "routing", "emptyDir": {}}]}, "volume routing"),
        ({"volumes": [{"name": "x", "emptyDir": {}}], "volumeMounts": [CONFIG_SUBDIR]}, "mountPath /etc/r3operator/c"),
        ({"labels": {"r3operator.io/job": "other"}}, "label r3operator.io/job"),
        ({"annotations": {"kueue.x-k8s.io/queue-name": "q"}}, "annotation kueue.x-k8s.io/queue-name"),
    ],
)
def test_a_template_that_sets_a_derived_field_is_refused_naming_it(template: dict[str, Any], named: str):
    job = _job(**{"inference.podTemplate": template})
    [finding] = [f for f in evaluate(job.spec) if f.rule == "ENGINE-POD-TEMPLATE-DERIVED"]
    assert finding.field == "spec.inference.podTemplate"
    assert finding.message == f"inference.podTemplate sets what r3operator derives: {named}"


def test_a_mount_of_an_undefined_volume_is_refused_and_the_job_wide_volumes_count():
    mount = {"volumeMounts": [{"name": "shared", "mountPath": "/shared"}]}
    job = _job(**{"trainer.podTemplate": mount})
    [finding] = [f for f in evaluate(job.spec) if f.rule == "TRAINER-POD-TEMPLATE-MOUNTS"]
    assert "shared" in finding.message
    with_volume = _job(podTemplate={"volumes": [{"name": "shared", "emptyDir": {}}]}, **{"trainer.podTemplate": mount})
    assert not [f for f in evaluate(with_volume.spec) if f.rule.endswith("-MOUNTS")]


def test_a_huge_toleration_list_is_refused_with_its_path():
    tolerations = [{"key": f"k{i}", "operator": "Exists"} for i in range(10_000)]
    with pytest.raises(RLJobLoadError) as err:
        _job(**{"trainer.podTemplate": {"tolerations": tolerations}})
    assert any(p.field == "spec.trainer.podTemplate.tolerations" for p in err.value.problems), err.value.problems


def test_the_reserved_names_cover_every_name_the_builders_derive():
    """A builder that starts deriving a new env var, volume or mount must reserve it (api/pod_rules.py)."""
    for uri in ("hf://Qwen/Qwen3-30B-A3B", "pvc://models/qwen3"):
        job = _job(**{"model.uri": uri, "inference.modelRunnerV2": True})
        for pod in [_engine_pod(job), *_trainer_pods(job)]:
            [container] = pod["spec"]["containers"]
            for env in container["env"]:
                assert env["name"] in RESERVED_ENV or env["name"].startswith(RESERVED_ENV_PREFIX), env
            assert {v["name"] for v in pod["spec"]["volumes"]} <= set(RESERVED_VOLUMES)
            for mount in container["volumeMounts"]:
                assert mount["mountPath"] in RESERVED_MOUNT_PATHS, mount


def test_the_workload_has_a_pod_set_per_role_with_the_pods_templates_and_the_priority():
    job = _job(queueName="gpu-team", podTemplate={"priorityClassName": "rl-batch"})
    sets = {s["name"]: s for s in pod_sets(job)}
    # The example: 4 engine replicas of one pod each, a Ray head and one worker (2 trainer nodes).
    assert {name: s["count"] for name, s in sets.items()} == {"engine": 4, "trainer-head": 1, "trainer-workers": 1}
    assert sets["engine"]["template"] == _engine_pod(job)
    workload = build_workload(job, priority=500)
    assert workload["spec"]["queueName"] == "gpu-team"
    assert (workload["spec"]["priorityClassName"], workload["spec"]["priority"]) == ("rl-batch", 500)
    assert workload["spec"]["priorityClassSource"] == "scheduling.k8s.io/priorityclass"
    assert workload["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-team"
    # Another replica count is another pod set: a new spec hash (the Workload is re-created).
    bigger = build_workload(_job(queueName="gpu-team", **{"inference.replicas": 5}), priority=None)
    assert (
        bigger["metadata"]["annotations"]
        != build_workload(_job(queueName="gpu-team"), priority=None)["metadata"]["annotations"]
    )


def test_not_admitted_holds_the_children_like_a_suspended_job():
    kids = {c["kind"]: c for c in desired(_job(queueName="q"), Facts(admitted=False))}
    assert kids["StatefulSet"]["spec"]["replicas"] == 0 and kids["RayJob"]["spec"]["suspend"] is True
    assert kids["Workload"]["spec"]["queueName"] == "q"
    running = {c["kind"]: c for c in desired(_job(queueName="q"), Facts(admitted=True))}
    assert running["StatefulSet"]["spec"]["replicas"] == 4 and running["RayJob"]["spec"]["suspend"] is False
    assert "Workload" not in {c["kind"] for c in desired(_job(), Facts())}
