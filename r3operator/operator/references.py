"""Objects the spec names but the operator does not create: checked before any pod is made.

The pod templates' Secrets, ConfigMaps, claims, ServiceAccount and PriorityClass, and the credentials of
the sources: ``model.tokenSecretRef`` and ``model.s3``/``model.gcs`` of a fetched model, ``task.s3``/
``task.gcs`` of a fetched dataset. A missing one would leave pods stuck (CreateContainerConfigError,
FailedCreate, ...) long after the RLJob was accepted; checked here, it is ``Valid=False`` with the object's
name and nothing is created. Optional references (``optional: true``) are not required.

A ServiceAccount a pod template names must not be an identity someone else holds (``ReferenceCheck.borrowed``):
one another RLJob controls (the CRD's CEL refuses every ``<job>-trainer`` name; this covers what the object alone
cannot show), or the operator's own (its pods would hold the operator's rights).

A Secret is read only for the names of its keys: the values are dropped as soon as the response is parsed,
never kept, compared or logged. Where the operator may not read Secrets (the chart's
``rbac.checkSecretReferences: false``) Secret references are not checked here; the pods' own
CreateContainerConfigError then reaches status instead (operator/scheduling.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from r3operator.api.pod_rules import SITES
from r3operator.api.pods import PodTemplate
from r3operator.api.v1alpha1 import RLJob
from r3operator.operator import meta
from r3operator.operator.builders.dataset import fetched_datasets
from r3operator.operator.builders.model_cache import credential_keys, uses_model_cache
from r3operator.operator.builders.overrides import role_template
from r3operator.operator.kube import KINDS, KubeClient, KubeError


@dataclass(frozen=True, slots=True)
class _Found:
    """What is kept of an object that exists: its key names (Secret, ConfigMap), a PriorityClass's value."""

    keys: frozenset[str] = frozenset()
    value: int | None = None
    controller: str | None = None
    """A ServiceAccount's controller ownerReference, ``Kind/name uid``."""


_UNREADABLE = _Found()


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
    borrowed: tuple[str, ...] = ()
    """ServiceAccounts a pod template names that are another's identity, each with its field and why."""


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
            refs.append(
                Reference("PersistentVolumeClaim", volume.persistent_volume_claim.claim_name, where=f"{where}.volumes")
            )
    refs += [Reference("Secret", s.name, where=f"{where}.imagePullSecrets") for s in template.image_pull_secrets]
    if template.service_account_name:
        refs.append(Reference("ServiceAccount", template.service_account_name, where=f"{where}.serviceAccountName"))
    if template.priority_class_name:
        refs.append(Reference("PriorityClass", template.priority_class_name, where=f"{where}.priorityClassName"))
    return refs


def _source_references(job: RLJob) -> list[Reference]:
    """The credentials of the sources that are fetched: the fetch step's secretKeyRef env."""
    refs: list[Reference] = []
    model = job.spec.model
    if uses_model_cache(job):
        if model.token_secret_ref is not None:
            token = model.token_secret_ref
            refs.append(Reference("Secret", token.name, token.key, "model.tokenSecretRef"))
        keys = credential_keys(model.uri, model.s3, model.gcs, "model")
        refs += [Reference("Secret", name, key, where) for name, key, where in keys]
    task = job.spec.task
    for _, path in fetched_datasets(job):  # the eval file too, with the task's store credentials
        keys = credential_keys(path, task.s3, task.gcs, "task")
        refs += [Reference("Secret", name, key, where) for name, key, where in keys]
    export = job.spec.export
    if export is not None:  # the head pod's secretKeyRef env (builders/export.py)
        keys = credential_keys(export.destination, export.s3, export.gcs, "export")
        refs += [Reference("Secret", name, key, where) for name, key, where in keys]
    return refs


def references(job: RLJob) -> list[Reference]:
    """Every required outside object of the job's pods, once each (first naming kept)."""
    found: dict[tuple[str, str, str | None], Reference] = {}
    for ref in _source_references(job):
        found.setdefault((ref.kind, ref.name, ref.key), ref)
    # The effective template of each role: a name from spec.podTemplate is reported under both roles' paths.
    for role, where in ((meta.ROLE_ENGINE, "inference.podTemplate"), (meta.ROLE_TRAINER, "trainer.podTemplate")):
        template = role_template(job, role)
        if template is None:
            continue
        for ref in _template_references(template, where):
            found.setdefault((ref.kind, ref.name, ref.key), ref)
    return list(found.values())


def _kept(kind: str, obj: dict[str, Any]) -> _Found:
    """The key names, never the values; a PriorityClass's value."""
    if kind == "PriorityClass":
        return _Found(value=int(obj["value"]) if "value" in obj else None)
    if kind == "ServiceAccount":
        ref = next((r for r in (obj.get("metadata") or {}).get("ownerReferences") or [] if r.get("controller")), None)
        return _Found(controller=f"{ref.get('kind')}/{ref.get('name')} {ref.get('uid')}" if ref else None)
    return _Found(keys=frozenset({**(obj.get("data") or {}), **(obj.get("binaryData") or {})}))


def _borrowed(job: RLJob, accounts: dict[str, _Found | None], operator_account: tuple[str, str] | None) -> list[str]:
    """The pod templates' ServiceAccounts that are the operator's own or controlled by another RLJob."""
    found: list[str] = []
    for site in SITES:
        template = site.get(job.spec)
        name = template.service_account_name if template is not None else None
        if name is None:
            continue
        field = f"spec.{site.path}.serviceAccountName {name}"
        if operator_account == (job.metadata.namespace, name):
            found.append(f"{field} is the operator's own ServiceAccount: its pods would hold the operator's rights")
            continue
        account = accounts.get(name)
        owner = account.controller if account is not None else None
        if owner is not None and owner.startswith("RLJob/") and not owner.endswith(f" {job.metadata.uid}"):
            found.append(
                f"{field} is controlled by {owner.partition(' ')[0]}: the identity of another job, whose pods "
                "could then be acted as"
            )
    return found


async def check_references(
    client: KubeClient,
    job: RLJob,
    *,
    priority_class: str | None,
    operator_account: tuple[str, str] | None = None,
) -> ReferenceCheck:
    """``operator_account``: the operator's own (namespace, ServiceAccount), which no pod template may name."""
    missing: list[str] = []
    cache: dict[tuple[str, str], _Found | None] = {}
    for ref in references(job):
        if (ref.kind, ref.name) not in cache:
            namespace = None if ref.kind == "PriorityClass" else job.metadata.namespace
            try:
                obj = await client.get(KINDS[ref.kind], namespace, ref.name)
            except KubeError as exc:
                if exc.status != 403:
                    raise
                # Secrets without rbac.checkSecretReferences: a missing one shows as the pods'
                # CreateContainerConfigError instead (operator/scheduling.py, docs/operator.md).
                cache[(ref.kind, ref.name)] = _UNREADABLE
            else:
                cache[(ref.kind, ref.name)] = None if obj is None else _kept(ref.kind, obj)
        found = cache[(ref.kind, ref.name)]
        if found is _UNREADABLE:
            continue
        if found is None:
            missing.append(f"{ref.describe()} does not exist")
        elif ref.key is not None and ref.key not in found.keys:
            missing.append(f"{ref.describe()} has no such key")
    priority = None
    if priority_class is not None:
        found = cache.get(("PriorityClass", priority_class))
        priority = found.value if found is not None else None
    accounts = {name: found for (kind, name), found in cache.items() if kind == "ServiceAccount"}
    return ReferenceCheck(tuple(missing), priority, tuple(_borrowed(job, accounts, operator_account)))
