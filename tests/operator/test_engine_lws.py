"""Engines whose replica spans nodes: the layout, the LeaderWorkerSet, its Kueue pod sets, upgrades, explain.

Pure: desired() and its builders, no cluster (tests/operator/test_lws_cluster.py runs the LWS controller).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from spec_edits import apply_edits
from typer.testing import CliRunner
from vllm_argv import exec_argv, flag

from r3operator.api.context import RuleContext
from r3operator.api.engine_layout import engine_layout
from r3operator.api.load import parse_rljob
from r3operator.api.rules import errors, evaluate
from r3operator.api.v1alpha1 import RLJob
from r3operator.cli.main import app
from r3operator.operator.builders.config import runtime_config
from r3operator.operator.desired import Facts, desired
from r3operator.operator.picture import scheduling_picture
from r3operator.operator.upgrade import EngineRollout, rolled_out, template_image

REPO = Path(__file__).resolve().parents[2]
QWEN = REPO / "examples" / "qwen3-30b-a3b-r3-fsdp.yaml"
# 16 GPUs a replica (tp 4 x dp 4) on 8-GPU nodes: two pods of two DP ranks each.
TWO_NODES = {
    "inference.tensorParallelSize": 4,
    "inference.dataParallelSize": 4,
    "inference.gpusPerNode": 8,
    "inference.replicas": 3,
}


def _job(**edits: Any) -> RLJob:
    doc = yaml.safe_load(QWEN.read_text())
    doc["metadata"]["uid"] = "uid-1"
    apply_edits(doc, {**TWO_NODES, **edits})
    return parse_rljob(doc)


def _engines(children: list[dict[str, Any]]) -> dict[str, Any]:
    [engines] = [c for c in children if c["kind"] in ("StatefulSet", "LeaderWorkerSet")]
    return engines


def _containers(lws: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    template = lws["spec"]["leaderWorkerTemplate"]
    return template["leaderTemplate"]["spec"]["containers"][0], template["workerTemplate"]["spec"]["containers"][0]


@pytest.mark.parametrize(
    ("tp", "dp", "dp_local", "gpus_per_node", "pods", "ranks"),
    [
        (4, 4, None, 8, 2, 2),  # 16 GPUs on 8-GPU nodes
        (2, 6, None, 8, 2, 3),  # ranks of 2 GPUs: 4 fit a node, but 6 splits evenly only by 3
        (1, 7, None, 4, 7, 1),  # a prime DP size: one rank per pod
        (2, 4, None, 8, 1, 4),  # fits one node: one pod
        (2, 4, 1, 8, 4, 1),  # dataParallelSizeLocal as given
    ],
)
def test_a_replica_wider_than_a_node_splits_along_dp_into_equal_pods(
    tp: int, dp: int, dp_local: int | None, gpus_per_node: int, pods: int, ranks: int
) -> None:
    edits = {
        "inference.tensorParallelSize": tp,
        "inference.dataParallelSize": dp,
        "inference.gpusPerNode": gpus_per_node,
        "inference.enableExpertParallel": False,
    }
    if dp_local is not None:
        edits["inference.dataParallelSizeLocal"] = dp_local
    layout = engine_layout(_job(**edits).spec)
    assert (layout.pods_per_replica, layout.dp_local, layout.gpus_per_pod) == (pods, ranks, tp * ranks)


def test_a_multi_node_replica_is_a_leader_worker_set_group_and_no_statefulset() -> None:
    children = desired(_job())
    kinds = [c["kind"] for c in children]
    assert "StatefulSet" not in kinds
    lws = _engines(children)
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert lws["metadata"]["name"] == "qwen3-30b-a3b-r3-engine"
    # The engine Service carries the LWS's name, so the LWS controller uses it as the pods' subdomain.
    [service] = [c for c in children if c["kind"] == "Service"]
    assert service["metadata"]["name"] == lws["metadata"]["name"]
    spec = lws["spec"]
    assert spec["replicas"] == 3
    assert spec["startupPolicy"] == "LeaderCreated"  # the leader is Ready only once every rank joined
    assert spec["networkConfig"] == {"subdomainPolicy": "Shared"}
    assert spec["leaderWorkerTemplate"]["size"] == 2
    assert spec["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader, worker = _containers(lws)
    for container in (leader, worker):
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert leader["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert not {"startupProbe", "readinessProbe", "livenessProbe"} & set(worker)  # a --headless pod serves no HTTP
    assert "--headless" not in leader["args"] and "--headless" in worker["args"]
    for template in ("leaderTemplate", "workerTemplate"):
        pod = spec["leaderWorkerTemplate"][template]
        assert pod["metadata"]["labels"]["r3operator.io/role"] == "engine"  # the NetworkPolicy and the Service
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["spec"]["tolerations"]


def _argv(container: dict[str, Any], tmp_path: Path, env: dict[str, str]) -> list[str]:
    """What the pod would exec: the container's command + args, with a `vllm` that prints its argv."""
    return exec_argv([*container["command"], *container.get("args", [])], env, tmp_path)


def test_each_pod_runs_its_own_dp_ranks_against_the_leader_address_lws_injects(tmp_path: Path) -> None:
    leader, worker = _containers(
        _engines(
            desired(
                _job(
                    **{
                        "inference.dataParallelSize": 6,
                        "inference.tensorParallelSize": 2,
                        "inference.enableExpertParallel": False,
                    }
                )
            )
        )
    )
    address = "qwen3-30b-a3b-r3-engine-1.qwen3-30b-a3b-r3-engine.rl"
    lead = _argv(leader, tmp_path, {"LWS_LEADER_ADDRESS": address, "LWS_WORKER_INDEX": "0"})
    follow = _argv(worker, tmp_path, {"LWS_LEADER_ADDRESS": address, "LWS_WORKER_INDEX": "1"})
    for argv in (lead, follow):
        assert argv[0] == "serve"
        assert (flag(argv, "--data-parallel-size"), flag(argv, "--data-parallel-size-local")) == ("6", "3")
        assert flag(argv, "--data-parallel-address") == address
        assert flag(argv, "--data-parallel-rpc-port") == "13345"
        assert "--enable-return-routed-experts" in argv  # R3 capture on every rank
    # The leader names no start rank: vLLM 0.30 would read even 0 as hybrid load balancing and refuse the workers.
    assert "--data-parallel-start-rank" not in lead and "--headless" not in lead
    assert flag(follow, "--data-parallel-start-rank") == "3" and "--headless" in follow


def test_stopped_engines_are_zero_groups_and_the_trainer_reaches_each_replicas_leader() -> None:
    job = _job()
    assert _engines(desired(job, Facts(admitted=False)))["spec"]["replicas"] == 0
    assert _engines(desired(_job(**{"runPolicy.suspend": True})))["spec"]["replicas"] == 0
    urls = runtime_config(job).runtime.engine_urls
    # Group i's leader is pod <lws>-i: the replica's API, as a StatefulSet's ordinal i is.
    assert urls == [
        f"http://qwen3-30b-a3b-r3-engine-{i}.qwen3-30b-a3b-r3-engine.{job.metadata.namespace or 'default'}.svc:8000"
        for i in range(3)
    ]


def test_kueue_pod_sets_count_every_leader_and_worker_with_their_own_templates() -> None:
    job = _job(**{"queueName": "gpus"})
    children = desired(job, Facts(admitted=False))
    [workload] = [c for c in children if c["kind"] == "Workload"]
    sets = {s["name"]: s for s in workload["spec"]["podSets"]}
    assert sets["engine-leaders"]["count"] == 3
    assert sets["engine-workers"]["count"] == 3  # 3 replicas x (2 pods - the leader)
    lws = _engines(children)
    template = lws["spec"]["leaderWorkerTemplate"]
    assert sets["engine-leaders"]["template"] == template["leaderTemplate"]
    assert sets["engine-workers"]["template"] == template["workerTemplate"]
    assert lws["spec"]["replicas"] == 0  # every group waits for Kueue's admission
    assert _engines(desired(job, Facts(admitted=True)))["spec"]["replicas"] == 3


def test_an_upgrade_canary_adds_one_group_on_the_new_image_behind_a_partition() -> None:
    job = _job()
    rollout = EngineRollout(image="vllm/vllm-openai:v0.30.0", surge_replicas=1, partition=3)
    lws = _engines(desired(job, Facts(engine_rollout=rollout)))
    assert lws["spec"]["replicas"] == 4
    assert lws["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"]["partition"] == 3
    leader, worker = _containers(lws)
    assert leader["image"] == worker["image"] == "vllm/vllm-openai:v0.30.0"
    assert template_image(lws) == "vllm/vllm-openai:v0.30.0"
    rolling = _engines(desired(job, Facts(engine_rollout=EngineRollout(image="vllm/vllm-openai:v0.30.0"))))
    assert rolling["spec"]["replicas"] == 3
    assert rolling["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"]["partition"] == 0


def _lws_status(replicas: int, updated: int, ready: int, updating: bool) -> dict[str, Any]:
    conditions = [{"type": "UpdateInProgress", "status": "True" if updating else "False"}]
    status = {"replicas": replicas, "updatedReplicas": updated, "readyReplicas": ready, "conditions": conditions}
    return {"kind": "LeaderWorkerSet", "metadata": {"generation": 3}, "status": status}


def test_an_lws_rollout_is_done_when_every_group_is_updated_and_ready_and_the_surge_group_is_gone() -> None:
    assert rolled_out(_lws_status(3, 3, 3, updating=False), pods=3) == (True, 3)
    assert rolled_out(_lws_status(3, 2, 3, updating=True), pods=3) == (False, 2)
    assert rolled_out(_lws_status(4, 3, 4, updating=False), pods=3)[0] is False  # the canary group still there
    assert rolled_out(_lws_status(3, 3, 2, updating=False), pods=3)[0] is False


def test_rules_refuse_a_multi_node_replica_without_lws_and_a_rank_wider_than_a_node() -> None:
    spec = _job().spec
    [missing] = errors(evaluate(spec, context=RuleContext.for_spec(spec, leader_worker_set=False)))
    assert missing.rule == "ENGINE-LWS" and missing.field == "spec.inference.dataParallelSize"
    assert "install LeaderWorkerSet" in missing.message and "2 pods" in missing.message
    assert evaluate(spec, context=RuleContext.for_spec(spec, leader_worker_set=True)) == []
    [assumed] = evaluate(spec)  # offline: rendered as an LWS, with a warning that the cluster must have it
    assert assumed.rule == "ENGINE-LWS-ASSUMED" and assumed.severity.value == "warning"
    wide = _job(
        **{"inference.tensorParallelSize": 16, "inference.dataParallelSize": 1, "inference.gpusPerNode": 8}
    ).spec
    assert [f.rule for f in errors(evaluate(wide))] == ["MP-SINGLE-NODE"]  # TP cannot span nodes with mp


def test_explain_shows_the_groups_leaders_and_workers() -> None:
    picture = scheduling_picture(_job())
    roles = {r.role: (r.pods, r.gpus_per_pod) for r in picture.roles}
    assert roles["engine leaders"] == (3, 8) and roles["engine workers"] == (3, 8)
    assert picture.engines.startswith("LeaderWorkerSet qwen3-30b-a3b-r3-engine: 3 replica(s) of 2 pods x 8 GPU")
    assert "1 leader serving the API + 1 --headless worker(s)" in picture.engines
    single = scheduling_picture(_job(**{"inference.dataParallelSize": 2}))
    assert single.engines == "StatefulSet qwen3-30b-a3b-r3-engine: 3 replica(s) of 1 pod x 8 GPU"


def test_explain_json_names_the_workload_and_the_pods_of_a_replica(tmp_path: Path) -> None:
    doc = yaml.safe_load(QWEN.read_text())
    apply_edits(doc, TWO_NODES)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    result = CliRunner().invoke(app, ["explain", "--leaderworkerset", "--output", "json", str(path)])
    assert result.exit_code == 0, result.output
    [entry] = json.loads(result.stdout)
    engines = entry["engines"]
    assert engines["workload"] == "LeaderWorkerSet"
    assert (engines["podsPerReplica"], engines["dataParallelSizeLocal"]) == (2, 2)
    assert (engines["gpusPerPod"], engines["gpusPerReplica"]) == (8, 16)
    assert entry["findings"] == []  # the cluster has LeaderWorkerSet: no ENGINE-LWS-ASSUMED warning
