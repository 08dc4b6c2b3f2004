"""GPU: deliberate kernel-layout build errors at bf16 over IPC, each caught on its first sync (issue 42).

    PYTHONPATH=/tmp/site:. VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0 \
        python3 -m pytest tests/gpu/test_receipt_build_errors.py -m gpu -q

One `vllm serve` engine (bf16, `--weight-transfer-config {"backend":"ipc"}`) shares the trainer's GPU; the trainer is
the runtime's own (`GRPORun`, fp32 master weights sent as bf16) with `weightSync.layout: kernel`, so its syncs write
the engine's parameters in place (weightsync/mapped.py). The engine is real; only the trainer's kernel builder is
broken on purpose (`build_parameter`, with the faults of tests/weightsync/test_kernel_reference.py: gate and up swapped,
every expert block rolled, w2's experts rolled: the same shapes, the same bytes, in the wrong places; on the tiny
model at bf16 the canary's forward passed each of them):

- at a plan's first sync (its reference: the checkpoint layout through vLLM's own `load_weights`, then every parameter
  compared), a broken builder refuses the kernel layout, naming the parameter, and the sync stays in the checkpoint
  layout, canaried;
- a builder that breaks after its plan was confirmed fails the receipt of the first kernel-layout sync it builds,
  naming the parameter (the trainer's fingerprints come from the tensors it trains, not from what it built);
- without a fault the plan is confirmed and every kernel-layout sync passes the receipt and the canary.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tests.weightsync.test_kernel_reference import FAULTS, _broken  # noqa: E402  (the CPU test's faults, one list)

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _block(fault: str) -> str:
    return "w2_weight" if fault == FAULTS[2] else "w13_weight"


def _break_the_builder(monkeypatch: pytest.MonkeyPatch, fault: str) -> None:
    from r3operator.weightsync import mapped, staged
    from r3operator.wire import kernel_layout

    broken = _broken(fault, kernel_layout.build_parameter)
    for module in (kernel_layout, mapped, staged):  # whichever IPC path the sync takes, and the reference's build
        monkeypatch.setattr(module, "build_parameter", broken)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The runtime on the `gpu` model with one IPC engine in the kernel layout, set up (its first sync: the plan's
    reference, passing)."""
    pytest.importorskip("vllm")
    from transformers import AutoConfig

    from benchmarks.bench_weight_sync import EXAMPLE, _free_port, engine_command, engine_env
    from r3operator.api.enums import WeightSyncLayout
    from r3operator.api.weight_transfer import TransferChoice, TransferMethod
    from r3operator.models import ensure_reference_model
    from r3operator.rollout.engines import EngineGroup, HTTPEngine
    from r3operator.runtime.app import build_settings
    from r3operator.runtime.loop import GRPORun
    from r3operator.wire.retry import Backoff

    tmp = tmp_path_factory.mktemp("receipt-build-errors")
    model_dir = ensure_reference_model("gpu")
    settings = build_settings(EXAMPLE, out_dir=tmp / "runs", device="cuda", model="gpu", resume=False)
    settings.show_progress = False
    settings.job.spec.weight_sync.layout = WeightSyncLayout.KERNEL
    settings.engine_dtype = "bfloat16"
    settings.weight_transfer = TransferChoice(TransferMethod.IPC, "tests/gpu/test_receipt_build_errors.py")
    port = _free_port()
    cmd = engine_command(model_dir, port=port, backend="ipc", dtype="bfloat16", gpu_memory_utilization=0.15)
    with (tmp / "engine.log").open("wb") as log:
        server = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=engine_env(None), start_new_session=True
        )
    try:
        engine = HTTPEngine(
            f"http://127.0.0.1:{port}",
            staging_dir=settings.run_dir / "weight-staging",
            num_experts=int(AutoConfig.from_pretrained(model_dir).num_experts),
            ready=Backoff(attempts=300, base_s=1.0, cap_s=2.0),
        )
        run = GRPORun(settings, engines=EngineGroup([engine]))
        run.setup()  # SFT warm-up, the first sync (the plan's reference), the canary
        assert run.weight_transfer.method is TransferMethod.IPC and not run.weight_transfer.fallback
        yield run
    finally:
        os.killpg(server.pid, 9)
        server.wait()
        torch.cuda.empty_cache()


def _new_policy(run: Any) -> None:
    with torch.no_grad():
        for param in run.trainer.model.parameters():
            param.add_(torch.randn_like(param), alpha=1e-3)


def _forget_the_plan(run: Any) -> None:
    """What a new run's first sync meets: no plan confirmed, none refused, a new rendezvous."""
    install = run.supervisor.install
    install.close()
    install.checked_plan, install.kernel_refused = None, None


@needs_cuda
def test_without_a_fault_the_plan_is_confirmed_and_kernel_syncs_pass_receipt_and_canary(run: Any) -> None:
    install = run.supervisor.install
    assert install.kernel_refused is None and install.checked_plan is not None, install.kernel_refused
    assert install.reference_seconds is not None
    for _ in range(2):
        _new_policy(run)
        run.sync_weights()
        assert install.ipc_path["path"] == "mapped", install.ipc_path
        assert run.canary()  # the receipt (exact), then the greedy decode


@needs_cuda
@pytest.mark.parametrize("fault", FAULTS)
def test_a_broken_builder_is_refused_at_its_plans_first_sync(
    run: Any, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    install = run.supervisor.install
    _forget_the_plan(run)
    _break_the_builder(monkeypatch, fault)
    _new_policy(run)
    run.sync_weights()
    refused = install.kernel_refused or ""
    assert "built by the kernel builder differ from what vLLM's own load_weights made" in refused, refused
    assert re.search(rf"mlp\.experts\.(\w+\.)?{_block(fault)}", refused), refused  # 0.30 adds `routed_experts.`
    assert "kernel refused" in run.weight_sync.described, run.weight_sync.described
    assert run.canary()  # the checkpoint layout, vLLM's own load: right
    monkeypatch.undo()
    _forget_the_plan(run)
    _new_policy(run)
    run.sync_weights()  # the next plan check passes again
    assert install.kernel_refused is None and run.canary()


@needs_cuda
@pytest.mark.parametrize("fault", FAULTS)
def test_a_builder_broken_after_its_plan_was_confirmed_fails_the_receipt_of_that_sync(
    run: Any, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    from r3operator.weightsync.canary import CanaryMismatchError

    install = run.supervisor.install
    assert install.checked_plan is not None
    _break_the_builder(monkeypatch, fault)
    _new_policy(run)
    run.sync_weights()
    assert install.ipc_path["path"] == "mapped", install.ipc_path
    with pytest.raises(
        CanaryMismatchError, match=rf"arrived with other bytes than the trainer sent: .*{_block(fault)}"
    ):
        run.canary()
    monkeypatch.undo()
    _new_policy(run)
    run.sync_weights()  # built right again
    assert run.canary()
