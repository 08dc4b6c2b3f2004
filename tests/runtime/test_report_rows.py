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
    gpu_rows = [
        {"step": "1", "reward_mean": "0", "trainer_peak_memory_gib": "40.25"},
        {"step": "2", "reward_mean": "1", "trainer_peak_memory_gib": "41.75"},
    ]
    text = write_report(tmp_path / "gpu.md", job_name="j", runs={"R3": gpu_rows}, facts={})
    assert "trainer peak GPU memory (largest rank): 41.8 GiB" in text
    cpu_rows = [{"step": "1", "reward_mean": "0", "trainer_peak_memory_gib": ""}]
    assert "peak GPU memory" not in write_report(tmp_path / "cpu.md", job_name="j", runs={"R3": cpu_rows}, facts={})


def test_the_canary_line_says_off_when_it_never_ran_and_counts_only_steps_that_synced(tmp_path: Path) -> None:
    rows = [
        {"step": "1", "reward_mean": "0", "canary_ok": "0", "skipped": "0"},
        {"step": "2", "reward_mean": "1", "canary_ok": "0", "skipped": "0"},
    ]
    off = write_report(tmp_path / "off.md", job_name="j", runs={"R3": rows}, facts={}, canary=False)
    assert "- weight-sync canary: off (spec.weightSync.canary: false)" in off and "0/2" not in off
    ran = [{**rows[0], "canary_ok": "1"}, {**rows[1], "skipped": "1"}]  # a skipped step has no sync
    assert "- weight-sync canary: passed after 1 of 1 step syncs" in write_report(
        tmp_path / "on.md", job_name="j", runs={"R3": ran}, facts={}
    )


def test_an_async_report_without_current_version_tokens_says_so_and_splits_the_gap_by_lag(tmp_path: Path) -> None:
    """metrics.csv rows of an asynchronous run (strings, as read back). Lag 1 over both steps: (30 x 0.1 +
    10 x 0.2) / 40 = 0.125; lag 2: 0.4 over 10 tokens; no lag-0 token, so no mismatch figure (not NaN)."""
    empty = {"logprob_abs_diff_mean": "", "logprob_abs_diff_max": "", "kl_k3": "", "routing_natural_agreement": ""}
    rows = [
        {
            "step": "1",
            "reward_mean": "0",
            "replay_applied": "1.0",
            "current_version_tokens": "0",
            **empty,
            "logprob_abs_diff_by_lag": "-;0.1;0.4",
            "tokens_by_lag": "0;30;10",
        },
        {
            "step": "2",
            "reward_mean": "1",
            "replay_applied": "1.0",
            "current_version_tokens": "0",
            **empty,
            "logprob_abs_diff_by_lag": "-;0.2;-",
            "tokens_by_lag": "0;10;0",
        },
    ]
    text = write_report(tmp_path / "async.md", job_name="j", runs={"R3": rows}, facts={})
    assert "nan" not in _fidelity(text)
    assert "rollout vs trainer: not measured: no step trained a token of the current policy version" in text
    assert "lag 1 0.125 (40 tokens), lag 2 0.4 (10 tokens)" in text

    measured = {
        "step": "3",
        "reward_mean": "1",
        "replay_applied": "1.0",
        "current_version_tokens": "8",
        "logprob_abs_diff_mean": "0.004",
        "logprob_abs_diff_max": "0.05",
        "kl_k3": "1e-5",
        "routing_natural_agreement": "0.99",
        "logprob_abs_diff_by_lag": "0.004;0.3;-",
        "tokens_by_lag": "8;20;0",
        "logprob_abs_diff_mean_resumed": "0.0021",
    }
    text = write_report(tmp_path / "mixed.md", job_name="j", runs={"R3": [*rows, measured]}, facts={})
    assert "resumed trajectories' current-version tokens" in text and "mean over 1 steps: 0.0021" in text
    assert "nan" not in _fidelity(text)
    assert "(tokens the current policy version sampled in trajectories it sampled alone, 1 of 3 steps" in text
    assert ": 0.004; max over steps: 0.05" in text and "natural vs engine: 0.9900" in text
    assert "lag 0 0.004 (8 tokens), lag 1 0.183 (60 tokens), lag 2 0.4 (10 tokens)" in text
    assert "routed differently" not in text  # no row has the column (a file from before it): nothing said of it


def test_the_routing_line_gives_the_share_of_tokens_with_a_layer_routed_differently(tmp_path: Path) -> None:
    """The mean over the steps that measured it, as a percentage: (0.25 + 0.125) / 2 = 18.75 % -> "18.8%"; a step
    that compared no routes (empty cell) is left out of the mean, not counted as 0."""
    base = {"reward_mean": "0", "replay_applied": "1.0", "logprob_abs_diff_mean": "0.004"}
    base |= {"logprob_abs_diff_max": "0.05", "routing_natural_agreement": "0.95"}
    rows = [
        {**base, "step": "1", "routing_tokens_any_diff": "0.25"},
        {**base, "step": "2", "routing_tokens_any_diff": "0.125"},
        {**base, "step": "3", "routing_tokens_any_diff": ""},
    ]
    text = write_report(tmp_path / "report.md", job_name="j", runs={"R3": rows}, facts={})
    line = next(x for x in text.splitlines() if x.startswith("- routing agreement"))
    assert line == (
        "- routing agreement, trainer natural vs engine: 0.9500 (tokens with a layer routed differently: 18.8%); "
        "replay applied (experts got the engine's ids): 1.0000"
    )


def _fidelity(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if "Δlogprob" in line or "routing" in line).lower()


def test_the_phase_line_names_the_phases_no_step_ran_instead_of_showing_nan(tmp_path: Path) -> None:
    """A synchronous run without evaluation: `t_eval` and `t_pause` are empty in every row (2026-12-07, `make run`
    printed "eval nan, … pause nan"). Means written out: rollout (0.25 + 0.75) / 2 = 0.50."""
    rows = [
        {"step": "1", "reward_mean": "0", "t_rollout": "0.25", "t_update": "1.0", "t_eval": "", "t_pause": ""},
        {"step": "2", "reward_mean": "1", "t_rollout": "0.75", "t_update": "2.0", "t_eval": "", "t_pause": ""},
    ]
    text = write_report(tmp_path / "report.md", job_name="j", runs={"R3": rows}, facts={})
    line = next(x for x in text.splitlines() if x.startswith("- mean phase seconds: "))
    assert "rollout 0.50" in line and "update 1.50" in line and "nan" not in line
    idle = line.split(" (not run: ", 1)[1].rstrip(")").split(", ")
    assert {"eval", "pause"} <= set(idle) and "rollout" not in idle
    ran = [{**r, "t_eval": "3.0", "t_pause": "0.5"} for r in rows]
    assert "eval 3.00" in write_report(tmp_path / "ran.md", job_name="j", runs={"R3": ran}, facts={})
