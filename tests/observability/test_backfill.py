"""A finished run's metrics.csv played back as the driver's series (observability/backfill.py).

The references: the driver's own exporter at the end of a real run (a `GRPORun` on a stand-in engine, with held-out
evaluations), which the backfill must give back series by series; timestamps written out from the rows' step_seconds;
a real Prometheus serving promtool's blocks, queried as the dashboards query it.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from fake_engine import FakeEngine
from runtime_test_helpers import settings_for, write_job

from r3operator.observability.backfill import BACKFILLED, BackfillError, backfill, play, read_run
from tests.observability.conftest import tool

ARITH = Path(__file__).resolve().parents[2] / "examples" / "data" / "arith.jsonl"


def _live(run: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every series the driver's registry holds now (gauges, counters' `_total`, histograms' parts)."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): float(s.value)
        for family in run.metrics.registry.collect()
        for s in family.samples
    }


def test_a_runs_rows_give_back_every_series_the_driver_exported_that_a_row_keeps(tmp_path: Path) -> None:
    from r3operator.rollout.engines import EngineGroup
    from r3operator.runtime.loop import GRPORun

    job = write_job(
        tmp_path,
        task={"name": "dataset", "datasetPath": str(ARITH), "reward": "math"},
        rollout={"promptsPerStep": 2, "groupSize": 4, "maxTokens": 6},
        weightSync={"canary": False},
        evaluation={"datasetPath": str(ARITH), "intervalSteps": 2, "maxPrompts": 3, "samplesPerPrompt": 2},
    )
    run = GRPORun(settings_for(job, tmp_path / "runs", steps=3), engines=EngineGroup([FakeEngine()]))
    run.run()
    live = _live(run)

    played = read_run(run.run_dir)
    assert played.rljob == run.run_dir.name and [int(r["step"]) for r in played.rows] == [1, 2, 3]
    assert played.eval_before is not None  # the evaluation before training, from eval.csv
    samples = list(play(played, start=1000.0, namespace=run.metrics.namespace))
    last = max(s.timestamp for s in samples)
    at_end = {(s.name, s.labels): s.value for s in samples if s.timestamp == last}
    # The driver's run has its own rljob label (the job's name); the played one is named after the directory.
    relabel = {run.metrics.rljob: played.rljob}
    expected = {
        (name, tuple((k, relabel.get(v, v) if k == "rljob" else v) for k, v in labels)): value
        for (name, labels), value in live.items()
        if name in BACKFILLED
    }
    assert expected and at_end == expected
    # Nothing a row does not keep: the driver's other series (route bytes, drop counters, per-layer agreement) would
    # read as a measured 0 or an old value.
    assert {s.name for s in samples} <= BACKFILLED
    assert {"r3operator_eval_reward", "r3operator_kl_k3", "r3operator_step_phase_seconds"} <= {s.name for s in samples}


def _write_rows(path: Path, rows: list[dict[str, Any]], *, extra: tuple[str, ...] = ()) -> Path:
    columns = ["step", "policy_version", "replay_mode", "reward_mean", "tokens_per_second", "step_seconds", "t_rollout"]
    columns += ["logprob_abs_diff_mean", "logprob_abs_diff_max", "kl_k3", "extreme_token_fraction", "canary_ok"]
    columns += ["eval_reward", *extra]
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({c: row.get(c, "") for c in columns})
    return path


def _row(step: int, seconds: float, **cells: Any) -> dict[str, Any]:
    fidelity = {"logprob_abs_diff_mean": 0.01, "logprob_abs_diff_max": 0.5, "kl_k3": 1e-5, "extreme_token_fraction": 0}
    base = {"step": step, "policy_version": step, "replay_mode": "R3", "reward_mean": 0.1 * step}
    return base | {"tokens_per_second": 900.0, "step_seconds": seconds, "t_rollout": seconds / 2, **fidelity} | cells


def test_each_step_ends_at_the_sum_of_its_runs_step_seconds_and_an_unmeasured_step_has_no_fidelity(
    tmp_path: Path,
) -> None:
    path = _write_rows(
        tmp_path / "r3-metrics.csv",
        [_row(1, 4.0), _row(2, 6.5, logprob_abs_diff_mean="", kl_k3=""), _row(3, 3.0, eval_reward=0.75)],
    )
    played = read_run(path)
    assert played.rljob == "r3" and played.seconds == 13.5
    samples = list(play(played, start=100.0))
    reward = [(s.timestamp, s.value) for s in samples if s.name == "r3operator_reward_mean"]
    assert reward == [(104.0, 0.1), (110.5, 0.2), (113.5, 0.30000000000000004)]
    kl = [(s.timestamp, s.value) for s in samples if s.name == "r3operator_kl_k3"]
    # No series before step 1 measured one (a live scrape reads none either); step 2 measured no token, so the driver
    # removed the series (clear_fidelity): no sample then.
    assert kl == [(104.0, 1e-5), (113.5, 1e-5)]
    evals = [(s.timestamp, s.value) for s in samples if s.name == "r3operator_eval_reward"]
    assert evals == [(113.5, 0.75)]
    armed = {s.value for s in samples if s.name == "r3operator_replay_active"}
    assert armed == {1.0}


def test_the_share_of_tokens_with_a_routing_difference_is_played_where_the_file_has_it(tmp_path: Path) -> None:
    name = "r3operator_routing_tokens_any_diff_ratio"
    path = _write_rows(
        tmp_path / "r3-metrics.csv",
        [_row(1, 4.0, routing_tokens_any_diff=0.25), _row(2, 2.0, routing_tokens_any_diff="")],
        extra=("routing_tokens_any_diff",),
    )
    played = [(s.timestamp, s.value) for s in play(read_run(path), start=100.0) if s.name == name]
    # No series before step 1 measured it; step 2 compared no routes, so the driver had removed the series.
    assert played == [(104.0, 0.25)]
    older = _write_rows(tmp_path / "old-metrics.csv", [_row(1, 4.0)])  # a run from before the column: no series
    assert [s for s in play(read_run(older), start=100.0) if s.name == name] == []


@pytest.mark.parametrize(
    ("rows", "named"),
    [
        ([{"step": "1", "policy_version": "1", "replay_mode": "R3"}], "'reward_mean'"),
        ([_row(1, 2.0, reward_mean="nan?")], "step '1', column 'reward_mean' is 'nan?'"),
        ([], "no step recorded yet"),
    ],
)
def test_a_file_that_is_not_a_runs_metrics_is_refused_naming_it(tmp_path: Path, rows: Any, named: str) -> None:
    path = tmp_path / "metrics.csv"
    if rows and "reward_mean" not in rows[0]:
        path.write_text("step,policy_version,replay_mode\n1,1,R3\n")
    else:
        _write_rows(path, rows)
    with pytest.raises(BackfillError, match=r"metrics\.csv") as raised:
        read_run(tmp_path)
        list(play(read_run(tmp_path), start=0.0))
    assert named in str(raised.value)
    with pytest.raises(BackfillError, match=r"no metrics\.csv there"):
        read_run(tmp_path / "elsewhere")


def test_prometheus_serves_the_backfilled_steps_as_the_dashboards_query_them(tmp_path: Path) -> None:
    from r3operator.observability.prom import PrometheusServer

    promtool, prometheus = tool("promtool"), tool("prometheus")
    disabled = read_run(
        _write_rows(tmp_path / "disabled-metrics.csv", [_row(s, 10.0, replay_mode="Disabled") for s in (1, 2, 3)])
    )
    r3 = read_run(_write_rows(tmp_path / "r3-metrics.csv", [_row(s, 12.0) for s in (1, 2)]))
    start = float(int(time.time()) - 600)
    blocks = backfill([disabled, r3], start, tmp_path / "blocks", promtool=promtool)
    with PrometheusServer([], blocks=blocks, binary=prometheus) as prom:
        series = prom.query_range('max by (rljob) (r3operator_step{rljob=~".*"})', start, start + 60, 1.0)
        steps = {s["metric"]["rljob"]: {float(t): float(v) for t, v in s["values"]} for s in series}
    # Each run's step k from its start plus k times its step_seconds on; a gauge holds until the next sample.
    assert (
        steps["disabled"][start + 10] == 1 and steps["disabled"][start + 29] == 2 and steps["disabled"][start + 30] == 3
    )
    assert steps["r3"][start + 12] == 1 and steps["r3"][start + 24] == 2 and start + 11 not in steps["r3"]


def test_the_command_draws_the_dashboards_of_finished_runs(tmp_path: Path) -> None:
    tool("promtool")
    path = _write_rows(tmp_path / "r3-metrics.csv", [_row(s, 5.0) for s in (1, 2, 3)])
    out = tmp_path / "png"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "r3operator",
            "dashboard-preview",
            "--run",
            f"learning-r3={path}",
            "--dashboard",
            "all",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PATH": f"{Path(tool('promtool')).parent}:{os.environ['PATH']}"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == [
        "r3operator-engines-run.png",
        "r3operator-job-overview-run.png",
        "r3operator-operator-run.png",
        "r3operator-r3-run.png",
    ]
    bad = subprocess.run(
        [sys.executable, "-m", "r3operator", "dashboard-preview", "--run", str(tmp_path / "nowhere")],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "COLUMNS": "400"},  # the whole message on one line of the error box
    )
    assert bad.returncode == 2 and "no metrics.csv there" in bad.stderr
