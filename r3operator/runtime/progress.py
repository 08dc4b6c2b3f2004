"""Rich live table: one row per step (reward, |Δlogprob|, routing agreement, phase times)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

PHASES = ("rollout", "old_logprob", "update", "weight_sync", "canary", "checkpoint")


class StepTable:
    def __init__(self, title: str, *, total_steps: int, enabled: bool = True, console: Console | None = None) -> None:
        self.title = title
        self.total_steps = total_steps
        self.enabled = enabled
        self.console = console or Console()
        self.rows: list[Mapping[str, Any]] = []
        self._live: Live | None = None

    def _table(self) -> Table:
        table = Table(title=f"{self.title}  ({len(self.rows)}/{self.total_steps} steps)")
        for col in ("step", "reward", "|Δlogprob|", "routing agr.", "canary", *[f"t_{p}" for p in PHASES], "step s"):
            table.add_column(col, justify="right")
        for r in self.rows[-25:]:
            table.add_row(
                str(r["step"]), f"{r['reward_mean']:.3f}", f"{r['logprob_abs_diff_mean']:.3g}",
                f"{r['routing_agreement']:.4f}", "ok" if r["canary_ok"] else "-",
                *[f"{r.get('t_' + p, 0.0):.2f}" for p in PHASES], f"{r['step_seconds']:.2f}",
            )  # fmt: skip
        return table

    def __enter__(self) -> StepTable:
        if self.enabled:
            self._live = Live(self._table(), console=self.console, refresh_per_second=4, transient=False)
            self._live.__enter__()
        return self

    def add(self, row: Mapping[str, Any]) -> None:
        self.rows.append(row)
        if self._live is not None:
            self._live.update(self._table())

    def note(self, message: str) -> None:
        if self.enabled:
            self.console.print(message)

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(None, None, None)
            self._live = None
