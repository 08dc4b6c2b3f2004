"""The `ReplayHealthy` condition: whether the last step replayed the engine's routes, from status.progress.

The trainer driver measures (runtime/route_checks.py) and pushes its figures into `status.progress`; this
module turns them into a condition with a reason. Pure. The thresholds are shared with the R3ReplayUnhealthy
alert (observability/rules.py), so the condition and the alert say the same thing.
"""

from __future__ import annotations

from r3operator.api.enums import ConditionStatus as S
from r3operator.api.enums import ConditionType as T
from r3operator.api.enums import ReplayMode
from r3operator.api.v1alpha1 import Progress, RLJob
from r3operator.operator.conditions import Desired, Reason

REPLAYED_FRACTION_MIN = 0.95
"""A step replays every row its samples needed (1.0) unless samples were skipped or rows fell back."""
FALLBACK_FRACTION_MAX = 0.05
"""Trained rows routed naturally: 0 in a single-turn or stitched multi-turn step."""
EXTREME_TOKEN_FRACTION_MAX = 0.05
"""Response tokens with p_train/p_rollout outside [0.5, 2]: a few per mille under working replay."""
NATURAL_AGREEMENT_MIN = 0.5
"""The trainer routers' own choice vs the engine's: ~0.98 aligned, near 0 with routes on the wrong tokens."""


def replay_healthy(job: RLJob, progress: Progress | None) -> Desired:
    """The verdict on `progress`, the trainer's report this pass takes into the status."""
    mode = job.spec.routing_replay.mode
    if mode is not ReplayMode.R3:
        return Desired(T.REPLAY_HEALTHY, S.FALSE, Reason.REPLAY_DISABLED, f"routingReplay.mode is {mode.value}")
    if progress is None or progress.step == 0:
        return Desired(T.REPLAY_HEALTHY, S.UNKNOWN, Reason.NO_STEP_YET, "no training step has reported yet")
    return _verdict(progress)


def _verdict(p: Progress) -> Desired:
    if p.route_check_failures:
        message = f"{p.route_check_failures} sample(s) failed a route check; {p.route_check_message or ''}"
        return Desired(T.REPLAY_HEALTHY, S.FALSE, Reason.ROUTE_CHECK_FAILED, message.rstrip("; "))
    checks: list[tuple[float | None, bool, Reason, str]] = [
        (p.replayed_fraction, False, Reason.REPLAYED_FRACTION_LOW, f"replayed fraction below {REPLAYED_FRACTION_MIN}"),
        (p.fallback_fraction, True, Reason.FALLBACK_HIGH, f"fallback fraction above {FALLBACK_FRACTION_MAX}"),
        (p.routing_agreement, False, Reason.NATURAL_AGREEMENT_LOW, f"natural agreement below {NATURAL_AGREEMENT_MIN}"),
        (
            p.extreme_token_fraction,
            True,
            Reason.EXTREME_TOKENS,
            f"extreme-token fraction above {EXTREME_TOKEN_FRACTION_MAX}",
        ),
    ]
    limits = {
        Reason.REPLAYED_FRACTION_LOW: REPLAYED_FRACTION_MIN,
        Reason.FALLBACK_HIGH: FALLBACK_FRACTION_MAX,
        Reason.NATURAL_AGREEMENT_LOW: NATURAL_AGREEMENT_MIN,
        Reason.EXTREME_TOKENS: EXTREME_TOKEN_FRACTION_MAX,
    }
    for value, above_is_bad, reason, what in checks:
        if value is None:
            continue
        bad = value > limits[reason] if above_is_bad else value < limits[reason]
        if bad:
            return Desired(T.REPLAY_HEALTHY, S.FALSE, reason, f"{what} ({value:.2g})")
    # No figure in the message: it would change every step, and so would the status the operator writes.
    return Desired(
        T.REPLAY_HEALTHY,
        S.TRUE,
        Reason.ROUTES_REPLAYED,
        "the last step replayed the engines' routes and passed every route check (figures in status.progress)",
    )
