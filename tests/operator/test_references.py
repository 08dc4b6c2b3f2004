"""Outside objects the spec names (operator/references.py): which are required, what a missing one says, and
that a Secret is read for its key names only; the pods' CreateContainerConfigError where Secrets cannot be read
(operator/scheduling.py, status)."""

from __future__ import annotations

import asyncio
from typing import Any

from operator_harness import example

from r3operator.api import RLJob, parse_rljob
from r3operator.api.enums import ConditionType
from r3operator.operator.kube import Kind, KubeError
from r3operator.operator.observed import Observed
from r3operator.operator.references import check_references, references
from r3operator.operator.scheduling import config_errors_by_role
from r3operator.operator.status import compute_conditions

S3 = {"credentialsSecret": "store", "endpointURL": "http://minio.storage:9000"}


def _job(**edits: Any) -> RLJob:
    return parse_rljob(example("job", "rl", **edits))


class Secrets:
    """A read-only client that holds Secrets (and nothing else), or refuses them like the chart without
    rbac.checkSecretReferences."""

    def __init__(self, secrets: dict[str, dict[str, str]], *, readable: bool = True) -> None:
        self.secrets, self.readable, self.reads = secrets, readable, 0

    async def get(self, kind: Kind, namespace: str | None, name: str) -> dict[str, Any] | None:
        assert kind.plural == "secrets" and namespace == "rl", (kind, namespace)
        self.reads += 1
        if not self.readable:
            raise KubeError(403, 'secrets "x" is forbidden: cannot get resource "secrets"')
        data = self.secrets.get(name)
        return None if data is None else {"kind": "Secret", "metadata": {"name": name}, "data": data}


def _check(job: RLJob, client: Secrets) -> tuple[str, ...]:
    return asyncio.run(check_references(client, job, priority_class=None)).missing  # type: ignore[arg-type]


def test_the_credentials_of_fetched_sources_are_required_references():
    dataset = {"task.datasetPath": "s3://data/math/train.jsonl", "task.s3": {"credentialsSecret": "data"}}
    job = _job(**{"model.tokenSecretRef": {"name": "hf", "key": "token"}, **dataset})
    named = {(r.name, r.key, r.where) for r in references(job)}
    assert named == {
        ("hf", "token", "model.tokenSecretRef"),
        ("data", "AWS_ACCESS_KEY_ID", "task.s3.credentialsSecret"),
        ("data", "AWS_SECRET_ACCESS_KEY", "task.s3.credentialsSecret"),
    }
    # An eval file on a gs:// store is fetched with task.gcs: its key is required as well (a local training file).
    held_out = {
        "task.datasetPath": "/data/train.jsonl",
        "task.s3": {"credentialsSecret": "data"},
        "task.gcs": {"credentialsSecret": "hmac"},
        "evaluation": {"datasetPath": "gs://held/out.jsonl"},
    }
    assert {(r.name, r.key, r.where) for r in references(_job(**held_out))} == {
        ("hmac", "AWS_ACCESS_KEY_ID", "task.gcs.credentialsSecret"),
        ("hmac", "AWS_SECRET_ACCESS_KEY", "task.gcs.credentialsSecret"),
    }
    s3_model = _job(**{"model.uri": "s3://models/qwen3", "model.revision": None, "model.s3": S3})
    assert {(r.name, r.key) for r in references(s3_model)} == {
        ("store", "AWS_ACCESS_KEY_ID"),
        ("store", "AWS_SECRET_ACCESS_KEY"),
    }
    gs_model = _job(
        **{"model.uri": "gs://models/qwen3", "model.revision": None, "model.gcs": {"credentialsSecret": "hmac"}}
    )
    assert {(r.name, r.key, r.where) for r in references(gs_model)} == {
        ("hmac", "AWS_ACCESS_KEY_ID", "model.gcs.credentialsSecret"),
        ("hmac", "AWS_SECRET_ACCESS_KEY", "model.gcs.credentialsSecret"),
    }
    # A model that is not fetched reads no token: nothing to require.
    pvc = _job(
        **{
            "model.uri": "pvc://weights/qwen3",
            "model.revision": None,
            "model.tokenSecretRef": {"name": "hf", "key": "token"},
        }
    )
    assert references(pvc) == []


def test_a_missing_secret_or_key_is_named_with_the_field_that_names_it():
    job = _job(**{"model.tokenSecretRef": {"name": "hf", "key": "token"}})
    assert _check(job, Secrets({})) == ("Secret/hf (key token), named in model.tokenSecretRef, does not exist",)
    assert _check(job, Secrets({"hf": {"other": "eA=="}})) == (
        "Secret/hf (key token), named in model.tokenSecretRef, has no such key",
    )
    assert _check(job, Secrets({"hf": {"token": "eA=="}})) == ()
    s3_model = _job(**{"model.uri": "s3://models/qwen3", "model.revision": None, "model.s3": S3})
    client = Secrets({"store": {"AWS_ACCESS_KEY_ID": "eA=="}})
    assert _check(s3_model, client) == (
        "Secret/store (key AWS_SECRET_ACCESS_KEY), named in model.s3.credentialsSecret, has no such key",
    )
    assert client.reads == 1  # one GET per Secret, however many keys are checked


def test_unreadable_secrets_are_skipped_not_reported():
    job = _job(**{"model.tokenSecretRef": {"name": "hf", "key": "token"}})
    assert _check(job, Secrets({}, readable=False)) == ()


def _stuck(role: str, container: str, message: str, *, init: bool = False) -> dict[str, Any]:
    waiting = {"name": container, "state": {"waiting": {"reason": "CreateContainerConfigError", "message": message}}}
    key = "initContainerStatuses" if init else "containerStatuses"
    return {"metadata": {"labels": {"r3operator.io/role": role}}, "status": {key: [waiting]}}


def test_the_kubelets_config_errors_name_the_secret_per_role():
    running = {"name": "vllm", "state": {"running": {}}}
    pods = [
        _stuck("model-fetch", "fetch-model", 'secret "hf" not found'),
        _stuck("engine", "vllm", "couldn't find key token in Secret rl/hf"),
        _stuck("engine", "vllm", "couldn't find key token in Secret rl/hf"),
        _stuck("trainer", "fetch-dataset", 'secret "data" not found', init=True),
        {"metadata": {"labels": {"r3operator.io/role": "engine"}}, "status": {"containerStatuses": [running]}},
    ]
    assert config_errors_by_role(pods) == {
        "model-fetch": '1 pod: container fetch-model: secret "hf" not found',
        "engine": "2 pods: container vllm: couldn't find key token in Secret rl/hf",
        "trainer": '1 pod: container fetch-dataset: secret "data" not found',
    }


def test_a_fetch_pod_stuck_on_a_missing_secret_stops_progress_with_the_secrets_name():
    job = _job(**{"model.tokenSecretRef": {"name": "hf", "key": "token"}})
    obs = Observed(
        model_fetch="running", config_errors={"model-fetch": '1 pod: container fetch-model: secret "hf" not found'}
    )
    progressing = compute_conditions(job, obs)[ConditionType.PROGRESSING]
    assert (progressing.status.value, progressing.reason) == ("False", "ReferenceNotFound")
    assert 'secret "hf" not found' in progressing.message and "job-model-fetch" in progressing.message
    pending = Observed(
        model_fetch="running",
        unschedulable={"model-fetch": "1 pod: 0/18 nodes are available: 16 node(s) had untolerated taint."},
    )
    progressing = compute_conditions(job, pending)[ConditionType.PROGRESSING]
    assert (progressing.status.value, progressing.reason) == ("False", "Unschedulable")
    assert "untolerated taint" in progressing.message
