"""Driver metrics: the data-plane fidelity and routing set (`R3Metrics`) plus step/reward/throughput/phase timings,
on one Prometheus registry; and the progress report the operator copies into the RLJob's `status.progress`.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import ssl
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from r3operator.api.v1alpha1 import Progress
from r3operator.rollout.partial import LagGap as LagGap  # what observe_lags takes, for the layers above
from r3operator.runtime.step_record import StepRecord, step_progress
from r3operator.settings import PROGRESS_KEY, runtime_settings
from r3operator.trainer.metrics import IDENTITY_LABELS, MetricSpec, R3Metrics, disable_created_series

log = logging.getLogger(__name__)

_ID = IDENTITY_LABELS

METRICS: list[MetricSpec] = [
    MetricSpec("r3operator_step", "gauge", _ID, "Last completed RL step."),
    MetricSpec("r3operator_policy_version", "gauge", _ID, "Policy version on the engines (weight syncs so far)."),
    MetricSpec("r3operator_reward_mean", "gauge", _ID, "Mean rollout reward of the last step."),
    MetricSpec("r3operator_tokens_per_second", "gauge", _ID, "Generated tokens per second of rollout, last step."),
    MetricSpec(
        "r3operator_eval_reward",
        "gauge",
        _ID,
        "Mean held-out eval reward of the last evaluation (spec.evaluation; absent without one).",
    ),
    MetricSpec(
        "r3operator_eval_step",
        "gauge",
        _ID,
        "The step after which the last evaluation ran (0: before training).",
    ),
    MetricSpec("r3operator_step_seconds", "gauge", _ID, "Wall time of the last step."),
    MetricSpec("r3operator_step_phase_seconds", "gauge", (*_ID, "phase"), "Wall time of each phase of the last step."),
    MetricSpec("r3operator_weight_sync_seconds", "gauge", _ID, "Wall time of the last weight sync (canary excluded)."),
    MetricSpec(
        "r3operator_weight_sync_phase_seconds",
        "gauge",
        (*_ID, "phase"),
        "Seconds of each phase of the last weight sync (gather, pack, fingerprint, begin, transfer, finish; "
        "docs/runtime.md).",
    ),
    MetricSpec("r3operator_weight_sync_canary_ok", "gauge", _ID, "1 if the last post-sync canary matched, else 0."),
    MetricSpec(
        "r3operator_weight_sync_kernel_refused",
        "gauge",
        _ID,
        "1 if the kernel layout was chosen and vLLM's own load_weights refused its plan at the reference sync (the "
        "syncs go on in the checkpoint layout), else 0; exported only where the kernel layout was chosen.",
    ),
    MetricSpec(
        "r3operator_samples_dropped_total",
        "counter",
        (*_ID, "reason"),
        "Samples left out of training (routes invalid or missing under R3; stale: older than "
        "algorithm.maxStaleness in the asynchronous mode).",
    ),
    MetricSpec(
        "r3operator_rollout_staleness",
        "histogram",
        _ID,
        "Asynchronous mode: policy versions between a sample's oldest token and the update that takes it "
        "(every sample taken from the rollout queue, kept or dropped as stale).",
    ),
    MetricSpec(
        "r3operator_partial_rollouts_total",
        "counter",
        _ID,
        "Asynchronous mode: samples taken from the rollout queue whose tokens were sampled under more "
        "than one policy version (a weight update interrupted them; they kept their routes).",
    ),
    MetricSpec(
        "r3operator_importance_weight_mean",
        "gauge",
        _ID,
        "Asynchronous mode: mean truncated importance weight pi_old/pi_rollout over trained tokens, last step.",
    ),
    MetricSpec(
        "r3operator_logprob_abs_diff_mean_by_lag",
        "gauge",
        (*_ID, "lag"),
        "Asynchronous mode: mean |rollout - trainer| logprob over the response tokens of each staleness lag "
        '(the step\'s policy version minus the one that sampled the token), last step. lag="0" is the '
        "engine/trainer mismatch (r3operator_logprob_abs_diff_mean) plus the current-version tokens of "
        "resumed (partial-rollout) trajectories, which that gauge leaves out; each further lag adds one "
        'update\'s policy drift. Labels 0 .. N-1 and ">=N", N = algorithm.maxStaleness (1 to 8); a lag '
        "without tokens has no series.",
    ),
    MetricSpec(
        "r3operator_response_tokens_by_lag",
        "gauge",
        (*_ID, "lag"),
        "Asynchronous mode: response tokens trained per staleness lag, last step (labels as "
        "r3operator_logprob_abs_diff_mean_by_lag; 0 where a lag had none).",
    ),
    MetricSpec(
        "r3operator_routing_agreement_by_turn_ratio",
        "gauge",
        (*_ID, "turn"),
        "Multi-turn rollouts: the trainer's natural routing agreement with the engine over the rows each "
        "turn's request returned (turn 1 = the prompt and the first reply but its last token), last step.",
    ),
    MetricSpec(
        "r3operator_route_record_failures_total",
        "counter",
        (*_ID, "operation"),
        "Failed writes (operation=write) or prunes (gc) of the routing record on the volume; training "
        "goes on without it.",
    ),
    MetricSpec(
        "r3operator_steps_skipped_total",
        "counter",
        (*_ID, "reason"),
        "Steps skipped without an update because no sample was usable (every one dropped).",
    ),
    MetricSpec(
        "r3operator_nonfinite_steps_total",
        "counter",
        _ID,
        "Steps with an update whose loss or gradient was not finite on some trainer rank: that optimizer step "
        "was skipped on every rank; a step with no update applied was neither synced nor checkpointed.",
    ),
    MetricSpec(
        "r3operator_replayed_rows_ratio",
        "gauge",
        _ID,
        "R3, last step: token rows replayed with the engine's routes over every row the rollout needed (each "
        "sample's tokens but its last); 1.0 when every sample trained with its routes.",
    ),
    MetricSpec(
        "r3operator_replay_fallback_rows_ratio",
        "gauge",
        _ID,
        "R3, last step: rows of the trained samples that routed naturally for want of an engine route.",
    ),
    MetricSpec(
        "r3operator_route_check_failures_total",
        "counter",
        (*_ID, "rule"),
        "R3: samples whose routes failed a route check, by rule (routes-missing, routes-invalid, route-shape, "
        "expert-range, zero-route, pad-replayed, constant-layer, hooks-not-fired; docs/rules.md).",
    ),
    MetricSpec(
        "r3operator_engine_faults_total",
        "counter",
        (*_ID, "kind"),
        "Engine faults ridden out: weight_sync (a sync aborted and repeated), stale_engine (an engine "
        "found restarted or unsynced, re-synced), engine_call / stale_result (a rollout or canary "
        "decode repeated).",
    ),
]

LAG_LABELS_MAX = 8
"""At most this many exact lag labels ("0" .. "7") and one ">=8": maxStaleness may be up to 1000, and each
label value is a series per job."""


def lag_label_bound(max_staleness: int) -> int:
    """N of the lag labels "0" .. "N-1", ">=N": maxStaleness, at least 1 (lag 0 apart from the rest) and at
    most LAG_LABELS_MAX. No trained token is older than maxStaleness, so below the cap ">=N" holds lag N alone."""
    return min(max(max_staleness, 1), LAG_LABELS_MAX)


def fold_lags(gaps: Sequence[LagGap], bound: int) -> dict[str, tuple[int, float | None]]:
    """lag label -> (tokens, token-weighted mean |Δlogprob|, None without tokens), every label of `bound`
    present: the per-lag split of metrics.csv with lags from `bound` on pooled under ">=bound"."""
    labels = [str(lag) for lag in range(bound)] + [f">={bound}"]
    tokens = dict.fromkeys(labels, 0)
    sums = dict.fromkeys(labels, 0.0)
    for gap in gaps:
        label = labels[min(gap.lag, bound)]
        tokens[label] += gap.tokens
        sums[label] += gap.tokens * (gap.abs_diff_mean or 0.0)
    return {label: (n, sums[label] / n if n else None) for label, n in tokens.items()}


# Policy versions; the only histogram of this list. A sample older than maxStaleness lands in a bucket too.
STALENESS_BUCKETS = (0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0, 32.0)


class RuntimeMetrics:
    """`R3Metrics` and this module's METRICS on one registry, optionally served over HTTP."""

    def __init__(self, rljob: str, *, namespace: str = "default", port: int | None = None) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        disable_created_series()
        self.rljob, self.namespace = rljob, namespace
        self.registry = CollectorRegistry()
        self.r3 = R3Metrics(rljob, registry=self.registry, namespace=namespace)
        self._m: dict[str, Any] = {}
        for spec in METRICS:
            base = spec.name.removesuffix("_total") if spec.type == "counter" else spec.name
            if spec.type == "histogram":
                self._m[spec.name] = Histogram(
                    base, spec.help, list(spec.labels), registry=self.registry, buckets=STALENESS_BUCKETS
                )
                continue
            cls = Counter if spec.type == "counter" else Gauge
            self._m[spec.name] = cls(base, spec.help, list(spec.labels), registry=self.registry)
        self.port: int | None = None
        if port:
            from prometheus_client import start_http_server

            start_http_server(port, registry=self.registry)
            self.port = port

    def _get(self, name: str, **labels: str) -> Any:
        return self._m[name].labels(namespace=self.namespace, rljob=self.rljob, **labels)

    def set(self, name: str, value: float, **labels: str) -> None:
        self._get(name, **labels).set(value)

    def inc(self, name: str, amount: float = 1.0, **labels: str) -> None:
        self._get(name, **labels).inc(amount)

    def observe(self, name: str, value: float, **labels: str) -> None:
        self._get(name, **labels).observe(value)

    def observe_step(self, record: StepRecord, phases: Mapping[str, float]) -> None:
        self.set("r3operator_step", record.step)
        self.set("r3operator_policy_version", record.policy_version)
        self.set("r3operator_reward_mean", record.reward_mean)
        self.set("r3operator_tokens_per_second", record.tokens_per_second)
        self.set("r3operator_step_seconds", record.step_seconds)
        for phase, seconds in phases.items():
            self.set("r3operator_step_phase_seconds", seconds, phase=phase)

    def observe_eval(self, step: int, reward_mean: float) -> None:
        """One held-out evaluation (runtime/evaluation.py): its reward and the step it was measured after."""
        self.set("r3operator_eval_reward", reward_mean)
        self.set("r3operator_eval_step", step)

    def observe_lags(self, gaps: Sequence[LagGap], *, max_staleness: int) -> None:
        """The step's |Δlogprob| split by staleness lag (metrics.csv's `*_by_lag`), under bounded lag labels.
        A label without tokens loses its mean series: a NaN would read as a figure (as clear_fidelity)."""
        for label, (tokens, mean) in fold_lags(gaps, lag_label_bound(max_staleness)).items():
            self.set("r3operator_response_tokens_by_lag", tokens, lag=label)
            if mean is None:
                self._m["r3operator_logprob_abs_diff_mean_by_lag"].remove(self.namespace, self.rljob, label)
            else:
                self.set("r3operator_logprob_abs_diff_mean_by_lag", mean, lag=label)

    def exposition(self) -> str:
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()


# ----------------------------------------------------------------------------- RLJob status.progress


def progress_patch(
    row: StepRecord,
    *,
    total_steps: int,
    last_checkpoint_step: int | None,
    now: dt.datetime | None = None,
    weight_sync: str | None = None,
    non_finite_steps: int | None = None,
    last_non_finite_step: int | None = None,
) -> dict[str, Any]:
    """The progress report after the step `row` (a StepRecord), shaped as the RLJob status it becomes:
    `{"status": {"progress": Progress}}` (`StatusPusher.push` sends it; the operator copies it into the status).
    Figures the step lacks are null, which clears the last step's; `weightSync` and `nonFiniteSteps` are left
    out when not known, and `evalReward`/`evalStep` on a step that did not evaluate, `weightSyncSeconds` on a step
    that did not sync, so the ones already reported stay (`lastNonFiniteStep` goes with its count); the export
    fields are the exporter's (runtime/export.py)."""
    stamp = (now or dt.datetime.now(dt.UTC)).strftime("%Y-%m-%dT%H:%M:%SZ")
    progress = step_progress(
        row,
        total_steps=total_steps,
        last_checkpoint_step=last_checkpoint_step,
        updated_at=stamp,
        weight_sync=weight_sync,
        non_finite_steps=non_finite_steps,
        last_non_finite_step=last_non_finite_step,
    )
    # Left out when not known, so that the value already there stays: weightSync, the run's non-finite count, the
    # last evaluation's figures.
    unknown = {
        "weight_sync": weight_sync,
        "non_finite_steps": non_finite_steps,
        "weight_sync_seconds": progress.weight_sync_seconds,  # a step without a sync keeps the last sync's
    }
    left_out = {k for k, v in unknown.items() if v is None}
    left_out |= {"exports", "last_export_step", "export_failure"}  # the exporter's own report (runtime/export.py)
    if non_finite_steps is None:
        left_out.add("last_non_finite_step")
    if progress.eval_reward is None:
        left_out |= {"eval_reward", "eval_step"}
    body = progress.model_dump(mode="json", by_alias=True, exclude=left_out or None)
    return {"status": {"progress": body}}


def eval_progress_patch(step: int, reward_mean: float) -> dict[str, Any]:
    """The report of an evaluation outside a step (before training, step 0): the eval figures alone."""
    progress = Progress(eval_reward=reward_mean, eval_step=step)
    return {
        "status": {"progress": progress.model_dump(mode="json", by_alias=True, include={"eval_reward", "eval_step"})}
    }


def merged_report(last: Mapping[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    """`last` with `patch` applied as a JSON merge patch (a null removes the key, a missing key keeps it)."""
    merged = dict(last)
    for key, value in patch.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = value
    return merged


class StatusPusher:
    """Reports progress for the RLJob named by R3OPERATOR_RLJOB_NAME / _NAMESPACE: the ConfigMap `<job>-progress`,
    which the operator created for it, checks and copies into the RLJob's `status.progress`.

    Disabled (no-op) outside a cluster. One HTTPS merge PATCH of the ConfigMap's `progress` key with the pod's
    own ServiceAccount token, whose Role allows exactly that ConfigMap (the trainer has no right on the RLJob or
    its status): no Kubernetes client library for one call. The key holds the whole report, each push merged
    over the last one (`merged_report`). A failed patch is logged, never fatal: training goes on.
    """

    def __init__(
        self, name: str | None = None, namespace: str | None = None, *, account_dir: Path | None = None
    ) -> None:
        env = runtime_settings()
        self.name = name or env.rljob_name
        self.namespace = namespace or env.rljob_namespace
        self._url: str | None = None
        self._account_dir = account_dir or env.service_account_dir
        self._last: dict[str, Any] = {}
        if self.name and self.namespace and env.in_cluster:
            from r3operator.api.names import ROLE_PROGRESS, child_name

            host = env.kubernetes_service_host or ""
            host = f"[{host}]" if ":" in host else host  # an IPv6 service address
            self._url = (
                f"https://{host}:{env.kubernetes_service_port}/api/v1"
                f"/namespaces/{self.namespace}/configmaps/{child_name(self.name, ROLE_PROGRESS)}"
            )

    @property
    def enabled(self) -> bool:
        return self._url is not None

    def push(self, body: dict[str, Any]) -> bool:
        """Report `body["status"]["progress"]` (`progress_patch`'s shape). True when the API server took it
        (False: logged, or not in a cluster)."""
        if self._url is None:
            return False
        # What the next push merges over, taken or not: each push sends the whole report.
        report = self._last = merged_report(self._last, body["status"]["progress"])
        try:
            # The token is re-read each time: the kubelet rotates projected tokens in place.
            token = (self._account_dir / "token").read_text().strip()
            context = ssl.create_default_context(cafile=str(self._account_dir / "ca.crt"))
            patch = {"data": {PROGRESS_KEY: json.dumps(report, separators=(",", ":"), allow_nan=False)}}
            request = urllib.request.Request(self._url, data=json.dumps(patch).encode(), method="PATCH")
            request.add_header("Authorization", f"Bearer {token}")
            request.add_header("Content-Type", "application/merge-patch+json")
            with urllib.request.urlopen(request, timeout=10, context=context) as response:
                response.read()
        except Exception as exc:  # the API server being away (or a NaN) must not kill a training step
            log.warning("progress report of rljob %s/%s failed: %s", self.namespace, self.name, exc)
            return False
        return True
