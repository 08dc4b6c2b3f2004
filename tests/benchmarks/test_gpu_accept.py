"""The GPU acceptance run's own machinery, on CPU: rows run as processes under their timeouts, the record
(accept.json / accept.md) is rewritten after every row and merged across invocations, and the judges read
the outputs the real rows write. The rows' commands themselves need GPUs (scripts/gpu-accept.sh)."""

from __future__ import annotations

import ast
import csv
import dataclasses
import json
import re
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import pytest

from benchmarks import gpu_accept
from benchmarks.gpu_accept import Context, Row, Verdict

REPO = Path(__file__).resolve().parents[2]


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
    assert "--steps 2 --no-resume" in main_job["command"]
    assert (
        main_job["command"].endswith("--steps 4")
        and "R3OPERATOR_FAULT_NONFINITE_STEPS=3 python3" in main_job["command"]
    )


@pytest.mark.parametrize(("lane_gpus", "method"), [("1", "--methods ipc"), ("2", "--methods nccl --engine-gpu 1")])
def test_a_dry_lane_prints_the_commands_of_its_own_gpu_count(
    machine: Path, monkeypatch: pytest.MonkeyPatch, lane_gpus: str, method: str
) -> None:
    """scripts/gpu-accept-lanes.sh hands each lane its count in ACCEPT_GPUS; a dry run of a 1-GPU lane must show the
    IPC command that lane would run, not the 2-GPU default's NCCL one."""
    monkeypatch.setenv("ACCEPT_DRY", "1")
    monkeypatch.delenv("ACCEPT_DRY_GPUS", raising=False)
    monkeypatch.setenv("ACCEPT_GPUS", lane_gpus)
    gpu_accept.main([str(machine), "--rows", "sync_layouts_a3b"])
    (row,) = json.loads((machine / "accept.json").read_text())["rows"]
    assert row["status"] == "not run" and f"bench_weight_sync {method} --model a3b" in row["command"]


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _main_job_outputs(work: Path, *, recompute: bool = False, nan_step: dict[str, Any] | None = None) -> None:
    """metrics.csv as the main job writes it: steps 1-4, step 3's two mini-batch updates NaN and not applied
    (no sync: the policy version stays, no weight_sync or checkpoint phase), `nan_step` overriding that row."""
    for mode, dlp in (("disabled", 0.005), ("r3", 0.004)):
        rows = [
            {
                "step": s,
                "policy_version": {1: 2, 2: 3, 3: 3, 4: 4}[s],
                "canary_ok": 0 if s == 3 else 1,
                "replay_applied": 1.0 if mode == "r3" else 0.97,
                "logprob_abs_diff_mean": dlp,
                "loss": "nan" if s == 3 else -0.01,
                "grad_norm": "nan" if s == 3 else 0.5,
                "step_seconds": 1.0 + s,
                "t_weight_sync": "" if s == 3 else 0.2,
                "t_checkpoint": "" if s == 3 else 0.1,
                "nonfinite_updates": 2 if s == 3 else 0,
            }
            for s in (1, 2, 3, 4)
        ]
        rows[2] = {**rows[2], **(nan_step or {})}
        _write_csv(work / "first" / f"{mode}.csv", rows[:2])
        if recompute:
            rows[1] = {**rows[1], "step_seconds": 9.9}
        _write_csv(work / "runs" / gpu_accept.MAIN_NAME / mode / "metrics.csv", rows)
        (work / "runs" / gpu_accept.MAIN_NAME / mode / "checkpoints" / "step-000004").mkdir(parents=True)


def test_the_main_job_passes_only_when_the_resume_kept_the_earlier_steps(tmp_path: Path) -> None:
    kept, recomputed = Context(gpus=1, work=tmp_path / "kept"), Context(gpus=1, work=tmp_path / "recomputed")
    _main_job_outputs(kept.work)
    _main_job_outputs(recomputed.work, recompute=True)
    good = gpu_accept.judge_main_job(kept, 0, "")
    assert good.passed and good.target_met and "Disabled 0.00500 → R3 0.00400 (0.80×)" in good.figure
    assert (
        "canary 3/3 each" in good.figure and "step 3's NaN updates not applied, synced or checkpointed" in good.figure
    )
    bad = gpu_accept.judge_main_job(recomputed, 0, "")
    assert not bad.passed and "recomputed" in bad.figure


@pytest.mark.parametrize(
    ("nan_step", "said"),
    [
        ({"nonfinite_updates": 0}, "nonfinite_updates '0', expected 2"),
        ({"policy_version": 4, "canary_ok": 1, "t_weight_sync": 0.2}, "the NaN step synced"),
        ({"t_checkpoint": 0.1}, "weight_sync or checkpoint phase"),
    ],
    ids=["not-counted", "synced", "checkpointed"],
)
def test_the_main_job_fails_when_the_guard_did_not_hold(tmp_path: Path, nan_step: dict[str, Any], said: str) -> None:
    ctx = Context(gpus=1, work=tmp_path)
    _main_job_outputs(tmp_path, nan_step=nan_step)
    verdict = gpu_accept.judge_main_job(ctx, 0, "")
    assert not verdict.passed and "step 3 (NaN injected)" in verdict.figure and said in verdict.figure


def test_the_main_jobs_mini_batches_are_the_ones_its_fault_poisons() -> None:
    import yaml

    job = yaml.safe_load((Path(gpu_accept.REPO) / gpu_accept.MAIN_JOB).read_text())
    assert job["spec"]["algorithm"]["miniBatches"] == gpu_accept.MAIN_MINI_BATCHES


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


def _sync_report(nbytes: int, seconds: dict[str, float], raw: float, canary: str = "3/3") -> dict[str, Any]:
    """bench_weight_sync's JSON of one engine start, `seconds` per layout in the order measured."""

    def figures(s: float) -> dict[str, Any]:
        return {
            "median_s": s,
            "gbps": round(nbytes / s / 1e9, 3),
            "canary_ok": canary,
            "phases_median_s": {"transfer": s - 0.01},
        }

    by_layout: dict[str, Any] = {
        layout: {"nccl": figures(s), **({"warmup_s": 1.0} if i else {})}
        for i, (layout, s) in enumerate(seconds.items())
    }
    return {
        "bytes_per_sync": nbytes,
        "nccl_broadcast_gbps": raw,
        "layouts": list(seconds),
        "by_layout": by_layout,
        "methods": by_layout[next(iter(seconds))],
    }


SMALL, LARGE = 5_000_000_000, 20_000_000_000


def _write_sync(work: Path, model: str, report: dict[str, Any]) -> None:
    row = work / gpu_accept.SYNC_LAYOUT_ROWS[model]
    row.mkdir(parents=True, exist_ok=True)
    (row / f"sync_{model}.json").write_text(json.dumps(report))


def test_the_x16l_row_takes_the_fixed_cost_from_its_own_and_the_a3b_rows_json(tmp_path: Path) -> None:
    """Two sizes on a line t = fixed + bytes / rate: the intercept is the fixed cost, written out here."""
    fixed, rate, raw = 0.030, 200e9, 300.0  # a3b-x16l: 20 GB in 0.13 s = 154 GB/s ≥ 0.5 × 300

    def kernel_first(nbytes: int, kernel_fixed: float) -> dict[str, float]:
        return {"kernel": kernel_fixed + nbytes / rate, "checkpoint": 0.4 + nbytes / 6e9}

    def judge(work: Path, kernel_fixed: float, canary: str = "3/3") -> Verdict:
        for model, nbytes in (("a3b", SMALL), ("a3b-x16l", LARGE)):
            _write_sync(work, model, _sync_report(nbytes, kernel_first(nbytes, kernel_fixed), raw, canary))
        ctx = Context(gpus=2, work=work / gpu_accept.SYNC_LAYOUT_ROWS["a3b-x16l"])
        return gpu_accept.judge_sync_layouts("a3b-x16l")(ctx, 0, "")

    small = _sync_report(SMALL, {"kernel": fixed + SMALL / rate}, raw)
    large = _sync_report(LARGE, {"kernel": fixed + LARGE / rate}, raw)
    assert gpu_accept.fixed_cost_s(small, large) == pytest.approx(fixed)
    assert gpu_accept.fixed_cost_s(small, large, "checkpoint") is None  # not measured in that layout
    met = judge(tmp_path / "met", fixed)
    assert met.passed and met.target_met and "kernel fixed cost per sync 30 ms" in met.figure
    assert "a3b-x16l checkpoint nccl" in met.figure and "a3b-x16l kernel nccl" in met.figure
    slow = judge(tmp_path / "slow", 0.4)
    assert slow.passed and slow.target_met is False  # 400 ms of fixed cost: the run passes, the target is missed
    assert not judge(tmp_path / "broken", fixed, canary="2/3").passed


def test_the_x16l_row_finds_the_a3b_json_of_another_lane_and_says_when_there_is_none(tmp_path: Path) -> None:
    rate, raw = 200e9, 300.0
    lane0, lane1 = tmp_path / "r3-accept-lane0", tmp_path / "r3-accept-lane1"
    _write_sync(lane1, "a3b-x16l", _sync_report(LARGE, {"kernel": 0.02 + LARGE / rate}, raw))
    ctx = Context(gpus=2, work=lane1 / gpu_accept.SYNC_LAYOUT_ROWS["a3b-x16l"])
    alone = gpu_accept.judge_sync_layouts("a3b-x16l")(ctx, 0, "")
    assert alone.target_met is None and "no sync_layouts_a3b JSON of the nccl method found" in alone.figure
    _write_sync(lane0, "a3b", _sync_report(SMALL, {"kernel": 0.02 + SMALL / rate}, raw))
    found = gpu_accept.judge_sync_layouts("a3b-x16l")(ctx, 0, "")
    assert "kernel fixed cost per sync 20 ms" in found.figure and str(lane0) in found.figure


def test_the_fixed_cost_pairs_only_syncs_of_one_method(tmp_path: Path) -> None:
    """Lanes run one after the other share /tmp/r3-accept-lane0: an IPC a3b-x16l must not take its fixed cost from
    the NCCL a3b left there (the 2026-11-28 run printed 32 ms that way), but from an IPC a3b in another lane."""
    rate, raw = 200e9, 300.0
    lane0, lane1 = tmp_path / "r3-accept-lane0", tmp_path / "r3-accept-lane1"

    def as_ipc(report: dict[str, Any]) -> dict[str, Any]:
        report["by_layout"]["kernel"] = {"ipc": report["by_layout"]["kernel"].pop("nccl")}
        return {**report, "methods": report["by_layout"]["kernel"]}

    nccl_small = _sync_report(SMALL, {"kernel": 0.01 + SMALL / rate}, raw)
    ipc_large = as_ipc(_sync_report(LARGE, {"kernel": 0.04 + LARGE / rate}, raw))
    assert gpu_accept.native_method(ipc_large) == "ipc" and gpu_accept.native_method(nccl_small) == "nccl"
    assert gpu_accept.fixed_cost_s(nccl_small, ipc_large) is None
    _write_sync(lane0, "a3b", nccl_small)
    _write_sync(lane0, "a3b-x16l", ipc_large)
    ctx = Context(gpus=1, work=lane0 / gpu_accept.SYNC_LAYOUT_ROWS["a3b-x16l"])
    mixed = gpu_accept.judge_sync_layouts("a3b-x16l")(ctx, 0, "")
    assert "no sync_layouts_a3b JSON of the ipc method found" in mixed.figure
    assert "fixed cost per sync" not in mixed.figure
    _write_sync(lane1, "a3b", as_ipc(_sync_report(SMALL, {"kernel": 0.04 + SMALL / rate}, raw)))
    paired = gpu_accept.judge_sync_layouts("a3b-x16l")(ctx, 0, "")
    assert "kernel fixed cost per sync 40 ms" in paired.figure and str(lane1) in paired.figure


def test_on_one_gpu_the_x16l_row_judges_ipc_against_the_device_copy(tmp_path: Path) -> None:
    """Colocated, issue 24's target is the IPC sync at ≥ 0.25 × the device's own copy bandwidth."""

    def ipc_report(nbytes: int, seconds: float, copy: float) -> dict[str, Any]:
        report = _sync_report(nbytes, {"kernel": seconds}, None)
        report["by_layout"]["kernel"] = {"ipc": report["by_layout"]["kernel"].pop("nccl")}
        return {**report, "device_copy_gbps": copy, "methods": report["by_layout"]["kernel"]}

    def judge(work: Path, seconds: float) -> Verdict:
        _write_sync(work, "a3b", ipc_report(SMALL, 0.03, 1400.0))
        _write_sync(work, "a3b-x16l", ipc_report(LARGE, seconds, 1400.0))
        return gpu_accept.judge_sync_layouts("a3b-x16l")(Context(gpus=1, work=work / "sync_layouts_x16l"), 0, "")

    fast = judge(tmp_path / "fast", LARGE / 400e9)  # 400 GB/s ≥ 0.25 × 1,400
    assert fast.target_met is True and "device copy 1400.0 GB/s" in fast.figure and "kernel ipc" in fast.figure
    assert judge(tmp_path / "slow", LARGE / 300e9).target_met is False  # 300 < 350


def test_a_fault_mid_sync_passes_only_where_what_it_left_is_right_for_its_path(tmp_path: Path) -> None:
    """A bracket the engines were inside must end aborted (no tag); only the staged kernel sync over IPC, which asks
    no engine before every byte is built, may leave the previous policy's tag, and only that one."""

    def fault(after: str | None, before: str | None = "run:3") -> dict[str, Any]:
        return {"tag_before": before, "tag_after_failure": after, "tag_after_resync_is_current": True}

    assert gpu_accept.fault_recovered("nccl", "kernel", fault(None)) == ("aborted and re-synced", True)
    assert gpu_accept.fault_recovered("ipc", "kernel", fault("run:3"))[1] is True
    assert gpu_accept.fault_recovered("ipc", "kernel", fault("run:9"))[1] is False  # a tag it never held
    assert gpu_accept.fault_recovered("nccl", "kernel", fault("run:3"))[1] is False  # half-received, still tagged
    assert gpu_accept.fault_recovered("ipc", "checkpoint", fault("run:3"))[1] is False
    stale = {**fault(None), "tag_after_resync_is_current": False}
    assert gpu_accept.fault_recovered("ipc", "checkpoint", stale)[1] is False

    report = _sync_report(SMALL, {"kernel": 0.03, "checkpoint": 0.5}, None)
    report["fault_mid_sync_ipc"] = {"kernel": fault("run:3"), "checkpoint": fault(None)}
    _write_sync(tmp_path, "a3b", report)
    verdict = gpu_accept.judge_sync_layouts("a3b")(Context(gpus=1, work=tmp_path / "sync_layouts_a3b"), 0, "")
    assert "kernel IPC fault mid-sync: no engine asked" in verdict.figure and verdict.passed


def test_a_row_killed_at_its_limit_still_reports_the_layouts_it_measured(tmp_path: Path) -> None:
    """bench_weight_sync rewrites its JSON after each layout: the kernel layout (measured first) survives a
    kill during the checkpoint layout, and the row says what is missing."""
    report = _sync_report(LARGE, {"kernel": 0.13}, 300.0)
    _write_sync(tmp_path, "a3b-x16l", report)
    ctx = Context(gpus=2, work=tmp_path / gpu_accept.SYNC_LAYOUT_ROWS["a3b-x16l"])
    verdict = gpu_accept.judge_sync_layouts("a3b-x16l")(ctx, -9, "")
    assert not verdict.passed
    assert "a3b-x16l kernel nccl: 153.846 GB/s" in verdict.figure
    assert "a3b-x16l checkpoint: not measured" in verdict.figure


def test_the_sync_rows_run_both_layouts_on_one_engine_start_each() -> None:
    for model, row_name in gpu_accept.SYNC_LAYOUT_ROWS.items():
        [row] = [r for r in gpu_accept.ROWS if r.name == row_name]
        two = row.command(Context(gpus=2, work=Path("/w") / row_name))
        one = row.command(Context(gpus=1, work=Path("/w") / row_name))
        assert two.count("bench_weight_sync") == 1 and "--methods nccl --engine-gpu 1" in two
        assert "--methods ipc" in one
        assert f"--model {model} --syncs 3 --layout kernel,checkpoint" in two
        assert f"--json /w/{row_name}/sync_{model}.json " in two  # where the row's judge reads it
        assert two.endswith(f"--profile /w/{row_name}/profile_{model}")  # one more sync per layout, profiled
        assert row.est_s < row.timeout_s <= 590
    [load] = [r for r in gpu_accept.ROWS if r.name == "engine_load_cuda"]
    assert "bench_engine_load" in load.command(Context(gpus=1, work=Path("/w")))
    [two_engines] = [r for r in gpu_accept.ROWS if r.name == "sync_two_engines"]
    assert two_engines.min_gpus == 3
    assert "--engine-gpu 1,2 --engines 2" in two_engines.command(Context(gpus=3, work=Path("/w")))


def test_the_two_engine_row_compares_with_one_engine(tmp_path: Path) -> None:
    report = _sync_report(SMALL, {"kernel": 0.15}, 300.0)
    report["by_layout"]["kernel"]["nccl"].update(
        one_engine={"median_s": 0.14, "canary_ok": "3/3"}, multi_engine_ratio=round(0.15 / 0.14, 3)
    )
    (tmp_path / "sync_two_engines.json").write_text(json.dumps(report))
    verdict = gpu_accept.judge_two_engines(Context(gpus=3, work=tmp_path), 0, "")
    assert verdict.passed and verdict.target_met and "1.071×" in verdict.figure


def test_the_tp_engine_row_wants_the_plan_confirmed_rank_by_rank_and_every_canary(tmp_path: Path) -> None:
    [row] = [r for r in gpu_accept.ROWS if r.name == "sync_tp_engine"]
    assert row.min_gpus == 3 and "--engine-gpu 1,2 --engine-tp 2" in row.command(Context(gpus=3, work=tmp_path))
    report = _sync_report(SMALL, {"kernel": 0.05, "checkpoint": 0.9}, 300.0)
    report["kernel_reference"] = {"seconds": 2.5, "refused": None}
    (tmp_path / "sync_tp_engine.json").write_text(json.dumps(report))
    verdict = gpu_accept.judge_tp_engine(Context(gpus=3, work=tmp_path), 0, "")
    assert verdict.passed and verdict.target_met and "kernel 0.05 s vs checkpoint 0.9 s" in verdict.figure
    report["kernel_reference"] = {"seconds": 2.5, "refused": "on engine-0 worker 1, 1 of 39 parameter(s) ..."}
    (tmp_path / "sync_tp_engine.json").write_text(json.dumps(report))
    refused = gpu_accept.judge_tp_engine(Context(gpus=3, work=tmp_path), 0, "")
    assert not refused.passed and "REFUSED" in refused.figure


def test_rows_named_run_in_the_order_named_once_each() -> None:
    """A reservation that may end early runs what its caller put first (2026-11-27: rows named
    `fingerprint_cuda,sync_layouts_a3b,sync_layouts_x16l,up_2gpu` ran in the table's order, `up_2gpu` first)."""
    picked = gpu_accept.select(
        gpu_accept.ROWS, None, ["sync_layouts_x16l", "up_2gpu", "sync_layouts_x16l", "weight_sync"]
    )
    assert [r.name for r in picked] == ["sync_layouts_x16l", "up_2gpu", "weight_sync"]
    with pytest.raises(SystemExit, match="unknown nope"):
        gpu_accept.select(gpu_accept.ROWS, None, ["up_2gpu", "nope"])


def test_a_row_is_judged_again_when_a_row_whose_output_it_reads_runs_after_it(
    machine: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2026-12-07: `sync_layouts_x16l` named before `sync_layouts_a3b` recorded "needs both sizes' kernel figures"
    although the a3b JSON was there a row later. A reader is judged again once the row it reads has run."""

    def reader_judge(ctx: Context, code: int, log: str) -> Verdict:
        written = ctx.work.parent / "writer" / "figure.txt"
        return Verdict(True, f"read {written.read_text().strip()}" if written.exists() else "nothing to read yet")

    def rows(reads: tuple[str, ...]) -> list[Row]:
        reader = dataclasses.replace(_row("reader", "echo reading", judge=reader_judge), reads=reads)
        writer = dataclasses.replace(
            _row("writer", ""), command=lambda ctx: f"echo 42 > {ctx.path('figure.txt')} && echo wrote"
        )
        return [reader, writer]

    def figures(out: Path, reads: tuple[str, ...]) -> dict[str, str]:
        monkeypatch.setenv("ACCEPT_WORK", str(out / "work"))
        monkeypatch.setattr(gpu_accept, "ROWS", rows(reads))
        gpu_accept.main([str(out), "--rows", "reader,writer"])
        return {r["name"]: r["figure"] for r in json.loads((out / "accept.json").read_text())["rows"]}

    x16l = {r.name: r for r in gpu_accept.ROWS}["sync_layouts_x16l"]
    assert x16l.reads == (gpu_accept.SYNC_LAYOUT_ROWS["a3b"],)
    assert figures(machine / "unlinked", ())["reader"] == "nothing to read yet"  # the order alone does not do it
    linked = figures(machine / "linked", ("writer",))
    assert linked == {"reader": "read 42", "writer": "said 'wrote'"}
    assert "| reader | **pass** | read 42 |" in (machine / "linked" / "accept.md").read_text()


def test_the_recorded_commit_says_when_the_files_are_not_that_commit(tmp_path: Path) -> None:
    """The GPU machine's copy may carry older git metadata than its files: the JSON must not name that commit bare."""
    import subprocess

    from benchmarks.gpu_accept import source_commit

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=tmp_path, capture_output=True, text=True, check=True).stdout.strip()

    git("init", "-q")
    (tmp_path / "code.py").write_text("a = 1\n")
    git("add", "code.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    head = git("rev-parse", "--short", "HEAD")
    assert source_commit(tmp_path) == head
    (tmp_path / "code.py").write_text("a = 2\n")
    assert source_commit(tmp_path) == f"{head}+modified (1 files)"
    assert source_commit(tmp_path / "missing").startswith("unknown")


def test_the_x16l_row_shows_the_receipts_cost_and_fails_when_the_kernel_layout_is_refused(tmp_path: Path) -> None:
    """Issue 42: the receipt's share of the time split (the check after the sync, the engine's reads), the share of
    the raw broadcast beside 2026-11-28's, the reference's one-off seconds; a kernel layout refused by its reference
    check is a failed row, whatever the figures (the syncs measured were checkpoint-layout ones)."""
    raw = 300.0
    report = _sync_report(LARGE, {"kernel": 0.1, "checkpoint": 4.0}, raw)
    kernel = report["by_layout"]["kernel"]["nccl"]
    kernel["phases_median_s"]["canary_receipt"] = 0.02
    kernel["with_receipt_median_s"] = 0.12
    kernel["engine_seconds_median"] = {"unchanged": 0.001}
    report["kernel_reference"] = {"seconds": 4.5, "refused": None}
    _write_sync(tmp_path, "a3b-x16l", report)
    ctx = Context(gpus=2, work=tmp_path / gpu_accept.SYNC_LAYOUT_ROWS["a3b-x16l"])
    confirmed = gpu_accept.judge_sync_layouts("a3b-x16l")(ctx, 0, "")
    assert confirmed.passed, confirmed.figure
    assert "receipt check 0.02 s, with it 0.12 s" in confirmed.figure and "engine unchanged 0.001" in confirmed.figure
    ratio = LARGE / 0.1 / 1e9 / raw  # 200 GB/s of 300
    assert f"kernel {ratio:.3f}× raw (2026-11-28 H200, before issue 42's receipt: 0.573×)" in confirmed.figure
    assert "kernel plan confirmed by vLLM's own load_weights in 4.5 s (one-off)" in confirmed.figure
    report["kernel_reference"] = {"seconds": 4.5, "refused": "on engine-0, 1 of 147 parameter(s) ...: w13_weight"}
    _write_sync(tmp_path, "a3b-x16l", report)
    refused = gpu_accept.judge_sync_layouts("a3b-x16l")(ctx, 0, "")
    assert not refused.passed and "kernel layout REFUSED by its reference check" in refused.figure


def test_the_receipt_build_errors_row_runs_its_gpu_test_on_one_gpu(tmp_path: Path) -> None:
    [row] = [r for r in gpu_accept.ROWS if r.name == "receipt_build_errors"]
    assert row.min_gpus == 1 and "tests/gpu/test_receipt_build_errors.py -m gpu" in row.command(Context(1, tmp_path))
    assert (REPO / "tests" / "gpu" / "test_receipt_build_errors.py").is_file()
    assert row.judge(Context(1, tmp_path), 0, "7 passed in 200.0s").passed
    assert not row.judge(Context(1, tmp_path), 1, "1 failed, 6 passed in 200.0s").passed


def _upgrade(work: Path, *, new_passed: bool = True, broken_passed: bool = False, after_steps: int = 4) -> Context:
    """What benchmarks/upgrade_row.py writes for the row's judge."""
    work.mkdir(parents=True)
    report = {"vLLM": "- vLLM: 0.22.1", "weight sync": "- weight sync: nccl (…); layout checkpoint (…)"}
    good = {"naturalMismatch": 0.0262, "logprobAbsDiffOff": 0.00551, "replayAgreement": 1.0}
    bad = {"naturalMismatch": 0.1462, "logprobAbsDiffOff": 0.03897, "replayAgreement": 1.0}
    result = {
        "new_release": "0.26.0",
        "before": {"exit": 0, "steps": [1, 2], "canary_ok": ["1", "1"], "report": report},
        "canary": {
            "new": {"passed": new_passed, "message": "new (0.26.0): replay agreement 1.0000", "new": good, "old": good},
            "broken": {"passed": broken_passed, "message": "mean |Δlogprob| 0.08 > 0.001", "new": bad, "old": good},
        },
        "after": {
            "exit": 0,
            "steps": list(range(1, after_steps + 1)),
            "canary_ok": ["1"] * after_steps,
            "report": {"vLLM": "- vLLM: 0.26.0", "weight sync": "- weight sync: packed (fallback: …)"},
        },
    }
    (work / "upgrade.json").write_text(json.dumps(result))
    return Context(gpus=1, work=work)


def test_the_upgrade_row_passes_only_with_the_canary_judged_both_ways_and_the_run_resumed(tmp_path: Path) -> None:
    ok = gpu_accept.judge_upgrade(_upgrade(tmp_path / "ok"), 0, "")
    assert ok.passed
    assert ok.figure == (
        "0.22.1 steps 1-2 → 0.26.0's canary passed (natural mismatch 0.0262 vs old 0.0262, mean |Δlogprob| 0.00551 "
        "vs 0.00551, replay agreement 1.0000); 0.26.0 with norm_topk_prob false rolled back (natural mismatch 0.1462 "
        "vs old 0.0262, mean |Δlogprob| 0.03897 vs 0.00551, replay agreement 1.0000); steps 3-4 on 0.26.0, 4/4 syncs "
        "canaried, weight sync packed"
    )
    not_rolled_back = gpu_accept.judge_upgrade(_upgrade(tmp_path / "broken", broken_passed=True), 0, "")
    assert not not_rolled_back.passed and "the broken release was not rolled back" in not_rolled_back.figure
    refused = gpu_accept.judge_upgrade(_upgrade(tmp_path / "new", new_passed=False), 0, "")
    assert not refused.passed and "the new release's canary did not pass" in refused.figure
    stopped = gpu_accept.judge_upgrade(_upgrade(tmp_path / "stopped", after_steps=2), 0, "")
    assert not stopped.passed and "after: exit 0, steps [1, 2]" in stopped.figure
    assert not gpu_accept.judge_upgrade(Context(gpus=1, work=tmp_path / "none"), 0, "").passed


def test_the_a3b_row_needs_auto_to_have_taken_the_kernel_layout(tmp_path: Path) -> None:
    def a3b(work: Path, synced: str) -> Context:
        run = work / "up" / "a3b-math"
        run.mkdir(parents=True)
        fields = ["step", "canary_ok", "step_seconds", "replay_applied", "reward_mean", "t_weight_sync"]
        with (run / "metrics.csv").open("w", newline="") as out:
            writer = csv.DictWriter(out, fieldnames=fields)
            writer.writeheader()
            for step in range(1, 11):
                writer.writerow(dict(zip(fields, [step, 1, 2.5, 1.0, 0.5, 0.03], strict=True)))
        (run / "report.md").write_text(f"# report\n- weight sync: {synced}\n")
        return Context(gpus=1, work=work)

    kernel = "ipc (vLLM 0.22.1 native ipc weight transfer); layout kernel (auto: engine vLLM 0.22.1 over ipc, …)"
    assert gpu_accept.judge_a3b(a3b(tmp_path / "kernel", kernel), 0, "").passed
    fallback = "ipc (…); layout checkpoint (fallback: kernel refused at run time: on engine-0, 3 of 39 …)"
    verdict = gpu_accept.judge_a3b(a3b(tmp_path / "fallback", fallback), 0, "")
    assert not verdict.passed and "auto did not take the kernel layout" in verdict.figure


def _pd_metrics(ctx: Context, name: str, job: str, *, gap: float, agreement: float, canary: str = "1") -> None:
    path = ctx.work / name / job / "runs" / "metrics.csv"
    path.parent.mkdir(parents=True)
    header = "step,replay_applied,canary_ok,logprob_abs_diff_mean,routing_natural_agreement,t_rollout,t_weight_sync"
    rows = [f"{s},1.0,{canary},{gap},{agreement},1.0,0.5" for s in (1, 2, 3)]
    path.write_text("\n".join([header, *rows]) + "\n")


def test_the_pd_row_passes_only_when_disaggregation_is_no_worse_than_one_engine(tmp_path: Path) -> None:
    def judged(work: str, *, pd_gap: float, canary: str = "1", log: str = "1 passed in 30.0s") -> Any:
        ctx = Context(gpus=1, work=tmp_path / work)
        _pd_metrics(ctx, "pd", "gpu-accept-pd", gap=pd_gap, agreement=0.96, canary=canary)
        _pd_metrics(ctx, "one", "gpu-accept-pd-one", gap=0.004, agreement=0.96)
        return gpu_accept.judge_pd(ctx, 0, log)

    assert judged("same", pd_gap=0.004).passed
    worse = judged("worse", pd_gap=0.008)
    assert not worse.passed and worse.target_met is False
    assert not judged("canary", pd_gap=0.004, canary="0").passed
    skipped = judged("skipped", pd_gap=0.004, log="1 skipped in 1.0s")  # NIXL missing: the routes test skipped
    assert not skipped.passed and "test_pd_nixl.py" in skipped.figure


def test_a_rows_independent_parts_all_run_and_any_failure_fails_the_row(tmp_path: Path) -> None:
    def run(*parts: str) -> int:
        return subprocess.run(["bash", "-c", gpu_accept.every_part(*parts)], cwd=tmp_path, check=False).returncode

    assert run("false", "touch second", "touch third && false") == 1
    assert (tmp_path / "second").exists() and (tmp_path / "third").exists()
    assert run("true", "echo a | grep -q a") == 0
    assert run("true", "exit 3", "touch after_exit") == 1 and (tmp_path / "after_exit").exists()

    ctx = Context(gpus=1, work=tmp_path / "pd")
    command = gpu_accept.pd_command(ctx)
    assert command.startswith("bash scripts/gpu-nixl-setup.sh && {")  # without NIXL no part can run
    assert command.count("|| rc=1") == 3 and "tests/gpu/test_pd_nixl.py" in command


def test_the_route_checks_row_judges_the_benchmarks_own_json(tmp_path: Path) -> None:
    """The row's command is the benchmark's (CPU here, small): its JSON passes on the passing path, with the checks'
    seconds set against the learning run's; a run that kept fewer samples, or no JSON, fails."""
    from benchmarks import bench_route_checks

    [row] = [r for r in gpu_accept.ROWS if r.name == "route_checks_cost"]
    ctx = Context(gpus=1, work=tmp_path)
    assert row.command(ctx).startswith("python3 -m benchmarks.bench_route_checks --device cuda --json ")
    assert not gpu_accept.judge_route_checks(ctx, 0, "").passed  # nothing written
    argv = ["--device", "cpu", "--samples", "8", "--max-response", "16", "--repeats", "1"]
    assert bench_route_checks.main([*argv, "--json", str(tmp_path / "route-checks.json")]) == 0
    verdict = gpu_accept.judge_route_checks(ctx, 0, "")
    assert verdict.passed and verdict.target_met
    assert "constant_layer_suspects" in verdict.figure and "against 0.59 s" in verdict.figure
    data = json.loads((tmp_path / "route-checks.json").read_text())
    (tmp_path / "route-checks.json").write_text(json.dumps({**data, "samples_kept": data["samples"] - 1}))
    failed = gpu_accept.judge_route_checks(ctx, 0, "")
    assert not failed.passed and "not the passing path" in failed.figure
    (tmp_path / "route-checks.json").write_text(json.dumps({**data, "agreement_matches_host": False}))
    differs = gpu_accept.judge_route_checks(ctx, 0, "")
    assert not differs.passed and "differs from NumPy's" in differs.figure


def test_beside_another_run_rows_get_twice_their_timeouts_and_the_record_says_the_gpu_was_shared(
    machine: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gpu_accept, "ROWS", [_row("slow", "sleep 1.5; echo done", timeout_s=1)])
    assert gpu_accept.main([str(machine), "--budget", "60"]) == 1  # alone: 1.5 s is past its 1 s
    assert gpu_accept.main([str(machine), "--budget", "60", "--beside", "learning run (e)"]) == 0
    record = json.loads((machine / "accept.json").read_text())
    assert record["beside"] == "learning run (e)" and record["rows"][0]["status"] == "pass"
    assert (
        "- shared: beside learning run (e) (timings are not alone-on-the-GPU figures)"
        in (machine / "accept.md").read_text()
    )
