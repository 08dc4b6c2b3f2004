"""How many write round trips a pass waits for before its status, against an in-memory client whose writes take a
moment: a new RLJob's children go out in one round (none waits for another's answer), and the pass that sees the
RayJob's end writes the status one round after the end's record, which goes out beside the engines' scale-down.
No server, no kopf. The reference is the count of rounds, from the client's side: a round is the writes in flight
together, from none in flight to none again."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

from test_reconcile import NOW, FakeClient, _rljob

from r3operator.operator.kube import KINDS, Kind
from r3operator.operator.lifecycle import ANNOTATION_FINISHED
from r3operator.operator.reconcile import Reconciler


def _merge(have: dict[str, Any], want: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(have)
    for key, value in want.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return copy.deepcopy(out)


class WriteRoundClient(FakeClient):
    """FakeClient whose writes each take 10 ms; ``rounds`` holds (round, verb, kind, name) of every write."""

    def __init__(self) -> None:
        super().__init__()
        self.in_flight = 0
        self.round = 0
        self.rounds: list[tuple[int, str, str, str]] = []

    async def _write(self, what: tuple[str, str, str], answer: Any) -> Any:
        if self.in_flight == 0:
            self.round += 1
        self.rounds.append((self.round, *what))
        self.in_flight += 1
        try:
            await asyncio.sleep(0.01)
            return await answer
        finally:
            self.in_flight -= 1

    async def apply(self, obj: dict[str, Any], *, force: bool, field_manager: str = "r3operator") -> dict[str, Any]:
        """As server-side apply merges: a partial apply (``spec.replicas`` alone) keeps the rest of the object."""
        self.writes.append(("apply", obj["kind"], obj["metadata"]["name"]))
        key = (KINDS[obj["kind"]].plural, obj["metadata"].get("namespace"), obj["metadata"]["name"])

        async def merged() -> dict[str, Any]:
            return self.put(_merge(self.objects.get(key) or {}, self.precondition(obj)))

        result: dict[str, Any] = await self._write(("apply", obj["kind"], obj["metadata"]["name"]), merged())
        return result

    async def merge_patch(
        self, kind: Kind, namespace: str | None, name: str, patch: dict[str, Any], *, subresource: str | None = None
    ) -> dict[str, Any]:
        """A merge patch of the status (``/status``) or of the rest (the RLJob's annotations)."""
        verb = "patch" + (f"/{subresource}" if subresource else "")
        self.writes.append((verb, kind.plural, name))
        key = (kind.plural, namespace, name)
        fields = {k: v for k, v in patch.items() if (k == "status") == (subresource == "status")}

        async def merged() -> dict[str, Any]:
            return self.put(_merge(self.objects[key], fields))

        result: dict[str, Any] = await self._write((verb, kind.plural, name), merged())
        return result

    def take(self) -> list[tuple[int, str, str, str]]:
        """The writes since the last take, rounds counted from 1 again."""
        taken, first = self.rounds, (self.rounds[0][0] - 1 if self.rounds else 0)
        self.rounds = []
        return [(r - first, *rest) for r, *rest in taken]


def _pass(reconciler: Reconciler, client: FakeClient) -> None:
    asyncio.run(reconciler.reconcile(client.objects[("rljobs", "rl", "job")]))


def _fetched(client: FakeClient) -> None:
    fetch = next(o for (p, _, n), o in client.objects.items() if p == "jobs" and n.endswith("-model-fetch"))
    client.put({**fetch, "status": {"conditions": [{"type": "Complete", "status": "True"}]}})


def test_a_new_rljobs_children_are_written_in_one_round_trip_and_its_status_in_the_next():
    client = WriteRoundClient()
    client.put(_rljob())
    reconciler = Reconciler(client, clock=lambda: NOW)  # type: ignore[arg-type]
    _pass(reconciler, client)
    writes = client.take()
    children = [w for w in writes if w[1] == "apply"]
    kinds = {kind for _, _, kind, _ in children}
    # The pod makers and what their pods mount or run as, all in this first pass ...
    assert {"StatefulSet", "RayJob", "Job", "ConfigMap", "ServiceAccount", "PersistentVolumeClaim"} <= kinds, writes
    # ... sent before any of them was answered: round 1, not the pod makers after the others' answers.
    assert {r for r, *_ in children} == {1}, writes
    assert [(r, verb) for r, verb, _, _ in writes if verb == "patch/status"] == [(2, "patch/status")], writes


def test_the_pass_that_sees_the_rayjob_fail_writes_the_end_record_beside_the_scale_down_and_then_the_status():
    client = WriteRoundClient()
    client.put(_rljob())
    reconciler = Reconciler(client, clock=lambda: NOW)  # type: ignore[arg-type]
    _pass(reconciler, client)
    _fetched(client)
    _pass(reconciler, client)  # the model is there: the engines scale up
    engines = next(o for (p, _, _), o in client.objects.items() if p == "statefulsets")
    assert engines["spec"]["replicas"] >= 1
    ray_job = next(o for (p, _, _), o in client.objects.items() if p == "rayjobs")
    client.put({**ray_job, "status": {"jobDeploymentStatus": "Failed", "jobStatus": "FAILED"}})
    client.take()
    _pass(reconciler, client)
    writes = client.take()
    record = [(r, verb) for r, verb, kind, _ in writes if (verb, kind) == ("patch", "rljobs")]
    scale = [r for r, verb, kind, _ in writes if (verb, kind) == ("apply", "StatefulSet")]
    status = [r for r, verb, _, _ in writes if verb == "patch/status"]
    assert record == [(1, "patch")] and scale == [1], writes  # together, not the scale-down after the record
    assert status == [2], writes
    rljob = client.objects[("rljobs", "rl", "job")]
    assert ANNOTATION_FINISHED in rljob["metadata"].get("annotations", {}), rljob["metadata"]
    failed = next(c for c in rljob["status"]["conditions"] if c["type"] == "Failed")
    assert failed["status"] == "True", rljob["status"]
