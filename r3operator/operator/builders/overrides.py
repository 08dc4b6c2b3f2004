"""Pod templates (api/pods.py) merged onto the pods the builders derive.

Precedence, highest first:

1. what the operator derives: GPU requests/limits, the vLLM command and args, the routing, config,
   shm and model volumes and their mounts, our env, our labels and the spec-hash annotation. A
   template cannot set these at all (rules ``*-POD-TEMPLATE-DERIVED``), so nothing here has to
   decide between them;
2. the role's template (``inference.podTemplate`` / ``trainer.podTemplate``);
3. the job-wide ``spec.podTemplate``;
4. the operator's defaults: the ``restricted`` securityContext (builders/security.py), the
   ``nvidia.com/gpu`` toleration (meta.GPU_TOLERATIONS), the role's ``resources`` block.

Maps (labels, annotations, nodeSelector, resources) merge key by key; named lists (env, volumes,
imagePullSecrets) merge by name; mounts by mountPath; tolerations add up (the GPU toleration always
stays); affinity, topologySpreadConstraints, priorityClassName and serviceAccountName are replaced
whole by the more specific template; securityContext fields replace the default's one by one.
"""

from __future__ import annotations

import copy
from typing import Any

from r3operator.api.pods import PodTemplate
from r3operator.api.v1alpha1 import RLJob
from r3operator.operator import meta

JSON = dict[str, Any]


def role_template(job: RLJob, role: str) -> PodTemplate | None:
    """The effective template of a role: the role's own merged over ``spec.podTemplate``."""
    default = job.spec.pod_template
    own = job.spec.inference.pod_template if role == meta.ROLE_ENGINE else job.spec.trainer.pod_template
    if default is None or own is None:
        return own or default
    return merge_templates(default, own)


def _fields(model: Any) -> JSON:
    """The fields the user set (not pydantic's defaults), in API spelling."""
    return {} if model is None else model.model_dump(by_alias=True, exclude_none=True, exclude_unset=True)


def merge_templates(default: PodTemplate, own: PodTemplate) -> PodTemplate:
    d, o = _fields(default), _fields(own)

    def whole(key: str) -> Any:
        return o.get(key) or d.get(key)

    def keyed(key: str) -> JSON:
        return {**d.get(key, {}), **o.get(key, {})}

    def named(key: str, by: str) -> list[JSON]:
        return list({item[by]: item for item in [*d.get(key, []), *o.get(key, [])]}.values())

    merged: JSON = {
        "labels": keyed("labels"),
        "annotations": keyed("annotations"),
        "nodeSelector": keyed("nodeSelector"),
        "tolerations": _unique([*d.get("tolerations", []), *o.get("tolerations", [])]),
        "affinity": whole("affinity"),
        "topologySpreadConstraints": whole("topologySpreadConstraints"),
        "priorityClassName": whole("priorityClassName"),
        "imagePullSecrets": named("imagePullSecrets", "name"),
        "serviceAccountName": whole("serviceAccountName"),
        "podSecurityContext": keyed("podSecurityContext") or None,
        "securityContext": keyed("securityContext") or None,
        "env": named("env", "name"),
        "volumes": named("volumes", "name"),
        "volumeMounts": named("volumeMounts", "mountPath"),
    }
    if "resources" in d or "resources" in o:
        dr, orr = d.get("resources", {}), o.get("resources", {})
        merged["resources"] = {k: {**dr.get(k, {}), **orr.get(k, {})} for k in ("requests", "limits")}
    return PodTemplate.model_validate({k: v for k, v in merged.items() if v is not None})


def _unique(items: list[Any]) -> list[Any]:
    seen: list[Any] = []
    for item in items:
        if item not in seen:
            seen.append(item)
    return seen


def _dumps(items: list[Any]) -> list[JSON]:
    return [i.model_dump(by_alias=True, exclude_none=True) for i in items]


def apply_template(pod: JSON, container_name: str, template: PodTemplate | None) -> JSON:
    """A copy of the derived pod template (``{"metadata", "spec"}``) with ``template`` merged in."""
    if template is None:
        return pod
    pod = copy.deepcopy(pod)
    metadata, spec = pod.setdefault("metadata", {}), pod["spec"]
    # Derived keys win; the DERIVED rules refuse the reserved ones before a template gets here.
    metadata["labels"] = {**template.labels, **metadata.get("labels", {})}
    if template.annotations or metadata.get("annotations"):
        metadata["annotations"] = {**template.annotations, **metadata.get("annotations", {})}
    if template.node_selector:
        spec["nodeSelector"] = {**spec.get("nodeSelector", {}), **template.node_selector}
    spec["tolerations"] = _unique([*spec.get("tolerations", []), *_dumps(template.tolerations)])
    if template.affinity is not None:
        spec["affinity"] = template.affinity.model_dump(by_alias=True, exclude_none=True)
    if template.topology_spread_constraints:
        spec["topologySpreadConstraints"] = _dumps(template.topology_spread_constraints)
    if template.priority_class_name:
        spec["priorityClassName"] = template.priority_class_name
    if template.image_pull_secrets:
        spec["imagePullSecrets"] = _dumps(template.image_pull_secrets)
    if template.service_account_name:
        spec["serviceAccountName"] = template.service_account_name
    if template.pod_security_context is not None:
        spec["securityContext"] = {**spec.get("securityContext", {}), **_fields(template.pod_security_context)}
    spec["volumes"] = [*spec.get("volumes", []), *_dumps(template.volumes)]
    [container] = [c for c in spec["containers"] if c["name"] == container_name]
    _apply_container(container, template)
    return pod


def _apply_container(container: JSON, template: PodTemplate) -> None:
    if template.security_context is not None:
        container["securityContext"] = {**container.get("securityContext", {}), **_fields(template.security_context)}
    container["env"] = [*container.get("env", []), *_dumps(template.env)]
    container["volumeMounts"] = [*container.get("volumeMounts", []), *_dumps(template.volume_mounts)]
    if template.resources is not None:
        resources = container.setdefault("resources", {})
        for which in ("requests", "limits"):
            extra = getattr(template.resources, which)
            if extra:
                # GPU keys are derived and refused by the DERIVED rules; every other key of the template wins.
                resources[which] = {**resources.get(which, {}), **extra}
