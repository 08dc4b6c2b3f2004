"""Held-out evaluation (`spec.evaluation`), as verl's `trainer.test_freq`: the eval reward of a fixed prompt set.

When. After the weight sync and the canary of every step that is a multiple of `intervalSteps`, and of the last
step, so the engines hold the policy that step's update produced (a skipped step evaluates the unchanged policy);
with `beforeTraining`, once more as step 0, after the first weight sync (and the supervised warm-up) of a fresh
start. In the asynchronous mode the evaluation runs inside the weight sync's pause (runtime/async_loop.py): no
rollout segment is on the engines, and the producer resumes, under the new policy, once it is done.

What. The first `maxPrompts` rows of `evaluation.datasetPath`, read, chat-templated and length-filtered exactly as
the task's own file (tasks/dataset_task.py), `samplesPerPrompt` answers each of at most `rollout.maxTokens` tokens
at `temperature` (unset: `rollout.temperature`), through the rollouts' own generate path (the engine group, under
the weight-sync supervisor that re-syncs an engine found restarted), scored by the task's reward. One seed serves
every evaluation, so two evaluations differ by the policy alone. The engines capture routed experts for every
request (vLLM's capture is engine-wide; a request cannot opt out): the evaluation asks for the fewest rows the API
returns (from each prompt's last token on) and drops them. Nothing here reads or advances the task's step order or
touches the trainer, so a run with evaluation trains exactly the samples of one without.

Where it shows. `eval.csv` in the run directory (EVAL_COLUMNS, step 0 for the evaluation before training), the
`eval_reward` column of metrics.csv on the steps that evaluated, report.md and its plot, the progress line,
`r3operator_eval_reward` with `r3operator_eval_step`, and `status.progress.evalReward`/`evalStep`; its time is the
step's `eval` phase (`t_eval`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from r3operator.api.v1alpha1 import EvaluationSpec, RLJobSpec
from r3operator.rollout.engines import EngineGroup
from r3operator.routing.sample import RolloutSample
from r3operator.runtime.metrics import RuntimeMetrics
from r3operator.runtime.report import EVAL_CSV, append_eval_row, keep_eval_rows_through
from r3operator.tasks.dataset_task import DatasetProblem, DatasetTask, load_problems
from r3operator.tasks.source import TaskSource, max_prompt_tokens
from r3operator.weightsync.faults import EngineSupervisor

log = logging.getLogger("r3operator.runtime")

EVAL_SEED_OFFSET = 977_130_011
"""An evaluation's seed is `seed * 1_000_003 + EVAL_SEED_OFFSET`: not a multiple of the rollouts' 10_007 per step, so
no step's rollout shares it."""


@dataclass(frozen=True)
class EvalRequest:
    """The evaluation's one generate call: every eval prompt, `n` answers each."""

    prompts: tuple[tuple[int, ...], ...]
    max_tokens: int
    temperature: float
    seed: int
    n: int

    def route_starts(self) -> list[int]:
        """The fewest routed-expert rows the engine API returns: from each prompt's last token on."""
        return [max(len(prompt) - 1, 0) for prompt in self.prompts]

    def send(self, engines: EngineGroup) -> list[RolloutSample]:
        return engines.generate(
            [list(prompt) for prompt in self.prompts],
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            seed=self.seed,
            n=self.n,
            routed_experts_prompt_start=self.route_starts(),
        )


Generate = Callable[[EvalRequest], list[RolloutSample]]
"""Sends the request to the engines on the current policy (the loop wraps `EvalRequest.send` in its supervisor)."""
Score = Callable[[Sequence[RolloutSample], Sequence[DatasetProblem]], np.ndarray]


@dataclass(frozen=True)
class EvalResult:
    step: int
    """The step after whose update the policy was evaluated (0: before training)."""
    policy_version: int
    reward_mean: float
    reward_std: float
    prompts: int
    samples: int
    response_tokens_mean: float
    seconds: float

    def row(self) -> dict[str, Any]:
        """eval.csv's row."""
        return {
            "step": self.step,
            "policy_version": self.policy_version,
            "eval_reward_mean": self.reward_mean,
            "eval_reward_std": self.reward_std,
            "prompts": self.prompts,
            "samples": self.samples,
            "response_tokens_mean": self.response_tokens_mean,
            "seconds": self.seconds,
        }

    def line(self) -> str:
        """What the progress output says of it."""
        when = "before training" if self.step == 0 else f"after step {self.step}"
        return (
            f"eval {when}: reward {self.reward_mean:.3f} ± {self.reward_std:.3f} over {self.prompts} held-out "
            f"prompts × {self.samples // max(self.prompts, 1)}, {self.response_tokens_mean:.1f} response tokens, "
            f"{self.seconds:.2f}s"
        )


class Evaluation:
    """The fixed eval set of a run, when it is due, and its eval.csv."""

    def __init__(
        self,
        spec: EvaluationSpec,
        problems: Sequence[DatasetProblem],
        *,
        score: Score,
        max_tokens: int,
        temperature: float,
        seed: int,
        last_step: int,
        run_dir: Path,
    ) -> None:
        if not problems:
            raise ValueError(f"spec.evaluation.datasetPath {spec.dataset_path}: no prompt to evaluate")
        self.spec = spec
        self.problems = list(problems)
        self.score = score
        self.last_step = last_step
        self.path = run_dir / EVAL_CSV
        self.request = EvalRequest(
            prompts=tuple(p.prompt_ids for p in self.problems),
            max_tokens=max_tokens,
            temperature=temperature,
            seed=seed * 1_000_003 + EVAL_SEED_OFFSET,
            n=spec.samples_per_prompt,
        )

    @property
    def before_training(self) -> bool:
        return self.spec.before_training

    def due(self, step: int) -> bool:
        """After every `intervalSteps`-th step and after the last one (step 0 is `before_training`'s)."""
        return step > 0 and (step % self.spec.interval_steps == 0 or step == self.last_step)

    def start(self, resumed_through: int | None) -> None:
        """A fresh run starts a new eval.csv; a resumed one keeps the rows through the checkpoint's step (the
        steps after it run, and evaluate, again)."""
        if resumed_through is None:
            self.path.unlink(missing_ok=True)
        else:
            keep_eval_rows_through(self.path, resumed_through)

    def on_engines(
        self,
        step: int,
        metrics: RuntimeMetrics,
        *,
        policy_version: int,
        engines: EngineGroup,
        supervisor: EngineSupervisor,
    ) -> EvalResult:
        """`run` through the rollouts' path: an engine that fails or turns stale is re-synced and the request
        repeated, as for a rollout (weightsync/faults.py). The result goes to the eval gauges of `metrics` and to the
        log as well as to eval.csv."""

        def generate(request: EvalRequest) -> list[RolloutSample]:
            where = "before training" if step == 0 else f"after step {step}"
            return supervisor.on_policy(lambda: request.send(engines), what=f"evaluation {where}")

        result = self.run(step, policy_version=policy_version, generate=generate)
        metrics.observe_eval(step, result.reward_mean)
        log.info("%s", result.line())
        return result

    def run(self, step: int, *, policy_version: int, generate: Generate) -> EvalResult:
        """Generate, score and record one evaluation (appended to eval.csv)."""
        begin = time.perf_counter()
        samples = generate(self.request)
        if len(samples) != len(self.problems) * self.request.n:
            raise RuntimeError(
                f"evaluation at step {step}: the engines answered {len(samples)} samples for "
                f"{len(self.problems)} prompts × {self.request.n}"
            )
        rewards = np.asarray(self.score(samples, self.problems), dtype=np.float64)
        if not np.isfinite(rewards).all():
            raise ValueError(f"evaluation at step {step}: the task's reward returned a non-finite score")
        result = EvalResult(
            step=step,
            policy_version=policy_version,
            reward_mean=float(rewards.mean()),
            reward_std=float(rewards.std()),
            prompts=len(self.problems),
            samples=len(samples),
            response_tokens_mean=float(np.mean([len(s.token_ids) for s in samples])),
            seconds=time.perf_counter() - begin,
        )
        append_eval_row(self.path, result.row())
        return result


def build_evaluation(
    spec: RLJobSpec, task: TaskSource, eval_file: Path | None, *, last_step: int, run_dir: Path
) -> Evaluation | None:
    """The run's evaluation (None without `spec.evaluation`): its rows read now, before any engine is touched, so a
    malformed file stops the run at setup naming its file and line."""
    evaluation = spec.evaluation
    if evaluation is None:
        return None
    if not isinstance(task, DatasetTask):
        raise ValueError(f"spec.evaluation: needs task.name dataset (its reader and reward), got {spec.task.name}")
    if eval_file is None:
        raise ValueError("spec.evaluation.datasetPath: no file to read")
    problems = load_problems(eval_file, task.tokenizer, max_prompt_tokens=max_prompt_tokens(spec))
    if evaluation.max_prompts is not None:
        problems = problems[: evaluation.max_prompts]
    return Evaluation(
        evaluation,
        problems,
        score=task.score,
        max_tokens=spec.rollout.max_tokens,
        temperature=spec.rollout.temperature if evaluation.temperature is None else evaluation.temperature,
        seed=spec.seed,
        last_step=last_step,
        run_dir=run_dir,
    )
