"""A NetworkPolicy that fences each RLJob's engine pods.

The engines run with ``VLLM_SERVER_DEV_MODE=1`` because the trainer drives weight sync over HTTP
(``/collective_rpc``, ``/reset_prefix_cache``), which vLLM serves only in dev mode. ``/collective_rpc``
calls any method of the worker extension on every GPU worker, so whoever reaches the engine port can
load weights into the policy. The policy admits:

- every port from this job's own trainer and engine pods: the trainer's HTTP calls and its NCCL weight
  broadcast, and the DP/torch.distributed traffic between the pods of a multi-pod replica;
- the engine port from the operator's namespace (the routed-experts canary POSTs ``/v1/completions``
  to engine pod 0) and from any namespace the operator is told to admit (e.g. Prometheus scraping
  vLLM's ``/metrics``, which shares the port).

A disaggregated job's prefill pods are fenced the same way (its decode pods are the engine pods): the policy selects
both roles, and each admits the other on every port (NixlConnector's side channel, UCX's transfers; the storage
connector needs none).

Every other pod, in this namespace or any other, is refused. Kubelet probes come from the node and
are not subject to NetworkPolicy on the common CNIs. A cluster whose CNI does not enforce
NetworkPolicy keeps the object but not the fence (docs/operator.md, "Network").
"""

from __future__ import annotations

from typing import Any

from r3operator.api import names
from r3operator.api.disaggregation import roles
from r3operator.api.v1alpha1 import RLJob
from r3operator.operator import meta

NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
"""Set by the API server on every namespace (Kubernetes >= 1.22): selects a namespace by its name."""


def _engine_pods(job: RLJob, engine_roles: list[str]) -> dict[str, Any]:
    if len(engine_roles) == 1:
        return {"matchLabels": meta.selector_labels(job, engine_roles[0])}
    return {
        "matchLabels": {meta.LABEL_JOB: job.metadata.name},
        "matchExpressions": [{"key": meta.LABEL_ROLE, "operator": "In", "values": engine_roles}],
    }


def build_engine_network_policy(
    job: RLJob, *, operator_namespace: str | None, admitted_namespaces: tuple[str, ...] = ()
) -> dict[str, Any]:
    """``operator_namespace`` None (an operator running outside the cluster) admits no namespace for the canary."""
    engine_roles = [meta.ROLE_ENGINE, *([names.ROLE_PREFILL] if roles(job.spec) else [])]
    same_job = [
        {"podSelector": {"matchLabels": meta.selector_labels(job, meta.ROLE_TRAINER)}},
        *({"podSelector": {"matchLabels": meta.selector_labels(job, role)}} for role in engine_roles),
    ]
    ingress: list[dict[str, Any]] = [{"from": same_job}]
    namespaces = sorted({*admitted_namespaces, *([operator_namespace] if operator_namespace else [])})
    if namespaces:
        ingress.append(
            {
                "from": [
                    {
                        "namespaceSelector": {
                            "matchExpressions": [{"key": NAMESPACE_NAME_LABEL, "operator": "In", "values": namespaces}]
                        }
                    }
                ],
                "ports": [{"protocol": "TCP", "port": job.spec.inference.port}],
            }
        )
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": meta.object_meta(job, meta.ROLE_ENGINE),
        "spec": {
            "podSelector": _engine_pods(job, engine_roles),
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }
