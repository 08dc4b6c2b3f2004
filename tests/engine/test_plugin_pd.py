"""The plugin's `VllmConfig` patch: routed-experts capture is admitted with a stitched prefill/decode connector role,
and stays refused where vLLM refuses it for a reason stitching does not remove (kv_both, offload, pipeline)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


def _config(model: Path, kv: dict[str, Any], **extra: Any) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=str(model),
        enable_return_routed_experts=True,
        kv_transfer_config=kv,
        enforce_eager=True,
        max_model_len=256,
        **extra,
    )
    return args.create_engine_config()


def test_capture_is_admitted_only_for_a_stitched_connector_role(tiny_model_dir: Path) -> None:
    pytest.importorskip("vllm")
    from vllm.config import VllmConfig

    from r3operator.engine.plugin import register

    register()
    producer = {"kv_connector": "NixlConnector", "kv_role": "kv_producer"}
    config = _config(tiny_model_dir, producer)
    assert config.model_config.enable_return_routed_experts  # the flag survives validation
    consumer = {
        "kv_connector": "R3StorageConnector",
        "kv_connector_module_path": "r3operator.engine.kv_storage",
        "kv_role": "kv_consumer",
    }
    assert _config(tiny_model_dir, consumer).kv_transfer_config.is_kv_consumer

    # vLLM itself refuses the same config: what the patch lifts, and only for these roles.
    original = VllmConfig.__post_init__.__wrapped__
    with pytest.raises(ValueError, match="incompatible with KV connectors"):
        original(config)
    for refused in (
        {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
        {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"},
        {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_producer"},
    ):
        with pytest.raises(ValueError, match="incompatible with KV connectors"):
            _config(tiny_model_dir, refused)


def test_a_release_whose_model_config_has_no_capture_flag_gets_vllms_own_validation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # vLLM >= 0.31 moved the flag to AuxOutputConfig and refuses NixlConnector in its own AuxOutput check. On an H100
    # with vLLM 0.33.0 the patch read ModelConfig.enable_return_routed_experts and every engine failed at start
    # with an AttributeError (2026-12-08); it must hand such a config to vLLM's validation untouched.
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from vllm.config import VllmConfig

    from r3operator.engine.plugin import PluginState, _patch_routed_experts_with_pd_connector

    validated: list[Any] = []
    monkeypatch.setattr(VllmConfig, "__post_init__", lambda self: validated.append(self))
    _patch_routed_experts_with_pd_connector(PluginState(vllm_version="0.33.0", calls=1))
    producer = SimpleNamespace(kv_connector="NixlConnector", kv_role="kv_producer")
    aux = SimpleNamespace(enable_return_routed_experts=True)
    config = SimpleNamespace(model_config=SimpleNamespace(), kv_transfer_config=producer, aux_output_config=aux)
    VllmConfig.__post_init__(config)  # type: ignore[arg-type]  # the shape of a 0.33 VllmConfig, as far as read
    assert validated == [config] and aux.enable_return_routed_experts
