"""The asynchronous mode without vLLM: partial trajectories across a weight update (stitched rows, per-token
policy versions), the staleness bound, the engine gate's pause, and the driver's rollout phase."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fake_engine import FakeEngine
from runtime_test_helpers import settings_for, write_job

from r3operator.rollout.partial import Trajectory, renumber, split_stale, staleness
from r3operator.rollout.producer import EngineGate, RolloutProducer
from r3operator.routing.codec import decode
from r3operator.routing.sample import RolloutSample
from r3operator.runtime.async_loop import segment_tokens
from r3operator.runtime.step_record import StepRecord

PROMPT = (5, 6, 7, 8)


def _producer(engine: FakeEngine, gate: EngineGate, **kwargs: Any) -> RolloutProducer:
    def generate(prompts: list[list[int]], starts: list[int], max_tokens: int, seed: int) -> list[RolloutSample]:
        return engine.generate(
            prompts, max_tokens=max_tokens, temperature=1.0, seed=seed, n=1, routed_experts_prompt_start=starts
        )

    options = {
        "group_size": 2,
        "max_tokens": 7,
        "segment_tokens": 3,
        "groups_in_flight": 1,
        "queue_groups": 4,
        "num_experts": engine.num_experts,
        **kwargs,
    }
    return RolloutProducer(generate=generate, next_prompt=lambda no: PROMPT, gate=gate, **options)


def test_a_weight_update_between_segments_keeps_the_old_rows_and_appends_the_new_tail() -> None:
    engine = FakeEngine(routes_follow_policy=True, tag="run:1")
    gate = EngineGate(version=1)
    producer = _producer(engine, gate)

    producer.run_segment()  # 3 tokens under policy 1
    # the weight update: the engine now routes with policy 2
    engine.tag = "run:2"
    gate.set_version(2)
    producer.run_segment()  # 3 more under policy 2
    producer.run_segment()  # the last one (budget 7)
    [group] = producer.take(1)

    # The resumed requests asked only for the rows not held yet: from the previous segment's last token on.
    assert engine.starts_seen == [[0, 0], [len(PROMPT) + 2] * 2, [len(PROMPT) + 5] * 2]
    assert producer.segments_resumed_after_update == 2  # both trajectories resumed once across the update
    for sample in group:
        assert len(sample.token_ids) == 7 and sample.extra["segments"] == 3 and sample.extra["partial"]
        np.testing.assert_array_equal(sample.extra["token_versions"], [1, 1, 1, 2, 2, 2, 2])
        sequence = sample.sequence
        rows = decode(sample.routes)
        assert sample.routes.start == 0 and len(rows) == len(sequence) - 1
        # Rows the first segment returned (prompt + first two tokens) keep policy 1's routing; the boundary
        # row (third token, prefilled by the resumed request) and the tail are policy 2's.
        first = len(PROMPT) + 2
        for position in range(len(rows)):
            tag = "run:1" if position < first else "run:2"
            np.testing.assert_array_equal(rows[position], engine.route_row(position, sequence[position], tag))
        # ...and they are not what policy 2 would have routed there: the old rows were not recomputed.
        assert any(not np.array_equal(rows[p], engine.route_row(p, sequence[p], "run:2")) for p in range(first))


def test_without_partial_rollouts_a_segment_is_the_whole_response() -> None:
    assert segment_tokens(16, False, 3) == 16
    assert segment_tokens(16, True, None) == 4
    assert segment_tokens(16, True, 5) == 5
    assert segment_tokens(2, True, None) == 1
    assert segment_tokens(4, True, 9) == 4


def test_a_trajectory_ends_at_a_stop_before_its_budget() -> None:
    engine = FakeEngine()
    trajectory = Trajectory(problem_no=0, choice_index=0, prompt=PROMPT, max_tokens=8)
    [sample] = engine.generate([list(PROMPT)], max_tokens=3, temperature=1.0, seed=0, n=1)
    from dataclasses import replace

    trajectory.add_segment(replace(sample, finish_reason="stop"), version=1, requested=3)
    assert trajectory.done and not trajectory.partial
    with pytest.raises(RuntimeError, match="is done"):
        trajectory.add_segment(sample, version=1, requested=3)


def _sample(versions: list[int], sid: str = "x") -> RolloutSample:
    extra = {"token_versions": np.asarray(versions), "partial": len(set(versions)) > 1}
    return RolloutSample(
        sample_id=sid,
        prompt_index=0,
        choice_index=0,
        prompt_token_ids=(1,),
        token_ids=tuple(range(len(versions))),
        logprobs=np.zeros(len(versions), np.float32),
        routes=None,
        extra=extra,
    )


def test_staleness_counts_from_the_oldest_token() -> None:
    assert staleness(_sample([3, 4, 5]), current_version=5) == 2
    assert staleness(_sample([5, 5]), current_version=5) == 0
    with pytest.raises(ValueError, match="newer than the current version"):
        staleness(_sample([6]), current_version=5)
    untagged = RolloutSample(
        sample_id="s",
        prompt_index=0,
        choice_index=0,
        prompt_token_ids=(1,),
        token_ids=(2,),
        logprobs=np.zeros(1, np.float32),
        routes=None,
    )
    with pytest.raises(ValueError, match="records no policy version"):
        staleness(untagged, current_version=1)


def test_the_staleness_bound_drops_whole_groups_older_than_k() -> None:
    on_policy = [_sample([5, 5]), _sample([5])]
    at_bound = [_sample([3, 4]), _sample([5])]  # 2 versions old: kept with k = 2
    one_member_too_old = [_sample([5]), _sample([2, 5])]  # 3 versions: the whole group goes
    kept, dropped = split_stale([on_policy, at_bound, one_member_too_old], current_version=5, max_staleness=2)
    assert kept == [on_policy, at_bound] and dropped == [one_member_too_old]
    kept, dropped = split_stale([on_policy, at_bound], current_version=5, max_staleness=0)
    assert kept == [on_policy] and dropped == [at_bound]
    with pytest.raises(ValueError, match="maxStaleness must be >= 0"):
        split_stale([], current_version=0, max_staleness=-1)


def test_renumber_makes_group_i_prompt_i() -> None:
    samples = renumber([[_sample([1]), _sample([1])], [_sample([1])]])
    assert [(s.sample_id, s.prompt_index, s.choice_index) for s in samples] == [
        ("p0-c0", 0, 0),
        ("p0-c1", 0, 1),
        ("p1-c0", 1, 0),
    ]


def test_a_pause_waits_for_the_segment_in_flight_and_holds_the_next_one() -> None:
    gate = EngineGate(version=1)
    order: list[str] = []
    in_segment, pausing = threading.Event(), threading.Event()

    def producer() -> None:
        with gate.segment() as version:
            assert version == 1
            in_segment.set()
            pausing.wait()
            while not gate._paused:  # the trainer has asked for the pause and waits for this segment
                threading.Event().wait(0.001)
            order.append("segment 1 ends")
        with gate.segment() as version:  # waits until the update resumed the engines
            order.append(f"segment 2 under v{version}")

    def trainer() -> None:
        in_segment.wait()
        pausing.set()
        with gate.paused():
            order.append("sync")
            gate.set_version(2)

    threads = [threading.Thread(target=producer), threading.Thread(target=trainer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert order == ["segment 1 ends", "sync", "segment 2 under v2"]


class _QueuedGroups:
    """The producer as the rollout phase sees it: groups taken in order."""

    def __init__(self, groups: list[list[RolloutSample]]) -> None:
        self.groups = groups

    def take(self, n: int, *, while_waiting: Any = None) -> list[list[RolloutSample]]:
        taken, self.groups = self.groups[:n], self.groups[n:]
        return taken


def test_the_rollout_phase_drops_and_counts_stale_groups_and_takes_others(tmp_path: Path) -> None:
    from r3operator.rollout.engines import EngineGroup
    from r3operator.runtime.async_loop import AsyncGRPORun
    from r3operator.tasks import toy as tasks

    job = write_job(
        tmp_path,
        rollout={"promptsPerStep": 2, "groupSize": 2, "partialRollout": True},
        algorithm={"mode": "async", "maxStaleness": 1},
    )
    run = AsyncGRPORun(settings_for(job, tmp_path / "runs"), engines=EngineGroup([FakeEngine()]))
    run.policy_version = 7
    problem = tasks.Problem(prompt_ids=[1, 2], answer_ids=[3])
    run.problems = {n: problem for n in range(4)}

    def group(no: int, versions: list[list[int]]) -> list[RolloutSample]:
        return [_replace_no(_sample(v, f"q{no}-c{j}"), no, j) for j, v in enumerate(versions)]

    run.producer = _QueuedGroups(
        [  # type: ignore[assignment]
            group(0, [[7, 7], [6, 7]]),  # staleness 1: kept (one member a partial rollout)
            group(1, [[5, 6], [7]]),  # staleness 2 > 1: dropped, both members
            group(2, [[6], [6]]),  # kept, taken in place of group 1
            group(3, [[7], [7]]),  # not needed this step
        ]
    )
    run.routes.dropped = []
    samples, problems = run.rollout(1)

    assert [s.sample_id for s in samples] == ["p0-c0", "p0-c1", "p1-c0", "p1-c1"]
    assert [list(s.extra["token_versions"]) for s in samples] == [[7, 7], [6, 7], [6], [6]]
    assert len(problems) == 2 and set(run.problems) == {3}  # taken problems leave, dropped ones too
    assert run.step_stale_dropped == 2 and [r for _, r in run.routes.dropped] == ["stale", "stale"]
    assert sorted(run.step_staleness) == [0, 1, 1, 1]  # the samples kept (the histogram has them all)
    assert run.step_partial == 1  # q0-c1 spans two versions (q1-c0 too, but it was dropped)
    exposition = run.metrics.exposition()
    [(labels, dropped)] = _series(exposition, "r3operator_samples_dropped_total")
    assert 'reason="stale"' in labels and dropped == 2
    assert [v for _, v in _series(exposition, "r3operator_partial_rollouts_total")] == [2]  # kept or dropped
    histogram = {
        labels.split('le="')[1].split('"')[0]: v
        for labels, v in _series(exposition, "r3operator_rollout_staleness_bucket")
    }
    assert histogram["0.0"] == 2 and histogram["1.0"] == 5 and histogram["2.0"] == 6


def _series(exposition: str, name: str) -> list[tuple[str, float]]:
    """(labels, value) of every sample of series `name` in a Prometheus text exposition."""
    return [
        (line[len(name) : line.rindex(" ")], float(line.rsplit(" ", 1)[1]))
        for line in exposition.splitlines()
        if line.startswith(name + "{")
    ]


def _by_lag_label(exposition: str, name: str) -> dict[str, float]:
    """lag label -> value of the series `name` (one job in the exposition)."""
    return {labels.split('lag="', 1)[1].split('"', 1)[0]: value for labels, value in _series(exposition, name)}


def _replace_no(sample: RolloutSample, no: int, j: int) -> RolloutSample:
    from dataclasses import replace

    return replace(sample, prompt_index=no, choice_index=j)


def test_async_steps_train_only_samples_within_the_bound_and_stop_the_producer(tmp_path: Path) -> None:
    """Three asynchronous steps through the driver (the real trainer on the tiny model, the fake engine)."""
    import csv

    from r3operator.rollout.engines import EngineGroup
    from r3operator.runtime.async_loop import AsyncGRPORun

    job = write_job(
        tmp_path,
        rollout={
            "promptsPerStep": 2,
            "groupSize": 2,
            "maxTokens": 4,
            "partialRollout": True,
            "partialRolloutSegment": 2,
        },
        algorithm={"mode": "async", "maxStaleness": 1, "importanceWeightCap": 2.0},
        weightSync={"canary": False},
    )
    run = AsyncGRPORun(settings_for(job, tmp_path / "runs", steps=3), engines=EngineGroup([FakeEngine()]))
    rows = run.run()

    assert [r.step for r in rows] == [1, 2, 3] and [r.policy_version for r in rows] == [2, 3, 4]
    assert run.producer is not None and run.producer._thread is None  # stopped with the run
    for row in rows:
        assert row.skipped == 0 and row.samples == 4 and row.samples_dropped == row.stale_dropped
        assert 0 <= row.staleness_max <= 1
        assert 0.0 < row.importance_weight_mean <= 2.0
        assert row.trainer_idle_seconds == row.phase_seconds["rollout"]
    with (run.run_dir / "metrics.csv").open() as fh:
        written = list(csv.DictReader(fh))
    assert [int(r["staleness_max"]) for r in written] == [r.staleness_max for r in rows]
    exposition = run.metrics.exposition()
    [(_, count)] = _series(exposition, "r3operator_rollout_staleness_count")
    assert count == sum(r.samples + r.stale_dropped for r in rows)  # every sample taken was observed
    _check_fidelity_split(rows, written, exposition)


def _check_fidelity_split(rows: list[StepRecord], written: list[dict[str, str]], exposition: str) -> None:
    """Every trained token is counted under its lag; the mismatch figures are those of lag 0, and a step
    without a lag-0 token has empty cells and no Prometheus series, never NaN."""
    # Step 1 takes groups the producer generated under the weights of the setup's sync, which step 1's
    # old-logprob pass runs: every token is of the current version.
    assert rows[0].current_version_tokens == rows[0].tokens > 0
    fidelity = ("logprob_abs_diff_mean", "logprob_abs_diff_max", "kl_k3", "routing_natural_agreement")
    for row, cells in zip(rows, written, strict=True):
        counts = [int(c) for c in row.tokens_by_lag.split(";")]
        diffs = row.logprob_abs_diff_by_lag.split(";")
        assert len(counts) == len(diffs) == 2 and sum(counts) == row.tokens  # maxStaleness 1: lags 0, 1
        assert counts[0] == row.current_version_tokens
        if counts[0]:
            assert float(diffs[0]) == pytest.approx(row.logprob_abs_diff_mean, rel=1e-3)
            assert all(np.isfinite(float(cells[key])) for key in fidelity)
        else:
            assert diffs[0] == "-" and all(getattr(row, key) is None and cells[key] == "" for key in fidelity)
    names = (
        "r3operator_logprob_",
        "r3operator_kl_k3",
        "r3operator_routing_agreement_ratio",
        "r3operator_routing_tokens_any_diff_ratio",
    )
    assert not [line for line in exposition.splitlines() if line.startswith(names) and "NaN" in line]
    if rows[-1].current_version_tokens == 0:  # the gauges describe the last step: not measured, no series
        assert not _series(exposition, "r3operator_logprob_abs_diff_mean")
    # Prometheus shows the last step's split as metrics.csv wrote it: maxStaleness 1, so lag "0" and ">=1"
    # (lag 1 alone); a lag without tokens has a token count of 0 and no mean series.
    last = written[-1]
    counts = [int(c) for c in last["tokens_by_lag"].split(";")]
    diffs = last["logprob_abs_diff_by_lag"].split(";")
    shown_tokens = _by_lag_label(exposition, "r3operator_response_tokens_by_lag")
    shown_diffs = _by_lag_label(exposition, "r3operator_logprob_abs_diff_mean_by_lag")
    assert shown_tokens == {"0": counts[0], ">=1": counts[1]}
    expected = {label: float(d) for label, d in zip(("0", ">=1"), diffs, strict=True) if d != "-"}
    assert shown_diffs.keys() == expected.keys()
    for label, value in expected.items():
        assert shown_diffs[label] == pytest.approx(value, rel=1e-3)  # the csv keeps 4 significant digits
    print("current-version tokens per step:", [r.current_version_tokens for r in rows])


class _ThreadRecordingEngine(FakeEngine):
    """Records, for every call, the thread it ran on and whether the engine gate was paused then."""

    gate: EngineGate | None = None
    where: list[tuple[str, str, bool]]

    def _call(self, method: str) -> None:
        if not hasattr(self, "where"):
            self.where = []
        paused = self.gate is not None and self.gate._paused
        self.where.append((method, threading.current_thread().name, paused))
        super()._call(method)


def test_a_restarted_engine_is_recovered_only_on_the_trainer_thread_inside_the_gate(tmp_path: Path) -> None:
    """The engine dies on its 2nd rollout segment (it comes back with the model's original weights). The
    re-sync (begin/load/finish) must run on the trainer's thread with the producer paused, never on the
    producer thread, which then would load the trainer's live weights under an old version stamp."""
    from r3operator.rollout.engines import EngineGroup
    from r3operator.runtime.async_loop import AsyncGRPORun

    job = write_job(
        tmp_path,
        rollout={
            "promptsPerStep": 2,
            "groupSize": 2,
            "maxTokens": 4,
            "partialRollout": True,
            "partialRolloutSegment": 2,
        },
        algorithm={"mode": "async", "maxStaleness": 1, "importanceWeightCap": 2.0},
        weightSync={"canary": False},
    )
    engine = _ThreadRecordingEngine(die_on={"generate": {2}})
    run = AsyncGRPORun(settings_for(job, tmp_path / "runs", steps=2), engines=EngineGroup([engine]))
    engine.gate = run.gate
    trainer_thread = threading.current_thread().name
    rows = run.run()

    assert engine.restarts == 1 and [r.step for r in rows] == [1, 2]
    installs = [(thread, paused) for method, thread, paused in engine.where if method in {"begin", "load", "finish"}]
    assert {thread for thread, _ in installs} == {trainer_thread}
    setup = next(i for i, (method, _, _) in enumerate(engine.where) if method == "finish")  # before the producer
    later = [paused for method, _, paused in engine.where[setup + 1 :] if method in {"begin", "load", "finish"}]
    assert len(later) > 0 and all(later)  # the recovery and both steps' syncs: with the producer paused
    assert {thread for method, thread, _ in engine.where if method == "generate"} == {"r3-rollout-producer"}


def test_fidelity_metrics_run_over_the_current_versions_tokens_and_rows_only() -> None:
    """Prompt of 3 tokens, 4 generated tokens of versions [1, 1, 2, 2] (a weight update after 2 tokens), the
    batch 9 wide. Current version 2: logprob columns P-1+j for j = 2, 3 -> 4, 5; route rows: token p's row is
    computed when p is fed, the prompt's by the first segment (v1), generated token j's by the request
    that generated token j + 1: rows 3 (token 0, fed with token 1, v1), 4 (token 1, v2: the boundary row,
    prefilled by the second segment), 5 (token 2, v2); token 3 (position 6) has no row."""
    from dataclasses import replace

    from r3operator.rollout.partial import current_version_masks

    sample = replace(_sample([1, 1, 2, 2]), prompt_token_ids=(5, 6, 7), token_ids=(10, 11, 12, 13))
    tokens, rows = current_version_masks([sample], width=9, version=2)
    assert np.flatnonzero(tokens[0]).tolist() == [4, 5]
    assert np.flatnonzero(rows[0]).tolist() == [4, 5]
    tokens, rows = current_version_masks([sample], width=9, version=1)
    assert np.flatnonzero(tokens[0]).tolist() == [2, 3]
    assert np.flatnonzero(rows[0]).tolist() == [0, 1, 2, 3]


def test_the_logprob_gap_is_split_by_staleness_lag() -> None:
    """Two samples, prompts of 2 and 3 tokens, batch 8 wide, current version 5. Sample a: versions [5, 4, 4]
    (columns 1, 2, 3: lags 0, 1, 1); sample b: versions [3, 5] (columns 2, 3: lags 2, 0). Rollout minus
    trainer logprobs at those columns: a 0.01, 0.2, -0.4; b 1.0, -0.03. By lag: 0 -> (0.01 + 0.03) / 2 =
    0.02 over 2 tokens, 1 -> (0.2 + 0.4) / 2 = 0.3 over 2, 2 -> 1.0 over 1, 3 -> none."""
    from dataclasses import replace

    from r3operator.rollout.partial import abs_diff_by_lag, format_by_lag, token_lags

    a = replace(_sample([5, 4, 4], "a"), prompt_token_ids=(1, 2), token_ids=(7, 8, 9))
    b = replace(_sample([3, 5], "b"), prompt_token_ids=(1, 2, 3), token_ids=(7, 8))
    lags = token_lags([a, b], width=8, version=5)
    assert lags.tolist() == [[-1, 0, 1, 1, -1, -1, -1], [-1, -1, 2, 0, -1, -1, -1]]
    trainer = np.full((2, 7), -1.5)
    rollout = trainer.copy()
    rollout[0, 1:4] += [0.01, 0.2, -0.4]
    rollout[1, 2:4] += [1.0, -0.03]
    rollout[0, 5] += 9.0  # no response token there: must not count
    gaps = abs_diff_by_lag(rollout, trainer, lags, max_lag=3)
    assert [(g.lag, g.tokens) for g in gaps] == [(0, 2), (1, 2), (2, 1), (3, 0)]
    assert [g.abs_diff_mean for g in gaps] == pytest.approx([0.02, 0.3, 1.0, None])  # type: ignore[list-item]
    assert format_by_lag(gaps) == ("0.02;0.3;1;-", "2;2;1;0")
