"""A disaggregated RLJob rendered, pure: both roles' StatefulSets and Services, each role's connector flags, the
side channel, the fence over both roles, the trainer's URLs, readiness per role, and an image upgrade that moves
both roles (canary pair, partitions, completion of both)."""

from __future__ import annotations

import json
from typing import Any

from test_upgrade import NEW, NOW, OLD, canary_status, engines, job, rec, said

from r3operator.api.v1alpha1 import RLJob
from r3operator.operator.desired import Facts, desired
from r3operator.operator.upgrade import plan_upgrade


def pd_job(connector: str = "nixl", image: str = NEW) -> RLJob:
    base = job(image=image, replicas=2)
    doc = base.model_dump(mode="json", by_alias=True, exclude_none=True)
    doc["spec"]["inference"].update(tensorParallelSize=4, dataParallelSize=1)  # the decode role sets none of its own
    doc["spec"]["inference"]["disaggregation"] = {
        "connector": connector,
        "prefill": {"replicas": 1, "tensorParallelSize": 2},
        "decode": {"replicas": 3},
    }
    return RLJob.model_validate(doc)


def _by_name(children: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(c["kind"], c["metadata"]["name"].removeprefix("qwen3-30b-a3b-r3-")): c for c in children}


def _container(sts: dict[str, Any]) -> dict[str, Any]:
    return sts["spec"]["template"]["spec"]["containers"][0]


def _flag(container: dict[str, Any], flag: str) -> str:
    argv = container["command"]
    return str(argv[argv.index(flag) + 1])


def test_both_roles_are_rendered_with_their_replicas_parallelism_and_connector_role() -> None:
    children = _by_name(desired(pd_job()))
    prefill, decode = children[("StatefulSet", "prefill")], children[("StatefulSet", "engine")]
    assert (prefill["spec"]["replicas"], decode["spec"]["replicas"]) == (1, 3)
    p, d = _container(prefill), _container(decode)
    assert (_flag(p, "--tensor-parallel-size"), _flag(d, "--tensor-parallel-size")) == ("2", "4")
    assert p["resources"]["limits"]["nvidia.com/gpu"] == "2" and d["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert json.loads(_flag(p, "--kv-transfer-config")) == {"kv_connector": "NixlConnector", "kv_role": "kv_producer"}
    assert json.loads(_flag(d, "--kv-transfer-config")) == {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}
    assert "--enable-return-routed-experts" in p["command"] and "--enable-return-routed-experts" in d["command"]
    # The selectors never overlap: each StatefulSet and Service owns its role's pods only.
    assert prefill["spec"]["selector"]["matchLabels"] != decode["spec"]["selector"]["matchLabels"]
    service = children[("Service", "prefill")]
    assert service["spec"]["selector"] == prefill["spec"]["selector"]["matchLabels"]
    # NixlConnector's side channel: a named port on the prefill pods and Service, advertised as the pod's IP.
    assert {"name": "nixl", "containerPort": 5600} in p["ports"]
    assert {"name": "nixl", "port": 5600, "targetPort": "nixl"} in service["spec"]["ports"]
    host = next(e for e in p["env"] if e["name"] == "VLLM_NIXL_SIDE_CHANNEL_HOST")
    assert host["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert not any(e["name"].startswith("VLLM_NIXL") for e in d["env"])
    # Both roles know the image they run: the trainer pairs only engines of one build.
    assert {e["name"]: e.get("value") for e in p["env"]}["R3OPERATOR_ENGINE_IMAGE"] == NEW

    fence = children[("NetworkPolicy", "engine")]["spec"]
    assert fence["podSelector"]["matchExpressions"] == [
        {"key": "r3operator.io/role", "operator": "In", "values": ["engine", "prefill"]}
    ]
    peers = [p["podSelector"]["matchLabels"]["r3operator.io/role"] for p in fence["ingress"][0]["from"]]
    assert sorted(peers) == ["engine", "prefill", "trainer"]

    config = json.loads(children[("ConfigMap", "config")]["data"]["config.json"])["runtime"]
    assert [u.split(".")[0] for u in config["engineURLs"]] == [f"http://qwen3-30b-a3b-r3-engine-{i}" for i in range(3)]
    assert [u.split(".")[0] for u in config["prefillEngineURLs"]] == ["http://qwen3-30b-a3b-r3-prefill-0"]


def test_the_storage_connector_mounts_only_its_folder_of_the_routing_volume_writable() -> None:
    children = _by_name(desired(pd_job("storage")))
    for name in ("prefill", "engine"):
        sts = children[("StatefulSet", name)]
        container = _container(sts)
        config = json.loads(_flag(container, "--kv-transfer-config"))
        assert config["kv_connector"] == "R3StorageConnector"
        assert config["kv_connector_extra_config"] == {"shared_storage_path": "/var/lib/r3operator/kv-transfer"}
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        assert mounts["routing"]["readOnly"] is True
        assert mounts["kv-transfer"] == {
            "name": "kv-transfer",
            "mountPath": "/var/lib/r3operator/kv-transfer",
            "subPath": "kv-transfer",
        }
        volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
        assert volumes["kv-transfer"]["persistentVolumeClaim"] == {"claimName": "qwen3-30b-a3b-r3-routing"}
    assert ("Service", "prefill") in children and "nixl" not in json.dumps(children[("Service", "prefill")])


def test_an_image_upgrade_moves_both_roles_and_completes_when_both_rolled() -> None:
    plan = plan_upgrade(pd_job(), engines(OLD, pods=3), now=NOW)
    assert plan.status is not None and plan.status.phase == "Canary"
    assert plan.canary is not None and (plan.canary.old_replica, plan.canary.new_replica) == (0, 3)
    assert plan.canary.prefill == (0, 1)  # the prefill role's surge ordinal is its replica count
    children = _by_name(desired(pd_job(), Facts(engine_rollout=plan.rollout, upgrade_canary=plan.canary)))
    for name, regular in (("prefill", 1), ("engine", 3)):
        sts = children[("StatefulSet", name)]
        assert sts["spec"]["replicas"] == regular + 1
        assert sts["spec"]["updateStrategy"]["rollingUpdate"]["partition"] == regular
        assert _container(sts)["image"] == NEW
    args = children[("Job", "upgrade-canary")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--new-prefill") + 1].split(".")[0].endswith("-prefill-1")
    assert args[args.index("--old-prefill") + 1].split(".")[0].endswith("-prefill-0")

    rolling = plan_upgrade(
        pd_job(), engines(NEW, pods=4, updated=1), prev=rec(canary_status()), canary=said("7", passed=True), now=NOW
    )
    assert rolling.status is not None and rolling.status.phase == "Rolling"
    record = rec(rolling.status.model_dump(mode="json", by_alias=True))
    # The decode role rolled, the prefill role not yet: not complete (no pair of one image would be missing).
    waiting = plan_upgrade(
        pd_job(),
        engines(NEW, pods=3),
        prev=record,
        prefill_set=engines(NEW, pods=1, updated=0, same_revision=False),
        now=NOW,
    )
    assert waiting.status is not None and waiting.status.phase == "Rolling"
    done = plan_upgrade(pd_job(), engines(NEW, pods=3), prev=record, prefill_set=engines(NEW, pods=1), now=NOW)
    assert done.status is not None and done.status.phase == "Complete"


def test_readiness_is_per_role() -> None:
    from r3operator.operator.observed import Observed
    from r3operator.operator.status import compute_status

    def ready(pods: int, ready: int) -> dict[str, Any]:
        sts = engines(NEW, pods=pods)
        sts["status"]["readyReplicas"] = ready
        return sts

    rljob = pd_job()
    status = compute_status(rljob, Observed(engine_set=ready(3, 3), prefill_set=ready(1, 0)), NOW)
    assert status.engines_ready == "P 0/1 D 3/3"
    assert status.prefill_engines is not None and status.prefill_engines.ready_replicas == 0
    engines_ready = next(c for c in status.conditions if c.type == "EnginesReady")
    assert engines_ready.status == "False" and "0/1 prefill engine replicas ready" in (engines_ready.message or "")
    status = compute_status(rljob, Observed(engine_set=ready(3, 3), prefill_set=ready(1, 1)), NOW)
    assert status.engines_ready == "P 1/1 D 3/3"


def test_a_queued_disaggregated_job_asks_kueue_for_both_roles() -> None:
    from r3operator.operator.builders.workload import pod_sets

    base = pd_job()
    queued = base.model_copy(update={"spec": base.spec.model_copy(update={"queue_name": "gpus"})})
    sets = {s["name"]: s for s in pod_sets(queued)}
    assert (sets["prefill"]["count"], sets["engine"]["count"]) == (1, 3)
    gpus = {
        name: s["template"]["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/gpu"]
        for name, s in sets.items()
        if name in ("prefill", "engine")
    }
    assert gpus == {"prefill": "2", "engine": "4"}


def test_the_plan_counts_both_roles_gpus() -> None:
    from r3operator.api.plan import plan

    resolved = plan(pd_job())
    # prefill: 1 replica x tp 2; decode: 3 replicas x tp 4 (inference's, dp 1)
    assert (resolved.engine_gpus_total, resolved.engine_gpus_per_replica) == (1 * 2 + 3 * 4, 4)
