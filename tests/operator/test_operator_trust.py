"""Trust boundaries, end to end: the real kopf operator against the real control plane, driven with kubectl.

What others may write (the RLJob status, objects under a child's name, keys in our children, a
hand-edited image) must never make the operator destroy, take over or loop; a job's trainer may
write its own progress report and nothing of any RLJob (issue #45: test_ownership_cluster.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from kopf.testing import KopfRunner
from operator_harness import (
    Cluster,
    all_children,
    children,
    example,
    paths,
    running_operator,
    wait_condition,
    wait_for,
    wait_passes,
)

NS = "trust"


@pytest.fixture(scope="module")
def operator(cluster: Cluster) -> Iterator[KopfRunner]:
    with running_operator(cluster, NS) as runner:
        yield runner


def _children(cluster: Cluster, job: str) -> dict[str, dict[str, Any] | None]:
    return children(cluster, NS, job)


def _all_children(cluster: Cluster, job: str) -> dict[str, dict[str, Any]]:
    return all_children(cluster, NS, job)


def _cond(cluster: Cluster, job: str, ctype: str, status: str, reason: str | None = None) -> dict[str, Any]:
    return wait_condition(cluster, NS, job, ctype, status, reason)


def _passes(cluster: Cluster, job: str, n: int) -> None:
    """Wait for n more reconcile passes of the job."""
    wait_passes(NS, job, n)


def _events(cluster: Cluster, job: str, reason: str) -> list[dict[str, Any]]:
    items = cluster.get(f"/api/v1/namespaces/{NS}/events")["items"]
    return [e for e in items if e["involvedObject"]["name"] == job and e["reason"] == reason]


def _operator_writes(cluster: Cluster, name_prefix: str) -> list[Any]:
    """Writes to objects named ``<name_prefix>…`` other than RLJobs, by anyone but kubectl (the tests)."""
    return [
        r
        for r in cluster.requests()
        if r.method in ("PATCH", "PUT", "POST", "DELETE")
        and f"/{name_prefix}" in r.path
        and "/rljobs/" not in r.path
        and not r.user_agent.startswith("kubectl")
    ]


def test_a_forged_terminal_status_deletes_nothing_and_is_overwritten(cluster: Cluster, operator: KopfRunner):
    job = "forged"
    cluster.apply(example(job, NS, **{"runPolicy.ttlSecondsAfterFinished": 0, "storage.retainPolicy": "Delete"}))
    _all_children(cluster, job)
    # The engines scale up once the model-fetch Job has filled the model cache (kwok completes its pod).
    wait_for(lambda: cluster.get(paths(NS, job)["sts"])["spec"]["replicas"] > 0, what="engines scaled up")
    before = _all_children(cluster, job)
    cluster.patch_status(paths(NS, job)["rayjob"], {"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"})
    _cond(cluster, job, "TrainerReady", "True")
    forged = {
        "type": "Succeeded",
        "status": "True",
        "reason": "TrainerSucceeded",
        "message": "forged",
        "lastTransitionTime": "2020-01-01T00:00:00Z",
    }
    rljob = cluster.get(paths(NS, job)["rljob"])
    others = [c for c in rljob["status"]["conditions"] if c["type"] != "Succeeded"]
    cluster.patch_status(
        paths(NS, job)["rljob"], {"conditions": [*others, forged], "completionTime": "2020-01-01T00:00:00Z"}
    )
    _passes(cluster, job, 3)
    after = _children(cluster, job)
    for kind, obj in before.items():
        assert after[kind] is not None and after[kind]["metadata"]["uid"] == obj["metadata"]["uid"], kind
    assert after["sts"]["spec"]["replicas"] == before["sts"]["spec"]["replicas"]  # engines not stopped
    assert not [r for r in _operator_writes(cluster, f"{job}-") if r.method == "DELETE"]
    # The status is output: the operator writes back what it observes.
    _cond(cluster, job, "Succeeded", "False", "NotFinished")
    assert "completionTime" not in cluster.get(paths(NS, job)["rljob"])["status"]


def test_names_held_by_foreign_objects_are_reported_and_never_touched(cluster: Cluster, operator: KopfRunner):
    job = "team"
    cluster.namespace(NS)
    foreign = [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": f"{job}-trainer", "namespace": NS},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "admin"},
            "subjects": [{"kind": "User", "name": "alice", "apiGroup": "rbac.authorization.k8s.io"}],
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": f"{job}-engine", "namespace": NS},
            "spec": {"ports": [{"port": 80}], "selector": {"app": "theirs"}},
        },
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": f"{job}-config", "namespace": NS},
            "data": {"theirs": "1"},
        },
    ]
    for obj in foreign:
        cluster.apply(obj)
    theirs = {key: cluster.get(paths(NS, job)[key]) for key in ("rb", "svc", "cm")}
    cluster.apply(example(job, NS))
    cond = _cond(cluster, job, "Valid", "False", "NameConflict")
    for held in ("ConfigMap/team-config", "Service/team-engine", "RoleBinding/team-trainer"):
        assert held in cond["message"]  # every name held, not only the first
    assert _cond(cluster, job, "Ready", "False")["reason"] == "NameConflict"
    _passes(cluster, job, 3)
    (event,) = _events(cluster, job, "NameConflict")
    assert event["source"]["component"] == event["reportingComponent"] == "r3operator"  # `From:` in describe
    for key, obj in theirs.items():
        assert cluster.get(paths(NS, job)[key])["metadata"]["resourceVersion"] == obj["metadata"]["resourceVersion"]
    # The first pass's creates go out without a read (reconcile.py, create-only): the API server refuses those under
    # the held names (409), and the pass deletes what it created beside them; no later pass writes a child.
    writes = _operator_writes(cluster, f"{job}-")
    held = {paths(NS, job)[key] for key in theirs}
    assert {r.code for r in writes if r.path.split("?")[0] in held} <= {409}, writes
    created = [r for r in writes if r.verb == "patch" and r.code < 400 and r.user_agent.startswith("r3operator/")]
    deleted = {r.path for r in writes if r.verb == "delete"}
    assert {r.path.split("?")[0] for r in created} <= deleted, writes
    _passes(cluster, job, 3)
    assert _operator_writes(cluster, f"{job}-") == writes, "a later pass writes nothing under the child names"
    assert cluster.get(paths(NS, job)["sts"]) is None and cluster.get(paths(NS, job)["pvc"]) is None


def test_foreign_keys_cause_no_write_loop_and_a_hand_edited_image_is_reverted(cluster: Cluster, operator: KopfRunner):
    job = "drift"
    cluster.apply(example(job, NS))
    kids = _all_children(cluster, job)
    cm_path, sts_path = paths(NS, job)["cm"], paths(NS, job)["sts"]
    cluster.http(
        "PATCH",
        cm_path,
        {"data": {"stray.json": "{}"}, "metadata": {"annotations": {"team/note": "x"}}},
        "application/merge-patch+json",
    )
    patched_rv = cluster.get(cm_path)["metadata"]["resourceVersion"]
    _passes(cluster, job, 3)
    cm = cluster.get(cm_path)
    assert cm["metadata"]["resourceVersion"] == patched_rv  # compared on our fields: no write, no loop
    assert cm["data"]["stray.json"] == "{}" and cm["data"]["config.json"] == kids["cm"]["data"]["config.json"]

    image = kids["sts"]["spec"]["template"]["spec"]["containers"][0]["image"]
    cluster.kubectl("set", "image", f"statefulset/{job}-engine", "vllm=attacker/vllm:evil", "-n", NS)
    wait_for(
        lambda: cluster.get(sts_path)["spec"]["template"]["spec"]["containers"][0]["image"] == image,
        what="the engine image taken back",
    )


def test_a_missing_existing_claim_is_reported_before_any_pod_would_mount_it(cluster: Cluster, operator: KopfRunner):
    job = "byo"
    cluster.apply(example(job, NS, **{"storage.existingClaim": "byo-data"}))
    cond = _cond(cluster, job, "Valid", "False", "ClaimNotFound")
    assert "PersistentVolumeClaim/byo-data" in cond["message"]
    _passes(cluster, job, 2)
    assert cluster.get(paths(NS, job)["sts"]) is None
    spec = {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}}
    cluster.apply(
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": "byo-data", "namespace": NS},
            "spec": spec,
        }
    )
    _cond(cluster, job, "Valid", "True", "SpecValid")
    sts = wait_for(lambda: cluster.get(paths(NS, job)["sts"]), what="engines created once the claim exists")
    mount = next(m for m in sts["spec"]["template"]["spec"]["containers"][0]["volumeMounts"] if m["name"] == "routing")
    assert mount["readOnly"] is True


@pytest.mark.parametrize(
    ("name", "refused_because"),
    [("1job", "DNS-1035"), ("my.job", "DNS-1035"), ("a" * 40, "at most 39 characters")],
)
def test_names_that_cannot_make_every_child_are_refused_by_kubectl_apply(
    cluster: Cluster, operator: KopfRunner, name: str, refused_because: str
):
    result = cluster.apply(example(name, NS), check=False)
    assert result.returncode != 0 and refused_because in result.stderr, result.stderr


def test_a_jobs_trainer_may_write_only_its_own_progress_report(cluster: Cluster, operator: KopfRunner):
    for job in ("rbac-a", "rbac-b"):
        cluster.apply(example(job, NS))
        _all_children(cluster, job)

    def can(verb: str, target: str, trainer_of: str, *extra: str) -> str:
        who = f"system:serviceaccount:{NS}:{trainer_of}-trainer"
        result = cluster.kubectl("auth", "can-i", verb, target, *extra, "-n", NS, f"--as={who}", check=False)
        return result.stdout.strip()

    if can("patch", "configmaps/rbac-a-progress", "rbac-a") not in ("yes", "no"):
        pytest.skip("this API server does not answer SelfSubjectAccessReviews (no RBAC)")
    assert can("patch", "configmaps/rbac-a-progress", "rbac-a") == "yes"
    assert can("patch", "configmaps/rbac-b-progress", "rbac-a") == "no"
    assert can("patch", "configmaps/rbac-a-config", "rbac-a") == "no"  # the runtime config is the operator's
    assert can("patch", "rljobs.r3operator.io/rbac-a", "rbac-a", "--subresource=status") == "no"
    assert can("patch", "rljobs.r3operator.io/rbac-a", "rbac-a") == "no"  # the spec is the author's
    assert can("delete", "rljobs.r3operator.io/rbac-a", "rbac-a") == "no"
