"""Trajectories generated in segments across weight updates (partial rollouts), and their staleness.

In the asynchronous mode a trajectory is generated one segment at a time (at most
`rollout.partialRolloutSegment` tokens per request). Between two segments the trainer may install new
weights; the next segment then continues the trajectory under them: the request's prompt is the prompt plus
every token generated so far (token ids, never re-tokenised) and its `routed_experts_prompt_start` is the
number of rows already held, so vLLM returns only the new rows: the boundary row (the previous segment's last
token, prefilled now) and one row per new token but the last. `routing/stitch.py` keeps the stored rows, which
were routed under the weights that produced those tokens, and appends the tail (verl #6046 semantics).

Every generated token records the policy version it was sampled under. A sample's staleness, seen from an
update that starts from policy version `v`, is `v - min(versions)`: how many weight updates ago its oldest
token was sampled.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from r3operator.routing.sample import RolloutSample
from r3operator.routing.stitch import TrajectoryRoutes


@dataclass
class Trajectory:
    """One sample being generated: problem `problem_no` (the producer's running count), member `choice_index`
    of its GRPO group."""

    problem_no: int
    choice_index: int
    prompt: tuple[int, ...]
    max_tokens: int
    tokens: list[int] = field(default_factory=list)  # generated so far
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # per generated token: the policy that sampled it
    routes: TrajectoryRoutes | None = None
    routes_error: str | None = None
    segments: int = 0
    finish_reason: str | None = None
    done: bool = False

    @property
    def remaining(self) -> int:
        return self.max_tokens - len(self.tokens)

    def request(self) -> tuple[list[int], int]:
        """The next segment's prompt (prompt + tokens so far) and `routed_experts_prompt_start` (rows held)."""
        start = 0 if self.routes is None else self.routes.captured_len
        return [*self.prompt, *self.tokens], start

    def add_segment(self, sample: RolloutSample, *, version: int, requested: int) -> None:
        """Append one segment generated under policy `version`; `requested` = the request's max_tokens.

        The trajectory is done when the engine stopped by itself (EOS/stop: not a length cut), or the token
        budget is spent; otherwise the next segment continues it.
        """
        if self.done:
            raise RuntimeError(f"trajectory {self.problem_no}/{self.choice_index} is done; no segment can follow")
        expected_prompt = [*self.prompt, *self.tokens]
        if list(sample.prompt_token_ids) != expected_prompt:
            # The engine generated from other tokens than the trajectory holds: nothing after could be replayed.
            self.routes_error = self.routes_error or (
                f"segment {self.segments + 1}: the engine's prompt token ids differ from the trajectory's"
            )
        self._stitch(sample)
        self.tokens.extend(int(t) for t in sample.token_ids)
        self.logprobs.extend(float(x) for x in sample.logprobs)
        self.versions.extend([version] * len(sample.token_ids))
        self.segments += 1
        self.finish_reason = sample.finish_reason
        cut_by_length = len(sample.token_ids) >= requested and sample.finish_reason in (None, "length")
        self.done = not cut_by_length or self.remaining <= 0

    def _stitch(self, sample: RolloutSample) -> None:
        if self.routes_error is not None:
            return
        if sample.routes is None:
            self.routes_error = f"segment {self.segments + 1}: {sample.routes_error}"
            return
        if self.routes is None:
            self.routes = TrajectoryRoutes(num_layers=sample.routes.num_layers, top_k=sample.routes.top_k)
            self.routes.add_turn(prompt_ids=self.prompt, generated_ids=sample.token_ids, routes=sample.routes)
        else:
            self.routes.add_partial(generated_ids=sample.token_ids, routes=sample.routes)
        if not self.routes.valid:
            self.routes_error = f"segment {self.segments + 1}: {self.routes.invalid_reason}"

    @property
    def partial(self) -> bool:
        """A weight update interrupted it: its tokens were sampled under more than one policy."""
        return len(set(self.versions)) > 1

    def sample(self, *, num_experts: int) -> RolloutSample:
        routes = None
        if self.routes_error is None and self.routes is not None:
            routes = self.routes.routes(num_experts=num_experts)
        return RolloutSample(
            sample_id=f"q{self.problem_no}-c{self.choice_index}",
            prompt_index=self.problem_no,
            choice_index=self.choice_index,
            prompt_token_ids=self.prompt,
            token_ids=tuple(self.tokens),
            logprobs=np.asarray(self.logprobs, dtype=np.float32),
            routes=routes,
            routes_error=None if routes is not None else (self.routes_error or "no segment returned routes"),
            finish_reason=self.finish_reason,
            routed_experts_prompt_start=0,
            extra={
                "token_versions": np.asarray(self.versions, dtype=np.int64),
                "partial": self.partial,
                "segments": self.segments,
            },
        )


def token_versions(sample: RolloutSample) -> np.ndarray:
    versions = sample.extra.get("token_versions")
    if versions is None:
        raise ValueError(f"sample {sample.sample_id!r} records no policy version per token (not an async rollout)")
    return np.asarray(versions, dtype=np.int64)


def staleness(sample: RolloutSample, *, current_version: int) -> int:
    """Policy versions between the oldest token of `sample` and `current_version` (0: fully on-policy)."""
    versions = token_versions(sample)
    if versions.size == 0:
        return 0
    oldest = int(versions.min())
    if oldest > current_version:
        raise ValueError(
            f"sample {sample.sample_id!r} has a token of policy version {oldest}, newer than the "
            f"current version {current_version}"
        )
    return current_version - oldest


def split_stale(
    groups: Sequence[Sequence[RolloutSample]], *, current_version: int, max_staleness: int
) -> tuple[list[list[RolloutSample]], list[list[RolloutSample]]]:
    """(kept, dropped) groups: a group goes when any of its samples is more than `max_staleness` versions
    old. Whole groups, because GRPO normalises advantages within a group: a group missing members would
    give the rest other advantages than the group they were sampled in."""
    if max_staleness < 0:
        raise ValueError(f"algorithm.maxStaleness must be >= 0, got {max_staleness}")
    kept: list[list[RolloutSample]] = []
    dropped: list[list[RolloutSample]] = []
    for group in groups:
        worst = max((staleness(s, current_version=current_version) for s in group), default=0)
        (dropped if worst > max_staleness else kept).append(list(group))
    return kept, dropped


def renumber(groups: Sequence[Sequence[RolloutSample]]) -> list[RolloutSample]:
    """The groups' samples in order, group i as prompt i (`p{i}-c{j}`), as a synchronous step numbers them."""
    return [
        replace(sample, prompt_index=i, choice_index=j, sample_id=f"p{i}-c{j}")
        for i, group in enumerate(groups)
        for j, sample in enumerate(group)
    ]


def current_version_masks(
    samples: Sequence[RolloutSample], *, width: int, version: int
) -> tuple[np.ndarray, np.ndarray]:
    """([B, S-1] logprob columns, [B, S] route rows) that the policy `version` produced, for the batch rows
    `samples` (in batch order; S = `width`). Response token j of a sample with P prompt tokens is
    logprob column P - 1 + j; its version is `token_versions[j]`. Route row p is computed when token p is
    fed: the prompt's rows by the first segment, generated token j's row by the request that generated
    token j + 1 (a segment's last token is prefilled by the next segment).

    The fidelity metrics (|Δlogprob|, natural routing agreement) over these alone compare the engine with
    the trainer under the same weights: the mismatch. Over older tokens they also measure the policy's
    drift since (staleness), which the importance weights correct and which is not a weight-sync fault."""
    tokens = np.zeros((len(samples), width - 1), dtype=bool)
    rows = np.zeros((len(samples), width), dtype=bool)
    for i, sample in enumerate(samples):
        versions = token_versions(sample)
        if versions.size == 0:
            continue
        p = len(sample.prompt_token_ids)
        tokens[i, p - 1 : p - 1 + versions.size] = versions == version
        row_versions = np.concatenate([np.full(p, versions[0]), versions[1:]])
        rows[i, : row_versions.size] = row_versions == version
    return tokens, rows


def resumed(samples: Sequence[RolloutSample]) -> np.ndarray:
    """[B] bool: the samples a weight update interrupted (tokens of more than one policy version).

    Their current-version tokens do not measure the mismatch alone: the resumed request's prompt (the earlier
    tokens) was prefilled by the engine under the new weights, with the new weights' routing, while the
    trainer replays the stitched routes, which keep the old weights' rows there (verl #6046). The context the
    engine sampled in differs from the one the trainer scores in, even where the two compute alike (fp32)."""
    return np.asarray([bool(s.extra.get("partial")) for s in samples], dtype=bool)


def token_lags(samples: Sequence[RolloutSample], *, width: int, version: int) -> np.ndarray:
    """[B, S-1] logprob columns: `version` minus the version that sampled the response token there (0: the
    current policy), -1 where there is no response token. Columns as in `current_version_masks`."""
    lags = np.full((len(samples), width - 1), -1, dtype=np.int64)
    for i, sample in enumerate(samples):
        versions = token_versions(sample)
        p = len(sample.prompt_token_ids)
        lags[i, p - 1 : p - 1 + versions.size] = version - versions
    return lags


@dataclass(frozen=True)
class LagGap:
    """Mean |rollout logprob - trainer logprob| over the `tokens` response tokens of one staleness lag (None
    when there are none). At lag 0 engine and trainer ran the same weights: the mismatch. At lag L > 0 it
    adds how far the policy moved in L updates (staleness, which the importance weights correct)."""

    lag: int
    tokens: int
    abs_diff_mean: float | None


def abs_diff_by_lag(
    rollout_logprobs: np.ndarray, trainer_logprobs: np.ndarray, lags: np.ndarray, *, max_lag: int
) -> list[LagGap]:
    """One `LagGap` per lag 0..max_lag (every column with a lag; `lags` -1 elsewhere, see `token_lags`)."""
    gaps = []
    diff = np.abs(np.asarray(rollout_logprobs, dtype=np.float64) - np.asarray(trainer_logprobs, dtype=np.float64))
    for lag in range(max_lag + 1):
        at = lags == lag
        count = int(at.sum())
        gaps.append(LagGap(lag, count, float(diff[at].mean()) if count else None))
    return gaps


def format_by_lag(gaps: Sequence[LagGap]) -> tuple[str, str]:
    """metrics.csv's `logprob_abs_diff_by_lag` ("0.0041;0.0812;-": lag 0 first, "-" where no token) and
    `tokens_by_lag` ("12;480;0")."""
    diffs = ";".join("-" if g.abs_diff_mean is None else f"{g.abs_diff_mean:.4g}" for g in gaps)
    return diffs, ";".join(str(g.tokens) for g in gaps)
