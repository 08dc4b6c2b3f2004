"""The ReplayHealthy condition from status.progress (operator/replay_health.py), one verdict per figure."""

from __future__ import annotations

from typing import Any

import pytest

from r3operator.api.v1alpha1 import Progress, RLJob, RLJobStatus
from r3operator.operator.replay_health import replay_healthy


def _healthy(job: RLJob) -> Any:
    """The verdict on the progress the job's status holds (what a pass takes from the trainer's report)."""
    return replay_healthy(job, job.status.progress if job.status is not None else None)


def _job(mode: str = "R3", progress: Progress | None = None) -> RLJob:
    job = RLJob.model_validate(
        {
            "apiVersion": "r3operator.io/v1alpha1",
            "kind": "RLJob",
            "metadata": {"name": "j", "namespace": "rl"},
            "spec": {
                "model": {
                    "uri": "hf://Qwen/Qwen3-30B-A3B",
                    "architecture": {"numLayers": 48, "numExperts": 128, "topK": 8},
                },
                "routingReplay": {"mode": mode},
                "inference": {"image": "ghcr.io/r3operator/engine:0.1.0-vllm0.30.0"},
                "trainer": {"image": "ghcr.io/r3operator/trainer:0.1.0"},
            },
        }
    )
    return job.model_copy(update={"status": RLJobStatus(progress=progress)})


HEALTHY: dict[str, Any] = {
    "step": 3,
    "replayed_fraction": 1.0,
    "fallback_fraction": 0.0,
    "routing_agreement": 0.97,
    "extreme_token_fraction": 0.002,
    "route_check_failures": 0,
}


def test_a_step_that_replayed_everything_is_healthy_with_a_message_that_does_not_change_per_step() -> None:
    one = _healthy(_job(progress=Progress(**HEALTHY)))
    two = _healthy(_job(progress=Progress(**{**HEALTHY, "step": 4, "extreme_token_fraction": 0.004})))
    assert (one.status.value, one.reason) == ("True", "RoutesReplayed") and one == two


@pytest.mark.parametrize(
    ("change", "reason", "named"),
    [
        (
            {
                "route_check_failures": 2,
                "route_check_message": "route check zero-route failed (sample p1-c0, layer 3): x",
            },
            "RouteCheckFailed",
            "zero-route failed (sample p1-c0, layer 3)",
        ),
        ({"replayed_fraction": 0.5}, "ReplayedFractionLow", "replayed fraction below 0.95 (0.5)"),
        ({"fallback_fraction": 0.2}, "FallbackHigh", "fallback fraction above 0.05 (0.2)"),
        ({"routing_agreement": 0.01}, "NaturalAgreementLow", "natural agreement below 0.5 (0.01)"),
        ({"extreme_token_fraction": 0.3}, "ExtremeTokens", "extreme-token fraction above 0.05 (0.3)"),
    ],
)
def test_each_unhealthy_figure_is_its_own_reason(change: dict[str, Any], reason: str, named: str) -> None:
    cond = _healthy(_job(progress=Progress(**{**HEALTHY, **change})))
    assert (cond.status.value, cond.reason) == ("False", reason) and named in cond.message


def test_before_the_first_step_it_is_unknown_and_without_r3_it_is_false() -> None:
    assert _healthy(_job()).reason == "NoStepYet" and _healthy(_job()).status.value == "Unknown"
    disabled = _healthy(_job("Disabled", Progress(**HEALTHY)))
    assert (disabled.status.value, disabled.reason) == ("False", "ReplayDisabled")
