"""`vllm serve` flags (`spec.inference.extraArgs`) as keyword arguments of an in-process `vllm.LLM`.

A local run's engines are `vllm.LLM` objects, not `vllm serve` processes, so the job's engine flags are read
by vLLM's own engine-argument parser: every flag means here what it means on an engine pod. Only the flags the
user wrote are returned (not the parser's defaults), so the run's own defaults stay where no flag is given.
"""

from __future__ import annotations

import argparse
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

_NOT_GIVEN = object()


@dataclass(frozen=True)
class EngineFlags:
    """What `engine_flag_kwargs` made of a list of flags."""

    kwargs: dict[str, Any] = field(default_factory=dict)
    """The `vllm.LLM` keyword arguments the flags set."""
    kept: tuple[str, ...] = ()
    """Settings the flags named that the run fixes itself (its contract with the trainer): left as the run sets them."""
    serve_only: tuple[str, ...] = ()
    """Arguments of `vllm serve` alone (the HTTP server's), which an in-process engine has no use for."""


def _parser() -> argparse.ArgumentParser:
    from vllm.engine.arg_utils import EngineArgs

    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # vLLM before the utils package split
        from vllm.utils import FlexibleArgumentParser  # type: ignore[attr-defined,no-redef]
    parser: argparse.ArgumentParser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    return parser


def engine_flag_kwargs(flags: Sequence[str], *, fixed: Collection[str]) -> EngineFlags:
    """The `vllm.LLM` keyword arguments that `flags` set, parsed by vLLM's engine-argument parser.

    `fixed`: keyword arguments the run sets and a flag may not change (model, dtype, routed-expert capture, the
    worker extension...): a flag naming one is reported in `kept`, not applied. Raises `ValueError` naming the
    flag when vLLM's parser refuses a value.
    """
    parser = _parser()

    def refuse(message: str) -> NoReturn:  # argparse would print its usage and exit
        raise ValueError(f"spec.inference.extraArgs {' '.join(flags)!r}: {message}")

    parser.error = refuse  # type: ignore[method-assign]
    given = argparse.Namespace(**{action.dest: _NOT_GIVEN for action in parser._actions})
    namespace, rest = parser.parse_known_args(list(flags), namespace=given)
    kwargs: dict[str, Any] = {}
    kept: list[str] = []
    for name, value in vars(namespace).items():
        if value is _NOT_GIVEN or name == "help":
            continue
        if name in fixed:
            kept.append(name)
        else:
            kwargs[name] = value
    return EngineFlags(kwargs=kwargs, kept=tuple(sorted(kept)), serve_only=tuple(rest))
