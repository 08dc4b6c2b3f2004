"""Step 1 of the GRPO step (runtime/loop.py): the step's samples from the engines, single-turn or multi-turn, each
call made with every engine on the current policy (weightsync/faults.py `EngineSupervisor.on_policy`: a call that
failed or ran while an engine was stale is repeated after the engines are re-synced)."""

from __future__ import annotations

from collections.abc import Sequence

from r3operator.api.v1alpha1 import RLJobSpec
from r3operator.rollout.engines import EngineGroup
from r3operator.rollout.multiturn import Conversation, roll_out_conversations
from r3operator.routing.sample import RolloutSample
from r3operator.tasks import envs
from r3operator.tasks.toy import Problem
from r3operator.weightsync.faults import EngineSupervisor


def rollout_seed(spec: RLJobSpec, step: int) -> int:
    """The step's request seed: a function of the job's seed and the step alone, so a resumed step samples alike."""
    return spec.seed * 1_000_003 + step * 10_007


def single_turn(
    spec: RLJobSpec, step: int, problems: Sequence[Problem], *, engines: EngineGroup, supervisor: EngineSupervisor
) -> list[RolloutSample]:
    """`groupSize` samples of every problem's prompt."""
    ro = spec.rollout
    return supervisor.on_policy(
        lambda: engines.generate(
            [p.prompt_ids for p in problems],
            max_tokens=ro.max_tokens,
            temperature=ro.temperature,
            seed=rollout_seed(spec, step),
            n=ro.group_size,
        ),
        what=f"step {step} rollout",
    )


def multi_turn(
    spec: RLJobSpec,
    step: int,
    problems: Sequence[Problem],
    *,
    engines: EngineGroup,
    supervisor: EngineSupervisor,
    vocab_size: int,
    num_experts: int,
) -> list[RolloutSample]:
    """`groupSize` conversations per prompt, each played against its own environment; one batched request per turn
    sends each open conversation whole, as token ids, and asks only for its new rows (rollout/multiturn.py). A turn is
    repeated like a rollout when an engine fails or turns stale."""
    ro = spec.rollout
    conversations = [
        Conversation(
            prompt_index=i,
            choice_index=j,
            prompt=problem.prompt_ids,
            env=envs.environment(spec.task.name, problem, vocab_size=vocab_size),
        )
        for i, problem in enumerate(problems)
        for j in range(ro.group_size)
    ]

    def turn(prompts: list[list[int]], starts: list[int], turn_no: int) -> list[RolloutSample]:
        seed = rollout_seed(spec, step) + turn_no * 100_003

        def call() -> list[RolloutSample]:
            return engines.generate(
                prompts,
                max_tokens=ro.max_tokens,
                temperature=ro.temperature,
                seed=seed,
                n=1,
                routed_experts_prompt_start=starts,
            )

        return supervisor.on_policy(call, what=f"step {step} rollout, turn {turn_no + 1}")

    return roll_out_conversations(conversations, turn, num_experts=num_experts)
