"""What the driver runs: the RLJob (from a file or the operator's ConfigMap) plus local overrides.

In a pod the operator mounts its ConfigMap at `/etc/r3operator/config.json`: an `api.runtime_config.RuntimeConfig`,
which `r3operator.operator.builders.config.runtime_config` writes (tests/runtime/test_config_contract.py pins it):

    {"apiVersion", "kind", "metadata", "spec",          # the RLJob, defaults filled
     "resolved": {...},                                  # the operator's plan (status.resolved)
     "runtime": {"engineURLs": ["http://<job>-engine-0.<job>-engine.<ns>.svc:8000", ...],
                 "routingDir": "/var/lib/r3operator", ...}}

`runtime.engineURLs` (or env R3OPERATOR_ENGINE_URLS, comma-separated) switches rollouts to HTTP engine Services;
without them the driver starts in-process vLLM engines in Ray actors. Run outputs (routes, checkpoints,
metrics.csv) go to `<routingDir>/runs/<job>` on the shared volume.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from r3operator.api.load import FieldProblem, RLJobLoadError, load_rljob
from r3operator.api.runtime_config import RuntimeConfig
from r3operator.api.v1alpha1 import RLJob
from r3operator.api.vllm_args import model_source
from r3operator.api.weight_transfer import TransferChoice
from r3operator.models.architecture import architecture
from r3operator.runtime.sources import fetched_model_dir
from r3operator.settings import REFERENCE_MODELS_SUBDIR, RuntimeSettings, runtime_settings


@dataclass
class RunSettings:
    job: RLJob
    run_dir: Path
    device: str = "cpu"
    steps: int = 1
    resume: bool = True
    model_override: str | None = None
    replay_override: str | None = None  # "R3" / "R2" / "Disabled" (compare-replay)
    metrics_port: int | None = None
    engine_urls: list[str] = field(default_factory=list)
    prefill_engine_urls: list[str] = field(default_factory=list)
    """A disaggregated job's prefill engines (its decode engines are `engine_urls`)."""
    engine_dtype: str = "float32"
    show_progress: bool = True
    routing_dir: Path | None = None
    """The routing volume (``--config`` only): reference models are generated onto it for the engines."""
    trainer_ranks: int | None = None  # None: trainer/factory.world_size decides from the RLJob and the device
    weight_transfer: TransferChoice | None = None
    """The operator's weight-sync choice (runtime.weightTransfer); None: chosen from the local topology."""

    @property
    def name(self) -> str:
        return self.job.metadata.name


def load_job_file(path: Path) -> RLJob:
    return load_rljob(path)


def load_job_config(path: Path) -> RuntimeConfig:
    """The operator's ConfigMap file; RLJobLoadError names the file and each field that does not fit."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise RLJobLoadError(str(path), [FieldProblem("", f"cannot read file: {exc.strerror or exc}")]) from None
    return RuntimeConfig.from_json(text, source=str(path))


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_model_dir(job: RLJob, override: str | None = None, *, routing_dir: Path | None = None) -> Path:
    """Local directory of the policy model. `override` (a reference name or a path) wins.

    With a routing volume (`routing_dir`), a reference model is also placed where the engine pods' `vllm serve`
    looks for it (``<routingDir>/models/<name>``, api/vllm_args.model_source)."""
    from r3operator.models import ensure_reference_model, place_reference_model

    if override:
        path = Path(override)
        return path if path.is_dir() else ensure_reference_model(override)
    env = runtime_settings()
    if env.model_dir:
        return env.host_path(env.model_dir)
    uri = job.spec.model.uri
    source = model_source(job.spec)
    if source.scheme == "r3operator":
        name = source.source.location
        if routing_dir is not None:
            return place_reference_model(name, routing_dir / REFERENCE_MODELS_SUBDIR)
        return ensure_reference_model(name)
    if source.scheme == "file":
        return env.host_path(source.directory)
    if source.fetched:
        return fetched_model_dir(job)
    if source.mounted:
        # In a pod the operator mounts the claim here (operator/builders/model.py).
        directory = env.host_path(source.directory)
        if directory.is_dir():
            return directory
        raise ValueError(
            f"spec.model.uri {uri!r}: the model's directory {directory} is not there; in a pod the operator mounts "
            f"it, elsewhere set {RuntimeSettings.env_name('model_dir')} to the model's directory"
        )
    raise ValueError(
        f"spec.model.uri {uri!r}: the runtime loads r3operator://reference/<name>, file://, pvc://, hf:// and "
        f"s3:// models; for others set {RuntimeSettings.env_name('model_dir')} to the model's directory"
    )


def check_architecture(job: RLJob, hf_config: Any) -> None:
    """spec.model.architecture must describe the model actually loaded (routes are shaped by it)."""
    arch = job.spec.model.architecture
    if arch is None:
        return
    actual = architecture(hf_config)
    declared = {"numLayers": arch.num_layers, "numExperts": arch.num_experts, "topK": arch.top_k}
    wrong = [f"{k}={declared[k]} (model has {actual[k]})" for k in declared if declared[k] != actual[k]]
    if wrong:
        raise ValueError("spec.model.architecture does not match the model: " + ", ".join(wrong))
