"""Objects the pod templates name but the operator does not create: checked before any pod is made.

A missing Secret, ConfigMap, claim, ServiceAccount or PriorityClass would leave pods stuck
(CreateContainerConfigError, FailedCreate, ...) long after the RLJob was accepted; checked here, it is
``Valid=False`` with the object's name and nothing is created. Optional references (``optional: true``)
are not required. Secret values are read only to see whether the key exists, and never kept or logged;
where the operator may not read Secrets (the chart's default RBAC), Secret references are not checked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from r3operator.api.pods import PodTemplate
from r3operator.api.v1alpha1 import RLJob
from r3operator.operator import meta
from r3operator.operator.builders.overrides import role_template
from r3operator.operator.kube import KINDS, KubeClient, KubeError

_UNREADABLE = {"unreadable": True}


@dataclass(frozen=True, slots=True)
class Reference:
    kind: str
    name: str
    key: str | None = None
    """A key the object must hold (secretKeyRef / configMapKeyRef)."""
    where: str = ""

    def describe(self) -> str:
        key = f" (key {self.key})" if self.key else ""
        return f"{self.kind}/{self.name}{key}, named in {self.where},"


@dataclass(frozen=True, slots=True)
class ReferenceCheck:
    missing: tuple[str, ...] = ()
    priority: int | None = None
    """The value of the PriorityClass the pods name (builders/workload.py), when it exists."""


def _template_references(template: PodTemplate, where: str) -> list[Reference]:
    refs: list[Reference] = []
    for env in template.env:
        source = env.value_from
        if source is None:
            continue
        if source.secret_key_ref is not None and not source.secret_key_ref.optional:
            refs.append(Reference("Secret", source.secret_key_ref.name, source.secret_key_ref.key, f"{where}.env"))
        if source.config_map_key_ref is not None and not source.config_map_key_ref.optional:
            ref = source.config_map_key_ref
            refs.append(Reference("ConfigMap", ref.name, ref.key, f"{where}.env"))
    for volume in template.volumes:
        if volume.secret is not None and not volume.secret.optional:
            refs.append(Reference("Secret", volume.secret.secret_name, where=f"{where}.volumes"))
        if volume.config_map is not None and not volume.config_map.optional:
            refs.append(Reference("ConfigMap", volume.config_map.name, where=f"{where}.volumes"))
        if volume.persistent_volume_claim is not None:
            refs.append(Reference("PersistentVolumeClaim", volume.persistent_volume_claim.claim_name,
                                  where=f"{where}.volumes"))  # fmt: skip
    refs += [Reference("Secret", s.name, where=f"{where}.imagePullSecrets") for s in template.image_pull_secrets]
    if template.service_account_name:
        refs.append(Reference("ServiceAccount", template.service_account_name, where=f"{where}.serviceAccountName"))
    if template.priority_class_name:
        refs.append(Reference("PriorityClass", template.priority_class_name, where=f"{where}.priorityClassName"))
    return refs


def references(job: RLJob) -> list[Reference]:
    """Every required outside object of the engine and trainer pods, once each (first naming kept)."""
    found: dict[tuple[str, str, str | None], Reference] = {}
    # The effective template of each role: a name from spec.podTemplate is reported under both roles' paths.
    for role, where in ((meta.ROLE_ENGINE, "inference.podTemplate"), (meta.ROLE_TRAINER, "trainer.podTemplate")):
        template = role_template(job, role)
        if template is None:
            continue
        for ref in _template_references(template, where):
            found.setdefault((ref.kind, ref.name, ref.key), ref)
    return list(found.values())


async def check_references(client: KubeClient, job: RLJob, *, priority_class: str | None) -> ReferenceCheck:
    missing: list[str] = []
    cache: dict[tuple[str, str], dict[str, Any] | None] = {}
    for ref in references(job):
        if (ref.kind, ref.name) not in cache:
            namespace = None if ref.kind == "PriorityClass" else job.metadata.namespace
            try:
                cache[(ref.kind, ref.name)] = await client.get(KINDS[ref.kind], namespace, ref.name)
            except KubeError as exc:
                if exc.status != 403:
                    raise
                # The chart grants no access to Secrets: such a reference cannot be checked up front, and
                # a missing one shows as the pods' CreateContainerConfigError instead (docs/operator.md).
                cache[(ref.kind, ref.name)] = _UNREADABLE
        obj = cache[(ref.kind, ref.name)]
        if obj is _UNREADABLE:
            continue
        if obj is None:
            missing.append(f"{ref.describe()} does not exist")
        elif ref.key is not None and ref.key not in {**(obj.get("data") or {}), **(obj.get("binaryData") or {})}:
            missing.append(f"{ref.describe()} has no such key")
    priority = None
    if priority_class is not None:
        found = cache.get(("PriorityClass", priority_class))
        priority = int(found["value"]) if found is not None and "value" in found else None
    return ReferenceCheck(tuple(missing), priority)
