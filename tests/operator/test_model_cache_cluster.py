"""The model cache on the real control plane: the fetch Job fills it before any engine or trainer pod exists,
every engine pod mounts it read-only behind a verify step, and no Secret value lands in anything the operator
writes or logs. kwok plays the nodes: it completes the fetch Job's pod (tests/kubecluster/kwok-stages.yaml)."""

from __future__ import annotations

import base64
import json
from typing import Any

from operator_harness import Cluster, condition, example, paths, running_operator, wait_for, written_objects

NS = "model-cache"
HF_TOKEN = "hf_9c1e7a44d2b0secretTOKENvalue"
AWS_KEY_ID = "AKIACACHETESTKEY0042"
AWS_SECRET = "aws-secret-5d8e1f0b9a7c3e2d"
SECRET_VALUES = (HF_TOKEN, AWS_KEY_ID, AWS_SECRET)


def small(name: str, **edits: Any) -> dict[str, Any]:
    """The Qwen3 example (hf://Qwen/Qwen3-30B-A3B, revision main) at 1 engine GPU + 1 trainer GPU."""
    return example(
        name,
        NS,
        **{
            "inference.replicas": 2,
            "inference.tensorParallelSize": 1,
            "inference.dataParallelSize": 1,
            "inference.dataParallelSizeLocal": 1,
            "inference.enableExpertParallel": False,
            "trainer.nodes": 1,
            "trainer.gpusPerNode": 1,
            **edits,
        },
    )


def _secret(cluster: Cluster, name: str, data: dict[str, str]) -> None:
    encoded = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
    cluster.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": NS}, "data": encoded})


def _list(cluster: Cluster, path: str, selector: str | None = None) -> list[dict[str, Any]]:
    query = f"?labelSelector={selector}" if selector else ""
    return (cluster.get(path + query) or {}).get("items") or []


def _engine_pods(cluster: Cluster, job: str) -> list[dict[str, Any]]:
    return _list(cluster, f"/api/v1/namespaces/{NS}/pods", f"r3operator.io/job={job},r3operator.io/role=engine")


def _fetch_job(cluster: Cluster, job: str) -> dict[str, Any] | None:
    return cluster.get(f"/apis/batch/v1/namespaces/{NS}/jobs/{job}-model-fetch")


def test_engines_and_trainer_start_only_after_the_cache_is_filled_and_mount_it_read_only(cluster: Cluster) -> None:
    job = "cached"
    with running_operator(cluster, NS):
        _secret(cluster, "hf", {"token": HF_TOKEN})
        _secret(cluster, "registry", {".dockerconfigjson": "{}"})
        # The trainer's pool: the fetch pod runs the trainer image, so it pulls and lands like a trainer pod.
        gpu_pool = {
            "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
            "imagePullSecrets": [{"name": "registry"}],
        }
        # kwok paused: the fetch Job's pod is created and scheduled but does not complete yet.
        with cluster.api.paused("kwok"):
            cluster.apply(
                small(job, **{"model.tokenSecretRef": {"name": "hf", "key": "token"}, "trainer.podTemplate": gpu_pool})
            )
            fetch = wait_for(lambda: _fetch_job(cluster, job), timeout=30, what="the model-fetch Job")
            sts = wait_for(lambda: cluster.get(paths(NS, job)["sts"]), timeout=30, what="the engine StatefulSet")
            rayjob = wait_for(lambda: cluster.get(paths(NS, job)["rayjob"]), timeout=30, what="the RayJob")
            assert sts["spec"]["replicas"] == 0 and rayjob["spec"]["suspend"] is True
            [fetch_pod] = wait_for(
                lambda: [
                    p
                    for p in _list(cluster, f"/api/v1/namespaces/{NS}/pods", f"job-name={job}-model-fetch")
                    if p["spec"].get("nodeName")
                ],
                timeout=30,
                what="the fetch pod scheduled",
            )
            # On the tainted GPU pool the trainer's template chose, with the registry's pull secret.
            assert fetch_pod["spec"]["nodeName"].startswith("gpu-node-")
            assert fetch_pod["spec"]["imagePullSecrets"] == [{"name": "registry"}]
            assert _engine_pods(cluster, job) == []
            assert not (fetch.get("status") or {}).get("succeeded")
        [cache] = _shared_claims(cluster, "hf://Qwen/Qwen3-30B-A3B@main")
        assert cache["spec"]["accessModes"] == ["ReadWriteMany"]
        claim = cache["metadata"]["name"]
        # kwok runs again: the fetch completes, then the operator scales the engines up and resumes the trainer.
        done = wait_for(
            lambda: (j := _fetch_job(cluster, job)) and condition(j, "Complete") and j, timeout=60, what="fill done"
        )
        pods = wait_for(lambda: len(p := _engine_pods(cluster, job)) == 2 and p, timeout=60, what="2 engine pods")
        completed = condition(done, "Complete")["lastTransitionTime"]
        assert all(p["metadata"]["creationTimestamp"] >= completed for p in pods)
        wait_for(lambda: cluster.get(paths(NS, job)["rayjob"])["spec"]["suspend"] is False, what="RayJob resumed")
        for pod in pods:
            spec = pod["spec"]
            [volume] = [v for v in spec["volumes"] if v["name"] == "model"]
            assert volume["persistentVolumeClaim"] == {"claimName": claim, "readOnly": True}
            [verify] = spec["initContainers"]
            assert verify["command"][:2] == ["r3operator", "fetch"] and verify["command"][-1] == "--verify"
            assert all(m.get("readOnly") for m in verify["volumeMounts"] if m["name"] == "model")
            mounts = spec["containers"][0]["volumeMounts"]
            assert {"name": "model", "mountPath": "/mnt/model", "readOnly": True} in mounts


def test_a_shared_cache_claim_that_does_not_exist_creates_nothing(cluster: Cluster) -> None:
    job = "no-cache-claim"
    with running_operator(cluster, NS):
        cluster.apply(small(job, **{"model.cache": {"claimName": "team-models"}}))
        valid = wait_for(
            lambda: (c := condition(cluster.get(paths(NS, job)["rljob"]), "Valid")) and c["status"] == "False" and c,
            timeout=30,
            what="Valid=False",
        )
        assert "PersistentVolumeClaim/team-models" in valid["message"]
        assert _fetch_job(cluster, job) is None and cluster.get(paths(NS, job)["sts"]) is None


def test_a_failed_fetch_stops_the_job_with_a_condition_that_names_the_fetch_job(cluster: Cluster) -> None:
    ns, job = "kwok-fail-jobs", "fetch-fails"  # kwok fails every Job-owned pod in this namespace
    with running_operator(cluster, ns):
        cluster.apply({**small(job, **{"runPolicy.backoffLimit": 0}), "metadata": {"name": job, "namespace": ns}})
        progressing = wait_for(
            lambda: (
                (c := condition(cluster.get(paths(ns, job)["rljob"]), "Progressing"))
                and c["reason"] == "ModelFetchFailed"
                and c
            ),
            timeout=90,
            what="Progressing=False ModelFetchFailed",
        )
        assert progressing["status"] == "False"
        assert f"kubectl logs job/{job}-model-fetch" in progressing["message"]
        assert cluster.get(paths(ns, job)["sts"])["spec"]["replicas"] == 0
        assert cluster.get(paths(ns, job)["rayjob"])["spec"]["suspend"] is True


def test_no_secret_value_lands_in_any_object_event_status_or_operator_log(cluster: Cluster) -> None:
    hf_job, s3_job = "secret-hf", "secret-s3"
    with running_operator(cluster, NS) as runner:
        _secret(cluster, "hf", {"token": HF_TOKEN})
        _secret(cluster, "store", {"AWS_ACCESS_KEY_ID": AWS_KEY_ID, "AWS_SECRET_ACCESS_KEY": AWS_SECRET})
        cluster.apply(small(hf_job, **{"model.tokenSecretRef": {"name": "hf", "key": "token"}}))
        s3 = {"credentialsSecret": "store", "endpointURL": "http://minio.storage:9000"}
        s3_source = {"model.uri": "s3://models/qwen3-30b-a3b", "model.revision": None, "model.s3": s3}
        s3_dataset = {"task.datasetPath": "s3://data/math/train.jsonl", "task.s3": s3}
        cluster.apply(small(s3_job, **s3_source, **s3_dataset))
        for job in (hf_job, s3_job):
            wait_for(lambda j=job: len(_engine_pods(cluster, j)) == 2, timeout=90, what=f"{job} engines")
            wait_for(lambda j=job: (cluster.get(paths(NS, j)["rljob"]) or {}).get("status"), what=f"{job} status")
        written = written_objects(cluster, NS)
    log = runner.output  # complete once the operator has stopped
    dump = json.dumps(written)
    # The references are there (the grep below looks where the values would be)...
    assert '"secretKeyRef": {"key": "token", "name": "hf"}' in json.dumps(written["jobs"], sort_keys=True)
    assert '"name": "store"' in json.dumps(written["rayjobs"])  # the dataset fetch of the s3 job's head pod
    assert written["configmaps"] and written["events"] and written["rljobs"]
    # ...and no value is, anywhere the operator writes or logs.
    for value in SECRET_VALUES:
        assert value not in dump
        assert value not in log


def test_a_missing_credentials_secret_is_valid_false_with_its_name_until_it_is_created(cluster: Cluster) -> None:
    job = "no-token-yet"
    with running_operator(cluster, NS):
        cluster.apply(small(job, **{"model.tokenSecretRef": {"name": "hf-late", "key": "token"}}))
        valid = wait_for(
            lambda: (c := condition(cluster.get(paths(NS, job)["rljob"]), "Valid")) and c["status"] == "False" and c,
            timeout=30,
            what="Valid=False",
        )
        assert valid["reason"] == "ReferenceNotFound"
        assert "Secret/hf-late (key token), named in model.tokenSecretRef, does not exist" in valid["message"]
        assert _fetch_job(cluster, job) is None and cluster.get(paths(NS, job)["sts"]) is None
        assert cluster.get(paths(NS, job)["rayjob"]) is None and cluster.get(paths(NS, job)["cm"]) is None
        # The Secret appears: the job goes on, the fetch first.
        _secret(cluster, "hf-late", {"token": HF_TOKEN})
        wait_for(lambda: _fetch_job(cluster, job), timeout=60, what="the model-fetch Job")
        wait_for(
            lambda: (c := condition(cluster.get(paths(NS, job)["rljob"]), "Valid")) and c["status"] == "True" and c,
            timeout=30,
            what="Valid=True",
        )


def _cache_claim(cluster: Cluster, name: str) -> dict[str, Any] | None:
    return cluster.get(f"/api/v1/namespaces/{NS}/persistentvolumeclaims/{name}")


def _filled(cluster: Cluster, job: str) -> dict[str, Any]:
    done = wait_for(lambda: (j := _fetch_job(cluster, job)) and condition(j, "Complete") and j, what=f"{job} filled")
    return dict(done)


def _shared_claims(cluster: Cluster, source: str) -> list[dict[str, Any]]:
    """The namespace's model cache claims shared by source and revision that hold ``source``, found as the docs
    say (the label, then the annotation)."""
    claims = _list(cluster, f"/api/v1/namespaces/{NS}/persistentvolumeclaims", "r3operator.io/model-cache")
    return [c for c in claims if c["metadata"]["annotations"]["r3operator.io/model-source"] == source]


def _mounted_claim(fetch: dict[str, Any]) -> str:
    [volume] = fetch["spec"]["template"]["spec"]["volumes"]
    return str(volume["persistentVolumeClaim"]["claimName"])


def test_a_kept_model_cache_is_reused_by_the_next_job_of_the_same_source_and_revision(cluster: Cluster) -> None:
    first, second, new_revision, throwaway = "kept-cache", "reuses-cache", "other-revision", "dropped-cache"
    with running_operator(cluster, NS):
        cluster.apply(small(first))
        first_fetch = _filled(cluster, first)
        claim = _mounted_claim(first_fetch)
        [kept] = _shared_claims(cluster, "hf://Qwen/Qwen3-30B-A3B@main")
        assert kept["metadata"]["name"] == claim and not kept["metadata"].get("ownerReferences")
        cluster.kubectl("delete", "rljob", first, "-n", NS, "--wait=true", "--timeout=60s")
        # The garbage collector takes what the RLJob owned (the fetch Job among them); the model copy stays.
        wait_for(lambda: _fetch_job(cluster, first) is None, timeout=60, what="the old fetch Job collected")
        still = _cache_claim(cluster, claim)
        assert still is not None and still["metadata"]["uid"] == kept["metadata"]["uid"]
        assert not still["metadata"].get("deletionTimestamp")

        # Another RLJob, same source and revision, names no claim: it finds the kept one (same PVC), its fetch
        # runs against it (`r3operator fetch` finds the verified copy there: tests/runtime/test_fetch.py).
        cluster.apply(small(second))
        fetch = _filled(cluster, second)
        assert _mounted_claim(fetch) == claim and fetch["metadata"]["uid"] != first_fetch["metadata"]["uid"]
        engines = wait_for(lambda: len(p := _engine_pods(cluster, second)) == 2 and p, timeout=60, what="engines")
        for pod in engines:
            [volume] = [v for v in pod["spec"]["volumes"] if v["name"] == "model"]
            assert volume["persistentVolumeClaim"]["claimName"] == claim
        [reused] = _shared_claims(cluster, "hf://Qwen/Qwen3-30B-A3B@main")
        assert reused["metadata"]["uid"] == kept["metadata"]["uid"]
        assert _cache_claim(cluster, f"{second}-model-cache") is None

        # Same source, another revision: another copy, in a claim of its own.
        cluster.apply(small(new_revision, **{"model.revision": "r2"}))
        other_claim = _mounted_claim(_filled(cluster, new_revision))
        [made] = _shared_claims(cluster, "hf://Qwen/Qwen3-30B-A3B@r2")
        assert made["metadata"]["name"] == other_claim != claim
        assert made["metadata"]["uid"] != kept["metadata"]["uid"]

        # retainPolicy Delete: the job's own claim, which goes with its RLJob.
        cluster.apply(small(throwaway, **{"model.cache": {"retainPolicy": "Delete"}}))
        assert _mounted_claim(_filled(cluster, throwaway)) == f"{throwaway}-model-cache"
        cluster.kubectl("delete", "rljob", throwaway, "-n", NS, "--wait=true", "--timeout=60s")
        wait_for(
            lambda: (
                (c := _cache_claim(cluster, f"{throwaway}-model-cache")) is None
                or bool(c["metadata"].get("deletionTimestamp"))
            ),
            timeout=60,
            what="the Delete-policy claim collected",
        )
        # Deleting the jobs that share a kept claim leaves it, with its copy.
        for job in (second, new_revision):
            cluster.kubectl("delete", "rljob", job, "-n", NS, "--wait=true", "--timeout=60s")
        for name, uid in ((claim, kept["metadata"]["uid"]), (other_claim, made["metadata"]["uid"])):
            left = _cache_claim(cluster, name)
            assert left is not None and left["metadata"]["uid"] == uid and not left["metadata"].get("deletionTimestamp")


def _uid(cluster: Cluster, job: str) -> str:
    return str(cluster.get(paths(NS, job)["rljob"])["metadata"]["uid"])


def _events(cluster: Cluster, job: str, reason: str) -> list[dict[str, Any]]:
    selector = f"involvedObject.name={job},reason={reason}"
    return (cluster.get(f"/api/v1/namespaces/{NS}/events?fieldSelector={selector}") or {}).get("items") or []


def test_a_kept_read_write_once_cache_is_reused_by_the_next_job_and_mounted_by_one_job_at_a_time(
    cluster: Cluster,
) -> None:
    first, second, third = "rwo-first", "rwo-second", "rwo-third"
    rwo = {"model.revision": "rwo", "model.cache": {"accessMode": "ReadWriteOnce"}}
    holder = "r3operator.io/model-cache-holder"
    with running_operator(cluster, NS):
        cluster.apply(small(first, **rwo))
        claim = _mounted_claim(_filled(cluster, first))
        kept = _cache_claim(cluster, claim)
        assert kept is not None and claim.endswith("-rwo") and kept["spec"]["accessModes"] == ["ReadWriteOnce"]
        assert kept["metadata"]["annotations"][holder] == f"{first}/{_uid(cluster, first)}"
        assert not kept["metadata"].get("ownerReferences")
        cluster.kubectl("delete", "rljob", first, "-n", NS, "--wait=true", "--timeout=60s")
        wait_for(lambda: _fetch_job(cluster, first) is None, timeout=60, what="the first fetch Job collected")

        # The next job of the same source and revision mounts the same claim (the same PVC), not one of its own.
        cluster.apply(small(second, **rwo))
        fetch = _filled(cluster, second)
        assert _mounted_claim(fetch) == claim and _cache_claim(cluster, f"{second}-model-cache") is None
        reused = _cache_claim(cluster, claim)
        assert reused is not None and reused["metadata"]["uid"] == kept["metadata"]["uid"]
        assert reused["metadata"]["annotations"][holder] == f"{second}/{_uid(cluster, second)}"
        engines = wait_for(lambda: len(p := _engine_pods(cluster, second)) == 2 and p, timeout=60, what="engines")
        assert all(
            v["persistentVolumeClaim"]["claimName"] == claim
            for pod in engines
            for v in pod["spec"]["volumes"]
            if v["name"] == "model"
        )
        [taken] = wait_for(lambda: _events(cluster, second, "ModelCacheTakenOver"), what="the takeover Event")
        assert f"RLJob/{first}" in taken["message"] and claim in taken["message"]

        # A third while the second lives: it waits, naming the holder, with nothing that mounts the claim...
        cluster.apply(small(third, **rwo))
        held = wait_for(
            lambda: (
                (c := condition(cluster.get(paths(NS, third)["rljob"]), "Progressing"))
                and c["reason"] == "ModelCacheHeld"
                and c
            ),
            timeout=60,
            what="Progressing=False ModelCacheHeld",
        )
        assert held["status"] == "False" and f"RLJob/{second}" in held["message"] and claim in held["message"]
        assert _fetch_job(cluster, third) is None
        assert cluster.get(paths(NS, third)["sts"])["spec"]["replicas"] == 0
        assert cluster.get(paths(NS, third)["rayjob"])["spec"]["suspend"] is True
        assert len(_events(cluster, third, "ModelCacheHeld")) == 1  # posted once, not on every pass
        # whenHeld: OwnClaim does not wait: it fetches into a claim of its own, and keeps it.
        own = "rwo-own"
        cluster.apply(small(own, **{**rwo, "model.cache": {"accessMode": "ReadWriteOnce", "whenHeld": "OwnClaim"}}))
        assert _mounted_claim(_filled(cluster, own)) == f"{own}-model-cache"
        wait_for(lambda: len(_engine_pods(cluster, own)) == 2, timeout=60, what="the OwnClaim job's engines")
        assert _fetch_job(cluster, third) is None
        # ...and goes on with the same copy once the holder is deleted.
        cluster.kubectl("delete", "rljob", second, "-n", NS, "--wait=true", "--timeout=60s")
        assert _mounted_claim(_filled(cluster, third)) == claim
        last = _cache_claim(cluster, claim)
        assert last is not None and last["metadata"]["uid"] == kept["metadata"]["uid"]
        assert last["metadata"]["annotations"][holder] == f"{third}/{_uid(cluster, third)}"
        wait_for(lambda: len(_engine_pods(cluster, third)) == 2, timeout=60, what="the third job's engines")
