"""Pod customisation: ``spec.podTemplate`` (every pod), ``inference.podTemplate``, ``trainer.podTemplate``.

Typed subsets of the core/v1 Pod fields a GPU cluster needs (where pods may run, who they run as, what
they mount and read), not a free-form PodSpec: every field is validated here and by the CRD, and a
field the operator derives (GPU counts, the vLLM command, the routing volume, our env) has no field
here or is refused by a rule (api/rules.py, POD-TEMPLATE-DERIVED). Every list and map is bounded so
that a 10k-entry toleration list is refused at admission (and the CEL cost estimator has bounds).

How the blocks merge onto what the builders derive is in operator/builders/overrides.py.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator, ConfigDict, Field, model_validator
from pydantic.config import JsonDict

from r3operator.api.base import ApiModel

DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
# A label/annotation/resource key: an optional DNS-subdomain prefix, then a name. [.] instead of \. so
# that the same text is a valid CEL string literal.
QUALIFIED_NAME = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
ENV_NAME = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"
QUANTITY = r"^[+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+|[KMGTPE]i|[mkMGTPE])?$"
MAX_KEY = 317  # 253 prefix + "/" + 63 name

MAX_TOLERATIONS = 64
MAX_ENV = 64
MAX_VOLUMES = 32
MAX_LABELS = 64

Quantity = Annotated[str, Field(pattern=QUANTITY, max_length=64)]
DnsSubdomain = Annotated[str, Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)]
DnsLabel = Annotated[str, Field(min_length=1, max_length=63, pattern=DNS_LABEL)]
LabelValue = Annotated[str, Field(max_length=63, pattern=LABEL_VALUE)]


def _qualified_keys(value: dict[str, str]) -> dict[str, str]:
    bad = [k for k in value if len(k) > MAX_KEY or not re.match(QUALIFIED_NAME, k)]
    if bad:
        raise ValueError(f"keys must be qualified names (prefix/name, at most {MAX_KEY} characters): {bad[:5]}")
    return value


def _keys_cel() -> JsonDict:
    """The same key check for the CRD (a structural schema cannot constrain map keys otherwise)."""
    return {
        "x-kubernetes-validations": [
            {
                "rule": f"self.all(k, k.size() <= {MAX_KEY} && k.matches('{QUALIFIED_NAME}'))",
                "message": f"keys must be qualified names (prefix/name, at most {MAX_KEY} characters)",
            }
        ]
    }


def _cel(rule: str, message: str) -> ConfigDict:
    """A CRD rule on the model's own object, next to the model_validator that enforces it in Python."""
    return ConfigDict(json_schema_extra={"x-kubernetes-validations": [{"rule": rule, "message": message}]})


LabelMap = Annotated[dict[str, LabelValue], AfterValidator(_qualified_keys)]
AnnotationMap = Annotated[dict[str, Annotated[str, Field(max_length=4096)]], AfterValidator(_qualified_keys)]
QuantityMap = Annotated[dict[str, Quantity], AfterValidator(_qualified_keys)]


# ------------------------------------------------------------------------------------ scheduling


class Toleration(ApiModel):
    """core/v1 Toleration."""

    key: str | None = Field(default=None, max_length=MAX_KEY)
    """Taint key; empty with operator Exists tolerates every taint."""
    operator: Literal["Exists", "Equal"] = "Equal"
    value: str | None = Field(default=None, max_length=63)
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    """Empty tolerates every effect."""
    toleration_seconds: int | None = Field(default=None, ge=0, le=10_000_000)
    """How long a NoExecute taint is tolerated before eviction."""

    model_config = _cel(
        "!(self.operator == 'Exists' && has(self.value) && self.value != '')",
        "a toleration with operator Exists has no value",
    )

    @model_validator(mode="after")
    def _exists_has_no_value(self) -> Toleration:
        if self.operator == "Exists" and self.value:
            raise ValueError("a toleration with operator Exists has no value")
        return self


class NodeSelectorRequirement(ApiModel):
    key: str = Field(min_length=1, max_length=MAX_KEY)
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"]
    values: list[Annotated[str, Field(max_length=63)]] = Field(default_factory=list, max_length=64)


class NodeSelectorTerm(ApiModel):
    match_expressions: list[NodeSelectorRequirement] = Field(default_factory=list, max_length=16)
    match_fields: list[NodeSelectorRequirement] = Field(default_factory=list, max_length=16)


class NodeSelector(ApiModel):
    node_selector_terms: list[NodeSelectorTerm] = Field(min_length=1, max_length=16)
    """Terms are ORed; the expressions of one term are ANDed."""


class PreferredSchedulingTerm(ApiModel):
    weight: int = Field(ge=1, le=100)
    preference: NodeSelectorTerm


class NodeAffinity(ApiModel):
    required_during_scheduling_ignored_during_execution: NodeSelector | None = None
    preferred_during_scheduling_ignored_during_execution: list[PreferredSchedulingTerm] = Field(
        default_factory=list, max_length=16
    )


class LabelSelectorRequirement(ApiModel):
    key: str = Field(min_length=1, max_length=MAX_KEY)
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: list[Annotated[str, Field(max_length=63)]] = Field(default_factory=list, max_length=64)


class LabelSelector(ApiModel):
    match_labels: LabelMap = Field(default_factory=dict, max_length=32, json_schema_extra=_keys_cel())
    match_expressions: list[LabelSelectorRequirement] = Field(default_factory=list, max_length=16)


class PodAffinityTerm(ApiModel):
    label_selector: LabelSelector | None = None
    namespaces: list[DnsLabel] = Field(default_factory=list, max_length=16)
    namespace_selector: LabelSelector | None = None
    topology_key: str = Field(min_length=1, max_length=MAX_KEY)
    """Node label that defines the domain, e.g. kubernetes.io/hostname or topology.kubernetes.io/zone."""


class WeightedPodAffinityTerm(ApiModel):
    weight: int = Field(ge=1, le=100)
    pod_affinity_term: PodAffinityTerm


class PodAffinity(ApiModel):
    required_during_scheduling_ignored_during_execution: list[PodAffinityTerm] = Field(
        default_factory=list, max_length=16
    )
    preferred_during_scheduling_ignored_during_execution: list[WeightedPodAffinityTerm] = Field(
        default_factory=list, max_length=16
    )


class Affinity(ApiModel):
    """core/v1 Affinity."""

    node_affinity: NodeAffinity | None = None
    pod_affinity: PodAffinity | None = None
    pod_anti_affinity: PodAffinity | None = None


class TopologySpreadConstraint(ApiModel):
    max_skew: int = Field(ge=1, le=1024)
    topology_key: str = Field(min_length=1, max_length=MAX_KEY)
    when_unsatisfiable: Literal["DoNotSchedule", "ScheduleAnyway"]
    label_selector: LabelSelector | None = None
    min_domains: int | None = Field(default=None, ge=1, le=1024)


# ------------------------------------------------------------------------------------- identity


class LocalObjectReference(ApiModel):
    name: DnsSubdomain


class SeccompProfile(ApiModel):
    type: Literal["RuntimeDefault", "Localhost", "Unconfined"]
    localhost_profile: str | None = Field(default=None, max_length=4096)


class Capabilities(ApiModel):
    add: list[Annotated[str, Field(max_length=64, pattern=r"^[A-Z_]+$")]] = Field(default_factory=list, max_length=64)
    drop: list[Annotated[str, Field(max_length=64, pattern=r"^[A-Z_]+$")]] = Field(default_factory=list, max_length=64)


class PodSecurityContext(ApiModel):
    """Pod-level securityContext; each field set replaces the operator's default (restricted profile)."""

    run_as_user: int | None = Field(default=None, ge=0, le=2**31 - 1)
    run_as_group: int | None = Field(default=None, ge=0, le=2**31 - 1)
    run_as_non_root: bool | None = None
    fs_group: int | None = Field(default=None, ge=0, le=2**31 - 1)
    fs_group_change_policy: Literal["OnRootMismatch", "Always"] | None = None
    supplemental_groups: list[Annotated[int, Field(ge=0, le=2**31 - 1)]] = Field(default_factory=list, max_length=32)
    seccomp_profile: SeccompProfile | None = None


class ContainerSecurityContext(ApiModel):
    """securityContext of the main container; each field set replaces the operator's default."""

    run_as_user: int | None = Field(default=None, ge=0, le=2**31 - 1)
    run_as_group: int | None = Field(default=None, ge=0, le=2**31 - 1)
    run_as_non_root: bool | None = None
    allow_privilege_escalation: bool | None = None
    privileged: bool | None = None
    read_only_root_filesystem: bool | None = None
    capabilities: Capabilities | None = None
    """Replaces the default (drop ALL) as a whole; e.g. add IPC_LOCK for RDMA."""
    seccomp_profile: SeccompProfile | None = None


# -------------------------------------------------------------------------------- env and volumes


class KeySelector(ApiModel):
    """A key of a Secret or ConfigMap in the RLJob's namespace."""

    name: DnsSubdomain
    key: str = Field(min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$")
    optional: bool | None = None
    """A missing optional object or key leaves the variable unset; a missing required one is refused (Valid=False)."""


class ObjectFieldSelector(ApiModel):
    field_path: str = Field(min_length=1, max_length=256)
    """e.g. metadata.name, spec.nodeName, status.podIP."""
    api_version: str | None = Field(default=None, max_length=64)


class ResourceFieldSelector(ApiModel):
    resource: str = Field(min_length=1, max_length=MAX_KEY)
    container_name: str | None = Field(default=None, max_length=63)
    divisor: Quantity | None = None


class EnvVarSource(ApiModel):
    secret_key_ref: KeySelector | None = None
    config_map_key_ref: KeySelector | None = None
    field_ref: ObjectFieldSelector | None = None
    resource_field_ref: ResourceFieldSelector | None = None

    model_config = _cel(
        "[has(self.secretKeyRef), has(self.configMapKeyRef), has(self.fieldRef), "
        "has(self.resourceFieldRef)].filter(x, x).size() == 1",
        "valueFrom sets exactly one of secretKeyRef, configMapKeyRef, fieldRef, resourceFieldRef",
    )

    @model_validator(mode="after")
    def _one_source(self) -> EnvVarSource:
        sources = [self.secret_key_ref, self.config_map_key_ref, self.field_ref, self.resource_field_ref]
        if sum(s is not None for s in sources) != 1:
            raise ValueError("valueFrom sets exactly one of secretKeyRef, configMapKeyRef, fieldRef, resourceFieldRef")
        return self


class EnvVar(ApiModel):
    name: str = Field(min_length=1, max_length=256, pattern=ENV_NAME)
    value: str | None = Field(default=None, max_length=32768)
    value_from: EnvVarSource | None = None

    model_config = _cel("!(has(self.value) && has(self.valueFrom))", "env sets value or valueFrom, not both")

    @model_validator(mode="after")
    def _value_or_source(self) -> EnvVar:
        if self.value is not None and self.value_from is not None:
            raise ValueError("env sets value or valueFrom, not both")
        return self


class PVCSource(ApiModel):
    claim_name: DnsSubdomain
    read_only: bool = False


class ConfigMapSource(ApiModel):
    name: DnsSubdomain
    default_mode: int | None = Field(default=None, ge=0, le=0o777)
    optional: bool | None = None


class SecretSource(ApiModel):
    secret_name: DnsSubdomain
    default_mode: int | None = Field(default=None, ge=0, le=0o777)
    optional: bool | None = None


class EmptyDirSource(ApiModel):
    medium: Literal["", "Memory"] | None = None
    size_limit: Quantity | None = None


class HostPathSource(ApiModel):
    path: str = Field(min_length=1, max_length=4096, pattern=r"^/")
    type: (
        Literal["", "DirectoryOrCreate", "Directory", "FileOrCreate", "File", "Socket", "CharDevice", "BlockDevice"]
        | None
    ) = None


class NFSSource(ApiModel):
    server: str = Field(min_length=1, max_length=253)
    path: str = Field(min_length=1, max_length=4096, pattern=r"^/")
    read_only: bool = False


class CSISource(ApiModel):
    driver: DnsSubdomain
    read_only: bool | None = None
    volume_attributes: dict[str, Annotated[str, Field(max_length=1024)]] = Field(default_factory=dict, max_length=32)


_VOLUME_SOURCES = ("persistentVolumeClaim", "configMap", "secret", "emptyDir", "hostPath", "nfs", "csi")


class Volume(ApiModel):
    """An extra pod volume: exactly one source."""

    name: DnsLabel
    persistent_volume_claim: PVCSource | None = None
    config_map: ConfigMapSource | None = None
    secret: SecretSource | None = None
    empty_dir: EmptyDirSource | None = None
    host_path: HostPathSource | None = None
    nfs: NFSSource | None = None
    csi: CSISource | None = None

    model_config = _cel(
        "[" + ", ".join(f"has(self.{s})" for s in _VOLUME_SOURCES) + "].filter(x, x).size() == 1",
        "a volume sets exactly one of " + ", ".join(_VOLUME_SOURCES),
    )

    @model_validator(mode="after")
    def _one_source(self) -> Volume:
        sources = [
            self.persistent_volume_claim,
            self.config_map,
            self.secret,
            self.empty_dir,
            self.host_path,
            self.nfs,
            self.csi,
        ]
        if sum(s is not None for s in sources) != 1:
            raise ValueError("a volume sets exactly one of " + ", ".join(_VOLUME_SOURCES))
        return self


class VolumeMount(ApiModel):
    name: DnsLabel
    """A volume of this template, or of spec.podTemplate."""
    mount_path: str = Field(min_length=1, max_length=4096, pattern=r"^/")
    sub_path: str | None = Field(default=None, max_length=4096)
    read_only: bool = False


class PodResources(ApiModel):
    """Requests and limits of the main container, by resource name, on top of the role's ``resources``.
    GPUs are derived from the parallel sizes and cannot be set here (POD-TEMPLATE-DERIVED)."""

    requests: QuantityMap = Field(default_factory=dict, max_length=16, json_schema_extra=_keys_cel())
    limits: QuantityMap = Field(default_factory=dict, max_length=16, json_schema_extra=_keys_cel())


# ------------------------------------------------------------------------------------- template


class PodTemplate(ApiModel):
    """What a pod of this role gets on top of what the operator derives (docs/operator.md, "Pod customisation")."""

    labels: LabelMap = Field(default_factory=dict, max_length=MAX_LABELS, json_schema_extra=_keys_cel())
    annotations: AnnotationMap = Field(default_factory=dict, max_length=MAX_LABELS, json_schema_extra=_keys_cel())
    node_selector: LabelMap = Field(default_factory=dict, max_length=32, json_schema_extra=_keys_cel())
    tolerations: list[Toleration] = Field(default_factory=list, max_length=MAX_TOLERATIONS)
    """Added to the default toleration of the nvidia.com/gpu taint, which always stays."""
    affinity: Affinity | None = None
    topology_spread_constraints: list[TopologySpreadConstraint] = Field(default_factory=list, max_length=16)
    priority_class_name: DnsSubdomain | None = None
    """A PriorityClass that must exist (Valid=False otherwise)."""
    image_pull_secrets: list[LocalObjectReference] = Field(default_factory=list, max_length=16)
    service_account_name: DnsSubdomain | None = None
    """Must exist. Trainer pods default to <job>-trainer; a chosen one is bound to the same narrow Role."""
    pod_security_context: PodSecurityContext | None = None
    security_context: ContainerSecurityContext | None = None
    env: list[EnvVar] = Field(default_factory=list, max_length=MAX_ENV)
    """Extra environment of the main container; names the operator sets are refused."""
    volumes: list[Volume] = Field(default_factory=list, max_length=MAX_VOLUMES)
    volume_mounts: list[VolumeMount] = Field(default_factory=list, max_length=MAX_VOLUMES)
    """Mounts of the main container."""
    resources: PodResources | None = None
