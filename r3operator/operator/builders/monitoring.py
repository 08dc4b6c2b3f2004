"""A PodMonitor (Prometheus Operator) scraping engine and trainer pods of one RLJob."""

from __future__ import annotations

from typing import Any

from r3operator.api.v1alpha1 import RLJob
from r3operator.operator import meta
from r3operator.operator.builders.trainer import DRIVER_METRICS_PORT_NAME

POD_MONITOR_GROUP_VERSION = "monitoring.coreos.com/v1"
SCRAPE_INTERVAL = "30s"  # rules.SCRAPE_INTERVAL_SECONDS: rate windows are sized on it (a test pins them equal)


# Dashboards and alerts select series by `namespace` (added by the Prometheus Operator) and `rljob`.
_RLJOB_LABEL = [
    {
        "sourceLabels": ["__meta_kubernetes_pod_label_r3operator_io_job"],
        "targetLabel": "rljob",
        "action": "replace",
    }
]


def wants_pod_monitor(job: RLJob) -> bool:
    return job.spec.monitoring.enabled and job.spec.monitoring.pod_monitor


def build_pod_monitor(job: RLJob) -> dict[str, Any]:
    # Endpoints name container ports; pods without a port of that name are skipped by Prometheus,
    # so one PodMonitor covers vLLM engines (`http`, /metrics) and the trainer driver (`r3-metrics`). The
    # driver labels its series with `namespace` and `rljob` itself (honorLabels keeps them, not
    # `exported_namespace`); the engines' vLLM series get them from the relabeling.
    return {
        "apiVersion": POD_MONITOR_GROUP_VERSION,
        "kind": "PodMonitor",
        "metadata": meta.object_meta(job, meta.ROLE_METRICS),
        "spec": {
            "selector": {"matchLabels": {meta.LABEL_JOB: job.metadata.name}},
            "podMetricsEndpoints": [
                {"port": "http", "path": "/metrics", "interval": SCRAPE_INTERVAL, "relabelings": _RLJOB_LABEL},
                {
                    "port": DRIVER_METRICS_PORT_NAME,
                    "path": "/metrics",
                    "interval": SCRAPE_INTERVAL,
                    "honorLabels": True,
                    "relabelings": _RLJOB_LABEL,
                },
            ],
        },
    }
