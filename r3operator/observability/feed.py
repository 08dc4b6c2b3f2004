"""A synthetic metrics feed: real exporters on 127.0.0.1 fed with synthetic observations.

- driver: the real `RuntimeMetrics` (r3operator.runtime.metrics, which holds the trainer's `R3Metrics`)
  fed with synthetic rollout/trainer logprobs, routing ids, rollout samples and step rows, so the
  project's own statistics code computes the r3operator_* fidelity and routing values.
- operator: the real r3operator.operator.metrics collectors (its module registry), fed through
  `observe_job` with the RLJob of examples/qwen3-30b-a3b-r3-fsdp.yaml and a synthetic status, plus
  reconcile counts and durations.
- engines: a FAKE vLLM exporter (synthetic values, not a vLLM server) that registers the real vLLM
  metric names with `prometheus_client` as vLLM does: one engine with the vLLM 0.30.0 names, one with
  the legacy pre-rename names, so the recording rules are exercised on both sides of a rename.

Prometheus sees each engine with the target labels a PodMonitor adds (`namespace`, `rljob`); the driver and
the operator carry those labels themselves and are scraped with honor_labels, as the PodMonitor and the
chart's Service/PodMonitor do.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace, TracebackType
from typing import Any, Self

import numpy as np

from r3operator.observability.metrics_contract import VLLM_METRICS, VllmMetric
from r3operator.observability.prom import ScrapeTarget

# Any: prometheus_client's registries and collectors, and the metric objects of our own drivers it feeds through their
# untyped `_get`, are Any here.


@dataclass
class _Exporter:
    name: str
    registry: Any
    target_labels: dict[str, str]
    honor_labels: bool = False
    server: Any = None
    thread: Any = None
    port: int = 0

    def start(self) -> None:
        from prometheus_client import start_http_server

        self.server, self.thread = start_http_server(0, addr="127.0.0.1", registry=self.registry)
        self.port = int(self.server.server_port)

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


@dataclass
class _Sample:  # the shape R3Metrics.observe_rollout reads from a RolloutSample
    routes_status: str
    routes: Any = None


@dataclass
class SyntheticFeed:
    namespace: str = "demo"
    rljob: str = "qwen3-30b-a3b-r3"
    layers: int = 4
    tick_seconds: float = 0.5
    seed: int = 0
    exporters: list[_Exporter] = field(default_factory=list)
    sources: dict[str, str] = field(default_factory=dict)  # what fed each exporter, for labels/reports
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _tickers: list[Any] = field(default_factory=list)
    _step: int = 0

    @property
    def identity(self) -> dict[str, str]:
        return {"namespace": self.namespace, "rljob": self.rljob}

    def start(self) -> Self:
        from prometheus_client import CollectorRegistry

        from r3operator.runtime.metrics import RuntimeMetrics

        rng = np.random.default_rng(self.seed)
        driver = RuntimeMetrics(self.rljob, namespace=self.namespace)
        # The driver labels its series with namespace/rljob itself; the PodMonitor honours them.
        self._add(
            "driver", driver.registry, "r3operator.runtime.metrics.RuntimeMetrics (real class)", honor_labels=True
        )
        self._tickers.append(lambda step: self._feed_driver(driver, rng, step))

        from r3operator.operator import metrics as operator_metrics

        job = _example_rljob(self.namespace, self.rljob)
        self._add(
            "operator", operator_metrics.REGISTRY, "r3operator.operator.metrics (real collectors)", honor_labels=True
        )
        self._tickers.append(lambda step: _feed_operator(operator_metrics, job, step))

        for variant, metrics in (("vllm-0.30", _vllm_metrics(legacy=False)), ("vllm-legacy", _vllm_metrics(True))):
            registry = CollectorRegistry()
            fake = _FakeVllm(metrics, registry, engine_label=variant == "vllm-0.30")
            self._tickers.append(fake.tick)
            self._add(
                variant,
                registry,
                "FAKE vLLM exporter: real vLLM metric names, synthetic values",
                extra={"pod": f"{self.rljob}-engine-{variant}"},
            )

        for exporter in self.exporters:
            exporter.start()
        self.tick()
        self._thread = threading.Thread(target=self._run, name="r3-synthetic-feed", daemon=True)
        self._thread.start()
        return self

    def _add(
        self, name: str, registry: Any, source: str, *, honor_labels: bool = False, extra: dict[str, str] | None = None
    ) -> None:
        labels = {} if honor_labels else {**self.identity, **(extra or {})}
        self.exporters.append(_Exporter(name, registry, labels, honor_labels))
        self.sources[name] = source

    def tick(self) -> None:
        self._step += 1
        for ticker in self._tickers:
            ticker(self._step)

    def _run(self) -> None:
        while not self._stop.wait(self.tick_seconds):
            self.tick()

    def targets(self) -> list[ScrapeTarget]:
        return [
            ScrapeTarget(f"r3-{e.name}", f"127.0.0.1:{e.port}", e.target_labels, e.honor_labels) for e in self.exporters
        ]

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for exporter in self.exporters:
            exporter.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _feed_driver(self, driver: Any, rng: np.random.Generator, step: int) -> None:
        self._feed_trainer(driver.r3, rng, step)
        phases = {
            "rollout": 4.0 + math.sin(step / 7.0),
            "logprobs": 1.2,
            "train": 3.0 + 0.5 * math.cos(step / 5.0),
            "weight_sync": 0.8,
        }
        from r3operator.runtime.step_record import StepRecord

        record = StepRecord(
            step=step,
            policy_version=step,
            replay_mode="R3",
            reward_mean=0.2 + 0.5 * (1 - math.exp(-step / 60.0)),
            reward_std=0.0,
            samples=0,
            samples_dropped=0,
            tokens=0,
            tokens_per_second=9000 + 800 * math.sin(step / 9.0),
            step_seconds=sum(phases.values()),
        )
        driver.observe_step(record, phases)
        if step == 1 or step % 10 == 0:  # spec.evaluation: every 10 steps, rising slower than the training reward
            driver.observe_eval(step, 0.15 + 0.4 * (1 - math.exp(-step / 80.0)))
        driver.set("r3operator_weight_sync_seconds", phases["weight_sync"])
        driver.set("r3operator_weight_sync_canary_ok", 1.0)
        if step % 25 == 0:
            driver.inc("r3operator_samples_dropped_total", reason="routes_invalid")
        # The asynchronous mode's series: staleness per sample, partial rollouts, stale drops, TIS weight.
        for _ in range(8):
            driver.observe("r3operator_rollout_staleness", float(rng.integers(0, 3)))
        driver.inc("r3operator_partial_rollouts_total", float(rng.integers(0, 6)))
        if step % 10 == 0:
            driver.inc("r3operator_samples_dropped_total", reason="stale")
        driver.set("r3operator_importance_weight_mean", 0.95 + 0.03 * math.sin(step / 11.0))
        from r3operator.runtime.metrics import LagGap

        # The gap per staleness lag: the mismatch at lag 0, policy drift growing with the lag.
        lags = [LagGap(lag, int(rng.integers(50, 200)), 0.004 + 0.06 * lag) for lag in range(3)]
        driver.observe_lags(lags, max_staleness=2)
        # Multi-turn rollouts: natural agreement per turn, a little lower at later turns.
        for turn in (1, 2, 3):
            driver.set("r3operator_routing_agreement_by_turn_ratio", 0.985 - 0.004 * turn, turn=str(turn))

    def _feed_trainer(self, metrics: Any, rng: np.random.Generator, step: int) -> None:
        tokens, top_k = 256, 2
        drift = 0.02 + 0.015 * math.sin(step / 8.0) + (0.3 if step % 40 in range(30, 34) else 0.0)
        rollout = rng.normal(-1.5, 0.6, size=tokens)
        trainer_lp = rollout + rng.normal(0.0, drift, size=tokens)
        metrics.observe_logprobs(rollout, trainer_lp, rng.random(tokens) < 0.9)
        engine_ids = np.stack([rng.permutation(8)[:top_k] for _ in range(tokens * self.layers)])
        engine_ids = engine_ids.reshape(tokens, self.layers, top_k)
        trainer_ids = engine_ids.copy()
        for layer in range(self.layers):  # deeper layers disagree more, as in MoE routing drift
            flip = rng.random(tokens) < 0.02 * (layer + 1) * (1.0 + drift * 5)
            trainer_ids[flip, layer, 0] = (engine_ids[flip, layer, 0] + 7) % 8
        metrics.observe_routing(trainer_ids, engine_ids)
        samples = [_Sample("ok", SimpleNamespace(nbytes=int(rng.integers(40_000, 60_000)))) for _ in range(8)]
        samples += [_Sample("missing")] * int(step % 10 == 0) + [_Sample("invalid")] * int(step % 25 == 0)
        metrics.observe_rollout(samples)
        metrics.set_replay_active(True)


def _example_rljob(namespace: str, name: str) -> Any:
    from r3operator.api import load_rljob

    path = Path(__file__).resolve().parents[2] / "examples" / "qwen3-30b-a3b-r3-fsdp.yaml"
    job = load_rljob(path)
    return job.model_copy(update={"metadata": job.metadata.model_copy(update={"namespace": namespace, "name": name})})


def _feed_operator(metrics: Any, job: Any, step: int) -> None:
    from r3operator.api.v1alpha1 import Condition, Progress, RLJobStatus

    stamp = "2026-01-01T00:00:00Z"
    conditions = [
        Condition(type=t, status="True", reason="Running", last_transition_time=stamp)
        for t in ("Ready", "Valid", "EnginesReady", "TrainerReady", "RoutingReplayActive")
    ]
    metrics.observe_job(job, RLJobStatus(conditions=conditions, progress=Progress(step=step)))
    metrics.RECONCILE_TOTAL.labels(result="ok").inc()
    metrics.RECONCILE_DURATION.observe(0.02 + 0.01 * math.sin(step / 3.0))
    if step % 9 == 0:
        metrics.RECONCILE_TOTAL.labels(result="error").inc()
        metrics.RECONCILE_ERRORS.labels(reason="ApiError").inc()


def _vllm_metrics(legacy: bool) -> list[VllmMetric]:
    if not legacy:
        return [m for m in VLLM_METRICS if m.current]
    renamed = {m.replaced_by for m in VLLM_METRICS if m.replaced_by}
    return [m for m in VLLM_METRICS if (m.current and m.name not in renamed) or not m.current]


class _FakeVllm:
    def __init__(self, metrics: list[VllmMetric], registry: Any, *, engine_label: bool) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        kinds = {"gauge": Gauge, "counter": Counter, "histogram": Histogram}
        self.values: dict[str, Any] = {}
        for m in metrics:
            labels = [lbl for lbl in m.labels if engine_label or lbl != "engine"]
            collector = kinds[m.type](m.name, m.note, labels, registry=registry)
            base = {"model_name": "Qwen/Qwen3-30B-A3B", **({"engine": "0"} if engine_label else {})}
            if "finished_reason" in labels:
                self.values[m.name] = [collector.labels(**base, finished_reason=r) for r in ("stop", "length")]
            else:
                self.values[m.name] = [collector.labels(**base)]

    def tick(self, step: int) -> None:
        wave = 0.5 + 0.4 * math.sin(step / 6.0)
        for name, children in self.values.items():
            for child in children:
                if name.endswith(("usage_perc",)):
                    child.set(wave)
                elif name.startswith("vllm:num_requests"):
                    child.set(round(32 * wave))
                elif name.endswith("_seconds"):
                    for q in (0.2, 0.5, 1.0):
                        child.observe(q * wave * (0.05 if "token" in name else 2.0))
                elif "hits" in name:
                    child.inc(600 * wave)
                elif "queries" in name:
                    child.inc(1000)
                elif "preemptions" in name:
                    child.inc(int(step % 7 == 0))
                else:
                    child.inc(2000 * wave)
