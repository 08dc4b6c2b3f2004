"""A step's figures, typed (runtime/step_record.py): one StepRecord is the metrics.csv row (its cells), what the
progress line and the Prometheus gauges read, and the RLJob's status.progress."""

from __future__ import annotations

import math
import re
from pathlib import Path

from r3operator.api.v1alpha1 import Progress
from r3operator.runtime.metrics import progress_patch
from r3operator.runtime.report import append_row, read_rows
from r3operator.runtime.step_record import COLUMNS, StepRecord

DOCS = Path(__file__).resolve().parents[2] / "docs" / "runtime.md"


def _documented_columns() -> list[str]:
    """The metrics.csv columns docs/runtime.md lists ("Outputs and metrics"), in its order."""
    lines = DOCS.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "| group | columns |") + 2
    names: list[str] = []
    for line in lines[start:]:
        if not line.strip().startswith("|"):
            break
        names += re.findall(r"`([a-z0-9_]+)`", line.split("|")[2])
    return names


def _trained_async_record() -> StepRecord:
    return StepRecord(
        step=4,
        policy_version=3,
        replay_mode="R3",
        reward_mean=0.5,
        reward_std=0.25,
        samples=8,
        samples_dropped=1,
        tokens=96,
        prompt_tokens=40,
        tokens_per_second=12.5,
        logprob_abs_diff_mean=None,
        logprob_abs_diff_max=None,
        kl_k3=None,
        extreme_token_fraction=None,
        replay_applied=1.0,
        routing_natural_agreement=None,
        routing_tokens_any_diff=None,
        loss=-0.125,
        clip_fraction=0.0625,
        grad_norm=2.5,
        entropy_mean=1.25,
        dual_clip_fraction=0.03125,
        canary_ok=1,
        canary_near_ties=2,
        skipped=0,
        step_seconds=7.75,
        trainer_peak_memory_gib=None,
        phase_seconds={"rollout": 1.5, "update": 2.25, "pause": 0.5},
        sync_seconds={"gather": 0.125, "transfer": 0.375},
        staleness_mean=0.5,
        staleness_max=1,
        partial_rollouts=2,
        stale_dropped=0,
        trainer_idle_seconds=1.5,
        importance_weight_mean=0.875,
        importance_truncated_fraction=0.0,
        current_version_tokens=0,
        logprob_abs_diff_mean_stale=0.04,
        logprob_abs_diff_by_lag="-;0.04",
        tokens_by_lag="0;80",
    )


def test_the_columns_are_the_ones_the_docs_list_in_their_order() -> None:
    assert list(COLUMNS) == _documented_columns()


def test_a_record_round_trips_through_metrics_csv_column_by_column(tmp_path: Path) -> None:
    record = _trained_async_record()
    path = tmp_path / "metrics.csv"
    append_row(path, record.row())

    (row,) = read_rows(path)
    assert list(row) == _documented_columns()
    # Each cell is the field's str(); empty where the step had nothing to measure or the column is not its kind's.
    expected = {
        "step": "4",
        "policy_version": "3",
        "replay_mode": "R3",
        "reward_mean": "0.5",
        "reward_std": "0.25",
        "samples": "8",
        "samples_dropped": "1",
        "tokens": "96",
        "prompt_tokens": "40",
        "tokens_per_second": "12.5",
        "logprob_abs_diff_mean": "",
        "logprob_abs_diff_max": "",
        "kl_k3": "",
        "extreme_token_fraction": "",
        "replay_applied": "1.0",
        "routing_natural_agreement": "",
        "routing_tokens_any_diff": "",
        "loss": "-0.125",
        "clip_fraction": "0.0625",
        "grad_norm": "2.5",
        "entropy_mean": "1.25",
        "dual_clip_fraction": "0.03125",
        "canary_ok": "1",
        "canary_near_ties": "2",
        "step_seconds": "7.75",
        "t_rollout": "1.5",
        "t_update": "2.25",
        "t_pause": "0.5",
        "skipped": "0",
        "trainer_peak_memory_gib": "",
        "nonfinite_updates": "0",
        "staleness_mean": "0.5",
        "staleness_max": "1",
        "partial_rollouts": "2",
        "stale_dropped": "0",
        "trainer_idle_seconds": "1.5",
        "importance_weight_mean": "0.875",
        "importance_truncated_fraction": "0.0",
        "current_version_tokens": "0",
        "logprob_abs_diff_mean_stale": "0.04",
        "logprob_abs_diff_by_lag": "-;0.04",
        "tokens_by_lag": "0;80",
        "sync_gather": "0.125",
        "sync_transfer": "0.375",
    }
    assert row == {column: expected.get(column, "") for column in _documented_columns()}


def test_a_record_reads_as_the_row_of_its_kind_of_step() -> None:
    record = _trained_async_record().cells()
    # Present: the step's columns, empty figures as None; absent: another kind of job's, phases not run.
    assert record["logprob_abs_diff_mean"] is None
    assert record["t_pause"] == 0.5 and record.get("t_canary", 0.0) == 0.0
    assert "turns_mean" not in record and "sync_pack" not in record
    assert record["tokens_by_lag"] == "0;80"

    skipped = StepRecord(
        step=5,
        policy_version=3,
        replay_mode="R3",
        reward_mean=0.0,
        reward_std=0.0,
        samples=8,
        samples_dropped=8,
        tokens=64,
        tokens_per_second=10.0,
    ).cells()
    assert skipped["skipped"] == 1 and skipped["canary_ok"] == 0
    assert all(math.isnan(skipped[c]) for c in ("logprob_abs_diff_mean", "kl_k3", "loss", "replay_applied"))
    assert "importance_weight_mean" not in skipped and "staleness_mean" not in skipped


def test_the_status_progress_is_the_api_model_of_the_record() -> None:
    record = _trained_async_record()
    body = progress_patch(record, total_steps=10, last_checkpoint_step=4, weight_sync="packed")["status"]["progress"]
    progress = Progress.model_validate(body)
    assert progress == Progress(
        step=4,
        total_steps=10,
        reward_mean=0.5,
        logprob_abs_diff_mean=None,
        logprob_abs_diff_max=None,
        kl_k3=None,
        routing_agreement=None,
        last_checkpoint_step=4,
        weight_sync="packed",
        updated_at=progress.updated_at,
    )
    # Unmeasured figures are sent as null (a JSON merge patch clears the last step's), never left out.
    assert body["logprobAbsDiffMean"] is None and "klK3" in body
