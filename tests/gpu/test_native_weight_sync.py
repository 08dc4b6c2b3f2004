"""GPU: weight sync through vLLM's native transfer, with the canary after every sync.

    PYTHONPATH=/tmp/site:. VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0 \
        python3 -m pytest tests/gpu/test_native_weight_sync.py -m gpu -q

- 1 GPU, `vllm serve` engine sharing the trainer's GPU: CUDA IPC over vLLM's HTTP routes vs the packed file
  path (benchmarks/bench_weight_sync.py), and a trainer failure in the middle of a native sync;
- 1 GPU, the local run's topology (engine in a Ray actor on the driver's GPU): IPC through `LLM` methods;
- 2 GPUs (skipped on 1): engine on GPU 1, trainer on GPU 0, NCCL.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_two = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (engine and trainer apart)")


@needs_cuda
def test_ipc_over_http_vs_the_file_path_with_the_canary_and_a_fault(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from benchmarks.bench_weight_sync import main

    r = main(["--model", "gpu", "--methods", "ipc,packed", "--syncs", "2", "--log-dir", str(tmp_path)])
    assert r["weight_transfer"].startswith("ipc (vLLM "), r["weight_transfer"]
    for method in ("ipc", "packed"):
        assert r["methods"][method]["canary_ok"] == "2/2", (method, r["methods"][method])
    fault = r["fault_mid_sync_ipc"]["checkpoint"]
    assert "injected" in fault["error"], fault
    assert fault["tag_after_failure"] is None  # no policy served from a half-loaded engine
    assert len(fault["resynced"]) == 1 and fault["tag_after_resync_is_current"], fault


@needs_cuda
def test_the_kernel_layout_over_ipc_is_written_into_the_engines_parameters(tmp_path: Path) -> None:
    """The trainer maps the engine's parameters and writes them in place (weightsync/mapped.py): each sync passes the
    receipt and the canary, and a trainer failure mid-write leaves the engine unstamped until it is re-synced."""
    pytest.importorskip("vllm")
    from benchmarks.bench_weight_sync import main

    r = main(["--model", "gpu", "--methods", "ipc", "--layout", "kernel", "--syncs", "2", "--log-dir", str(tmp_path)])
    ipc = r["methods"]["ipc"]
    assert ipc["ipc"]["path"] == "mapped", ipc["ipc"]
    assert ipc["canary_ok"] == "2/2", ipc
    fault = r["fault_mid_sync_ipc"]["kernel"]
    assert fault["tag_before"] is not None and fault["tag_after_failure"] is None, fault
    assert fault["tag_after_resync_is_current"], fault


@needs_cuda
def test_local_run_engine_actor_on_the_trainers_gpu_syncs_over_ipc(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    pytest.importorskip("ray")
    from r3operator.api.weight_transfer import TransferMethod
    from r3operator.runtime.app import build_settings, run_once

    example = Path(__file__).resolve().parents[2] / "examples" / "rljob-local.yaml"
    settings = build_settings(example, out_dir=tmp_path, device="cuda", model="gpu", steps=2, resume=False)
    settings.show_progress = False
    rows, run = run_once(settings)  # every sync is followed by the canary, which raises on a mismatch
    assert run.weight_transfer.method is TransferMethod.IPC and not run.weight_transfer.fallback
    assert [int(r["canary_ok"]) for r in rows] == [1, 1]
    run.engines.engines[0].shutdown()


@needs_two
def test_nccl_engine_on_its_own_gpu(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from benchmarks.bench_weight_sync import main

    r = main(
        ["--model", "gpu", "--methods", "nccl,packed", "--engine-gpu", "1", "--syncs", "2", "--log-dir", str(tmp_path)]
    )
    assert r["weight_transfer"].startswith("nccl (vLLM "), r["weight_transfer"]
    for method in ("nccl", "packed"):
        assert r["methods"][method]["canary_ok"] == "2/2", (method, r["methods"][method])
    assert r["nccl_broadcast_gbps"] > 0
