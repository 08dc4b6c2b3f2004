"""`r3operator validate / explain / crd`: exit codes, one-line errors, JSON rows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from r3operator.cli.main import app
from tests.api.conftest import base_manifest, set_path
from tests.api.rule_cases import CASES, FACTS

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(str(p) for p in (ROOT / "examples").glob("*.yaml"))
runner = CliRunner()


def _write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_examples_validate_exit_0() -> None:
    result = runner.invoke(app, ["validate", *EXAMPLES])
    assert result.exit_code == 0, result.output
    assert result.output.count(": valid") == len(EXAMPLES)


@pytest.mark.parametrize("rule_id", sorted(CASES))
def test_failing_case_in_json(tmp_path: Path, rule_id: str) -> None:
    manifest = base_manifest()
    CASES[rule_id][1](manifest)
    path = _write(tmp_path, "job.yaml", yaml.safe_dump(manifest))
    # The cluster facts a rule reads reach validate as flags (cli/cluster_facts.py).
    flags = ["--no-leaderworkerset"] if FACTS.get(rule_id, {}).get("leader_worker_set") is False else []
    result = runner.invoke(app, ["validate", *flags, "--output", "json", str(path)])
    rows = json.loads(result.stdout)
    hit = [r for r in rows if r["rule"] == rule_id]
    assert hit and set(hit[0]) == {"file", "rule", "severity", "field", "message"}
    assert hit[0]["file"] == str(path)
    assert result.exit_code == (1 if hit[0]["severity"] == "error" else 0)


BAD_INPUTS = {
    "malformed.yaml": ("spec: [1,\n", "malformed YAML at line 2"),
    "pod.yaml": ("apiVersion: v1\nkind: Pod\nmetadata: {name: p}\n", "not an RLJob"),
    "list.yaml": ("- a\n- b\n", "expected a mapping"),
    "empty.yaml": ("", "no YAML documents"),
}


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_bad_input_exits_2_with_one_line(tmp_path: Path, name: str) -> None:
    text, expected = BAD_INPUTS[name]
    path = _write(tmp_path, name, text)
    result = runner.invoke(app, ["validate", str(path)])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{path}: ") and expected in lines[0]
    assert "Traceback" not in result.output


def test_unknown_field_and_wrong_type_name_their_paths(tmp_path: Path) -> None:
    manifest = base_manifest()
    set_path(manifest, "inference.tensorParalelSize", 2)
    set_path(manifest, "rollout.groupSize", "eight")
    path = _write(tmp_path, "typo.yaml", yaml.safe_dump(manifest))
    result = runner.invoke(app, ["validate", "-o", "json", str(path)])
    assert result.exit_code == 2
    rows = {r["field"]: r for r in json.loads(result.stdout)}
    assert rows["spec.inference.tensorParalelSize"]["message"] == "unknown field"
    assert rows["spec.inference.tensorParalelSize"]["rule"] == "schema"
    assert "integer" in rows["spec.rollout.groupSize"]["message"]


def test_missing_file_exits_2(tmp_path: Path) -> None:
    result = runner.invoke(app, ["validate", str(tmp_path / "nope.yaml")])
    assert result.exit_code == 2
    assert "cannot read file" in result.stderr


def test_worst_exit_code_wins_across_files(tmp_path: Path) -> None:
    bad = _write(tmp_path, "bad.yaml", "spec: [\n")
    result = runner.invoke(app, ["validate", EXAMPLES[0], str(bad)])
    assert result.exit_code == 2


def test_explain_prints_plan() -> None:
    example = str(ROOT / "examples" / "qwen3-30b-a3b-r3-fsdp.yaml")
    result = runner.invoke(app, ["explain", example], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "0.22.1 (from image-tag)" in result.output
    assert "384 bytes/token" in result.output  # 48 layers x top-8 x uint8
    assert "engine EP size │ 4" in result.output
    assert "weight sync    │ nccl (vLLM 0.22.1 native nccl weight transfer; the trainer  │" in result.output
    assert "│ image carries vLLM 0.22.1)" in result.output  # the table wraps the cell
    assert "│ model          │ hf://Qwen/Qwen3-30B-A3B fetched once by Job" in result.output


def test_explain_names_the_model_cache_claim_and_the_credentials_secret() -> None:
    from r3operator.api.load import parse_rljob
    from r3operator.cli.sources_view import model_summary

    doc = yaml.safe_load((ROOT / "examples" / "qwen3-30b-a3b-r3-fsdp.yaml").read_text())
    doc["spec"]["model"] |= {
        "uri": "s3://models/qwen3",
        "revision": None,
        "s3": {"credentialsSecret": "store"},
        "cache": {"claimName": "team-models"},
    }
    assert model_summary(parse_rljob(doc)) == (
        "s3://models/qwen3 fetched once by Job qwen3-30b-a3b-r3-model-fetch into claim team-models, read-only at "
        "/mnt/model/s3/models/qwen3 in every engine and trainer pod; AWS credentials from Secret store"
    )


def test_crd_command_matches_committed_file() -> None:
    result = runner.invoke(app, ["crd"])
    assert result.exit_code == 0
    assert result.stdout == (ROOT / "crds" / "rljob.yaml").read_text()


def test_console_script_runs_without_traceback(tmp_path: Path) -> None:
    """The installed entry point, as a user runs it."""
    bad = _write(tmp_path, "bad.yaml", "kind: [\n")
    exe = Path(sys.executable).with_name("r3operator")
    proc = subprocess.run([str(exe), "validate", str(bad)], capture_output=True, text=True, check=False)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


def test_rules_markdown_is_committed() -> None:
    result = runner.invoke(app, ["rules", "--markdown"])
    assert result.exit_code == 0
    assert result.stdout == (ROOT / "docs" / "rules.md").read_text(), "docs/rules.md is stale"


# --- duplicate keys, multi-document explain, -o json|yaml, --version ----------------------------------------

LOCAL = ROOT / "examples" / "rljob-local.yaml"  # R3
QWEN = ROOT / "examples" / "qwen3-30b-a3b-r3-fsdp.yaml"


@pytest.mark.parametrize("command", ["validate", "explain", "render"])
def test_two_manifests_pasted_without_a_separator_exit_2_naming_the_duplicate_key(tmp_path: Path, command: str) -> None:
    pasted = _write(tmp_path, "pasted.yaml", LOCAL.read_text() + QWEN.read_text())
    result = runner.invoke(app, [command, str(pasted)])
    assert result.exit_code == 2, result.output
    assert "duplicate key 'apiVersion'" in result.stderr and result.stdout == ""


def test_a_duplicate_key_deep_in_the_spec_is_refused_too(tmp_path: Path) -> None:
    text = LOCAL.read_text().replace("\nspec:\n", "\nspec:\n  seed: 1\n  seed: 2\n", 1)
    result = runner.invoke(app, ["validate", str(_write(tmp_path, "seed.yaml", text))])
    assert result.exit_code == 2 and "duplicate key 'seed'" in result.stderr


def test_explain_takes_a_multi_document_file(tmp_path: Path) -> None:
    both = _write(tmp_path, "both.yaml", LOCAL.read_text() + "---\n" + QWEN.read_text())
    result = runner.invoke(app, ["explain", str(both)], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "RLJob tiny-count-r3: resolved plan" in result.output
    assert "RLJob qwen3-30b-a3b-r3: resolved plan" in result.output


@pytest.mark.parametrize("fmt", ["json", "yaml"])
def test_explain_prints_machine_readable_plans(tmp_path: Path, fmt: str) -> None:
    both = _write(tmp_path, "both.yaml", LOCAL.read_text() + "---\n" + QWEN.read_text())
    result = runner.invoke(app, ["explain", "-o", fmt, str(both)])
    assert result.exit_code == 0, result.output
    plans = json.loads(result.stdout) if fmt == "json" else yaml.safe_load(result.stdout)
    assert [p["name"] for p in plans] == ["tiny-count-r3", "qwen3-30b-a3b-r3"]
    qwen = plans[1]
    assert qwen["vllmVersion"] == {"version": "0.22.1", "source": "image-tag"}
    assert qwen["replay"]["routingBytesPerToken"] == 384 and qwen["engines"]["expertParallelSize"] == 4
    assert qwen["findings"] == []


def _r2(tmp_path: Path) -> Path:
    manifest = yaml.safe_load(QWEN.read_text())
    manifest["spec"]["routingReplay"]["mode"] = "R2"
    return _write(tmp_path, "r2.yaml", yaml.safe_dump(manifest))


def test_explain_shows_routed_experts_gates_only_when_replay_captures_routes(tmp_path: Path) -> None:
    r3 = runner.invoke(app, ["explain", str(QWEN)], terminal_width=300)
    r2 = runner.invoke(app, ["explain", str(_r2(tmp_path))], terminal_width=300)
    assert r3.exit_code == 0 and r2.exit_code == 0, r2.output
    assert "routed-experts-return=yes" in r3.output
    assert "routed-experts" not in r2.output and "vLLM features" not in r2.output
    [plan] = json.loads(runner.invoke(app, ["explain", "-o", "json", str(_r2(tmp_path))]).stdout)
    assert plan["replay"] == {"mode": "R2", "path": plan["replay"]["path"]}


def test_explain_exit_code_is_1_when_a_rule_fails(tmp_path: Path) -> None:
    manifest = base_manifest()
    CASES["EXTRA-ARGS-DERIVED"][1](manifest)
    result = runner.invoke(app, ["explain", "-o", "json", str(_write(tmp_path, "bad.yaml", yaml.safe_dump(manifest)))])
    assert result.exit_code == 1
    [plan] = json.loads(result.stdout)
    assert [f["rule"] for f in plan["findings"] if f["severity"] == "error"] == ["EXTRA-ARGS-DERIVED"]


@pytest.mark.parametrize("fmt", ["json", "yaml"])
def test_rules_machine_readable(fmt: str) -> None:
    from r3operator.api.rules import RULES

    result = runner.invoke(app, ["rules", "-o", fmt])
    assert result.exit_code == 0
    rows = json.loads(result.stdout) if fmt == "json" else yaml.safe_load(result.stdout)
    assert [r["id"] for r in rows] == [r.id for r in RULES]
    derived = next(r for r in rows if r["id"] == "EXTRA-ARGS-DERIVED")
    assert derived["severity"] == "error" and derived["enforcedBy"] == ["operator", "CEL"]


def test_version_flag_prints_the_package_version() -> None:
    from r3operator import __version__

    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout == f"r3operator {__version__}\n"


def test_validate_yaml_rows(tmp_path: Path) -> None:
    manifest = base_manifest()
    CASES["EXTRA-ARGS-DERIVED"][1](manifest)
    result = runner.invoke(app, ["validate", "-o", "yaml", str(_write(tmp_path, "j.yaml", yaml.safe_dump(manifest)))])
    assert result.exit_code == 1 and yaml.safe_load(result.stdout)[0]["rule"] == "EXTRA-ARGS-DERIVED"


def _as_kubectl_prints_it() -> dict:
    """The Qwen3 example as `kubectl get rlj NAME -o yaml` prints it: server fields, status, managedFields."""
    doc = yaml.safe_load(QWEN.read_text())
    managed = [{"manager": "kubectl", "operation": "Apply", "fieldsType": "FieldsV1"}]
    doc["metadata"].update(uid="3f1c", resourceVersion="123", generation=2, managedFields=managed)
    ready = {"type": "Ready", "status": "False", "reason": "X", "lastTransitionTime": "2026-11-26T06:00:00Z"}
    doc["status"] = {"observedGeneration": 2, "conditions": [ready]}
    return doc


@pytest.mark.parametrize("command", ["validate", "explain", "render"])
def test_a_dash_reads_a_piped_object_or_list_from_standard_input(command: str) -> None:
    # kubectl get rlj qwen3-30b-a3b-r3 -o yaml | r3operator explain -
    one = yaml.safe_dump(_as_kubectl_prints_it())
    result = runner.invoke(app, [command, "-"], input=one, terminal_width=200)
    assert result.exit_code == 0, result.output
    direct = runner.invoke(app, [command, str(QWEN)], terminal_width=200)
    if command == "validate":
        assert result.stdout == direct.stdout.replace(str(QWEN), "<stdin>")
    elif command == "render":  # the live object has a uid, so ownerReferences: the same objects and specs

        def objects(text: str) -> list[tuple[str, str, object]]:
            return [(d["kind"], d["metadata"]["name"], d.get("spec")) for d in yaml.safe_load_all(text) if d]

        assert objects(result.stdout) == objects(direct.stdout)
    else:
        assert result.stdout == direct.stdout
    # kubectl get rlj -o yaml (no name) prints a List of them.
    listed = yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": [_as_kubectl_prints_it()]})
    assert runner.invoke(app, [command, "-"], input=listed, terminal_width=200).stdout == result.stdout


def test_a_dash_with_nothing_piped_is_exit_2_naming_stdin() -> None:
    result = runner.invoke(app, ["validate", "-"], input="")
    assert result.exit_code == 2 and "<stdin>" in result.stderr and "no YAML documents" in result.stderr
