"""Observability as code: metrics contract, Prometheus rules, Grafana dashboards, PNG preview."""
