"""A PodMonitor (Prometheus Operator) scraping engine and trainer pods of one RLJob."""

from __future__ import annotations

from typing import Any

from r3operator.api.v1alpha1 import RLJob
from r3operator.operator import meta

POD_MONITOR_GROUP_VERSION = "monitoring.coreos.com/v1"


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
    # so one PodMonitor covers vLLM engines (`http`, /metrics) and the trainer driver (`metrics`).
    return {
        "apiVersion": POD_MONITOR_GROUP_VERSION,
        "kind": "PodMonitor",
        "metadata": meta.object_meta(job, meta.ROLE_METRICS),
        "spec": {
            "selector": {"matchLabels": {meta.LABEL_JOB: job.metadata.name}},
            "podMetricsEndpoints": [
                {"port": "http", "path": "/metrics", "interval": "30s", "relabelings": _RLJOB_LABEL},
                {"port": "metrics", "path": "/metrics", "interval": "30s", "relabelings": _RLJOB_LABEL},
            ],
        },
    }
