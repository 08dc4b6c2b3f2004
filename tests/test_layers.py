"""The package's layers, checked on its own import graph and on what each layer loads.

The graph is read from the source (every ``import`` statement, function-level and TYPE_CHECKING ones
included), so an import that runs only on some path still counts. docs/contributing.md explains the layers.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "r3operator"

# Which of the package's parts each part may import (itself always). `r3operator` itself (the root
# __init__, only __version__) is below everything. Two stacks share the bottom (settings, api, routing): the
# control plane is `operator`; the data plane is grouped by where its code runs, from the bottom up:
# `routing` (numpy only: the routed experts, the rollout sample that carries them, the agreement metric and the
# routes' placement, which every data-plane part reads), `wire` (what crosses a process boundary for weight sync:
# the chunk format, the sync's typed messages, the receipt, the phase clock, shared buffers and the doorbell; and
# `retry.py`, the retry policy of every call across a process boundary, because its users -- the HTTP reward of
# `tasks`, the engine handles of `rollout`, the supervisor of `weightsync` -- share no part above `wire`),
# `engine` (inside vLLM), `tasks` and `trainer` (side by side: neither knows the other), `rollout` (the driver's
# handle on engines: generation and one transport call for the sync's messages), `weightsync` (trainer ->
# engines: it takes the trainer's tensors through the driver, never the trainer package), `runtime` (the driver
# that runs the loop). What two of them share lives below both.
MAY_IMPORT: dict[str, frozenset[str]] = {
    "r3operator": frozenset(),
    "settings": frozenset(),
    "api": frozenset({"settings"}),
    "routing": frozenset(),
    "models": frozenset({"settings"}),
    "wire": frozenset({"routing", "settings"}),
    "engine": frozenset({"api", "routing", "settings", "wire"}),
    "tasks": frozenset({"api", "models", "routing", "settings", "wire"}),
    "trainer": frozenset({"api", "models", "routing", "settings", "wire"}),
    "rollout": frozenset({"api", "engine", "models", "routing", "settings", "tasks", "wire"}),
    "weightsync": frozenset({"api", "models", "rollout", "routing", "settings", "wire"}),
    "operator": frozenset({"api", "settings"}),
    "runtime": frozenset({"api", "models", "rollout", "routing", "settings", "tasks", "trainer", "weightsync", "wire"}),
    "observability": frozenset({"api", "operator", "runtime", "settings"}),
    "cli": frozenset({"api", "models", "observability", "operator", "routing", "runtime", "settings"}),
    "__main__": frozenset({"cli"}),
}


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules_under(root: Path) -> dict[str, Path]:
    """Module name → file for every module of the `r3operator` package under `root`."""
    return {_module_name(p, root): p for p in sorted((root / "r3operator").rglob("*.py"))}


@cache
def _package_modules() -> dict[str, Path]:
    return modules_under(PACKAGE.parent)


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module an import names: `pkg.mod.Class` → `pkg.mod`, `pkg.mod` → `pkg.mod`."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in modules:
            return ".".join(parts)
        parts.pop()
    return None


def _imported_names(node: ast.AST, module: str, is_package: bool) -> Iterator[str]:
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            origin = ".".join([*base, *([node.module] if node.module else [])])
        else:
            origin = node.module or ""
        yield from (f"{origin}.{alias.name}" for alias in node.names)


def import_edges(modules: dict[str, Path]) -> list[Edge]:
    """Every import of one of `modules` by another, with its line."""
    edges = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            for name in _imported_names(node, module, path.name == "__init__.py"):
                target = _resolve(name, modules)
                if target is not None and target != module:
                    edges.append(Edge(module, target, node.lineno))
    return edges


def part_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def allowed(source: str, target: str) -> bool:
    src, dst = part_of(source), part_of(target)
    return src == dst or dst == "r3operator" or dst in MAY_IMPORT[src]


def layer_violations(edges: list[Edge]) -> list[str]:
    def may(part: str) -> str:
        return ", ".join(sorted(MAY_IMPORT[part])) or "nothing of ours"

    return [
        f"{e.source} (line {e.line}) imports {e.target}; {part_of(e.source)} may import {may(part_of(e.source))}"
        for e in edges
        if not allowed(e.source, e.target)
    ]


def cycles(edges: list[Edge]) -> list[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.source, set()).add(e.target)
        graph.setdefault(e.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(frozenset(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_every_part_of_the_package_is_placed_in_a_layer() -> None:
    assert {part_of(m) for m in _package_modules()} == set(MAY_IMPORT)


def test_imports_between_parts_follow_the_layers() -> None:
    violations = layer_violations(import_edges(_package_modules()))
    assert violations == [], "\n".join(violations)


def test_only_the_command_line_and_observability_import_the_runtime() -> None:
    edges = import_edges(_package_modules())
    importers = {part_of(e.source) for e in edges if part_of(e.target) == "runtime"} - {"runtime"}
    assert importers <= {"cli", "observability"}


# Inside the control plane: the manifest builders are pure and below the controller's logic (reconcile, upgrade,
# status, ...), which renders through them; a builder imports only other builders and these.
BUILDERS_MAY_IMPORT = frozenset({"r3operator.operator.meta", "r3operator.operator.hashing"})


def builder_violations(edges: list[Edge]) -> list[str]:
    builders = "r3operator.operator.builders"
    return [
        f"{e.source} (line {e.line}) imports {e.target}: a builder imports only builders, meta and hashing"
        for e in edges
        if e.source.startswith(builders)
        and e.target.startswith("r3operator.operator.")
        and not e.target.startswith(builders)
        and e.target not in BUILDERS_MAY_IMPORT
    ]


def test_the_operators_builders_import_no_controller_module() -> None:
    violations = builder_violations(import_edges(_package_modules()))
    assert violations == [], "\n".join(violations)


def test_the_layers_form_no_cycle_and_settings_and_routing_import_nothing_of_ours() -> None:
    edges = [Edge(src, dst, 0) for src, targets in MAY_IMPORT.items() for dst in targets]
    assert cycles(edges) == []
    assert MAY_IMPORT["settings"] == MAY_IMPORT["routing"] == frozenset()
    assert MAY_IMPORT["api"] == frozenset({"settings"})


def test_the_package_has_no_import_cycle() -> None:
    found = [" <-> ".join(sorted(c)) for c in cycles(import_edges(_package_modules()))]
    assert found == [], "import cycles:\n" + "\n".join(found)


# The weight-sync layout's walk on the data plane (docs/architecture.md): chosen in the API (`resolve_layout`, `auto`
# resolved), made the bracket every engine opens by the session, read by the sender alone on the way, and branched
# on by the worker. The layers between them (the installs, the fan-out, the endpoints, the engine handles) carry the
# typed message and never name the layout: a module that starts to is a new stop on the walk, said here first.
LAYOUT_NAMES = frozenset({"BracketLayout", "WeightSyncLayout", "LayoutChoice", "resolve_layout", "choose_layout"})
LAYOUT_WALK = frozenset(
    {
        "r3operator.weightsync.session",
        "r3operator.weightsync.transfer",
        "r3operator.wire.sync_messages",
        "r3operator.engine.worker",
    }
)


def modules_naming(names: frozenset[str], modules: dict[str, Path]) -> set[str]:
    """The modules whose code names one of `names` (an identifier or an attribute), wherever it is."""
    found = set()
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            named = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
            imported = {a.name for a in node.names} if isinstance(node, ast.ImportFrom | ast.Import) else set()
            if named in names or imported & names:
                found.add(module)
                break
    return found


def test_the_layout_walks_from_the_api_to_the_worker_through_the_session_and_the_sender_alone() -> None:
    data_plane = {m for m in modules_naming(LAYOUT_NAMES, _package_modules()) if part_of(m) not in {"api", "operator"}}
    assert data_plane == LAYOUT_WALK, f"the layout is named outside its walk: {sorted(data_plane - LAYOUT_WALK)}"


def test_the_checks_catch_an_upward_import_and_a_cycle(tmp_path: Path) -> None:
    routing = tmp_path / "r3operator" / "routing"
    routing.mkdir(parents=True)
    (tmp_path / "r3operator" / "__init__.py").write_text("")
    (routing / "__init__.py").write_text("")
    (routing / "a.py").write_text("from r3operator.routing import b\n")
    (routing / "b.py").write_text("def f():\n    from . import a\n    from r3operator.runtime import loop\n")
    (tmp_path / "r3operator" / "runtime").mkdir()
    (tmp_path / "r3operator" / "runtime" / "__init__.py").write_text("")
    (tmp_path / "r3operator" / "runtime" / "loop.py").write_text("")
    edges = import_edges(modules_under(tmp_path))
    assert cycles(edges) == [frozenset({"r3operator.routing.a", "r3operator.routing.b"})]
    assert layer_violations(edges) == [
        "r3operator.routing.b (line 3) imports r3operator.runtime.loop; routing may import nothing of ours"
    ]
    assert allowed("r3operator.operator.builders.engine", "r3operator.api.vllm_args")
    assert not allowed("r3operator.operator.builders.engine", "r3operator.engine.llm")


HEAVY = ("torch", "vllm", "ray", "megatron", "transformers", "kopf", "kubernetes")

# module -> heavy libraries importing it may load (the operator image has no torch, vLLM or Ray)
MAY_LOAD: dict[str, set[str]] = {
    "r3operator.api": set(),
    "r3operator.settings": set(),
    "r3operator.routing": set(),
    "r3operator.cli.main": set(),
    "r3operator.operator.desired": set(),
    # kopf imports the kubernetes client for type checks whenever it is installed (thirdparty.py);
    # the operator's own calls go through operator/kube.py.
    "r3operator.operator.handlers": {"kopf", "kubernetes"},
    "r3operator.api.vllm_args": set(),
    # what the data plane's processes exchange loads no framework: the driver, a reward server or a test reads
    # a sample or a weight chunk's index without torch, vLLM or Ray
    "r3operator.routing.sample": set(),
    "r3operator.wire.weights": set(),
    "r3operator.wire.retry": set(),
    "r3operator.wire.receipt": set(),
    "r3operator.wire.sync_phases": set(),
    "r3operator.wire.sync_messages": set(),
    # vLLM loads the plugin's module to find `register`; vLLM itself is imported inside it, on call
    "r3operator.engine.plugin": set(),
    "r3operator.tasks.source": set(),
    "r3operator.rollout.client": set(),
}


def _loaded_heavy(module: str) -> set[str]:
    code = (
        f"import importlib, json, sys; importlib.import_module({module!r}); "
        f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & set({list(HEAVY)!r}))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("module", sorted(MAY_LOAD))
def test_layer_loads_only_the_libraries_it_may(module: str) -> None:
    assert _loaded_heavy(module) <= MAY_LOAD[module]
