"""`render` through typer's CliRunner on a small app (cli/main.py mounts the same functions)."""

from __future__ import annotations

from pathlib import Path

import typer
import yaml
from typer.testing import CliRunner

from r3operator.cli import operator_cmds

REPO = Path(__file__).resolve().parents[2]
app = typer.Typer()
app.command("render")(operator_cmds.render)
app.command("operator")(operator_cmds.run_operator)


def test_render_prints_the_children_as_a_yaml_stream():
    result = CliRunner().invoke(app, ["render", str(REPO / "examples" / "qwen3-30b-a3b-r3-fsdp.yaml")])
    assert result.exit_code == 0, result.output
    docs = list(yaml.safe_load_all(result.stdout))
    assert [d["kind"] for d in docs] == [
        "PersistentVolumeClaim",
        "PersistentVolumeClaim",
        "Job",
        "ConfigMap",
        "ConfigMap",
        "Service",
        "StatefulSet",
        "NetworkPolicy",
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "RayJob",
        "PodMonitor",
    ]
    assert '"numLayers": 48' in docs[3]["data"]["config.json"]


def test_render_shows_the_model_fetch_its_secret_references_and_the_read_only_cache_mounts(tmp_path: Path):
    doc = yaml.safe_load((REPO / "examples" / "qwen3-30b-a3b-r3-fsdp.yaml").read_text())
    doc["spec"]["model"] |= {
        "uri": "s3://models/qwen3-30b-a3b",
        "revision": None,
        "s3": {"credentialsSecret": "store", "endpointURL": "http://minio:9000"},
    }
    path = tmp_path / "s3.yaml"
    path.write_text(yaml.safe_dump(doc))
    result = CliRunner().invoke(app, ["render", str(path)])
    assert result.exit_code == 0, result.output
    docs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(result.stdout)}
    fetch = docs[("Job", "qwen3-30b-a3b-r3-model-fetch")]["spec"]["template"]["spec"]["containers"][0]
    assert fetch["command"] == [
        "r3operator",
        "fetch",
        "s3://models/qwen3-30b-a3b",
        "/mnt/model",
        "--endpoint-url",
        "http://minio:9000",
    ]
    secret_ref = {"secretKeyRef": {"name": "store", "key": "AWS_SECRET_ACCESS_KEY"}}
    assert {"name": "AWS_SECRET_ACCESS_KEY", "valueFrom": secret_ref} in fetch["env"]
    [claim] = [name for kind, name in docs if kind == "PersistentVolumeClaim" and name.startswith("model-cache-")]
    assert docs[("PersistentVolumeClaim", claim)]["metadata"]["annotations"] == {
        "r3operator.io/model-source": "s3://models/qwen3-30b-a3b"
    }
    engine = docs[("StatefulSet", "qwen3-30b-a3b-r3-engine")]["spec"]["template"]["spec"]
    assert engine["initContainers"][0]["command"][-1] == "--verify"
    assert {"name": "model", "mountPath": "/mnt/model", "readOnly": True} in engine["containers"][0]["volumeMounts"]


def test_render_exit_codes_follow_validate(tmp_path: Path):
    doc = yaml.safe_load((REPO / "examples" / "qwen3-30b-a3b-r3-fsdp.yaml").read_text())
    doc["spec"]["inference"]["image"] = "vllm/vllm-openai:v0.13.0"
    bad = tmp_path / "old.yaml"
    bad.write_text(yaml.safe_dump(doc))
    result = CliRunner().invoke(app, ["render", str(bad)])
    assert result.exit_code == 1 and "R3-VLLM-MIN-VERSION" in result.output
    assert "kind:" not in result.stdout
    assert CliRunner().invoke(app, ["render", str(tmp_path / "missing.yaml")]).exit_code == 2
    assert CliRunner().invoke(app, ["operator"]).exit_code == 2  # neither --namespace nor -A
