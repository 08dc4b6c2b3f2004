"""Every spelling under which `vllm serve` accepts a flag, from the checked-in tables of vLLM's own parser.

vLLM parses its command line with argparse behind `FlexibleArgumentParser`, which accepts, for one flag:
the long option and its short alias (`--tensor-parallel-size`, `-tp`); underscores for dashes in a long
option's name (`--tensor_parallel_size`); a value after `=` or in the next argument; a JSON field after a
dot (`--speculative-config.method=ngram`); the `--no-` form of a boolean; any unambiguous prefix of a long
option (argparse's `allow_abbrev`: `--served-model`), and of a short one (`-t` for `-tp`); and a value
glued to a short option (`-tp4`).

`derived_pattern` turns that into ONE regular expression over a single argument, in the RE2 subset that
both Python's `re` and Kubernetes CEL's `matches()` run identically, so the Python rule and the CRD's CEL
rule give the same verdict on every input. It is built from the option tables of every pinned vLLM
version (the union: an argument refused under any of them is refused).
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cache

from r3operator.api import vllm_cli_tables


@dataclass(frozen=True)
class OptionTable:
    vllm_version: str
    allow_abbrev: bool
    options: Mapping[str, str]  # option string -> argparse dest


@cache
def tables() -> tuple[OptionTable, ...]:
    found = []
    for info in sorted(pkgutil.iter_modules(vllm_cli_tables.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{vllm_cli_tables.__name__}.{info.name}")
        found.append(OptionTable(module.VLLM_VERSION, module.ALLOW_ABBREV, dict(module.OPTIONS)))
    if not found:
        raise RuntimeError("r3operator/api/vllm_cli_tables has no table: run scripts/gen-vllm-cli-table.py")
    return tuple(found)


def _long_keys(table: OptionTable, dests: frozenset[str]) -> set[str]:
    """Names (after `--`, dashes only) that argparse resolves to one of `dests`: exact, or a prefix whose
    every completion is one of `dests` (a prefix shared with any other flag is ambiguous or that flag's)."""
    names = {s[2:]: d for s, d in table.options.items() if s.startswith("--")}
    keys = {n for n, d in names.items() if d in dests}
    if table.allow_abbrev:
        for name in [n for n in names if names[n] in dests]:
            for end in range(1, len(name)):
                prefix = name[:end]
                completions = {names[n] for n in names if n.startswith(prefix)}
                if prefix not in names and completions <= dests:
                    keys.add(prefix)
    return keys


def _short_patterns(table: OptionTable, dests: frozenset[str]) -> set[str]:
    shorts = {s: d for s, d in table.options.items() if s.startswith("-") and not s.startswith("--")}
    patterns: set[str] = set()
    for short, dest in shorts.items():
        if dest not in dests:
            continue
        # `-tp`, `-tp=4`, and `-tp4` unless the next character continues into another short option.
        following = sorted({o[len(short)] for o in shorts if o != short and o.startswith(short)} | {"="})
        glued = "[^" + "".join(re.escape(c) for c in following) + "].*"
        patterns.add(f"{re.escape(short)}(?:=.*|{glued})?")
        if table.allow_abbrev:
            for end in range(2, len(short)):
                prefix = short[:end]
                completions = {d for o, d in shorts.items() if o.startswith(prefix)}
                if prefix not in shorts and completions <= dests:
                    patterns.add(f"{re.escape(prefix)}(?:=.*)?")
    return patterns


_Trie = dict[str, "_Trie"]


def _trie_regex(words: Iterable[str]) -> str:
    """A compact alternation of `words` (a trie), each `-` matching `-` or `_`."""
    trie: _Trie = {}
    for word in words:
        node = trie
        for char in word:
            node = node.setdefault(char, {})
        node[""] = {}

    def emit(node: _Trie) -> str:
        ends = "" in node
        branches = [
            "[-_]" + emit(child) if char == "-" else re.escape(char) + emit(child)
            for char, child in sorted(node.items())
            if char
        ]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        if ends:
            return f"(?:{body})?"
        return body

    return emit(trie)


def derived_pattern(dests: Iterable[str], options: Iterable[OptionTable] | None = None) -> str:
    """An anchored regex matching every single argument that sets one of `dests` (argparse dest names)."""
    wanted = frozenset(dests)
    long_keys: set[str] = set()
    shorts: set[str] = set()
    for table in options if options is not None else tables():
        long_keys |= _long_keys(table, wanted)
        shorts |= _short_patterns(table, wanted)
    alternatives = [f"--{_trie_regex(long_keys)}(?:[.=].*)?", *sorted(shorts)]
    return "^(?:" + "|".join(alternatives) + ")$"


def dest_of(argument: str, options: Iterable[OptionTable] | None = None) -> str | None:
    """The argparse dest an argument sets in the first table where it names one flag (for messages)."""
    for table in options if options is not None else tables():
        if argument.startswith("--"):
            key = argument.split("=", 1)[0].split(".", 1)[0].replace("_", "-")
        else:
            key = argument.split("=", 1)[0]
        if key in table.options:
            return table.options[key]
        hits = {d for o, d in table.options.items() if o.startswith(key) and o[:2].count("-") == key[:2].count("-")}
        if len(hits) == 1:
            return hits.pop()
        glued = [o for o in table.options if not o.startswith("--") and key.startswith(o)]
        if glued:
            return table.options[max(glued, key=len)]
    return None
