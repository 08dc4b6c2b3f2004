"""Rules for the pod templates (api/pods.py): what the operator derives cannot be overridden.

One pair of rules per template (``spec.podTemplate``, ``inference.podTemplate``, ``trainer.podTemplate``),
so that the API server's refusal names the template's own field path:

- ``*-DERIVED``: env names, volume names, mount paths, the GPU resource and the label/annotation keys
  the operator sets itself. Letting a template set them would silently fight the builders (a second
  ``VLLM_PLUGINS``, a ``routing`` volume that is not the job's claim, a GPU count that disagrees with
  the parallel sizes).
- ``*-MOUNTS``: every volumeMount names a volume of its template or of ``spec.podTemplate``; the API
  server would otherwise refuse the StatefulSet or RayJob only after the job was accepted.
- ``*-IDENTITY``: ``serviceAccountName`` may not name a ServiceAccount the operator manages (``<job>-trainer``,
  of this job or another): its pods would run with that job's token. What the object alone cannot show (an
  account another RLJob controls under another name, the operator's own) the operator refuses
  (operator/identity.py).

The reserved names live here because ``api`` imports nothing above it; tests/operator/test_pod_overrides.py
checks that every name the builders use is reserved.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from r3operator.api.context import RuleContext
from r3operator.api.names import MANAGED_IDENTITY_SUFFIX
from r3operator.api.pods import PodTemplate
from r3operator.api.v1alpha1 import RLJobSpec

RESERVED_ENV: tuple[str, ...] = ("VLLM_PLUGINS", "VLLM_SERVER_DEV_MODE", "VLLM_USE_V2_MODEL_RUNNER")
RESERVED_ENV_PREFIX = "R3OPERATOR_"
RESERVED_VOLUMES: tuple[str, ...] = ("routing", "config", "dshm", "model", "model-cache")
RESERVED_MOUNT_PATHS: tuple[str, ...] = ("/var/lib/r3operator", "/etc/r3operator", "/dev/shm", "/mnt/model")
"""The routing volume, the runtime config, shared memory and the model: the paths and everything under them."""
DERIVED_RESOURCES: tuple[str, ...] = ("nvidia.com/gpu",)
RESERVED_KEY_PREFIXES: tuple[str, ...] = ("r3operator.io/", "kueue.x-k8s.io/")
"""Our own keys (job, role, spec hash) and Kueue's (the queue comes from spec.queueName, and a queue
label on a pod would hand it to Kueue's pod integration outside the job's workload)."""
RESERVED_KEYS: tuple[str, ...] = (
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/component",
    "app.kubernetes.io/managed-by",
)


@dataclass(frozen=True, slots=True)
class TemplateSite:
    """Where a pod template sits in the spec."""

    rule_prefix: str
    path: str
    """Relative to spec, e.g. ``inference.podTemplate``."""
    get: Callable[[RLJobSpec], PodTemplate | None]
    is_default: bool = False


SITES: tuple[TemplateSite, ...] = (
    TemplateSite("POD-TEMPLATE", "podTemplate", lambda s: s.pod_template, is_default=True),
    TemplateSite("ENGINE-POD-TEMPLATE", "inference.podTemplate", lambda s: s.inference.pod_template),
    TemplateSite("TRAINER-POD-TEMPLATE", "trainer.podTemplate", lambda s: s.trainer.pod_template),
)


def _reserved_key(key: str) -> bool:
    return key in RESERVED_KEYS or key.startswith(RESERVED_KEY_PREFIXES)


def _reserved_path(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in RESERVED_MOUNT_PATHS)


def derived_overrides(template: PodTemplate) -> list[str]:
    """What the template sets that the operator derives, as ``kind name`` items."""
    found = [f"env {e.name}" for e in template.env if e.name in RESERVED_ENV or e.name.startswith(RESERVED_ENV_PREFIX)]
    found += [f"volume {v.name}" for v in template.volumes if v.name in RESERVED_VOLUMES]
    found += [f"volumeMount {m.name}" for m in template.volume_mounts if m.name in RESERVED_VOLUMES]
    found += [f"mountPath {m.mount_path}" for m in template.volume_mounts if _reserved_path(m.mount_path)]
    if template.resources is not None:
        for which, values in (("requests", template.resources.requests), ("limits", template.resources.limits)):
            found += [f"resources.{which} {r}" for r in DERIVED_RESOURCES if r in values]
    found += [f"label {k}" for k in template.labels if _reserved_key(k)]
    found += [f"annotation {k}" for k in template.annotations if _reserved_key(k)]
    return found


def unknown_mounts(template: PodTemplate, default: PodTemplate | None) -> list[str]:
    known = {v.name for v in template.volumes} | ({v.name for v in default.volumes} if default else set())
    return [m.name for m in template.volume_mounts if m.name not in known]


def check_derived(site: TemplateSite) -> Callable[[RuleContext], str | None]:
    def check(c: RuleContext) -> str | None:
        template = site.get(c.spec)
        found = derived_overrides(template) if template is not None else []
        if found:
            return f"{site.path} sets what r3operator derives: {', '.join(found)}"
        return None

    return check


def check_mounts(site: TemplateSite) -> Callable[[RuleContext], str | None]:
    def check(c: RuleContext) -> str | None:
        template = site.get(c.spec)
        if template is None:
            return None
        missing = unknown_mounts(template, None if site.is_default else c.spec.pod_template)
        if missing:
            where = f"{site.path}.volumes" if site.is_default else f"{site.path}.volumes or podTemplate.volumes"
            return f"{site.path}.volumeMounts name volumes that {where} does not define: {', '.join(missing)}"
        return None

    return check


def check_identity(site: TemplateSite) -> Callable[[RuleContext], str | None]:
    def check(c: RuleContext) -> str | None:
        template = site.get(c.spec)
        account = template.service_account_name if template is not None else None
        if account is not None and account.endswith(MANAGED_IDENTITY_SUFFIX):
            return identity_message(site.path, account)
        return None

    return check


def identity_message(path: str, account: str) -> str:
    return (
        f"{path}.serviceAccountName {account} ends in {MANAGED_IDENTITY_SUFFIX}: ServiceAccounts <job>"
        f"{MANAGED_IDENTITY_SUFFIX} are the per-RLJob identities r3operator manages, and a pod running as the account "
        "of another job could act as that job; name another ServiceAccount, or none (then the job gets its own)"
    )


# ------------------------------------------------------------------------------------------- CEL


def _list(items: tuple[str, ...]) -> str:
    return "[" + ", ".join(f"'{i}'" for i in items) + "]"


def _key_reserved_cel(k: str) -> str:
    prefixes = " || ".join(f"{k}.startsWith('{p}')" for p in RESERVED_KEY_PREFIXES)
    return f"({k} in {_list(RESERVED_KEYS)} || {prefixes})"


def _path_reserved_cel(p: str) -> str:
    return f"{_list(RESERVED_MOUNT_PATHS)}.exists(r, {p} == r || {p}.startsWith(r + '/'))"


def _env_reserved_cel(n: str) -> str:
    return f"({n} in {_list(RESERVED_ENV)} || {n}.startsWith('{RESERVED_ENV_PREFIX}'))"


def _gpu_cel(t: str, which: str) -> str:
    return f"(has({t}.resources) && {_list(DERIVED_RESOURCES)}.exists(r, r in {t}.resources.{which}))"


def derived_cel(site: TemplateSite) -> tuple[str, str]:
    """(rule, messageExpression) over ``self`` = spec."""
    t = f"self.{site.path}"
    parts = [
        f"{t}.env.all(e, !{_env_reserved_cel('e.name')})",
        f"{t}.volumes.all(v, !(v.name in {_list(RESERVED_VOLUMES)}))",
        f"{t}.volumeMounts.all(m, !(m.name in {_list(RESERVED_VOLUMES)}) && !{_path_reserved_cel('m.mountPath')})",
        f"!{_gpu_cel(t, 'requests')}",
        f"!{_gpu_cel(t, 'limits')}",
        f"{t}.labels.all(k, !{_key_reserved_cel('k')})",
        f"{t}.annotations.all(k, !{_key_reserved_cel('k')})",
    ]
    rule = f"!has({t}) || (" + " && ".join(parts) + ")"
    # A constant message: one that lists the offending entries exceeds the apiserver's messageExpression
    # cost budget. The Python check (Valid=False, `r3operator validate`) names them.
    env = "/".join(RESERVED_ENV)
    message = (
        f"'{site.path} sets what r3operator derives: env {RESERVED_ENV_PREFIX}* or {env}, volumes "
        f"{'/'.join(RESERVED_VOLUMES)}, mounts at or under {', '.join(RESERVED_MOUNT_PATHS)}, "
        f"{'/'.join(DERIVED_RESOURCES)} resources, or {', '.join(RESERVED_KEY_PREFIXES)}, app.kubernetes.io/ "
        "labels and annotations are refused'"
    )
    return rule, message


def mounts_cel(site: TemplateSite) -> tuple[str, str]:
    t = f"self.{site.path}"
    known = f"{t}.volumes.exists(v, v.name == m.name)"
    if not site.is_default:
        known += " || (has(self.podTemplate) && self.podTemplate.volumes.exists(v, v.name == m.name))"
    rule = f"!has({t}) || {t}.volumeMounts.all(m, {known})"
    where = f"{site.path}.volumes" if site.is_default else f"{site.path}.volumes or podTemplate.volumes"
    message = f"'every {site.path}.volumeMounts entry must name a volume of {where}'"
    return rule, message


def identity_cel(site: TemplateSite) -> tuple[str, str]:
    t = f"self.{site.path}"
    account = f"{t}.serviceAccountName"
    rule = f"!has({t}) || !has({account}) || !{account}.endsWith('{MANAGED_IDENTITY_SUFFIX}')"
    head, _, tail = identity_message(site.path, "\0").partition("\0")
    return rule, f"'{head}' + {account} + '{tail}'"
