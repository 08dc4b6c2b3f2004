"""RLJob inference spec → `vllm serve` arguments and environment. Pure: no vLLM import, no I/O.

The operator's engine builder and the local runner both call these, so the flags an engine pod runs
with are exactly the flags `r3operator render` shows.

Replay modes and route capture:
- R3: engines capture routes (``--enable-return-routed-experts``) and must use the ``mp`` executor
  (the ray executor hangs with capture on, vLLM #36237);
- R2 and Disabled: capture stays off. R2 replays the trainer's *own* routing, so an R2 engine must
  never return rollout routes that something downstream could consume by mistake.

``inference.extraArgs`` come last; the API rule EXTRA-ARGS-DERIVED refuses flags derived here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from r3operator.api.disaggregation import kv_transfer_arg
from r3operator.api.engine_layout import engine_layout
from r3operator.api.enums import EngineRole, KVConnector, ReplayMode
from r3operator.api.sources import SourceURI, parse_source_uri
from r3operator.api.v1alpha1 import RLJobSpec
from r3operator.api.versions import resolve_engine_version, supports
from r3operator.api.weight_transfer import cluster_transfer, weight_transfer_config_arg
from r3operator.settings import ENGINE_IMAGE_ENV, MODEL_MOUNT, REFERENCE_MODELS_DIR

WORKER_EXTENSION_CLS = "r3operator.engine.worker.WeightSyncWorkerExtension"
"""Weight-sync hooks loaded into every vLLM worker (collective_rpc targets)."""
VLLM_PLUGIN_NAME = "r3operator"
"""Our `vllm.general_plugins` entry point name (pyproject.toml)."""
LOGPROBS_MODE = "processed_logprobs"
"""vLLM returns the sampled token's logprob after temperature (and top-k/top-p, which our requests turn
off): the log-probability under the distribution it was drawn from, the one the trainer scores with
logits / T. vLLM's default, raw_logprobs, is the T = 1 distribution whatever the temperature."""

_KV_CONNECTORS: dict[KVConnector, str] = {
    KVConnector.NIXL: "NixlConnector",
    KVConnector.LMCACHE: "LMCacheConnectorV1",
    KVConnector.OFFLOADING: "OffloadingConnector",
}


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where engine and trainer pods find the model of ``spec.model.uri``: the one resolver both use.

    - ``hf://org/name[@rev]``, ``s3://bucket/prefix`` and ``gs://bucket/prefix``: fetched once into the model
      cache claim, which every engine and trainer pod mounts read-only at MODEL_MOUNT; the model is
      ``MODEL_MOUNT/<cache key>``
      (api/sources.py; runtime/fetch.py fills and verifies that directory);
    - ``pvc://claim/path``: the claim is mounted read-only at MODEL_MOUNT, the model is ``MODEL_MOUNT/path``;
    - ``file:///path``: a path already inside the pod's image or node;
    - ``r3operator://reference/<name>``: generated onto the routing volume by the trainer driver;
    """

    source: SourceURI
    directory: str
    """The model's directory inside every pod."""
    claim: str | None = None
    """pvc:// only: the PersistentVolumeClaim mounted at MODEL_MOUNT."""

    @property
    def scheme(self) -> str:
        return self.source.scheme

    @property
    def fetched(self) -> bool:
        """Copied into the model cache before any engine or trainer pod starts."""
        return self.source.fetched

    @property
    def mounted(self) -> bool:
        """The pods get a ``model`` volume at MODEL_MOUNT (the user's claim or the model cache)."""
        return self.claim is not None or self.fetched


def model_source(spec: RLJobSpec) -> ModelSource:
    """SourceURIError for a URI the rules refuse (MODEL-URI-FORM); they run before anything is rendered."""
    uri = spec.model.uri
    source = parse_source_uri(uri, revision=spec.model.revision)
    if source.fetched:
        return ModelSource(source, f"{MODEL_MOUNT}/{source.cache_key}")
    if source.scheme == "pvc":
        return ModelSource(source, f"{MODEL_MOUNT}/{source.path}".rstrip("/"), claim=source.location)
    if source.scheme == "file":
        return ModelSource(source, source.location)
    if source.scheme == "r3operator":
        return ModelSource(source, f"{REFERENCE_MODELS_DIR}/{source.location}")
    return ModelSource(source, uri)


def model_path(spec: RLJobSpec) -> str:
    """What `vllm serve` is given as the model for `spec.model.uri` (and so the name it serves it under)."""
    return model_source(spec).directory


def captures_routes(spec: RLJobSpec) -> bool:
    """Only R3 consumes rollout routes; R2 and Disabled never turn capture on."""
    return spec.routing_replay.mode is ReplayMode.R3


R3_MOE_BACKEND = "triton"
"""The fused-MoE kernel R3 pins on a vLLM whose capture misses monolithic kernels (see below)."""


def capture_safe_moe_backend(spec: RLJobSpec) -> list[str]:
    """`--moe-backend triton` where R3's capture would silently miss a monolithic MoE kernel.

    Before 0.30.0 vLLM captures routes in `BaseRouter.select_experts`, which a monolithic kernel (FlashInfer
    TRT-LLM BF16/FP8/FP4, the first choice for unquantized MoE on Blackwell in 0.22.1's
    fused_moe/oracle/unquantized.py) never calls: every route comes back zero. Triton routes through
    `select_experts`. 0.30.0 binds capture into the monolithic kernels that support it and refuses the
    others at start-up, so it needs no pin. Versions before `--moe-backend` get no flag (the zero-route check
    at the first step is what catches it there).
    """
    version = resolve_engine_version(image=spec.inference.image, explicit=spec.inference.vllm_version)
    if supports(version, "routed-experts-monolithic") is not False or not supports(version, "moe-backend-flag"):
        return []
    return ["--moe-backend", R3_MOE_BACKEND]


def vllm_serve_args(
    spec: RLJobSpec, *, model_path: str, role: EngineRole | None = None, kv_storage_dir: str | None = None
) -> list[str]:
    """The full `vllm serve` command line (including `vllm serve MODEL`) for one engine pod; `role`: of a
    disaggregated job, whose engines `spec` (`api/disaggregation.role_spec`) already describes."""
    inf = spec.inference
    args = ["vllm", "serve", model_path, "--port", str(inf.port)]
    if spec.model.trust_remote_code:
        args.append("--trust-remote-code")
    args += [
        "--tensor-parallel-size",
        str(inf.tensor_parallel_size),
        "--pipeline-parallel-size",
        str(inf.pipeline_parallel_size),
        "--data-parallel-size",
        str(inf.data_parallel_size),
        "--data-parallel-size-local",
        str(engine_layout(spec).dp_local),
    ]
    if inf.decode_context_parallel_size > 1:
        args += ["--decode-context-parallel-size", str(inf.decode_context_parallel_size)]
    if inf.enable_expert_parallel:
        args.append("--enable-expert-parallel")
    args += ["--distributed-executor-backend", inf.executor_backend.value]
    if inf.max_model_len is not None:
        args += ["--max-model-len", str(inf.max_model_len)]
    args += ["--gpu-memory-utilization", f"{inf.gpu_memory_utilization:g}"]
    args += ["--logprobs-mode", LOGPROBS_MODE]
    if captures_routes(spec):
        args.append("--enable-return-routed-experts")
        args += capture_safe_moe_backend(spec)
    if inf.async_scheduling:
        args.append("--async-scheduling")
    if inf.speculative_decoding is not None:
        sd = inf.speculative_decoding
        config = {"method": sd.method, "num_speculative_tokens": sd.num_speculative_tokens}
        args += ["--speculative-config", json.dumps(config, separators=(",", ":"))]
    connector = _KV_CONNECTORS.get(inf.kv_connector)
    if connector is None and inf.kv_cache_offload:
        connector = _KV_CONNECTORS[KVConnector.OFFLOADING]
    if role is not None:
        args += kv_transfer_arg(spec, role, storage_dir=kv_storage_dir)
    elif connector is not None:
        kv = {"kv_connector": connector, "kv_role": "kv_both"}
        args += ["--kv-transfer-config", json.dumps(kv, separators=(",", ":"))]
    transfer = cluster_transfer(spec)
    if transfer.native:  # only on images whose vLLM has the backend and the start/finish bracket
        args += ["--weight-transfer-config", weight_transfer_config_arg(transfer.method)]
    args += ["--worker-extension-cls", WORKER_EXTENSION_CLS]
    args += list(inf.extra_args)
    return args


def vllm_env(spec: RLJobSpec) -> dict[str, str]:
    """Environment of the engine container (sorted keys, so manifests are stable)."""
    env = {
        # An allowlist: only our plugin loads, whatever else the image happens to ship.
        "VLLM_PLUGINS": VLLM_PLUGIN_NAME,
        # The trainer drives weight sync over HTTP (/collective_rpc, /reset_prefix_cache), which vLLM serves
        # only in dev mode; the operator fences the port with a NetworkPolicy (operator/builders/network.py).
        "VLLM_SERVER_DEV_MODE": "1",
    }
    if spec.inference.model_runner_v2:
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    if spec.inference.disaggregation is not None:
        # The build a prefill engine must share with its decode engine (rollout/disaggregated.py).
        env[ENGINE_IMAGE_ENV] = spec.inference.image
    return dict(sorted(env.items()))
