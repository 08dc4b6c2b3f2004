"""r3operator/settings.py: one prefix, one reader of the environment, and the variables the operator sets
on pods are the ones the runtime reads."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from r3operator.api.load import load_rljob
from r3operator.operator.desired import desired
from r3operator.settings import (
    ENV_PREFIX,
    OperatorSettings,
    RuntimeSettings,
    SettingsError,
    operator_settings,
    runtime_settings,
    unknown_variables,
)

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "r3operator"
EXAMPLE = REPO / "examples" / "qwen3-30b-a3b-r3-fsdp.yaml"
# Variables other programs define; reading them is part of talking to those programs.
FOREIGN = {"KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"}
# torch.distributed's launch contract, read where the process group is set up.
DISTRIBUTED = {"WORLD_SIZE", "LOCAL_RANK"}


def test_every_variable_has_the_one_prefix_and_belongs_to_one_group() -> None:
    operator, runtime = OperatorSettings.env_names(), RuntimeSettings.env_names()
    assert all(n.startswith(ENV_PREFIX) for n in operator + runtime if n not in FOREIGN)
    assert not set(operator) & set(runtime)
    assert OperatorSettings.env_name("resync_seconds") == "R3OPERATOR_RESYNC_SECONDS"
    assert RuntimeSettings.env_name("steps") == "R3OPERATOR_STEPS"


def _environment_reads(path: Path) -> list[tuple[int, str]]:
    """(line, key) of every read of os.environ / os.getenv in a file; key '?' when not a literal."""
    reads = []

    def key(node: ast.expr) -> str:
        return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else "?"

    def is_environ(node: ast.expr) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "environ"

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            if (is_environ(node.func.value) and node.func.attr == "get") or node.func.attr == "getenv":
                reads.append((node.lineno, key(node.args[0])))
        elif isinstance(node, ast.Subscript) and is_environ(node.value) and isinstance(node.ctx, ast.Load):
            reads.append((node.lineno, key(node.slice)))
        elif isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
            reads.append((node.lineno, key(node.left)))
    return reads


def test_only_the_settings_module_reads_the_environment() -> None:
    found = [
        f"{path.relative_to(REPO)}:{line} reads {name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != PACKAGE / "settings.py"
        for line, name in _environment_reads(path)
        if name not in DISTRIBUTED
    ]
    assert found == []


def test_the_environment_scan_sees_every_way_of_reading(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import os\n"
        "a = os.environ.get('R3OPERATOR_X')\n"
        "b = os.getenv('R3OPERATOR_Y')\n"
        "c = os.environ['R3OPERATOR_Z']\n"
        "d = 'R3OPERATOR_W' in os.environ\n"
        "os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')\n"
    )
    assert _environment_reads(probe) == [
        (2, "R3OPERATOR_X"),
        (3, "R3OPERATOR_Y"),
        (4, "R3OPERATOR_Z"),
        (5, "R3OPERATOR_W"),
    ]


def test_pods_get_only_variables_the_runtime_reads() -> None:
    children = desired(load_rljob(EXAMPLE))
    containers = [c for child in children for template in _pod_templates(child) for c in template["spec"]["containers"]]
    names = {e["name"] for c in containers for e in c.get("env", [])}
    ours = {n for n in names if n.startswith(ENV_PREFIX)}
    # The example's hf:// model is downloaded into the pods: the trainer is told where (R3OPERATOR_MODEL_DIR).
    assert ours == {"R3OPERATOR_RLJOB_NAME", "R3OPERATOR_RLJOB_NAMESPACE", "R3OPERATOR_MODEL_DIR"}
    assert ours <= set(RuntimeSettings.env_names())


def _pod_templates(child: dict) -> list[dict]:
    spec = child.get("spec", {})
    if child["kind"] == "StatefulSet":
        return [spec["template"]]
    if child["kind"] == "RayJob":
        cluster = spec["rayClusterSpec"]
        return [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    return []


def test_runtime_settings_parse_lists_and_ignore_empty_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("R3OPERATOR_ENGINE_URLS", "http://e-0:8000, http://e-1:8000,")
    monkeypatch.setenv("R3OPERATOR_STEPS", "")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    settings = runtime_settings()
    assert settings.engine_urls == ["http://e-0:8000", "http://e-1:8000"]
    assert settings.steps is None
    assert settings.in_cluster


@pytest.mark.parametrize(
    ("name", "value", "group"),
    [
        ("R3OPERATOR_RESYNC_SECONDS", "soon", operator_settings),
        ("R3OPERATOR_METRICS_PORT", "70000", operator_settings),
        ("R3OPERATOR_STEPS", "0", runtime_settings),
        ("R3OPERATOR_SYNC_CANARY_EPSILON", "-0.1", runtime_settings),
    ],
)
def test_a_refused_value_names_the_variable(monkeypatch: pytest.MonkeyPatch, name: str, value: str, group) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(SettingsError, match=f"{name}='{value}'"):
        group()


def test_operator_canary_switch_reads_common_spellings(monkeypatch: pytest.MonkeyPatch) -> None:
    for off in ("0", "false", "False", "off"):
        monkeypatch.setenv("R3OPERATOR_CANARY", off)
        assert operator_settings().canary is False
    monkeypatch.delenv("R3OPERATOR_CANARY")
    assert operator_settings().canary is True


def test_unknown_variables_with_the_prefix_are_reported() -> None:
    environ = {"R3OPERATOR_STEP": "3", "R3OPERATOR_STEPS": "3", "R3OPERATOR_METRICS_PORT": "0", "HOME": "/root"}
    assert unknown_variables(environ) == ["R3OPERATOR_STEP"]
