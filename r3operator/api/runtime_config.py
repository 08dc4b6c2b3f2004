"""The runtime config: the ConfigMap file the operator writes and the trainer driver and `up` read.

``config.json`` = the RLJob (apiVersion, kind, name and namespace, the spec with defaults filled) + the
operator's plan (``resolved``) + the ``runtime`` block: the names and URLs of the other children and the
weight-sync method the engines were rendered for, so no process has to ask the Kubernetes API for its
peers. One model for the writer (operator/builders/config.py) and every reader (runtime/config.py,
cli/up/plan.py); a file that does not fit it is refused with the field named.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_serializer

from r3operator.api.load import FieldProblem, RLJobLoadError, _problems
from r3operator.api.v1alpha1 import API_VERSION, KIND, ObjectMeta, ResolvedSpec, RLJob, RLJobSpec
from r3operator.api.weight_transfer import TransferChoice, TransferMethod


class _Block(BaseModel):
    # Unknown keys are ignored: a driver reads the config of an operator one release apart.
    model_config = ConfigDict(populate_by_name=True, frozen=True, extra="ignore")


class WeightTransferConfig(_Block):
    """The transport the engines were rendered for (their --weight-transfer-config); the driver re-checks it
    against the running engines and its own vLLM (weightsync/sync.py)."""

    method: TransferMethod
    reason: str = "rendered by the operator"
    fallback: bool = False

    def choice(self) -> TransferChoice:
        return TransferChoice(self.method, self.reason, fallback=self.fallback)


class RuntimeBlock(_Block):
    config_path: str = Field(alias="configPath")
    routing_dir: str = Field(alias="routingDir")
    """Where the routing volume is mounted; run outputs go to ``<routingDir>/runs/<job>``."""
    routing_claim: str = Field(alias="routingClaim")
    engine_service: str = Field(alias="engineService")
    engine_stateful_set: str = Field(alias="engineStatefulSet")
    """The engines' StatefulSet, or their LeaderWorkerSet when a replica spans pods (same name)."""
    engine_urls: list[str] = Field(alias="engineURLs")
    """One URL per engine replica: the DP leader pod of each replica serves the API (a disaggregated job's decode
    engines)."""
    prefill_engine_urls: list[str] = Field(default_factory=list, alias="prefillEngineURLs")
    """A disaggregated job's prefill engines, one URL per replica; empty otherwise."""
    trainer_ray_job: str = Field(alias="trainerRayJob")
    weight_transfer: WeightTransferConfig | None = Field(default=None, alias="weightTransfer")


class JobName(_Block):
    name: str
    namespace: str
    uid: str | None = None
    """The RLJob's uid (an export's manifest names it); None where the RLJob was never stored (a render)."""


class RuntimeConfig(_Block):
    api_version: Literal["r3operator.io/v1alpha1"] = Field(default="r3operator.io/v1alpha1", alias="apiVersion")
    kind: Literal["RLJob"] = "RLJob"
    metadata: JobName
    spec: RLJobSpec
    resolved: ResolvedSpec
    runtime: RuntimeBlock

    @field_serializer("resolved")
    def _only_what_was_resolved(self, resolved: ResolvedSpec) -> dict[str, Any]:
        return resolved.model_dump(mode="json", by_alias=True, exclude_none=True)

    @property
    def job(self) -> RLJob:
        meta = ObjectMeta(name=self.metadata.name, namespace=self.metadata.namespace, uid=self.metadata.uid)
        return RLJob(api_version=API_VERSION, kind=KIND, metadata=meta, spec=self.spec)

    def to_json(self) -> str:
        """The ConfigMap's text (sorted keys, so an unchanged job renders the same bytes)."""
        return json.dumps(self.model_dump(mode="json", by_alias=True), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, *, source: str) -> RuntimeConfig:
        """Parse the file's text; RLJobLoadError names `source` and each field that does not fit."""
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise RLJobLoadError(source, [FieldProblem("", f"malformed JSON: {exc}")]) from None
        if not isinstance(data, dict) or "spec" not in data:
            expected = "expected the operator's runtime config (an RLJob with 'spec', 'resolved' and 'runtime')"
            raise RLJobLoadError(source, [FieldProblem("", expected)])
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise RLJobLoadError(source, _problems(exc)) from None
