"""EXTRA-ARGS-DERIVED sees every spelling of a derived flag that vLLM's own parser accepts.

The oracle is the installed vLLM's `vllm serve` parser (FlexibleArgumentParser: underscores, dotted JSON
fields, argparse prefixes, short options), with its type conversions and choices switched off so that any
value parses and only the SPELLING decides which argument an input sets.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest

from r3operator.api import vllm_cli
from r3operator.api.checks import DERIVED_VLLM_DESTS, DERIVED_VLLM_PATTERN

REPO = Path(__file__).resolve().parents[2]
DERIVED = re.compile(DERIVED_VLLM_PATTERN)
UNSET = object()

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM installed")


def _generator() -> Any:
    spec = importlib.util.spec_from_file_location("gen_vllm_cli_table", REPO / "scripts" / "gen-vllm-cli-table.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def vllm_parser() -> argparse.ArgumentParser:
    return _generator().serve_parser()


@pytest.fixture(scope="module")
def oracle(vllm_parser: argparse.ArgumentParser) -> Any:
    for action in vllm_parser._actions:
        action.type, action.choices, action.default = None, None, UNSET

    def sets(argv: list[str]) -> set[str] | None:
        """The dests vLLM sets from `argv` after the model, or None when it refuses the command line."""
        try:
            namespace = vllm_parser.parse_args(["model", *argv])
        except (SystemExit, Exception):
            return None
        return {k for k, v in vars(namespace).items() if v is not UNSET and k != "model_tag"}

    return sets


def test_the_checked_in_table_is_the_installed_vllms(vllm_parser: argparse.ArgumentParser) -> None:
    import vllm

    version = vllm.__version__.split("+")[0]
    path = REPO / "r3operator/api/vllm_cli_tables" / f"v{version.replace('.', '_')}.py"
    assert path.read_text() == _generator().render(version, vllm_parser), "run scripts/gen-vllm-cli-table.py"
    assert version in {t.vllm_version for t in vllm_cli.tables()}


def test_every_derived_dest_is_a_vllm_argument() -> None:
    for table in vllm_cli.tables():
        assert set(DERIVED_VLLM_DESTS) <= set(table.options.values()), table.vllm_version


def _spellings(option: str) -> set[str]:
    out = {option, f"{option}=1", f"{option}.field=1"}
    if option.startswith("--"):
        name = option[2:]
        out |= {"--" + name.replace("-", "_"), f"--{name.replace('-', '_')}=1"}
        out |= {f"--{name[:end]}" for end in range(1, len(name))}
        out |= {f"--{name[:end].replace('-', '_')}=1" for end in range(1, len(name))}
    else:
        out |= {f"{option}4", f"{option}x"} | {option[:end] for end in range(2, len(option))}
    return out


def _argv(spelling: str) -> list[str]:
    return [spelling] if "=" in spelling else [spelling, "1"]


def test_every_spelling_vllm_accepts_for_a_derived_flag_is_refused(oracle: Any) -> None:
    table = next(t for t in vllm_cli.tables() if t.vllm_version == _installed())
    checked = 0
    for option, dest in table.options.items():
        if dest not in DERIVED_VLLM_DESTS:
            continue
        for spelling in _spellings(option):
            for argv in (_argv(spelling), [spelling]):
                dests = oracle(argv)
                if dests and dests & set(DERIVED_VLLM_DESTS):
                    checked += 1
                    assert DERIVED.match(spelling), (spelling, dests)
    assert checked > 500  # prefixes, underscores, =value, dotted fields, short and glued forms


def test_no_spelling_of_another_flag_is_refused(oracle: Any) -> None:
    table = next(t for t in vllm_cli.tables() if t.vllm_version == _installed())
    # One pattern serves every pinned vLLM: a spelling that sets a derived argument in another release
    # (itself or as an abbreviation) is refused everywhere: `-dc` abbreviates 0.22.1's
    # -dcp (--decode-context-parallel-size) and is 0.30.0's --diffusion-config.
    derived_anywhere = {o for t in vllm_cli.tables() for o, d in t.options.items() if d in DERIVED_VLLM_DESTS}
    checked = 0
    for option, dest in table.options.items():
        if dest in DERIVED_VLLM_DESTS or dest == "help" or any(o.startswith(option) for o in derived_anywhere):
            continue
        for spelling in (option, f"{option}=1", "--" + option[2:].replace("-", "_") if option[1] == "-" else option):
            dests = oracle(_argv(spelling)) or oracle([spelling])
            if dests and not dests & set(DERIVED_VLLM_DESTS):
                checked += 1
                assert not DERIVED.match(spelling), (spelling, dests)
    assert checked > 300


def _installed() -> str:
    import vllm

    return str(vllm.__version__).split("+")[0]


@pytest.mark.parametrize(
    ("argument", "dest"),
    [
        ("-tp4", "tensor_parallel_size"),
        ("--served_model=x", "served_model_name"),
        ("--no-enable-return-routed-experts", "enable_return_routed_experts"),
        ("--kv-transfer-config.kv_connector=X", "kv_transfer_config"),
        ("-dpl=1", "data_parallel_size_local"),
    ],
)
def test_the_message_names_what_a_spelling_sets(argument: str, dest: str) -> None:
    assert vllm_cli.dest_of(argument) == dest
