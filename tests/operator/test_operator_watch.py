"""The operator reacts to its children's changes from watches, not a timer, on the real control plane.

The operator runs as its own process (``r3operator operator``) with a resync of 10 minutes, so anything
that happens within a test's seconds was caused by a watch event: a child deleted or edited by hand, the
RayJob finishing, the API server restarting under the watches, edits made while the operator was down. At
rest it makes no request at all but its watches. The informer's relist after a 410 Gone is driven against
the real API server too (a watch from resourceVersion 1, long compacted out of its watch cache).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from operator_harness import WRITE_VERBS, Cluster, OperatorProcess, all_children, condition, example, paths, wait_for

from r3operator.operator.informer import ChildCache
from r3operator.operator.kube import KubeClient

NS = "rl-watch"
RESYNC_S = "600"
REACT_S = 10.0
"""Seconds a test allows for a reaction (the target is one; the 2-core CI box is shared with the control
plane); the resync is sixty times longer."""


def _start(cluster: Cluster) -> OperatorProcess:
    return OperatorProcess(cluster, NS, "--liveness", "", env={"R3OPERATOR_RESYNC_SECONDS": RESYNC_S})


def _stop(op: OperatorProcess) -> None:
    op.stop()
    assert "Traceback" not in op.log(), op.log(80)


@pytest.fixture
def operator(cluster: Cluster) -> Iterator[OperatorProcess]:
    cluster.namespace(NS)
    op = _start(cluster)
    yield op
    _stop(op)


def _operator_requests(cluster: Cluster, since: int) -> list[Any]:
    """The operator's requests after ``since`` (audit log), its long-running watches left out, and so are the
    lists of the kinds this cluster does not serve (LeaderWorkerSet, PodMonitor, Kueue Workload: answered 404,
    tried again every 30 s whatever the number of RLJobs, so that an installed CRD is picked up)."""
    return _by_operator(cluster.requests()[since:])


def _by_operator(records: list[Any]) -> list[Any]:
    """``_operator_requests`` of these records."""
    return [
        r
        for r in records
        if r.user_agent.startswith(("r3operator/", "kopf/"))
        and r.verb != "watch"
        and "/leases/" not in r.path
        and not (r.verb == "list" and r.code == 404)
    ]


@dataclass(frozen=True)
class Window:
    operator: list[Any]
    """The operator's requests in the window (``_operator_requests``)."""


def _quiet_window(
    cluster: Cluster,
    seconds: float,
    *,
    timeout: float,
    what: str,
    lead: float = 5.0,
    require_silent_operator: bool = False,
) -> Window:
    """The first window of ``seconds``, after a ``lead``, in which nobody but the operator wrote in ``NS`` (a
    write by anyone else means something changed, so the operator's requests may be its reaction, not a poll;
    the lead covers a reaction to a write made just before the window). The audit log is read every second: a
    write by anyone else starts the lead again from that reading, rather than after a whole window. The window
    runs from the first reading at least ``lead`` after the start to the first at least ``seconds`` after that.
    ``require_silent_operator``: the operator's requests in the window (it is still finishing a reaction) also
    start the lead again. Fails after ``timeout`` seconds without such a window."""
    deadline = time.monotonic() + timeout
    started, start = time.monotonic(), len(cluster.requests())
    mark: tuple[float, int] | None = None
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now, records = time.monotonic(), cluster.requests()
        others = [
            r
            for r in records[start:]
            if r.verb in WRITE_VERBS
            and f"/namespaces/{NS}/" in r.path
            and not r.user_agent.startswith(("r3operator/", "kopf/"))
        ]
        window = Window(operator=_by_operator(records[mark[1] :])) if mark is not None else None
        if others or (require_silent_operator and window is not None and window.operator):
            started, start, mark = now, len(records), None
            continue
        if mark is None:
            if now - started >= lead:
                mark = (now, len(records))
        elif now - mark[0] >= seconds:
            assert window is not None
            return window
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _uid(obj: dict[str, Any] | None) -> str:
    return str(((obj or {}).get("metadata") or {}).get("uid") or "")


def test_child_changes_reach_the_rljob_within_seconds_and_nothing_is_read_at_rest(
    cluster: Cluster, operator: OperatorProcess
) -> None:
    job = "watched"
    p = paths(NS, job)
    cluster.apply(example(job, NS))
    kids = all_children(cluster, NS, job)
    wait_for(lambda: condition(cluster.get(p["rljob"]), "Valid"), timeout=60, what=f"status\n{operator.log(80)}")

    # At rest: in a window in which nobody else wrote anything in the namespace (kwok and the controllers
    # settle the children for a while after the create, and each change they make is a watch event the
    # operator rightly reacts to), the operator sends nothing but its open watches.
    at_rest = _quiet_window(cluster, 10.0, timeout=180, what="a window nobody else wrote in")
    assert at_rest.operator == [], at_rest.operator

    # A child deleted by hand comes back, a hand edit of a field the operator sets is taken back.
    cluster.kubectl("delete", "configmap", f"{job}-config", "-n", NS)
    healed = wait_for(
        lambda: (cm := cluster.get(p["cm"])) and _uid(cm) != _uid(kids["cm"]) and cm,
        timeout=REACT_S,
        what="the ConfigMap re-created",
    )
    assert healed["data"] == kids["cm"]["data"]
    _quiet_window(
        cluster, 5.0, require_silent_operator=True, timeout=60, what="the operator at rest after the re-create"
    )
    mark = len(cluster.requests())
    patch = {"spec": {"template": {"spec": {"containers": [{"name": "vllm", "image": "example.com/edited:1"}]}}}}
    cluster.http("PATCH", p["sts"], patch, "application/strategic-merge-patch+json")
    want = kids["sts"]["spec"]["template"]["spec"]["containers"][0]["image"]
    wait_for(
        lambda: cluster.get(p["sts"])["spec"]["template"]["spec"]["containers"][0]["image"] == want,
        timeout=REACT_S,
        what="the engine image taken back",
    )
    # The passes that took it back read the RLJob from kopf's watch and the StatefulSet from the cache: no GET
    # of either (a GET is left only for a name the cache holds nothing under: the canary Job the edited image
    # starts, which someone else's object could hold).
    time.sleep(2)
    sent = _operator_requests(cluster, mark)
    gets = [r.path for r in sent if r.verb == "get" and r.path.split("?")[0] in (p["rljob"], p["sts"])]
    assert gets == [], [(r.verb, r.path) for r in sent]
    assert any(r.verb == "patch" and r.path.startswith(p["sts"]) for r in sent)

    # The RayJob finishing (the status KubeRay would write; KubeRay paused so it does not overwrite it).
    with cluster.api.paused("kuberay-operator"):
        started = time.monotonic()
        cluster.patch_status(p["rayjob"], {"jobStatus": "SUCCEEDED", "jobDeploymentStatus": "Complete"})
        wait_for(
            lambda: (c := condition(cluster.get(p["rljob"]), "Succeeded")) and c["status"] == "True",
            timeout=REACT_S,
            what=f"Succeeded=True\n{operator.log(80)}",
        )
        assert time.monotonic() - started < REACT_S


def test_watches_survive_an_api_server_restart_and_edits_made_while_the_operator_was_down(
    cluster: Cluster, operator: OperatorProcess
) -> None:
    job = "survivor"
    p = paths(NS, job)
    cluster.apply(example(job, NS))
    kids = all_children(cluster, NS, job)

    # The API server restarts: every watch breaks; the operator lists again and keeps reacting.
    cluster.api.restart_apiserver()
    cluster.kubectl("delete", "service", f"{job}-engine", "-n", NS)
    wait_for(
        lambda: _uid(cluster.get(p["svc"])) not in ("", _uid(kids["svc"])),
        timeout=4 * REACT_S,
        what=f"the Service re-created after the restart\n{operator.log(80)}",
    )

    # Down: a child deleted, another edited. Up again: both converge, nothing duplicated.
    _stop(operator)
    cluster.kubectl("delete", "networkpolicy", f"{job}-engine", "-n", NS)
    cluster.http("PATCH", p["cm"], {"data": {"edited": "by hand"}}, "application/merge-patch+json")
    cm_data = kids["cm"]["data"]
    restarted = _start(cluster)
    try:
        wait_for(lambda: cluster.get(p["np"]) is not None, timeout=60, what=f"NetworkPolicy\n{restarted.log(80)}")
        # The hand-added key is not ours (server-side apply leaves it); every key we set is as we set it.
        wait_for(
            lambda: all(cluster.get(p["cm"])["data"].get(k) == v for k, v in cm_data.items()),
            timeout=60,
            what="the ConfigMap as the operator set it",
        )
        items = cluster.get(f"/apis/apps/v1/namespaces/{NS}/statefulsets?labelSelector=r3operator.io/job={job}")
        assert len(items["items"]) == 1
    finally:
        _stop(restarted)


def test_the_informer_lists_again_after_410_gone_and_drops_what_vanished(cluster: Cluster) -> None:
    """A watch from a version the API server no longer holds (what a long outage or compaction leaves) is
    answered 410 Gone; the informer lists again, replaces its store and wakes the owners of what changed."""
    cluster.namespace(NS)
    cm = lambda name, job: {"metadata": {"name": name, "namespace": NS, "labels": {"r3operator.io/job": job}}}  # noqa: E731
    base = f"/api/v1/namespaces/{NS}/configmaps"
    for name in ("gone-a", "gone-b", "kept-c"):
        if cluster.get(f"{base}/{name}") is not None:
            cluster.http("DELETE", f"{base}/{name}")
    cluster.http("POST", base, cm("kept-c", "job-c"))

    async def scenario() -> tuple[list[tuple[str, str]], list[str], set[str]]:
        from kubecluster.controlplane import ControlPlane

        plane: ControlPlane = cluster.api
        auth = {"Authorization": f"Bearer {plane.admin_token}"}
        client = KubeClient(plane.url, headers=auth, ssl_context=plane.ssl_context())
        woken: list[tuple[str, str]] = []
        lists: list[str] = []
        real_list = client.list_with_version

        async def listing(*args: Any, **kwargs: Any) -> tuple[list[dict[str, Any]], str]:
            items, version = await real_list(*args, **kwargs)
            lists.append(version)
            # The first list's objects, as if they had been seen long ago: its version is long compacted.
            if len(lists) > 1:
                return items, version
            return [*items, cm("gone-a", "job-a"), cm("gone-b", "job-b")], "1"

        client.list_with_version = listing  # type: ignore[method-assign]
        cache = ChildCache(client, woken.append, kinds=("ConfigMap",), watch_timeout_s=30)
        cache.watch_namespace(NS)
        try:
            for _ in range(200):
                if len(lists) >= 2:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.2)
            held = cache.of_job("ConfigMap", NS, "job-c")
            names = {o["metadata"]["name"] for o in held} if isinstance(held, list) else set()
            gone = {n for n in ("gone-a", "gone-b") if cache.lookup("ConfigMap", NS, n) is not None}
        finally:
            await cache.close()
            await client.close()
        return woken, lists, names | gone

    woken, lists, held = asyncio.run(scenario())
    assert len(lists) >= 2, "no second list after the 410"
    assert held == {"kept-c"}, held
    assert (NS, "job-a") in woken and (NS, "job-b") in woken
