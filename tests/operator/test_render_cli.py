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
        "PersistentVolumeClaim", "ConfigMap", "Service", "StatefulSet", "NetworkPolicy", "ServiceAccount", "Role",
        "RoleBinding", "RayJob", "PodMonitor",
    ]  # fmt: skip
    assert '"numLayers": 48' in docs[1]["data"]["config.json"]


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
