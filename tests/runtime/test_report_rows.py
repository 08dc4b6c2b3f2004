"""metrics.csv across image versions and the report's memory line."""

from __future__ import annotations

import csv
from pathlib import Path

from r3operator.runtime.report import COLUMNS, append_row, read_rows, write_report


def test_a_resumed_run_rewrites_an_older_header_so_new_rows_line_up(tmp_path: Path) -> None:
    path = tmp_path / "metrics.csv"
    older = [c for c in COLUMNS if c != "trainer_peak_memory_gib"]
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=older)
        writer.writeheader()
        writer.writerow({c: "" for c in older} | {"step": "1", "reward_mean": "0.25"})

    append_row(path, {"step": 2, "reward_mean": 0.5, "trainer_peak_memory_gib": 41.5})

    with path.open() as fh:
        assert fh.readline().rstrip("\r\n").split(",") == list(COLUMNS)
    rows = read_rows(path)
    assert [(r["step"], r["reward_mean"], r["trainer_peak_memory_gib"]) for r in rows] == [
        ("1", "0.25", ""),
        ("2", "0.5", "41.5"),
    ]


def test_the_report_names_the_largest_peak_and_leaves_it_out_on_cpu(tmp_path: Path) -> None:
    gpu_rows = [{"step": "1", "reward_mean": "0", "trainer_peak_memory_gib": "40.25"},
                {"step": "2", "reward_mean": "1", "trainer_peak_memory_gib": "41.75"}]  # fmt: skip
    text = write_report(tmp_path / "gpu.md", job_name="j", runs={"R3": gpu_rows}, facts={})
    assert "trainer peak GPU memory (largest rank): 41.8 GiB" in text
    cpu_rows = [{"step": "1", "reward_mean": "0", "trainer_peak_memory_gib": ""}]
    assert "peak GPU memory" not in write_report(tmp_path / "cpu.md", job_name="j", runs={"R3": cpu_rows}, facts={})


def test_the_canary_line_says_off_when_it_never_ran_and_counts_only_steps_that_synced(tmp_path: Path) -> None:
    rows = [{"step": "1", "reward_mean": "0", "canary_ok": "0", "skipped": "0"},
            {"step": "2", "reward_mean": "1", "canary_ok": "0", "skipped": "0"}]  # fmt: skip
    off = write_report(tmp_path / "off.md", job_name="j", runs={"R3": rows}, facts={}, canary=False)
    assert "- weight-sync canary: off (spec.weightSync.canary: false)" in off and "0/2" not in off
    ran = [{**rows[0], "canary_ok": "1"}, {**rows[1], "skipped": "1"}]  # a skipped step has no sync
    assert "- weight-sync canary: passed after 1 of 1 step syncs" in write_report(
        tmp_path / "on.md", job_name="j", runs={"R3": ran}, facts={}
    )
