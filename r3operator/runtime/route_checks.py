"""R3's route checks in the step loop: every sample's routes before the old-logprob pass, the pass's replay
against the trainer's own routing after it, and always before the update (routing/checks.py has the rules).

`spec.routingReplay.onRouteCheckFailure` decides what a failing sample costs: `Fail` stops the job with
`RouteCheckError` (nothing trained), `SkipSample` leaves it out of the step and counts it. A rule about the
model (hooks-not-fired) stops the job either way. The step loop times all of it as the `route_checks`
phase, so its cost shows in every step's time split (`t_route_checks`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from r3operator.api.enums import ReplayMode, RouteCheckPolicy
from r3operator.models.architecture import moe_layers
from r3operator.models.architecture import num_experts as experts_of
from r3operator.routing import checks
from r3operator.routing.checks import ModelRouting, RouteCheckFailure
from r3operator.routing.codec import RoutedExperts, decode
from r3operator.routing.sample import RolloutSample
from r3operator.runtime.metrics import RuntimeMetrics, StatusPusher
from r3operator.trainer.base import OldPass
from r3operator.trainer.batch import TrainBatch, build_batch

log = logging.getLogger("r3operator.runtime")


class RouteCheckError(RuntimeError):
    """A route check failed under `onRouteCheckFailure: Fail` (or a model rule failed): nothing was trained."""

    def __init__(self, failure: RouteCheckFailure) -> None:
        super().__init__(
            f"{failure}; nothing was trained on these routes (spec.routingReplay.onRouteCheckFailure: "
            f"{RouteCheckPolicy.FAIL.value}; docs/rules.md, 'Silent failures')"
        )
        self.failure = failure


def model_routing(model_dir: Path) -> ModelRouting:
    """What routes must look like for the model in `model_dir` (its Hugging Face config)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    cfg = getattr(cfg, "text_config", None) or cfg
    experts = experts_of(cfg) or getattr(cfg, "n_routed_experts", None)
    if experts is None:
        raise ValueError(f"{model_dir}: the model has no routed experts; routingReplay.mode R3 needs an MoE model")
    return ModelRouting(
        num_layers=int(cfg.num_hidden_layers),
        top_k=int(cfg.num_experts_per_tok),
        num_experts=int(experts),
        moe_layers=moe_layers(cfg),
    )


def _np(x: Any) -> np.ndarray:
    return x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)


def constant_layer_suspects(engine: Any, natural: Any, replayed: Any, moe_layers: Sequence[int]) -> list[int]:
    """The batch rows that may break `constant-layer` (routing/checks.py `check_constant_layers`, which decides),
    found where the tensors are: engine and natural ids [B, S, L, K], `replayed` [B, S]. On a GPU the step's routes
    (hundreds of MB at 64 × 8 samples of 600 tokens) then stay there; only a suspect's cross to the host.

    A screen first: rows holding one expert set have the same sum of ids, so a sample whose replayed rows of a layer
    all sum alike is a candidate. Sorting each row's ids (the exact test) then runs on the candidates alone, of which
    a healthy step has none: one reduction over the routes instead of two sorts."""
    import torch

    if not moe_layers:
        return []
    every_layer = list(moe_layers) == list(range(engine.shape[2]))
    layers = torch.as_tensor(list(moe_layers), dtype=torch.int64, device=engine.device)

    def moe(ids: Any) -> Any:
        """[B', S, L_moe, K]: the MoE layers' ids."""
        return ids if every_layer else ids.index_select(2, layers)

    def one_set(values: Any, replayed_rows: Any) -> Any:
        """[B', L_moe]: every replayed row of a sample holds the same `values` ([B', S, L_moe, ...]) on that layer."""
        first = replayed_rows.to(torch.int64).argmax(dim=1)  # a sample's first replayed row (0 when none: masked)
        same = values == values[torch.arange(values.shape[0], device=values.device), first][:, None]
        same = same.flatten(start_dim=3).all(dim=-1) if same.dim() > 3 else same
        return (same | ~replayed_rows[:, :, None]).all(dim=1)

    rows = replayed.to(device=engine.device, dtype=torch.bool)
    ids = moe(engine)
    candidate = one_set(ids.sum(dim=-1), rows) & (rows.sum(dim=1) >= 2)[:, None]  # [B, L_moe]
    picked = candidate.any(dim=1).nonzero().flatten()
    if picked.numel() == 0:
        return []
    rows = rows[picked]
    natural_picked = natural[picked.to(natural.device)].to(engine.device)
    exact = one_set(ids[picked].sort(dim=-1).values, rows) & ~one_set(moe(natural_picked).sort(dim=-1).values, rows)
    return [int(i) for i in picked[(exact & candidate[picked]).any(dim=1)].tolist()]


def select_old(old: OldPass, rows: Sequence[int]) -> OldPass:
    """The old pass of the batch rows `rows` (what `TrainBatch.select` does to its batch)."""
    import torch

    def pick(t: Any) -> Any:
        return None if t is None else t[torch.as_tensor(list(rows), dtype=torch.int64, device=t.device)]

    return replace(
        old,
        logprobs=pick(old.logprobs),
        natural_ids=pick(old.natural_ids),
        used_ids=pick(old.used_ids),
        replay_ids=pick(old.replay_ids),
        replay_pad=pick(old.replay_pad),
        entropy=pick(old.entropy),
    )


@dataclass
class StepTally:
    """One step's route-check outcome, for its row (metrics.csv, status.progress) and the gauges."""

    failures: list[RouteCheckFailure] = field(default_factory=list)
    needed_rows: int = 0
    replayed_rows: int = 0
    trained_rows: int = 0

    @property
    def fractions(self) -> checks.ReplayFractions:
        return checks.replay_fractions(
            replayed_rows=self.replayed_rows, trained_rows=self.trained_rows, needed_rows=self.needed_rows
        )

    @property
    def message(self) -> str | None:
        return str(self.failures[0])[:1024] if self.failures else None


class RouteChecks:
    def __init__(
        self,
        model: ModelRouting,
        policy: RouteCheckPolicy,
        *,
        on_failure: Callable[[RouteCheckFailure, bool], None] | None = None,
    ) -> None:
        """`on_failure(failure, fatal)` runs for every failure, before a fatal one is raised."""
        self.model = model
        self.policy = policy
        self.on_failure = on_failure
        self.step = StepTally()

    def begin_step(self, samples: Sequence[RolloutSample]) -> None:
        self.step = StepTally(needed_rows=sum(len(s.sequence) - 1 for s in samples))

    def failed(self, failure: RouteCheckFailure) -> None:
        """Count `failure`; raise under Fail (and for a model rule). Under SkipSample the caller drops it."""
        self.step.failures.append(failure)
        log.error("%s", failure)
        fatal = self.policy is not RouteCheckPolicy.SKIP_SAMPLE or failure.rule in checks.MODEL_RULES
        if self.on_failure is not None:
            self.on_failure(failure, fatal)
        if fatal:
            raise RouteCheckError(failure)

    @staticmethod
    def arrival_failure(sample: RolloutSample) -> RouteCheckFailure | None:
        """routes-missing / routes-invalid, as the routes arrived (routing/sample.py)."""
        status = sample.routes_status
        if status == "ok":
            return None
        rule = checks.ROUTES_MISSING if status == "missing" else checks.ROUTES_INVALID
        return RouteCheckFailure(rule, sample.sample_id, None, sample.routes_error or "")

    def before_forward(self, batch: TrainBatch, samples: Sequence[RolloutSample]) -> list[int]:
        """Rows of `batch` whose samples passed route-shape, expert-range, zero-route and pad-replayed (each
        failure counted, or raised under Fail)."""
        by_id = {s.sample_id: s for s in samples}
        kept_samples = [by_id[sid] for sid in batch.sample_ids]
        bad: dict[int, RouteCheckFailure] = {}
        for row, sample in enumerate(kept_samples):
            assert sample.routes is not None  # phase 4 kept only samples with routes
            failure = checks.check_sample_routes(sample.sample_id, decode(sample.routes, validate=False), self.model)
            if failure is not None:
                bad[row] = failure
        if batch.route_pad is not None:
            replayed = ~_np(batch.route_pad).astype(bool)
            spans = [(s.routes.start, s.routes.end) if s.routes is not None else (0, 0) for s in kept_samples]
            lengths = [len(s.sequence) for s in kept_samples]
            for failure in checks.check_replay_mask(batch.sample_ids, lengths, replayed, spans):
                bad.setdefault(batch.sample_ids.index(str(failure.sample_id)), failure)
        for row in sorted(bad):
            self.failed(bad[row])
        return [row for row in range(batch.size) if row not in bad]

    def after_forward(self, batch: TrainBatch, old: OldPass) -> list[int]:
        """Rows of `batch` that passed constant-layer; raises for hooks-not-fired. Then tallies the rows
        replayed for the step's fractions (call `tally` with the batch the update takes)."""
        hooks = self._hooks_failure(old.hook_calls)
        if hooks is not None:
            self.failed(hooks)
        if batch.engine_routes is None or batch.route_pad is None:
            return list(range(batch.size))
        replayed = ~batch.route_pad
        suspects = constant_layer_suspects(batch.engine_routes, old.natural_ids, replayed, self.model.moe_layers)
        failures = []
        if suspects:  # only their routes cross to the host, for the rule and its message
            ids = [batch.sample_ids[i] for i in suspects]
            sel = np.asarray(suspects)
            failures = checks.check_constant_layers(
                ids,
                _np(batch.engine_routes)[sel],
                _np(old.natural_ids)[sel],
                ~_np(batch.route_pad).astype(bool)[sel],
                self.model.moe_layers,
            )
        bad = {batch.sample_ids.index(str(f.sample_id)): f for f in failures}
        for row in sorted(bad):
            self.failed(bad[row])
        return [row for row in range(batch.size) if row not in bad]

    def _hooks_failure(self, hook_calls: dict[int, dict[int, int]] | None) -> RouteCheckFailure | None:
        if not hook_calls:
            return RouteCheckFailure(
                checks.HOOKS_NOT_FIRED,
                None,
                None,
                "the trainer reported no replay-hook counts for an R3 pass: it did not replay",
            )
        expected = {rank: self.model.moe_layers for rank in hook_calls}
        return checks.check_hooks_fired(expected, hook_calls)

    def tally(self, batch: TrainBatch | None) -> None:
        """The rows the update replays (`batch`, None: a skipped step) against what the rollout needed."""
        if batch is None or batch.route_pad is None:
            self.step.replayed_rows = self.step.trained_rows = 0
            return
        lengths = _np(batch.attention_mask).sum(axis=1)
        replayed = ~_np(batch.route_pad).astype(bool)
        self.step.replayed_rows = int(replayed.sum())
        self.step.trained_rows = int((lengths - 1).sum())


class StepRoutes:
    """Phase 4 and the route checks of one step: the batch from the step's samples (R3: each sample's routes as the
    engine sent them; one missing or invalid fails the job or is dropped, `onRouteCheckFailure`), then `check`
    before and after the old-logprob pass. `dropped` names each sample left out and why."""

    def __init__(self, mode: ReplayMode, metrics: RuntimeMetrics, status: StatusPusher) -> None:
        self.mode, self.metrics, self.status = mode, metrics, status
        self.checks: RouteChecks | None = None  # R3: set up once the model is known (GRPORun.setup)
        self.dropped: list[tuple[str, str]] = []

    def enable_checks(self, model: ModelRouting, policy: RouteCheckPolicy) -> None:
        self.checks = RouteChecks(model, policy, on_failure=self._failed)

    def begin_step(self, samples: Sequence[RolloutSample]) -> None:
        if self.checks is not None:
            self.checks.begin_step(samples)

    def batch(
        self, samples: Sequence[RolloutSample], adv: np.ndarray, trainer: BatchTarget, *, temperature: float
    ) -> TrainBatch | None:
        """The step's batch; None when no sample is left (the step is skipped)."""
        kept, kept_adv, routes = [], [], []
        for sample, a in zip(samples, adv, strict=True):
            sample_routes = sample.routes  # R2/Disabled: metrics only, never replayed
            if self.mode is ReplayMode.R3:
                sample_routes = self._arrived(sample)
                if sample_routes is None:
                    continue
            kept.append(sample)
            kept_adv.append(a)
            routes.append(sample_routes)
        if not kept:
            return None
        present = [r for r in routes if r is not None]  # R3 kept only samples with routes: all or none
        return build_batch(
            kept,
            kept_adv,
            routes=present if len(present) == len(routes) else None,
            pad_id=trainer.pad_id,
            device=trainer.batch_device,
            temperature=temperature,
        )

    def _arrived(self, sample: RolloutSample) -> RoutedExperts | None:
        """The sample's routes as they arrived from the engine (`build_sample` validated ids and rows); a missing or
        invalid one fails the job or is dropped (routingReplay.onRouteCheckFailure)."""
        failure = RouteChecks.arrival_failure(sample)
        if failure is not None:
            if self.checks is not None:
                self.checks.failed(failure)  # raises under Fail
            self.drop(sample.sample_id, sample.routes_status, sample.routes_error or "")
            return None
        return sample.routes

    def check(
        self, batch: TrainBatch, samples: Sequence[RolloutSample], old: OldPass | None = None
    ) -> tuple[TrainBatch | None, OldPass | None]:
        """The route checks before the old-logprob pass (`old` None) or after it: the batch (and pass) without the
        samples that failed under SkipSample; (None, None) when none is left."""
        checker = self.checks
        assert checker is not None  # R3 only
        before = len(checker.step.failures)
        rows = checker.before_forward(batch, samples) if old is None else checker.after_forward(batch, old)
        for failure in checker.step.failures[before:]:  # SkipSample: Fail raised in `failed`
            self.metrics.inc("r3operator_samples_dropped_total", reason=failure.rule)
            self.dropped.append((str(failure.sample_id), failure.rule))
        if not rows:
            return None, None
        if len(rows) < batch.size:
            batch, old = batch.select(rows), (None if old is None else select_old(old, rows))
        return batch, old

    def _failed(self, failure: RouteCheckFailure, fatal: bool) -> None:
        """Count a route-check failure; before a fatal one stops the job, status.progress says why."""
        self.metrics.inc("r3operator_route_check_failures_total", rule=failure.rule)
        if fatal and self.checks is not None:
            failures = len(self.checks.step.failures)
            self.status.push(
                {"status": {"progress": {"routeCheckFailures": failures, "routeCheckMessage": str(failure)[:1024]}}}
            )

    def none_left(self, step: int, samples: int) -> None:
        """Every one of the step's `samples` was dropped, so the step is skipped: logged with the reasons, counted
        (`r3operator_steps_skipped_total`)."""
        reasons = ", ".join(sorted({reason for _, reason in self.dropped}))
        log.error("step %d skipped: all %d samples were dropped (%s)", step, samples, reasons)
        self.metrics.inc("r3operator_steps_skipped_total", reason="no_usable_samples")

    def drop(self, sample_id: str, reason: str, detail: str) -> None:
        log.error("step sample %s dropped from training (routes %s): %s", sample_id, reason, detail)
        self.metrics.inc("r3operator_samples_dropped_total", reason=reason)
        self.dropped.append((sample_id, reason))


class BatchTarget(Protocol):
    """What the batch is built for: the trainer's pad token and the device its step reads the batch on."""

    pad_id: int
    batch_device: str
