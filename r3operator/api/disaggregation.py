"""Prefill/decode disaggregation (`spec.inference.disaggregation`): each role as a spec of its own, and its connector.

A role is rendered as the engines of a spec whose `inference` carries the role's replicas and parallel sizes
(`role_spec`), so the `vllm serve` flags, the pod layout and the probes are the ones a single-role job gets; the
role adds `--kv-transfer-config` (`kv_transfer_config`). The decode role keeps the engine objects' names
(`<job>-engine`: the upgrade record, the verified image and the trainer's engine URLs live there); the prefill
role is `<job>-prefill`.

Where the routes come from (rollout/disaggregated.py): the prefill engine computes every prompt token and never
loads KV; the decode engine loads the prompt's KV, recomputes the prompt's last token and generates. A sample's
record holds the prefill engine's rows for the prompt and the decode engine's for the generated tokens.
"""

from __future__ import annotations

import json

from r3operator.api.enums import EngineRole, PDConnector
from r3operator.api.names import ROLE_ENGINE, ROLE_PREFILL
from r3operator.api.v1alpha1 import EngineRoleSpec, RLJobSpec
from r3operator.settings import ROUTING_MOUNT

KV_ROLES: dict[EngineRole, str] = {EngineRole.PREFILL: "kv_producer", EngineRole.DECODE: "kv_consumer"}
"""vLLM's kv_role per role (NixlConnector deprecates kv_both; R3StorageConnector loads only as a consumer)."""
STORAGE_CONNECTOR_CLASS = "R3StorageConnector"
STORAGE_CONNECTOR_MODULE = "r3operator.engine.kv_storage"
STORAGE_SUBDIR = "kv-transfer"
"""Where the storage connector's transfers live, under the routing volume (engines mount it writable there)."""
NIXL_CONNECTOR = "NixlConnector"
NIXL_PORT_ENV = "VLLM_NIXL_SIDE_CHANNEL_PORT"
NIXL_SIDE_CHANNEL_PORT = 5600
"""vLLM's default VLLM_NIXL_SIDE_CHANNEL_PORT: the decode engine's handshake with a prefill engine (every NixlConnector
engine core listens there, at this port + its DP index)."""


def roles(spec: RLJobSpec) -> tuple[EngineRole, ...]:
    """The engine roles the job renders: prefill then decode when disaggregated, else none (one engine group)."""
    return (EngineRole.PREFILL, EngineRole.DECODE) if spec.inference.disaggregation is not None else ()


def role_of(spec: RLJobSpec, role: EngineRole) -> EngineRoleSpec:
    pd = spec.inference.disaggregation
    if pd is None:
        raise ValueError("spec.inference.disaggregation is not set: the engines have no prefill or decode role")
    return pd.prefill if role is EngineRole.PREFILL else pd.decode


def role_spec(spec: RLJobSpec, role: EngineRole) -> RLJobSpec:
    """`spec` with `inference` as one role's engines run it: its replicas and parallel sizes, one pod per replica."""
    part = role_of(spec, role)
    inf = spec.inference
    update = {
        "replicas": part.replicas if part.replicas is not None else inf.replicas,
        "tensor_parallel_size": part.tensor_parallel_size or inf.tensor_parallel_size,
        "data_parallel_size": part.data_parallel_size or inf.data_parallel_size,
        "data_parallel_size_local": None,
    }
    return spec.model_copy(update={"inference": inf.model_copy(update=update)})


def role_replicas(spec: RLJobSpec, role: EngineRole) -> int:
    return role_spec(spec, role).inference.replicas


def engine_replicas(spec: RLJobSpec) -> int:
    """The replicas of the engines named ``<job>-engine``: a disaggregated job's decode role, else every engine."""
    return role_replicas(spec, EngineRole.DECODE) if roles(spec) else spec.inference.replicas


def engine_role_name(role: EngineRole | None) -> str:
    """The role of its children (their names' suffix and their role label): the decode role keeps the single
    group's (`engine`)."""
    return ROLE_PREFILL if role is EngineRole.PREFILL else ROLE_ENGINE


def storage_path() -> str:
    return f"{ROUTING_MOUNT}/{STORAGE_SUBDIR}"


def kv_transfer_config(spec: RLJobSpec, role: EngineRole, *, storage_dir: str | None = None) -> dict[str, object]:
    """The role's `--kv-transfer-config`. `storage_dir`: where the storage connector's transfers live (default: the
    routing volume's; a local run passes its own)."""
    pd = spec.inference.disaggregation
    if pd is None:
        raise ValueError("spec.inference.disaggregation is not set")
    if pd.connector is PDConnector.NIXL:
        return {"kv_connector": NIXL_CONNECTOR, "kv_role": KV_ROLES[role]}
    return {
        "kv_connector": STORAGE_CONNECTOR_CLASS,
        "kv_connector_module_path": STORAGE_CONNECTOR_MODULE,
        "kv_role": KV_ROLES[role],
        "kv_connector_extra_config": {"shared_storage_path": storage_dir or storage_path()},
    }


def kv_transfer_arg(spec: RLJobSpec, role: EngineRole, *, storage_dir: str | None = None) -> list[str]:
    config = kv_transfer_config(spec, role, storage_dir=storage_dir)
    return ["--kv-transfer-config", json.dumps(config, separators=(",", ":"))]
