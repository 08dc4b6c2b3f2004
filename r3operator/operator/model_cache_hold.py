"""Which RLJob mounts a kept ReadWriteOnce model cache now.

A ReadWriteOnce claim attaches to one node, so the pods of two RLJobs on different nodes cannot both mount
it. The kept one (``model-cache-<key>-rwo``, builders/model_cache.py) is held by one RLJob at a time, its
holder, recorded on the claim in the annotation ``r3operator.io/model-cache-holder: <name>/<uid>``. Only the
operator writes it (a trainer's ServiceAccount may patch its RLJob's status, never a claim), with a merge
patch that carries the claim's resourceVersion: of two RLJobs that try at once, one gets 409 and waits.

The holder is live while its RLJob exists with that uid, is not being deleted and has not finished (the
operator's own ``r3operator.io/finished`` annotation on it, never its status). Another RLJob of the model
waits with its engines at 0 and its RayJob suspended, ``Progressing=False ModelCacheHeld`` naming the
holder, and takes the claim over in its first pass after the holder is gone (every RLJob deletion in the
namespace wakes the namespace's jobs; a holder that ended is seen at the next resync), posting
``ModelCacheTakenOver`` once: the pass whose patch the API server took.

Waiting is the default rather than a claim of its own: the cache exists so that a model is downloaded once
and stored once, and a second kept copy (another 200 Gi, another download) would be left behind by every
RLJob that ran beside another. A user who wants two at once asks for ReadWriteMany, or ``retainPolicy:
Delete`` (a claim of the job's own).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from r3operator.api.v1alpha1 import RLJob
from r3operator.operator import meta
from r3operator.operator.apply import is_ours
from r3operator.operator.builders.model_cache import build_model_cache_claim, shared_claim_name
from r3operator.operator.kube import KINDS, KubeClient, KubeError
from r3operator.operator.lifecycle import ANNOTATION_FINISHED


@dataclass(frozen=True, slots=True)
class Hold:
    claim: str
    holder: str | None = None
    """Another live RLJob that holds the claim: this one waits."""
    taken_from: str | None = None
    """The RLJob this pass took the claim over from (for the one Event), None when it held it already."""


def holder_of(claim: dict[str, Any]) -> tuple[str, str] | None:
    """(name, uid) of the recorded holder, None when none (or a value the operator did not write)."""
    value = ((claim.get("metadata") or {}).get("annotations") or {}).get(meta.ANNOTATION_MODEL_CACHE_HOLDER)
    name, _, uid = str(value or "").partition("/")
    return (name, uid) if name and uid else None


def holds(rljob: dict[str, Any] | None, uid: str) -> bool:
    """The RLJob read back is the recorded holder and still mounts the claim: same uid, not being deleted,
    not finished."""
    metadata = (rljob or {}).get("metadata") or {}
    return (
        metadata.get("uid") == uid
        and not metadata.get("deletionTimestamp")
        and ANNOTATION_FINISHED not in (metadata.get("annotations") or {})
    )


async def hold_model_cache(client: KubeClient, job: RLJob) -> Hold:
    """Make this RLJob the claim's holder unless another live one is (then say which); create the claim when
    there is none, so the first RLJob of a model records itself before anything mounts it."""
    namespace, kind = job.metadata.namespace, KINDS["PersistentVolumeClaim"]
    name = shared_claim_name(job)
    claim = await client.get(kind, namespace, name)
    if claim is None:
        body = build_model_cache_claim(job)
        assert body is not None  # a kept cache of a fetched model
        claim = await client.apply(body, force=False)
    if not is_ours(claim, job.metadata.uid) or claim["metadata"].get("deletionTimestamp"):
        return Hold(name)  # not a model cache claim (NameConflict), or going away: the reconciler reports it
    me = (job.metadata.name, job.metadata.uid or "")
    recorded = holder_of(claim)
    if recorded == me:
        return Hold(name)
    if recorded is not None and holds(await client.get(KINDS["RLJob"], namespace, recorded[0]), recorded[1]):
        return Hold(name, holder=recorded[0])
    annotations = {meta.ANNOTATION_MODEL_CACHE_HOLDER: "/".join(me)}
    patch = {"metadata": {"resourceVersion": claim["metadata"]["resourceVersion"], "annotations": annotations}}
    try:
        await client.merge_patch(kind, namespace, name, patch)
    except KubeError as exc:
        if exc.status != 409:
            raise
        winner = holder_of(await client.get(kind, namespace, name) or {})  # another RLJob took it meanwhile
        return Hold(name, holder=winner[0] if winner else "another RLJob")
    return Hold(name, taken_from=recorded[0] if recorded else None)
