"""The GPU acceptance run's own machinery, on CPU: rows run as processes under their timeouts, the record
(accept.json / accept.md) is rewritten after every row and merged across invocations, and the judges read
the outputs the real rows write. The rows' commands themselves need GPUs (scripts/gpu-accept.sh)."""

from __future__ import annotations

import ast
import csv
import json
import re
import tarfile
from pathlib import Path
from typing import Any

import pytest

from benchmarks import gpu_accept
from benchmarks.gpu_accept import Context, Row, Verdict

REPO = Path(__file__).resolve().parents[1]


def _row(
    name: str, command: str, *, part: int = 1, min_gpus: int = 1, est_s: int = 1, timeout_s: int = 30, judge: Any = None
) -> Row:
    def default_judge(ctx: Context, code: int, log: str) -> Verdict:
        return Verdict(code == 0, f"said {log.splitlines()[-1]!r}", data={"code": code})

    return Row(
        name,
        part,
        f"what {name}",
        f"target {name}",
        min_gpus,
        est_s,
        timeout_s,
        lambda ctx: command,
        judge or default_judge,
    )


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Two GPUs as far as the runner knows; its work directory under tmp_path."""
    monkeypatch.setattr(gpu_accept, "gpu_facts", lambda: (2, "Test GPU"))
    monkeypatch.setenv("ACCEPT_WORK", str(tmp_path / "work"))
    monkeypatch.delenv("ACCEPT_DRY", raising=False)
    return tmp_path / "out"


def test_each_row_is_recorded_with_its_outcome_and_a_failure_does_not_stop_the_next(
    machine: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken_judge(ctx: Context, code: int, log: str) -> Verdict:
        return Verdict(**json.loads((ctx.work / "missing.json").read_text()))

    rows = [
        _row("ok", "echo fine"),
        _row("fails", "echo bad; exit 3"),
        _row("hangs", "sleep 60", timeout_s=1),
        _row("no_output", "true", judge=broken_judge),
        _row("four_gpus", "echo never", min_gpus=4),
        _row("too_long", "echo never", est_s=10_000),
    ]
    monkeypatch.setattr(gpu_accept, "ROWS", rows)
    assert gpu_accept.main([str(machine), "--budget", "600"]) == 1
    record = json.loads((machine / "accept.json").read_text())
    by = {r["name"]: r for r in record["rows"]}
    assert [r["name"] for r in record["rows"]] == [r.name for r in rows]
    assert by["ok"]["status"] == "pass" and by["ok"]["figure"] == "said 'fine'" and by["ok"]["exit_code"] == 0
    assert by["fails"]["status"] == "fail" and by["fails"]["exit_code"] == 3 and "bad" in by["fails"]["log_tail"]
    assert by["hangs"]["status"] == "fail" and by["hangs"]["reason"].startswith("timed out after")
    assert by["hangs"]["seconds"] < 30
    assert by["no_output"]["status"] == "fail" and "FileNotFoundError" in by["no_output"]["reason"]
    assert by["four_gpus"]["status"] == "not run" and "needs 4 GPUs, this machine has 2" in by["four_gpus"]["reason"]
    assert by["too_long"]["status"] == "not run" and "--rows too_long" in by["too_long"]["reason"]
    assert record["device"] == "Test GPU" and record["gpus"] == 2 and record["date"].endswith("Z")
    assert all(r["command"] for r in record["rows"])
    md = (machine / "accept.md").read_text()
    assert "2 pass" not in md and "1 pass, 3 fail, 2 not run" in md
    assert "| ok | **pass** | said 'fine' | target ok |" in md
    assert (machine / "logs-all.tar.gz").is_file()
    assert sorted(p.name for p in machine.iterdir()) == ["accept.json", "accept.md", "logs-all.tar.gz"]


def test_the_record_is_written_after_every_row(machine: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []

    def judge(ctx: Context, code: int, log: str) -> Verdict:
        path = machine / "accept.json"
        seen.append([r["name"] for r in json.loads(path.read_text())["rows"]] if path.exists() else [])
        return Verdict(True, "x")

    monkeypatch.setattr(gpu_accept, "ROWS", [_row("a", "true", judge=judge), _row("b", "true", judge=judge)])
    gpu_accept.main([str(machine)])
    assert seen == [[], ["a"]]  # a run killed during b still leaves a's row


def test_a_second_part_into_the_same_out_keeps_the_first_parts_rows(
    machine: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = [_row("first", "echo one", part=1), _row("second", "echo two", part=2)]
    monkeypatch.setattr(gpu_accept, "ROWS", rows)
    gpu_accept.main([str(machine), "--part", "2"])
    gpu_accept.main([str(machine), "--part", "1"])
    record = json.loads((machine / "accept.json").read_text())
    assert [(r["name"], r["status"]) for r in record["rows"]] == [("first", "pass"), ("second", "pass")]
    assert {"logs-part1.tar.gz", "logs-part2.tar.gz"} <= {p.name for p in machine.iterdir()}


def test_a_row_the_budget_left_out_runs_in_the_next_invocation_after_its_own_rows(
    machine: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = [_row("big", "echo big", part=1, est_s=100), _row("own", "echo own", part=2, est_s=1)]
    monkeypatch.setattr(gpu_accept, "ROWS", rows)
    gpu_accept.main([str(machine), "--part", "1", "--budget", "50"])
    first = json.loads((machine / "accept.json").read_text())["rows"]
    assert [(r["name"], r["status"]) for r in first] == [("big", "not run")]
    gpu_accept.main([str(machine), "--part", "2", "--budget", "500"])
    final = json.loads((machine / "accept.json").read_text())["rows"]
    assert [(r["name"], r["status"]) for r in final] == [("big", "pass"), ("own", "pass")]
    assert final[1]["started"] < final[0]["started"]  # its own row first, then the carried one
    with tarfile.open(machine / "logs-part2.tar.gz") as tar:
        assert sorted(n for n in tar.getnames() if n.endswith(".log")) == ["big.log", "own.log"]


def test_dry_mode_runs_nothing_and_records_every_row_with_its_command(
    machine: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("ACCEPT_DRY", "1")
    gpu_accept.main([str(machine)])
    record = json.loads((machine / "accept.json").read_text())
    assert [r["name"] for r in record["rows"]] == [r.name for r in gpu_accept.ROWS]
    assert all(r["status"] == "not run" and "dry run" in r["reason"] for r in record["rows"])
    assert not (tmp_path / "work").exists()
    main_job = next(r for r in record["rows"] if r["name"] == "main_job")
    assert "--steps 2 --no-resume" in main_job["command"] and main_job["command"].endswith("--steps 3")


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _main_job_outputs(work: Path, *, recompute: bool) -> None:
    for mode, dlp in (("disabled", 0.005), ("r3", 0.004)):
        rows = [
            {
                "step": s,
                "canary_ok": 1,
                "replay_applied": 1.0 if mode == "r3" else 0.97,
                "logprob_abs_diff_mean": dlp,
                "step_seconds": 1.0 + s,
            }
            for s in (1, 2, 3)
        ]
        _write_csv(work / "first" / f"{mode}.csv", rows[:2])
        if recompute:
            rows[1] = {**rows[1], "step_seconds": 9.9}
        _write_csv(work / "runs" / gpu_accept.MAIN_NAME / mode / "metrics.csv", rows)
        (work / "runs" / gpu_accept.MAIN_NAME / mode / "checkpoints" / "step-000003").mkdir(parents=True)


def test_the_main_job_passes_only_when_the_resume_kept_the_earlier_steps(tmp_path: Path) -> None:
    kept, recomputed = Context(gpus=1, work=tmp_path / "kept"), Context(gpus=1, work=tmp_path / "recomputed")
    _main_job_outputs(kept.work, recompute=False)
    _main_job_outputs(recomputed.work, recompute=True)
    good = gpu_accept.judge_main_job(kept, 0, "")
    assert good.passed and good.target_met and "Disabled 0.00500 → R3 0.00400 (0.80×)" in good.figure
    bad = gpu_accept.judge_main_job(recomputed, 0, "")
    assert not bad.passed and "recomputed" in bad.figure


def test_pytest_rows_allow_only_the_skips_the_gpu_count_explains() -> None:
    judge = gpu_accept.judge_pytest(lambda gpus: 5 if gpus == 2 else 0)
    log = "....\n=== 3 passed, 5 skipped, 2 warnings in 250.1s ==="
    assert judge(Context(gpus=2, work=Path()), 0, log).passed
    assert not judge(Context(gpus=4, work=Path()), 0, log).passed
    assert not judge(Context(gpus=2, work=Path()), 1, "1 failed, 2 passed, 5 skipped in 9.0s").passed
    assert gpu_accept.pytest_counts("1 failed, 2 passed, 5 skipped in 9.0s") == {"failed": 1, "passed": 2, "skipped": 5}


def test_the_megatron_rows_split_the_tests_cases_with_their_gpu_counts() -> None:
    tree = ast.parse((REPO / "tests" / "gpu" / "test_megatron_ranks_gpu.py").read_text())
    [cases] = [n.value for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "CASES"]
    [ids] = [k.value for n in ast.walk(tree) if isinstance(n, ast.Call) for k in n.keywords if k.arg == "ids"]
    assert isinstance(cases, ast.List)
    gpus = [ast.literal_eval(case.elts[0]) for case in cases.elts]
    assert list(zip(ast.literal_eval(ids), gpus, strict=True)) == list(gpu_accept.MEGATRON_CASES)
    grouped = [i for _, group in gpu_accept.MEGATRON_GROUPS for i in group]
    assert sorted(grouped) == sorted(i for i, _ in gpu_accept.MEGATRON_CASES)  # each case in one row


@pytest.mark.parametrize(("name", "ids"), gpu_accept.MEGATRON_GROUPS)
def test_each_megatron_row_selects_exactly_its_cases(name: str, ids: tuple[str, ...], tmp_path: Path) -> None:
    from _pytest.mark.expression import Expression  # pytest's own `-k` grammar and substring matching

    [row] = [r for r in gpu_accept.ROWS if r.name == name]
    [expression] = re.findall(r"-k '([^']+)'", row.command(Context(gpus=4, work=tmp_path)))
    node_ids = [f"test_megatron_over_ray_ranks_trains_like_one_process[{i}]" for i, _ in gpu_accept.MEGATRON_CASES]
    compiled = Expression.compile(expression)
    selected = [n for n in node_ids if compiled.evaluate(lambda word, n=n, **_: word in n)]
    assert selected == [n for n in node_ids if n.endswith(tuple(f"[{i}]" for i in ids))]
    assert row.min_gpus == min(dict(gpu_accept.MEGATRON_CASES)[i] for i in ids)
    assert row.judge(Context(gpus=row.min_gpus, work=tmp_path), 0, f"{len(ids)} passed in 9.0s").passed


def _sync_report(nbytes: int, seconds: float, raw: float, canary: str = "3/3") -> dict[str, Any]:
    return {
        "bytes_per_sync": nbytes,
        "nccl_broadcast_gbps": raw,
        "methods": {
            "nccl": {
                "median_s": seconds,
                "gbps": round(nbytes / seconds / 1e9, 3),
                "canary_ok": canary,
                "phases_median_s": {"transfer": seconds - 0.01},
            }
        },
    }


def test_the_sync_layouts_row_takes_the_fixed_cost_from_two_model_sizes(tmp_path: Path) -> None:
    """Two sizes on a line t = fixed + bytes / rate: the intercept is the fixed cost, written out here."""
    fixed, rate, raw = 0.030, 200e9, 300.0  # a3b-x16l: 20 GB in 0.13 s = 154 GB/s ≥ 0.5 × 300
    small, large = 5_000_000_000, 20_000_000_000

    def write(work: Path, kernel_fixed: float, canary: str = "3/3") -> Context:
        work.mkdir()
        for model, nbytes in (("a3b", small), ("a3b-x16l", large)):
            for layout, f in (("checkpoint", 0.4), ("kernel", kernel_fixed)):
                report = _sync_report(nbytes, f + nbytes / rate, raw, canary if layout == "kernel" else "3/3")
                (work / f"sync_{model}_{layout}.json").write_text(json.dumps(report))
        return Context(gpus=2, work=work)

    assert gpu_accept.fixed_cost_s(
        _sync_report(small, fixed + small / rate, raw), _sync_report(large, fixed + large / rate, raw)
    ) == pytest.approx(fixed)
    met = gpu_accept.judge_sync_layouts(write(tmp_path / "met", fixed), 0, "")
    assert met.passed and met.target_met and "kernel fixed cost per sync 30 ms" in met.figure
    slow = gpu_accept.judge_sync_layouts(write(tmp_path / "slow", 0.4), 0, "")
    assert slow.passed and slow.target_met is False  # 400 ms of fixed cost: the run passes, the target is missed
    broken = gpu_accept.judge_sync_layouts(write(tmp_path / "broken", fixed, canary="2/3"), 0, "")
    assert not broken.passed
    (tmp_path / "met" / "sync_a3b-x16l_kernel.json").unlink()
    missing = gpu_accept.judge_sync_layouts(Context(gpus=2, work=tmp_path / "met"), 0, "")
    assert not missing.passed and "a3b-x16l kernel: no JSON" in missing.figure and missing.target_met is None


def test_the_sync_layouts_row_runs_both_sizes_in_both_layouts() -> None:
    two = gpu_accept.sync_layouts_command(Context(gpus=2, work=Path("/w")))
    one = gpu_accept.sync_layouts_command(Context(gpus=1, work=Path("/w")))
    for model, layout in gpu_accept.SYNC_LAYOUT_RUNS:
        assert f"--model {model} --syncs 3 --layout {layout}" in two
    assert two.count("--methods nccl --engine-gpu 1") == 4 and one.count("--methods ipc") == 4
    assert "bench_engine_load" in two and "--device cuda --layout both" in two
