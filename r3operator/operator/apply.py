"""The diff step: for one desired child and what exists under its name, the single write (if any).

Ownership first. The operator writes only objects it controls: a controller ownerReference to this
RLJob (by uid), or, for a ``Retain`` claim, which has no ownerReference, the
``r3operator.io/retained-from-uid`` annotation with this job's label, or, for a model cache claim shared by
source and revision, its ``r3operator.io/model-cache`` label. Anything else under a child's
name is someone else's: the verdict is ``conflict`` and the reconciler touches nothing.

Writes are server-side apply with the field manager ``r3operator`` (``kube.FIELD_MANAGER``). The
comparison is on the fields we set (``is_subset``): keys, labels and annotations that others add
never make an object look different, so they never cause a write, and the apply leaves them alone.
A field we set that someone changed (an image edited by hand) is taken back with ``force``. Nothing known under
a child's name (the cache holds no labelled object there, which it cannot for someone else's) means a
create-only apply (``create_only``): refused by the server when the name is taken after all.

Rules per kind:
- StatefulSet: the whole object is applied when the pod template's spec-hash annotation differs, or
  when a container's ``image``/``command``/``args`` drifted from ours. Hashes cover spec fields, not
  the rendering, so an operator upgrade that renders the template differently rolls no pod unless it
  changes an engine's image or command line. ``replicas`` alone goes through its own field manager,
  so scaling never rewrites the template.
- RayJob: a different spec hash means delete-and-recreate (KubeRay fixes a RayJob's cluster per
  run); a container image edited by hand is applied back in place; ``suspend`` alone goes through its own
  field manager.
- PVC: the spec is immutable, so the apply carries the spec as it is; only labels, annotations and
  the ownerReference follow the RLJob (``retainPolicy``).
- RoleBinding: ``roleRef`` is immutable: a different one means delete-and-recreate.
- Workload (Kueue): a different spec hash (pod sets, queue, priority) means delete-and-recreate; the
  status is Kueue's and the job controller's (operator/admission.py), never applied.
- Job (the model fetch): a different spec hash means delete-and-recreate. Until it completes, a different
  pod hash (its pod customisation) is a recreate too, and ``suspend`` alone goes through its own field
  manager (Kueue admission, ``runPolicy.suspend``); a completed one is left alone.
- Everything else: the whole object is applied when a field we set differs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from r3operator.operator import meta
from r3operator.operator.kube import FIELD_MANAGER

SCALE_MANAGER = f"{FIELD_MANAGER}-scale"
"""Field manager of ``spec.replicas`` (StatefulSet) and ``spec.suspend`` (RayJob) alone: a partial
apply under the main manager would remove every other field that manager applied before."""

Verb = Literal["apply", "recreate", "none", "conflict"]


@dataclass(frozen=True, slots=True)
class Action:
    verb: Verb
    body: dict[str, Any] | None = None
    """The apply configuration (a whole object, or the few fields of ``manager``)."""
    force: bool = False
    manager: str = FIELD_MANAGER
    why: str = ""
    create: bool = False
    """Nothing is known under the name: create it, only if nothing is there (``create_only``); refused with
    409 when anything is, which the reconciler then reads and plans again."""


def is_subset(want: Any, have: Any) -> bool:
    """Every field set in ``want`` has the same value in ``have`` (extra server-set fields allowed)."""
    if isinstance(want, dict):
        return isinstance(have, dict) and all(is_subset(v, have.get(k)) for k, v in want.items())
    if isinstance(want, list):
        return isinstance(have, list) and len(want) == len(have) and all(map(is_subset, want, have))
    return want == have


def is_ours(have: dict[str, Any], job_uid: str | None) -> bool:
    """Controlled by this RLJob, a Retain claim an RLJob of this name created, or a model cache claim shared by
    source and revision (builders/model_cache.py), which no RLJob controls and any of that model uses."""
    controller = meta.controller_uid(have)
    if controller is not None:
        return job_uid is not None and controller == job_uid
    metadata = have.get("metadata") or {}
    if have.get("kind") != "PersistentVolumeClaim":
        return False
    return meta.ANNOTATION_RETAINED_FROM in (metadata.get("annotations") or {}) or meta.LABEL_MODEL_CACHE in (
        metadata.get("labels") or {}
    )


def describe_owner(have: dict[str, Any]) -> str:
    """Who controls ``have``, for the NameConflict message; an object being deleted (typically a child of a
    deleted RLJob of the same name, a claim waiting for its pods) says so: the conflict ends by itself."""
    metadata = have.get("metadata") or {}
    owner = "not controlled by this RLJob (no controller ownerReference)"
    for ref in metadata.get("ownerReferences") or []:
        if ref.get("controller"):
            owner = f"controlled by {ref.get('kind')}/{ref.get('name')} (uid {ref.get('uid')})"
            break
    if metadata.get("deletionTimestamp"):
        return f"{owner}, terminating since {metadata['deletionTimestamp']}: retrying until it is gone"
    return owner


def _hash(obj: dict[str, Any], *path: str) -> str | None:
    node: Any = obj
    for key in path:
        node = (node or {}).get(key)
    return ((node or {}).get("annotations") or {}).get(meta.ANNOTATION_SPEC_HASH)


def _partial(want: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    name = {"name": want["metadata"]["name"], "namespace": want["metadata"].get("namespace")}
    return {"apiVersion": want["apiVersion"], "kind": want["kind"], "metadata": name, "spec": spec}


def _containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    return (((obj.get("spec") or {}).get("template") or {}).get("spec") or {}).get("containers") or []


def _engine_drift(want: dict[str, Any], have: dict[str, Any]) -> str | None:
    """A container's image/command/args differ from what the operator set (edited by hand)."""
    observed = {c.get("name"): c for c in _containers(have)}
    for container in _containers(want):
        seen = observed.get(container["name"]) or {}
        for key in ("image", "command", "args"):
            if container.get(key) != seen.get(key):
                return f"container {container['name']} {key} differs from the spec"
    return None


def _statefulset(want: dict[str, Any], have: dict[str, Any]) -> Action:
    if _hash(want, "spec", "template", "metadata") != _hash(have, "spec", "template", "metadata"):
        return Action("apply", want, force=True, why="spec changed")
    drift = _engine_drift(want, have)
    if drift is not None or not is_subset(_owned_metadata(want), have.get("metadata")):
        return Action("apply", want, force=True, why=drift or "labels, annotations or ownerReference changed")
    if _partition(want) != _partition(have):  # an upgrade's canary partition set or lifted
        return Action("apply", want, force=True, why="rollout partition changed")
    replicas = want["spec"]["replicas"]
    if replicas != (have.get("spec") or {}).get("replicas"):
        return Action("apply", _partial(want, {"replicas": replicas}), force=True, manager=SCALE_MANAGER)
    return Action("none")


def _partition(statefulset: dict[str, Any]) -> int:
    strategy = (statefulset.get("spec") or {}).get("updateStrategy") or {}
    return int((strategy.get("rollingUpdate") or {}).get("partition") or 0)


def _job(want: dict[str, Any], have: dict[str, Any]) -> Action:
    """A Job's pod template is immutable: a Job of another upgrade attempt, or a model-fetch Job whose spec
    hash changed, is replaced, never patched; a finished model-fetch Job is the record that the cache is filled."""
    label = f"{meta.PREFIX}/upgrade-attempt"
    if (want["metadata"].get("labels") or {}).get(label) != ((have.get("metadata") or {}).get("labels") or {}).get(
        label
    ):
        return Action("recreate", want, why="another upgrade attempt")
    if _hash(want, "metadata") != _hash(have, "metadata"):
        return Action("recreate", want, why="spec changed")
    if meta.has_true_condition(have, "Complete"):
        return Action("none")
    pod_hash = _annotation(have, meta.ANNOTATION_POD_HASH)
    # No annotation: a Job of an operator version before it; an operator upgrade restarts no fetch. A failed
    # fetch is replaced too: the new pod template may be its fix (a proxy, a CA bundle, a pull secret).
    if pod_hash is not None and pod_hash != _annotation(want, meta.ANNOTATION_POD_HASH):
        return Action("recreate", want, why="pod template changed before the fetch completed")
    suspend = (want.get("spec") or {}).get("suspend")
    if meta.has_true_condition(have, "Failed"):
        return Action("none")
    if suspend is not None and bool(suspend) != bool((have.get("spec") or {}).get("suspend")):
        return Action("apply", _partial(want, {"suspend": suspend}), force=True, manager=SCALE_MANAGER)
    return Action("none")


def _annotation(obj: dict[str, Any], key: str) -> str | None:
    return ((obj.get("metadata") or {}).get("annotations") or {}).get(key)


def _ray_images(ray_job: dict[str, Any]) -> list[tuple[str, str | None]]:
    """(container, image) of every container and init container of the RayJob's head and worker groups."""
    cluster = (ray_job.get("spec") or {}).get("rayClusterSpec") or {}
    groups = [cluster.get("headGroupSpec") or {}, *(cluster.get("workerGroupSpecs") or [])]
    found = []
    for group in groups:
        pod = (group.get("template") or {}).get("spec") or {}
        for container in [*(pod.get("initContainers") or []), *(pod.get("containers") or [])]:
            found.append((str(container.get("name")), container.get("image")))
    return found


def _ray_job(want: dict[str, Any], have: dict[str, Any]) -> Action:
    if _hash(want, "metadata") != _hash(have, "metadata"):
        return Action("recreate", want, why="spec changed")
    if _ray_images(want) != _ray_images(have):
        # Edited by hand: taken back in place. KubeRay made the running cluster from the RayJob as it was when the
        # job started, so no pod ran the edited image; re-creating would restart training.
        return Action("apply", want, force=True, why="a container image differs from the spec")
    suspend = bool(want["spec"]["suspend"])
    if suspend != bool((have.get("spec") or {}).get("suspend")):
        return Action("apply", _partial(want, {"suspend": suspend}), force=True, manager=SCALE_MANAGER)
    return Action("none")


def _workload(want: dict[str, Any], have: dict[str, Any]) -> Action:
    # Kueue refuses pod-set changes while quota is reserved: a new Workload queues the changed job whole.
    if _hash(want, "metadata") != _hash(have, "metadata"):
        return Action("recreate", want, why="pod sets changed")
    return Action("none")


def _owned_metadata(want: dict[str, Any]) -> dict[str, Any]:
    return {k: want["metadata"][k] for k in ("labels", "annotations", "ownerReferences") if k in want["metadata"]}


def _claim(want: dict[str, Any], have: dict[str, Any]) -> Action:
    current_refs = [r for r in (have.get("metadata") or {}).get("ownerReferences") or [] if r.get("controller")]
    wanted_refs = want["metadata"].get("ownerReferences") or []
    if is_subset(_owned_metadata(want), have.get("metadata")) and len(current_refs) == len(wanted_refs):
        return Action("none")
    spec = have.get("spec") or {}
    as_is = {k: spec[k] for k in want["spec"] if k in spec}
    return Action("apply", {**want, "spec": as_is}, force=True, why="ownerReference follows retainPolicy")


CREATE_ONLY_VERSION = "1"
"""A resourceVersion no stored object has (etcd's first write is revision 2), sent as an apply's precondition."""


def create_only(want: dict[str, Any]) -> dict[str, Any]:
    """The server-side apply of ``want`` that creates it and never touches an object already under its name.

    ``metadata.resourceVersion`` in an apply is a precondition: the API server compares it with the stored
    object's and answers 409 Conflict, writing nothing, when they differ, whoever's object it is. When nothing is
    there the apply creates the object as any apply does (the version is not stored), so its managedFields hold
    the ``Apply`` entry of ``r3operator``, exactly as before. A plain create (POST) would record an ``Update``
    entry instead, a manager of its own in server-side apply's bookkeeping: later applies would then share every
    field with it, and a field a later render drops would stay, still owned by the create."""
    return {**want, "metadata": {**want["metadata"], "resourceVersion": CREATE_ONLY_VERSION}}


def plan_action(want: dict[str, Any], have: dict[str, Any] | None, *, job_uid: str | None) -> Action:
    if have is None:
        # Create-only: should the name be taken (someone else's object, which the labelled cache cannot hold,
        # or one taken between our read and this write), the server refuses and changes nothing.
        return Action("apply", create_only(want), force=False, why="created", create=True)
    if not is_ours(have, job_uid):
        return Action("conflict", why=describe_owner(have))
    kind = want["kind"]
    if kind == "StatefulSet":
        return _statefulset(want, have)
    if kind == "RayJob":
        return _ray_job(want, have)
    if kind == "Job":
        return _job(want, have)
    if kind == "PersistentVolumeClaim":
        return _claim(want, have)
    if kind == "Workload":
        return _workload(want, have)
    if kind == "RoleBinding" and want["roleRef"] != have.get("roleRef"):
        return Action("recreate", want, why="roleRef is immutable")
    fields = {k: v for k, v in want.items() if k not in ("apiVersion", "kind", "metadata")}
    if is_subset(fields, have) and is_subset(_owned_metadata(want), have.get("metadata")):
        return Action("none")
    return Action("apply", want, force=True, why="a field we set differs")
