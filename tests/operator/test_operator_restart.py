"""Operator lifecycle on the real control plane: KubeRay missing, restart without writes, a pass cut short.

Each scenario starts and stops its own real kopf operator (KopfRunner). "Writes" are read from the
apiserver's audit log, by user agent: the operator's own (r3operator/…, kopf/…), not the controllers'.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from kopf.testing import KopfRunner
from operator_harness import REPO, Cluster, condition, example, kopf_runner, operator_writes, paths, wait_for

from r3operator.api.load import parse_rljob
from r3operator.operator.desired import Facts, desired

NS = "rl"


@pytest.fixture(scope="module")
def ns(cluster: Cluster) -> Iterator[str]:
    cluster.namespace(NS)
    old = os.environ.get("KUBECONFIG")
    os.environ["KUBECONFIG"] = str(cluster.kubeconfig)
    yield NS
    if old is None:
        os.environ.pop("KUBECONFIG", None)
    else:
        os.environ["KUBECONFIG"] = old


def _run() -> KopfRunner:
    return kopf_runner([NS])


def _check(runner: KopfRunner) -> None:
    assert runner.exception is None, runner.output
    assert "Traceback" not in runner.output, runner.output[-4000:]


def _child_paths(job: str) -> set[str]:
    return {p for key, p in paths(NS, job).items() if key != "rljob"}


@pytest.fixture(scope="module")
def bare_cluster() -> Iterator[Cluster]:
    """A control plane of its own without KubeRay (the session's has it installed for good)."""
    from kubecluster.controlplane import Fleet, control_plane

    with control_plane(fleet=Fleet(nodes=2), with_kuberay=False) as plane:
        c = Cluster(plane)
        c.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
        plane.wait_established("rljobs.r3operator.io")
        yield c


def test_kuberay_missing_gives_valid_false_and_no_children_until_installed(bare_cluster: Cluster):
    cluster, job = bare_cluster, "no-kuberay"
    cluster.namespace(NS)
    old = os.environ.get("KUBECONFIG")
    os.environ["KUBECONFIG"] = str(cluster.kubeconfig)
    with _run() as runner:
        cluster.apply(example(job, NS))
        cond = wait_for(
            lambda: (c := condition(cluster.get(paths(NS, job)["rljob"]), "Valid")) and c["status"] == "False" and c,
            what="Valid=False",
        )
        assert cond["reason"] == "KubeRayMissing"
        assert all(cluster.get(p) is None for p in _child_paths(job) if "ray.io" not in p)
        # Installing KubeRay's CRDs later is enough: the next pass sees them and creates everything.
        cluster.kubectl("apply", "--server-side", "-f", str(cluster.api.bin_dir.parent / "crds"))
        # Discovery is cached for 15 s and the next pass comes from the resync timer: allow for both on a busy box.
        wait_for(
            lambda: all(cluster.get(p) for p in _child_paths(job)), timeout=60.0, what="children after KubeRay install"
        )
        wait_for(
            lambda: (c := condition(cluster.get(paths(NS, job)["rljob"]), "Valid")) and c["status"] == "True",
            what="Valid=True",
        )
    if old is None:
        os.environ.pop("KUBECONFIG", None)
    else:
        os.environ["KUBECONFIG"] = old
    _check(runner)


def test_restart_writes_nothing_and_a_pass_cut_short_converges_without_duplicates(cluster: Cluster, ns: str):
    stable, cut = "stable", "cut-short"
    with _run() as runner:
        cluster.apply(example(stable, NS))
        wait_for(lambda: all(cluster.get(p) for p in _child_paths(stable)), what="children of the stable job")
        wait_for(lambda: condition(cluster.get(paths(NS, stable)["rljob"]), "Valid"), what="status")
        # Running: the model-fetch Job has filled the cache and the engines are scaled up.
        wait_for(lambda: cluster.get(paths(NS, stable)["sts"])["spec"]["replicas"] > 0, what="stable engines up")
    _check(runner)

    # What an operator killed in the middle of its first pass leaves behind: the RLJob, and only the
    # first children of desired() (created exactly as the operator would have), no status.
    cluster.apply(example(cut, NS))
    body = cluster.get(paths(NS, cut)["rljob"])
    first = desired(parse_rljob(body), Facts(pod_monitor_crd=False))
    partial = [c for c in first if c["metadata"]["name"] in (f"{cut}-routing", f"{cut}-config")]
    assert [c["kind"] for c in partial] == ["PersistentVolumeClaim", "ConfigMap"]
    for child in partial:
        kind_path = paths(NS, cut)["pvc" if child["kind"] == "PersistentVolumeClaim" else "cm"]
        cluster.http("POST", kind_path.rsplit("/", 1)[0], child)
    partial_paths = {paths(NS, cut)["pvc"], paths(NS, cut)["cm"]}

    mark = len(cluster.requests())
    with _run() as runner:
        wait_for(lambda: all(cluster.get(p) for p in _child_paths(cut)), what="the cut-short job converged")
        wait_for(
            lambda: (c := condition(cluster.get(paths(NS, stable)["rljob"]), "Valid")) and c["status"] == "True",
            what="stable job seen again",
        )
        seen = len(cluster.requests())
        wait_for(lambda: len(cluster.requests()) > seen + 20, what="a few more passes")
    _check(runner)

    after = cluster.requests()[mark:]
    # The restart restarted nothing: not one write by the operator to any child of the running job.
    assert operator_writes(after, _child_paths(stable)) == []
    # The cut-short job: its two existing children untouched, the rest created once, no 409 anywhere.
    assert operator_writes(after, partial_paths) == []
    # The operator creates children with server-side apply: a patch that answers 201 Created.
    creates = [r for r in operator_writes(after) if r.code == 201 and "/events" not in r.path]
    assert creates and all(r.code != 409 for r in operator_writes(after)), creates
    # One of each; the job's own claim is the routing volume: the hf:// model's cache is the one claim of that
    # source and revision, which the stable job made and both mount. Two ConfigMaps: the runtime config and the
    # trainer's progress report.
    for plural, count in (("statefulsets", 1), ("services", 1), ("configmaps", 2), ("persistentvolumeclaims", 1)):
        group = "/apis/apps/v1" if plural == "statefulsets" else "/api/v1"
        items = cluster.get(f"{group}/namespaces/{NS}/{plural}?labelSelector=r3operator.io/job={cut}")["items"]
        assert len(items) == count, (plural, [i["metadata"]["name"] for i in items])
    caches = cluster.get(f"/api/v1/namespaces/{NS}/persistentvolumeclaims?labelSelector=r3operator.io/model-cache")
    assert len(caches["items"]) == 1, [i["metadata"]["name"] for i in caches["items"]]
    rayjobs = cluster.get(f"/apis/ray.io/v1/namespaces/{NS}/rayjobs?labelSelector=r3operator.io/job={cut}")
    assert len(rayjobs["items"]) == 1
