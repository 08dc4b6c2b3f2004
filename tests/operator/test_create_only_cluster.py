"""A new child is created by a create-only server-side apply (apply.create_only), on the real control plane.

The reference is the API server itself: what it stores (managedFields, data), what it refuses (409), and its
audit log (which requests the operator sent).

- the API: a create-only apply makes the object with an ``Apply`` entry of ``r3operator`` and is refused (409,
  nothing written) when anything is under the name, ours or not; a later apply owns and drops fields as usual.
  A plain create (POST) would not do: its fields belong to an ``Update`` entry, which a later apply shares
  them with, so a field the render drops stays;
- the operator: a new RLJob's children are created without a read of their names; a scale change and an engine
  image upgrade of those children converge, with no conflict, only ``Apply`` entries of the operator, and no
  write at rest.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from canary_ending import canary_verdict, end_canary
from operator_harness import (
    WRITE_VERBS,
    Cluster,
    all_children,
    example,
    operator_writes,
    paths,
    running_operator,
    wait_condition,
    wait_for,
)

from r3operator.operator.apply import create_only
from r3operator.operator.kube import KubeError

NS = "create-only"
OLD, NEW = (f"ghcr.io/r3operator/engine:0.{i}.0-vllm0.22.1" for i in (1, 2))


def _config_map(name: str, data: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "namespace": NS}, "data": data}


def _entries(obj: dict[str, Any]) -> list[tuple[str, str]]:
    return sorted((e["manager"], e["operation"]) for e in obj["metadata"].get("managedFields") or [])


def test_a_create_only_apply_creates_with_an_apply_entry_and_refuses_whatever_holds_the_name(cluster: Cluster) -> None:
    cluster.namespace(NS)
    base = f"/api/v1/namespaces/{NS}/configmaps"
    for name in ("made", "theirs", "posted"):
        if cluster.get(f"{base}/{name}") is not None:
            cluster.http("DELETE", f"{base}/{name}")
    cluster.kubectl("create", "configmap", "theirs", "-n", NS, "--from-literal=x=1")
    theirs = cluster.get(f"{base}/theirs")

    async def scenario() -> dict[str, Any]:
        client = cluster.client()
        refused: dict[str, int] = {}
        try:
            made = await client.apply(create_only(_config_map("made", {"a": "1", "b": "2"})), force=False)
            # Ours, or someone else's with no field in common (an apply without the precondition would merge
            # into it, adding our fields and, for a child, our controller reference): refused, nothing written.
            for name in ("made", "theirs"):
                try:
                    await client.apply(create_only(_config_map(name, {"a": "9"})), force=False)
                except KubeError as exc:
                    refused[name] = exc.status
            # Later applies own the fields as before: one the next render leaves out is removed.
            later = await client.apply(_config_map("made", {"a": "1"}), force=True)
            # A plain create, for the contrast: the same manager's Update entry keeps "b" through the apply.
            posted = await client.request(
                "POST", f"{base}?fieldManager=r3operator", _config_map("posted", {"a": "1", "b": "2"})
            )
            posted_later = await client.apply(_config_map("posted", {"a": "1"}), force=True)
        finally:
            await client.close()
        return {"made": made, "refused": refused, "later": later, "posted": posted, "posted_later": posted_later}

    got = asyncio.run(scenario())
    made = got["made"]
    assert made["data"] == {"a": "1", "b": "2"} and _entries(made) == [("r3operator", "Apply")]
    assert made["metadata"]["resourceVersion"] != "1"  # the precondition is not stored
    assert got["refused"] == {"made": 409, "theirs": 409}
    assert cluster.get(f"{base}/theirs") == theirs  # untouched: same resourceVersion, data, managers
    assert got["later"]["data"] == {"a": "1"} and _entries(got["later"]) == [("r3operator", "Apply")]
    assert _entries(got["posted"]) == [("r3operator", "Update")]
    assert got["posted_later"]["data"] == {"a": "1", "b": "2"}, "the POST's Update entry still owns b"
    assert _entries(got["posted_later"]) == [("r3operator", "Apply"), ("r3operator", "Update")]


def _upgrade(cluster: Cluster, job: str) -> dict[str, Any]:
    return ((cluster.get(paths(NS, job)["rljob"]) or {}).get("status") or {}).get("upgrade") or {}


def _at_rest(cluster: Cluster, seconds: float) -> tuple[list[Any]] | None:
    """The operator's writes in a window of ``seconds`` in which nobody else wrote in the namespace (None if
    someone did: kwok and the controllers settle pods for a while, and the operator rightly reacts)."""
    start = len(cluster.requests())
    time.sleep(seconds)
    window = cluster.requests()[start:]
    ours = operator_writes(window)
    others = [r for r in window if r.verb in WRITE_VERBS and f"/namespaces/{NS}/" in r.path and r not in ours]
    return None if others else (ours,)


def _only_apply_entries(cluster: Cluster, job: str) -> dict[str, list[tuple[str, str]]]:
    """Each child's managedFields entries of the operator's managers that are not an Apply, and a child without
    an Apply entry of ``r3operator`` (an empty dict: every child as a create-only apply leaves it)."""
    bad = {}
    for key, obj in all_children(cluster, NS, job).items():
        ours = [e for e in _entries(obj) if e[0].startswith("r3operator")]
        if ("r3operator", "Apply") not in ours or any(op != "Apply" for _, op in ours):
            bad[key] = ours
    return bad


def test_children_made_by_create_only_take_a_scale_change_and_an_image_upgrade_with_no_conflict(
    cluster: Cluster,
) -> None:
    job = "made"
    p = paths(NS, job)
    with running_operator(cluster, NS):
        mark = len(cluster.requests())
        cluster.apply(example(job, NS, **{"inference.image": OLD, "inference.replicas": 1}))
        wait_condition(cluster, NS, job, "EnginesReady", "True")
        # Created without a read of their names: no GET of a child by the operator.
        child_paths = {path for key, path in p.items() if key != "rljob"}
        sent = [r for r in cluster.requests()[mark:] if r.user_agent.startswith("r3operator/")]
        assert [r.path for r in sent if r.verb == "get" and r.path.split("?")[0] in child_paths] == []
        assert _only_apply_entries(cluster, job) == {}

        # A scale change: spec.replicas through the scale manager.
        cluster.kubectl("-n", NS, "patch", "rlj", job, "--type=merge", "-p", '{"spec":{"inference":{"replicas":2}}}')
        wait_for(lambda: cluster.get(p["sts"])["spec"]["replicas"] == 2, what="two engine replicas")
        wait_condition(cluster, NS, job, "EnginesReady", "True")

        # An engine image upgrade: the whole StatefulSet applied again (the template, a partition), then rolled.
        image = f'{{"spec":{{"inference":{{"image":"{NEW}"}}}}}}'
        cluster.kubectl("-n", NS, "patch", "rlj", job, "--type=merge", "-p", image)
        upgrade = wait_for(
            lambda: (u := _upgrade(cluster, job)).get("phase") == "Canary" and u, timeout=60, what="the canary"
        )
        wait_for(lambda: _upgrade(cluster, job).get("canaryStartedAt"), what="the canary's clock")
        end_canary(cluster, NS, job, canary_verdict(upgrade["attempt"], OLD, NEW))
        wait_for(lambda: _upgrade(cluster, job).get("phase") == "Complete", timeout=120, what="the upgrade complete")
        sts = cluster.get(p["sts"])
        assert sts["spec"]["template"]["spec"]["containers"][0]["image"] == NEW and sts["spec"]["replicas"] == 2

        # Nothing refused along the way, and the operator's fields still belong to its Apply entries only.
        refused = [(r.verb, r.path, r.code) for r in operator_writes(cluster.requests()[mark:]) if r.code == 409]
        assert refused == []
        assert _only_apply_entries(cluster, job) == {}

        # At rest (the harness's resync is 1 s: a pass every second), the operator writes nothing. The first quiet
        # window may still hold its reaction to the rollout's end (the new engines' status, the R3 canary run
        # against them): once it has been silent for 5 s, the next 10 s with nobody else writing hold no write.
        wait_for(lambda: (w := _at_rest(cluster, 5.0)) is not None and w[0] == [], timeout=120, what="a silent window")
        (writes,) = wait_for(lambda: _at_rest(cluster, 10.0), timeout=120, what="a window nobody else wrote in")
        assert writes == []
