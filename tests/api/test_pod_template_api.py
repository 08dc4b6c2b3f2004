"""Bad pod templates refused by the real kube-apiserver (the generated CRD's bounds and object rules), and
the same verdicts from the Python models (``r3operator validate`` and the operator parse them alike)."""

from __future__ import annotations

from typing import Any

import pytest

from r3operator.api import RLJobLoadError, parse_rljob
from tests.api.conftest import base_manifest, set_path
from tests.api.real_apiserver import RLJobApi


def _with(path: str, template: dict[str, Any]) -> dict[str, Any]:
    manifest = base_manifest()
    set_path(manifest, path, template)
    return manifest


BAD: list[tuple[str, dict[str, Any], str, str]] = [
    # (template path, template, the field the apiserver names, words of its message)
    (
        "trainer.podTemplate",
        {"tolerations": [{"key": f"k{i}", "operator": "Exists"} for i in range(10_000)]},
        "spec.trainer.podTemplate.tolerations",
        "must have at most 64 items",
    ),
    (
        "inference.podTemplate",
        {"tolerations": [{"key": "a", "operator": "Exists", "value": "b"}]},
        "spec.inference.podTemplate.tolerations[0]",
        "a toleration with operator Exists has no value",
    ),
    (
        "podTemplate",
        {"env": [{"name": "A", "value": "1", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]},
        "spec.podTemplate.env[0]",
        "env sets value or valueFrom, not both",
    ),
    (
        "inference.podTemplate",
        {"volumes": [{"name": "v", "emptyDir": {}, "secret": {"secretName": "s"}}]},
        "spec.inference.podTemplate.volumes[0]",
        "a volume sets exactly one of",
    ),
    (
        "trainer.podTemplate",
        {"labels": {"not a key!": "x"}},
        "spec.trainer.podTemplate.labels",
        "keys must be qualified names",
    ),
]


@pytest.mark.parametrize(("path", "template", "field", "words"), BAD, ids=[b[2] + ":" + b[3][:20] for b in BAD])
def test_bad_templates_are_refused_by_the_apiserver_and_by_the_models(
    rljob_api: RLJobApi, path: str, template: dict[str, Any], field: str, words: str
) -> None:
    manifest = _with(path, template)
    causes = rljob_api.refusal(manifest)
    assert [c for c in causes if c.field == field and words in c.message], causes
    with pytest.raises(RLJobLoadError):
        parse_rljob(manifest)


def test_a_full_template_is_accepted_by_the_apiserver(rljob_api: RLJobApi) -> None:
    template = {
        "labels": {"team": "rl"},
        "annotations": {"example.com/cost-center": "42"},
        "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "rl", "effect": "NoSchedule"}],
        "affinity": {
            "podAntiAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "weight": 50,
                        "podAffinityTerm": {
                            "topologyKey": "kubernetes.io/hostname",
                            "labelSelector": {"matchLabels": {"team": "rl"}},
                        },
                    }
                ]
            }
        },
        "topologySpreadConstraints": [
            {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway"}
        ],
        "priorityClassName": "rl-batch",
        "imagePullSecrets": [{"name": "registry"}],
        "serviceAccountName": "rl-runner",
        "podSecurityContext": {"runAsUser": 2000, "fsGroup": 2000, "seccompProfile": {"type": "RuntimeDefault"}},
        "securityContext": {"readOnlyRootFilesystem": True, "capabilities": {"add": ["IPC_LOCK"], "drop": ["ALL"]}},
        "env": [{"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {"name": "wandb", "key": "key"}}}],
        "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "datasets", "readOnly": True}}],
        "volumeMounts": [{"name": "data", "mountPath": "/data", "readOnly": True}],
        "resources": {"limits": {"cpu": "32", "rdma/ib": "1"}},
    }
    manifest = _with("inference.podTemplate", template)
    assert rljob_api.refusal(manifest, strict=True) == []
    parsed = parse_rljob(manifest).spec.inference.pod_template
    assert parsed is not None and parsed.model_dump(by_alias=True, exclude_unset=True) == template
