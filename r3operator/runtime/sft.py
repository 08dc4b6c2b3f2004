"""The supervised warm-up (`algorithm.sftWarmupSteps`): cross-entropy on the task's answers (a dataset row's
`solution` where it has one), natural routing.

One function for the two places that run it: the driver on a fresh start (`GRPORun.setup`) and the verl
comparison's common warmed-up start (benchmarks/peers/warm_start.py), which must train exactly what an RLJob
with `sftWarmupSteps` would before handing the weights to both frameworks.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from r3operator.tasks import toy as tasks
from r3operator.trainer.base import Trainer

SFT_BATCH = 32


def sft_warmup(trainer: Trainer, pool: Sequence[tasks.Problem], *, steps: int, seed: int) -> list[float]:
    """`steps` optimizer steps of `SFT_BATCH` problems drawn with replacement from `pool` (the same draws for
    a seed); each step's token-mean loss, in order."""
    rng = np.random.default_rng([seed, 7])
    losses = []
    for _ in range(steps):
        batch = tasks.sample_problems(pool, count=SFT_BATCH, rng=rng)
        losses.append(trainer.sft_step([p.prompt_ids for p in batch], [p.target_ids for p in batch]))
    return losses
