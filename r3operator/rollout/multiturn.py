"""Multi-turn rollouts with routed experts, token in / token out.

Each conversation is one trajectory. Every turn sends the whole conversation so far as token ids (never
re-rendered or re-tokenised) and asks the engine only for the rows it does not hold yet:
`routed_experts_prompt_start` = the trajectory's captured rows, i.e. every position before the previous
turn's last sampled token. That token was never fed back to the engine in its own turn, so its row (the
"boundary row") comes with the next turn's prefill, together with the environment's tokens.
`routing/stitch.py` places each turn's rows at their absolute positions and refuses a prompt that is not
a token-exact extension of the trajectory.

The result is one `RolloutSample` per conversation: the first prompt as prompt, everything after it (model
turns and environment replies) as generated tokens, the stitched routes from position 0, and a loss mask
that is False on the environment's tokens: they keep their routes (the context every later token was
computed in) but are not actions of the policy, so they take no part in the loss.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from r3operator.routing.agreement import routing_agreement
from r3operator.routing.errors import RoutingDataError
from r3operator.routing.sample import RolloutSample
from r3operator.routing.stitch import TrajectoryRoutes
from r3operator.tasks.envs import Environment

log = logging.getLogger("r3operator.runtime")

# generate(prompts, routed_experts_prompt_start per prompt, turn index) -> one sample per prompt, in order
TurnGenerate = Callable[[list[list[int]], list[int], int], Sequence[RolloutSample]]


@dataclass
class Conversation:
    """One trajectory being rolled out: problem `prompt_index`, sample `choice_index` of its group."""

    prompt_index: int
    choice_index: int
    prompt: tuple[int, ...]
    env: Environment
    tokens: list[int] = field(default_factory=list)  # the whole conversation, prompt included
    trained: list[bool] = field(default_factory=list)  # per token after the prompt: the model sampled it
    turn_of: list[int] = field(default_factory=list)  # per token: the turn whose request returned its row
    logprobs: list[float] = field(default_factory=list)  # per token after the prompt (0 for env tokens)
    routes: TrajectoryRoutes | None = None
    routes_error: str | None = None
    done: bool = False
    reward: float = 0.0
    turns: int = 0
    finish_reason: str | None = None

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt)
        self.turn_of = [1] * len(self.prompt)

    @property
    def known_rows(self) -> int:
        """Rows already held: the next request asks the engine for the rows after them only."""
        return 0 if self.routes is None else self.routes.captured_len

    def add_model_turn(self, sample: RolloutSample) -> None:
        if list(sample.prompt_token_ids) != self.tokens:
            # The engine saw other tokens than the conversation holds (a re-tokenised history): nothing of
            # this trajectory could be replayed onto the tokens we train.
            raise RoutingDataError(
                f"conversation p{self.prompt_index}-c{self.choice_index}, turn {self.turns + 1}: the engine's "
                "prompt token ids differ from the conversation's (re-tokenised?); R3-RETOKENIZE"
            )
        self._stitch(sample)
        self.tokens.extend(sample.token_ids)
        self.trained.extend([True] * len(sample.token_ids))
        self.logprobs.extend(float(x) for x in sample.logprobs)
        self.finish_reason = sample.finish_reason
        self.turns += 1
        # The last sampled token is fed to the engine only by the next turn's request, which returns its row.
        generated = len(sample.token_ids)
        self.turn_of.extend([self.turns] * (generated - 1) + [self.turns + 1] * min(generated, 1))

    def _stitch(self, sample: RolloutSample) -> None:
        if self.routes_error is not None:
            return
        if sample.routes is None:
            self.routes_error = f"turn {self.turns + 1}: {sample.routes_error}"
            return
        if self.routes is None:
            self.routes = TrajectoryRoutes(num_layers=sample.routes.num_layers, top_k=sample.routes.top_k)
        self.routes.add_turn(prompt_ids=sample.prompt_token_ids, generated_ids=sample.token_ids, routes=sample.routes)
        if not self.routes.valid:
            self.routes_error = f"turn {self.turns + 1}: {self.routes.invalid_reason}"

    def add_env_reply(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(int(t) for t in tokens)
        self.trained.extend([False] * len(tokens))
        self.logprobs.extend([0.0] * len(tokens))
        self.turn_of.extend([self.turns + 1] * len(tokens))  # the next turn's request prefills them

    def sample(self, *, num_experts: int) -> RolloutSample:
        """The trajectory as one sample: routes stitched from position 0, env tokens out of the loss."""
        routes = None
        if self.routes_error is None and self.routes is not None:
            routes = self.routes.routes(num_experts=num_experts)
        generated = tuple(self.tokens[len(self.prompt) :])
        return RolloutSample(
            sample_id=f"p{self.prompt_index}-c{self.choice_index}",
            prompt_index=self.prompt_index,
            choice_index=self.choice_index,
            prompt_token_ids=self.prompt,
            token_ids=generated,
            logprobs=np.asarray(self.logprobs, dtype=np.float32),
            routes=routes,
            routes_error=None if routes is not None else (self.routes_error or "no turn returned routes"),
            finish_reason=self.finish_reason,
            routed_experts_prompt_start=0,
            loss_mask=np.asarray(self.trained, dtype=bool),
            extra={
                "reward": self.reward,
                "turns": self.turns,
                "env_tokens": self.trained.count(False),
                "turn_of": np.asarray(self.turn_of, dtype=np.int64),
            },
        )


def roll_out_conversations(
    conversations: Sequence[Conversation], generate: TurnGenerate, *, num_experts: int
) -> list[RolloutSample]:
    """Play every conversation to its end, one batched engine request per turn over the open ones."""
    turn = 0
    while open_ := [c for c in conversations if not c.done]:
        samples = generate([list(c.tokens) for c in open_], [c.known_rows for c in open_], turn)
        if len(samples) != len(open_):
            raise RuntimeError(f"turn {turn + 1}: the engine returned {len(samples)} samples for {len(open_)} prompts")
        for conversation, sample in zip(open_, samples, strict=True):
            conversation.add_model_turn(sample)
            reply = conversation.env.turn(conversation.tokens, sample.token_ids)
            if reply.done or conversation.turns >= conversation.env.max_turns:
                conversation.done, conversation.reward = True, float(reply.reward) if reply.done else 0.0
            else:
                conversation.add_env_reply(reply.tokens)
        turn += 1
    for conversation in conversations:
        if conversation.routes_error is not None:
            log.warning(
                "conversation p%d-c%d has no usable routes: %s",
                conversation.prompt_index,
                conversation.choice_index,
                conversation.routes_error,
            )
    return [c.sample(num_experts=num_experts) for c in conversations]


def agreement_by_turn(
    natural_ids: Any, engine_routes: Any, route_pad: Any, samples: Sequence[RolloutSample]
) -> list[float]:  # tensors [B, S, L, K], [B, S, L, K], [B, S]
    """Trainer-natural vs engine routing agreement over the positions each turn's request prefilled or
    generated (turn 1: the prompt and the first answer). A stitching error shows as a drop from some turn
    on, which the all-token figure averages away. `samples` are the batch's rows, in order."""
    turn = np.zeros(tuple(route_pad.shape), dtype=np.int64)  # 0: padding, no turn
    for i, sample in enumerate(samples):
        turn_of = sample.extra["turn_of"]
        turn[i, : len(turn_of)] = turn_of
    has_route = ~route_pad.cpu().numpy().astype(bool)
    # The final turn's last token was never fed back: it carries a turn number but no route.
    last = int(turn[has_route].max()) if has_route.any() else 0
    return [
        routing_agreement(natural_ids, engine_routes, has_route & (turn == t)).agreement_ratio
        for t in range(1, last + 1)
    ]
