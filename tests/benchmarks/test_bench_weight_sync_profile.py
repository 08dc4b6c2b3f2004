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

    run = SimpleNamespace(s=SimpleNamespace(device="cpu"), sync_phases=phases, sync_weights=sync_weights)
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
    with pytest.raises(ValueError, match="not among the 2 GPU"):
        engine_env(2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert engine_env(1)["CUDA_VISIBLE_DEVICES"] == "1"


def test_the_engines_own_seconds_are_the_slowest_worker_of_any_engine_by_part() -> None:
    """A sync waits for its slowest engine worker: that one's host seconds are the figure, part by part."""
    from benchmarks.bench_weight_sync import engine_seconds

    class Engine:
        def __init__(self, *receipts: dict[str, object]) -> None:
            self.receipts = list(receipts)

        def sync_receipts(self) -> list[dict[str, object]]:
            return self.receipts

    tp2 = Engine({"engine_seconds": {"load": 0.010, "receipt": 0.004}}, {"engine_seconds": {"load": 0.012}})
    other = Engine({"engine_seconds": {"load": 0.011, "release": 0.030}}, {"closed": False})
    assert engine_seconds([tp2, other]) == {"load": 0.012, "receipt": 0.004, "release": 0.030}
    assert engine_seconds([]) == {}
