"""Every environment variable r3operator reads, and the paths and keys its processes share.

One prefix, ``R3OPERATOR_``, for every variable; a variable's name is the prefix plus its field name in
upper case (``RuntimeSettings.steps`` is ``R3OPERATOR_STEPS``). Two groups read them:

- :class:`OperatorSettings`: the kopf operator (``r3operator operator``), read once at import of the handlers;
- :class:`RuntimeSettings`: the training driver (``r3operator run``), local overrides and what the
  operator sets on the trainer pods.

The mount paths and ConfigMap keys below are written by the operator's builders and read by the
engines and the runtime; keeping them here means neither side imports the other to agree on them.

This module sits at the bottom of the package beside ``api``: it imports pydantic-settings and nothing of
ours, so the operator, the engine, the trainer and the runtime all read it without importing each other
(tests/test_layers.py enforces that).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

# Any: pydantic-settings' validators take the raw environment value before it is parsed: Any until parsed.

ENV_PREFIX = "R3OPERATOR_"

# Paths inside every engine and trainer container, and the ConfigMap that carries the runtime config.
ROUTING_MOUNT = "/var/lib/r3operator"
"""Where the routing-data volume is mounted in every engine and trainer container."""
CONFIG_DIR = "/etc/r3operator"
"""Where the RLJob's ConfigMap is mounted (read-only) in every engine and trainer container."""
CONFIG_KEY = "config.json"
"""The ConfigMap key holding the runtime config; the volume makes it the file CONFIG_PATH."""
CONFIG_PATH = f"{CONFIG_DIR}/{CONFIG_KEY}"
"""The resolved runtime config as seen inside every container (``r3operator run --config`` reads it)."""
PROGRESS_KEY = "progress"
"""The key of the ConfigMap ``<job>-progress`` the trainer driver writes its ``Progress`` JSON under (the operator
copies it into the RLJob's ``status.progress``: operator/progress.py)."""
REFERENCE_MODELS_SUBDIR = "models"
REFERENCE_MODELS_DIR = f"{ROUTING_MOUNT}/{REFERENCE_MODELS_SUBDIR}"
"""r3operator://reference/<name> models are generated onto the shared volume by the trainer driver."""
MODEL_MOUNT = "/mnt/model"
"""pvc://claim/path models: the claim is mounted read-only here; hf://, s3:// and gs:// models: the model cache
is (``MODEL_MOUNT/<cache key>``, api/sources.py)."""
DATA_MOUNT = "/mnt/data"
"""An s3:// or gs:// ``task.datasetPath`` is fetched to ``DATA_MOUNT/<cache key>`` in the trainer's head pod."""
EXPORT_MOUNT = "/mnt/export"
"""A pvc:// ``export.destination``: the claim is mounted read-write here in the trainer's head pod."""
RUNS_DIR = "runs"
"""Run outputs (routes, checkpoints, metrics.csv) go to ``<routingDir>/runs/<job>``."""

ENGINE_IMAGE_ENV = f"{ENV_PREFIX}ENGINE_IMAGE"
"""Set on the engines of a disaggregated job to the image their pod runs: the driver pairs a prefill engine only with
a decode engine of the same build (rollout/disaggregated.py), also while an upgrade rolls the two roles."""


def engine_image() -> str | None:
    """The image this engine's pod runs (ENGINE_IMAGE_ENV), where the operator set it."""
    return os.environ.get(ENGINE_IMAGE_ENV) or None


DEFAULT_CANARY_URL = "http://{service}-0.{service}.{namespace}.svc:{port}"
"""The first engine pod; ``{service}``, ``{namespace}``, ``{port}``, ``{name}`` are filled in."""


class SettingsError(ValueError):
    """An environment variable holds a value its setting refuses; the message names the variable."""


def _comma_list(value: Any) -> Any:
    if isinstance(value, str):
        return [item.strip() for item in value.split(",") if item.strip()]
    return value


class _Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_ignore_empty=True, frozen=True, extra="ignore")

    @classmethod
    def env_name(cls, field: str) -> str:
        """The environment variable that sets ``field`` (KeyError for a field this group lacks)."""
        info = cls.model_fields[field]
        alias = info.validation_alias
        return alias if isinstance(alias, str) else ENV_PREFIX + field.upper()

    @classmethod
    def env_names(cls) -> list[str]:
        return [cls.env_name(name) for name in cls.model_fields]


class OperatorSettings(_Settings):
    """What the operator reads from its Deployment's environment (charts/r3operator sets some)."""

    resync_seconds: float = Field(300.0, gt=0)
    """The longest an RLJob goes without a pass: the safety net under the watches, which wake a pass
    within a second of a child's change."""
    settle_seconds: float = Field(0.5, ge=0, le=10)
    """How long a pass woken by a child's event waits first, so that the rest of that burst (a StatefulSet's status
    written one field at a time, the echoes of the pass's own writes) goes into the same pass and status write.
    A change of the RLJob itself, its first pass and a retry do not wait; 0 turns the wait off."""
    discovery_ttl_seconds: float = Field(15.0, ge=0)
    """Cache of 'is KubeRay / the PodMonitor CRD installed'."""
    watch_server_timeout_seconds: int = Field(600, gt=0)
    """Server-side watch timeout: a kopf watch can hang silently without one. Whole seconds:
    kube-apiserver parses ``timeoutSeconds`` as an integer and refuses ``600.0`` with a 400."""
    watch_client_timeout_seconds: float = Field(660.0, gt=0)
    """Client-side watch timeout, a bit above the server's so the server closes first."""
    metrics_port: int = Field(9090, ge=0, le=65535)
    """prometheus-client port; 0 disables the server."""
    canary: bool = True
    """False disables the R3 routed-experts canary (RoutingReplayActive then stays Unknown)."""
    canary_url: str = DEFAULT_CANARY_URL
    """Where the canary goes (``{service}``, ``{namespace}``, ``{port}``, ``{name}`` are filled in)."""
    operator_namespace: str | None = Field(None, min_length=1)
    """The operator's namespace (the chart sets it from the downward API): each RLJob's engine NetworkPolicy
    admits it to the engine port, for the canary. Unset outside a cluster: no namespace is admitted."""
    service_account: str | None = Field(None, min_length=1)
    """The operator's own ServiceAccount (the chart sets it from the downward API): an RLJob in the operator's
    namespace whose pod template names it is refused (its pods would hold the operator's rights)."""
    pod_name: str | None = Field(None, min_length=1)
    """This replica's pod name (the chart sets it from the downward API): its leader-election identity."""
    engine_ingress_namespaces: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """Comma-separated namespaces also admitted to the engine port, e.g. the one Prometheus scrapes from."""

    @field_validator("engine_ingress_namespaces", mode="before")
    @classmethod
    def _split_namespaces(cls, value: Any) -> Any:
        return _comma_list(value)


class RuntimeSettings(_Settings):
    """What the training driver reads from its environment; command-line options win over these."""

    steps: int | None = Field(None, ge=1)
    """Replaces ``spec.algorithm.steps``."""
    model: str | None = None
    """A reference model name (``tiny``, ``small``, ``gpu``, ``a3b``) or a model directory; skips the architecture
    check."""
    model_dir: Path | None = None
    """The policy model's directory, for models the runtime cannot fetch itself (hf://, s3://, gs://, pvc://)."""
    dataset_path: Path | None = None
    """The dataset file of ``task.name: dataset``; wins over ``spec.task.datasetPath`` (set it where the file was
    fetched or mounted somewhere else)."""
    engine_dtype: str | None = None
    """vLLM engine dtype (default: float32 on CPU, bfloat16 on CUDA)."""
    trainer_ranks: int | None = Field(None, ge=1)
    """Trainer ranks (Ray actors, FSDP2 over all); default: trainer.nodes × trainer.gpusPerNode on CUDA, 1 on CPU."""
    engine_urls: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """Comma-separated engine URLs; replaces the ConfigMap's ``engineURLs`` (HTTP engines)."""
    prefill_engine_urls: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """Comma-separated prefill engine URLs of a disaggregated job; replaces the ConfigMap's ``prefillEngineURLs``."""
    mounts: Annotated[dict[str, Path], NoDecode] = Field(default_factory=dict)
    """Comma-separated ``CONTAINER_PATH=HOST_PATH`` pairs: where a pod's volume lives outside a pod
    (``r3operator up``). Paths the driver reads from its argv, the ConfigMap and the environment
    (``--config``, ``routingDir``, the model directory) are looked up through them (:meth:`host_path`)."""
    driver_metrics_port: int | None = Field(None, ge=0, le=65535)
    """The driver's Prometheus port; replaces ``spec.monitoring.port`` under ``--config`` (0: off)."""
    sync_canary_epsilon: float | None = Field(None, ge=0)
    """Weight-sync canary: logit gap accepted at a near-tie (default 128 × the engine's unit roundoff: 0.5 for
    bf16, 0.0625 for fp32 on CUDA, 7.6e-6 for fp32 on CPU)."""
    sync_canary_logprob_tol: float | None = Field(None, ge=0)
    """Weight-sync canary: |Δlogprob| accepted per greedy token (default 64 × the engine's unit roundoff +
    2^-13: 0.25 for bf16, 0.031 for fp32 on CUDA, 1.3e-4 for fp32 on CPU)."""
    sync_pre_abort: Literal["auto", "always"] = "auto"
    """Native weight sync: close brackets left open before a sync only where one can be open ("auto": before a
    rendezvous, after a failure) or before every sync ("always", the earlier behaviour: two round trips more
    per engine and sync)."""
    sync_receipt: bool = True
    """Weight-sync canary: compare every engine worker's receipt of a sync (fingerprints of each tensor it
    loaded, parameters that kept old values) with what the trainer sent; false skips that comparison."""
    fault_nonfinite_steps: Annotated[list[int], NoDecode] = Field(default_factory=list)
    """Fault injection, for tests and the GPU acceptance run: comma-separated step numbers on which the driver
    makes the first ``miniBatches`` samples' advantages NaN (one in each mini-batch), so none of that step's
    updates is finite (the non-finite guard must keep them off the engines and the checkpoints). Never set it
    on a real job."""
    export_aws_access_key_id: SecretStr | None = None
    """spec.export to s3:// or gs://: the access key (an HMAC access ID for gs://), from export.s3 or export.gcs's
    Secret (set by the operator on the trainer's head pod). Unset: the S3 client's own chain (AWS_* variables, a
    web identity, an instance profile)."""
    export_aws_secret_access_key: SecretStr | None = None
    export_aws_session_token: SecretStr | None = None
    export_retry_base_s: float = Field(1.0, ge=0)
    """spec.export: the first backoff delay between tries of an export's upload or copy, doubled each retry."""
    export_retry_cap_s: float = Field(60.0, ge=0)
    """spec.export: the largest backoff delay between tries."""
    rljob_name: str | None = None
    """The RLJob whose ``status.progress`` the driver patches (set by the operator on trainer pods)."""
    rljob_namespace: str | None = None
    """Its namespace (set by the operator on trainer pods)."""
    cache_dir: Path | None = None
    """Reference models are generated under ``<cache_dir>/models`` (default ``~/.cache/r3operator``)."""
    engine_retry_attempts: int | None = Field(None, ge=1)
    """Tries of one engine call (HTTP or Ray) before it fails the step (default 6)."""
    engine_retry_base_s: float | None = Field(None, ge=0)
    """First backoff delay between tries, doubled each retry (default 1 s)."""
    engine_retry_cap_s: float | None = Field(None, ge=0)
    """Largest backoff delay between tries (default 30 s)."""
    engine_ready_attempts: int | None = Field(None, ge=1)
    """Checks of a (re)starting engine before giving up on it (default 40, about 9 minutes in all)."""
    engine_ready_base_s: float | None = Field(None, ge=0)
    """First delay between readiness checks (default 1 s)."""
    engine_ready_cap_s: float | None = Field(None, ge=0)
    """Largest delay between readiness checks (default 15 s)."""
    service_account_dir: Path = Path("/var/run/secrets/kubernetes.io/serviceaccount")
    """The pod's ServiceAccount token and CA (what the driver's status patches authenticate with)."""
    kubernetes_service_host: str | None = Field(None, validation_alias="KUBERNETES_SERVICE_HOST")
    kubernetes_service_port: int = Field(443, validation_alias="KUBERNETES_SERVICE_PORT")
    """Set by Kubernetes beside the host: the API server's port inside the cluster."""
    """Set by Kubernetes in every pod: the driver only talks to the API server when it is there."""

    @field_validator("engine_urls", "prefill_engine_urls", "fault_nonfinite_steps", mode="before")
    @classmethod
    def _split_commas(cls, value: Any) -> Any:
        return _comma_list(value)

    @field_validator("mounts", mode="before")
    @classmethod
    def _split_mounts(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        mounts: dict[str, str] = {}
        for item in _comma_list(value):
            inside, sep, outside = item.partition("=")
            if not sep or not inside.startswith("/") or not outside:
                raise ValueError(f"{item!r} is not CONTAINER_PATH=HOST_PATH with an absolute CONTAINER_PATH")
            mounts[inside.rstrip("/") or "/"] = outside
        return mounts

    @property
    def in_cluster(self) -> bool:
        return bool(self.kubernetes_service_host)

    def host_path(self, path: str | Path) -> Path:
        """``path`` as seen in a container → where it is on this host, through the longest matching mount."""
        text = str(path)
        for inside in sorted(self.mounts, key=len, reverse=True):
            if text == inside or text.startswith(inside.rstrip("/") + "/"):
                return Path(self.mounts[inside]) / text[len(inside) :].lstrip("/")
        return Path(text)


_S = TypeVar("_S", bound=_Settings)


def load(group: type[_S]) -> _S:
    """Read ``group`` from the environment; a refused value raises SettingsError naming the variable."""
    try:
        return group()
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            field = str(error["loc"][0]) if error["loc"] else ""
            name = group.env_name(field) if field in group.model_fields else field
            problems.append(f"{name}={error.get('input')!r}: {error['msg']}")
        raise SettingsError("; ".join(problems)) from None


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """``R3OPERATOR_*`` variables no group declares: a misspelt name would otherwise be ignored silently."""
    known = set(OperatorSettings.env_names()) | set(RuntimeSettings.env_names())
    names = os.environ if environ is None else environ
    return sorted(n for n in names if n.upper().startswith(ENV_PREFIX) and n.upper() not in known)


def process_environment() -> dict[str, str]:
    """This process's whole environment, for a launcher that hands it on to its children (``r3operator up``)."""
    return dict(os.environ)


def operator_settings() -> OperatorSettings:
    return load(OperatorSettings)


def runtime_settings() -> RuntimeSettings:
    return load(RuntimeSettings)
