"""bench_weight_sync `--profile`: one sync under torch's profiler with every sync phase a named span, so the next
GPU run can say where a phase's time goes (the phase clock books GPU work to whichever phase waits for it)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from benchmarks import bench_weight_sync  # noqa: E402
from r3operator.wire.sync_phases import SyncPhases  # noqa: E402


def test_the_profiled_sync_names_each_phase_and_leaves_the_clock_unlabelled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    phases = SyncPhases()
    policies: list[int] = []

    def sync_weights() -> None:
        with phases("gather"):
            weights = [torch.randn(64, 64) for _ in range(4)]
        for _ in phases.timed("transfer", weights):
            with phases("fingerprint"):
                torch.mm(weights[0], weights[1])

    run = SimpleNamespace(
        s=SimpleNamespace(device="cpu"), weight_sync=SimpleNamespace(phases=phases), sync_weights=sync_weights
    )
    monkeypatch.setattr(bench_weight_sync, "new_policy", lambda r, steps: policies.append(steps))

    paths = bench_weight_sync.profile_one_sync(run, 0, tmp_path / "profile" / "kernel-nccl")

    assert policies == [0]  # a new policy first: the profiled sync moves new bytes like the timed ones
    assert phases.label is None  # the timed syncs after it run without spans
    spans = {e["name"] for e in json.loads(Path(paths["trace"]).read_text())["traceEvents"]}
    assert {"gather", "transfer", "fingerprint"} <= spans
    table = Path(paths["table"]).read_text()
    assert "== by host time" in table and "aten::mm" in table


def test_phases_open_a_span_each_only_when_labelled() -> None:
    opened: list[str] = []

    class Span:
        def __init__(self, name: str) -> None:
            self.name = name

        def __enter__(self) -> None:
            opened.append(self.name)

        def __exit__(self, *exc: object) -> None:
            opened.append("/" + self.name)

    phases = SyncPhases()
    with phases("begin"):
        pass
    assert opened == []
    phases.label = Span
    with phases("begin"):
        pass
    assert list(phases.timed("gather", [1, 2])) == [1, 2]
    assert opened == ["begin", "/begin", "gather", "/gather", "gather", "/gather", "gather", "/gather"]
    assert set(phases.seconds) == {"begin", "gather"}


def test_the_engine_gpu_counts_within_this_process_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    """A lane given GPUs 2,3 puts its engine on GPU 3, not on the other lane's GPU 1."""
    from benchmarks.bench_weight_sync import engine_env

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert engine_env(1)["CUDA_VISIBLE_DEVICES"] == "3"
    assert engine_env([0, 1])["CUDA_VISIBLE_DEVICES"] == "2,3"  # a tensor-parallel engine (--engine-tp 2)
    with pytest.raises(ValueError, match="not among the 2 GPU"):
        engine_env(2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert engine_env(1)["CUDA_VISIBLE_DEVICES"] == "1"


def test_the_engines_own_seconds_are_the_slowest_worker_of_any_engine_by_part() -> None:
    """A sync waits for its slowest engine worker: that one's host seconds are the figure, part by part."""
    from sync_fakes import SendsToVerbs

    from benchmarks.bench_weight_sync import engine_seconds

    class Engine(SendsToVerbs):
        def __init__(self, *receipts: dict[str, object]) -> None:
            self.receipts = list(receipts)

        def sync_receipts(self) -> list[dict[str, object]]:
            return self.receipts

    tp2 = Engine({"engine_seconds": {"load": 0.010, "receipt": 0.004}}, {"engine_seconds": {"load": 0.012}})
    other = Engine({"engine_seconds": {"load": 0.011, "release": 0.030}}, {"closed": False})
    assert engine_seconds([tp2, other]) == {"load": 0.012, "receipt": 0.004, "release": 0.030}
    assert engine_seconds([]) == {}


def test_a_layout_switch_makes_a_new_install_of_the_same_method_and_closes_the_old(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`--layout kernel,checkpoint` measures both layouts on one engine start: the product has no way to change an
    install's layout, so the benchmark makes a new install as setup() would (a new rendezvous, as after an engine
    restart), closes the old one, and syncs once with the new layout before the timed syncs."""
    from r3operator.api.weight_transfer import TransferMethod
    from r3operator.weightsync.sync import NativeInstall
    from r3operator.wire.sync_messages import BeginNative, BracketLayout

    old = NativeInstall(
        TransferMethod.NCCL,
        state_dict=dict,
        dtype=None,
        buffer_size_bytes=7,
        master_address="10.0.0.2",
        bracket=BeginNative(),
        kernel_fallback=True,
    )
    closed: list[int] = []
    monkeypatch.setattr(old, "close", lambda: closed.append(1))
    monkeypatch.setattr(bench_weight_sync, "new_policy", lambda r, steps: None)
    synced: list[object] = []
    checked: list[object] = []
    run = SimpleNamespace(
        supervisor=SimpleNamespace(install=old),
        weight_sync=SimpleNamespace(install=old, check_receipts=lambda engines, names: checked.append(names)),
        engines=SimpleNamespace(engines=[]),
        canary=lambda: True,
    )
    run.sync_weights = lambda: synced.append((run.supervisor.install.bracket.layout, len(closed)))

    fresh, _ = bench_weight_sync.switch_layout(run, old, BeginNative(BracketLayout.KERNEL), 0)  # type: ignore[arg-type]

    assert fresh is not old and fresh is run.supervisor.install is run.weight_sync.install
    assert synced == [(BracketLayout.KERNEL, 1)] and checked == [[]]  # the old one closed first, then one sync
    same = ("method", "buffer_size_bytes", "master_address", "kernel_fallback", "sent", "phases", "state_dict")
    assert all(getattr(fresh, name) == getattr(old, name) for name in same)
