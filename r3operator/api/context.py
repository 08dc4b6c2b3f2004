"""What a rule check sees: the spec plus the outside facts resolved for it."""

from __future__ import annotations

from dataclasses import dataclass

from r3operator.api.v1alpha1 import RLJobSpec
from r3operator.api.versions import EngineVersion, resolve_engine_version


@dataclass(frozen=True, slots=True)
class RuleContext:
    spec: RLJobSpec
    engine_version: EngineVersion
    leader_worker_set: bool | None = None
    """The cluster serves leaderworkersets.leaderworkerset.x-k8s.io; None: not known (offline validate/render)."""

    @classmethod
    def for_spec(cls, spec: RLJobSpec, *, leader_worker_set: bool | None = None) -> RuleContext:
        version = resolve_engine_version(image=spec.inference.image, explicit=spec.inference.vllm_version)
        return cls(spec=spec, engine_version=version, leader_worker_set=leader_worker_set)
