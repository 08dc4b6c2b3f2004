"""Step progress: a rich live table on a terminal; one plain line per step in a non-TTY log (CI).

Rich's `Live` cannot refresh in place without a terminal and squeezes a wide table into 80 columns, so
a CI log gets a header line and then one self-describing line per step instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

PHASES = (
    ("rollout", "rollout"),
    ("old_logprob", "old-lp"),
    ("update", "update"),
    ("weight_sync", "sync"),
    ("canary", "canary"),
)


def _pct(value: Any) -> str:
    try:
        return f"{100 * float(value):.2f}%"
    except (TypeError, ValueError):
        return "-"


def _num(value: Any) -> str:
    """A figure, or "-" where the step had nothing to measure it on (async: no current-version token)."""
    return "-" if value is None else f"{float(value):.3g}"


def _eval_reward(row: Mapping[str, Any]) -> str:
    """The held-out eval reward of a step that evaluated (spec.evaluation), else ""."""
    value = row.get("eval_reward")
    return "" if value is None or value == "" else f"{float(value):.3f}"


def _eval(row: Mapping[str, Any]) -> str:
    reward = _eval_reward(row)
    return f"eval reward {reward}  " if reward else ""


def step_line(row: Mapping[str, Any], total_steps: int) -> str:
    """One plain-text progress line (the non-TTY form), every field named."""
    times = " ".join(f"{label} {row.get('t_' + key, 0.0):.2f}s" for key, label in PHASES)
    if row.get("t_eval") is not None:
        times += f" eval {float(row['t_eval']):.2f}s"
    if row.get("skipped"):
        return (
            f"step {row['step']}/{total_steps}  SKIPPED: no usable samples ({row.get('samples_dropped')} of "
            f"{row.get('samples')} dropped), no update  reward {row['reward_mean']:.3f}  {_eval(row)}"
            f"step {row['step_seconds']:.2f}s"
        )
    if row.get("nonfinite_updates"):
        times += f"  NON-FINITE: {row['nonfinite_updates']} update(s) not applied"
    return (
        f"step {row['step']}/{total_steps}  reward {row['reward_mean']:.3f}  {_eval(row)}"
        f"|dlogprob| mean {_num(row['logprob_abs_diff_mean'])} max {_num(row['logprob_abs_diff_max'])}  "
        f"routing natural {_pct(row.get('routing_natural_agreement'))} replay {_pct(row.get('replay_applied'))}  "
        f"canary {'ok' if row['canary_ok'] else '-'}  {times}  step {row['step_seconds']:.2f}s"
    )


class StepTable:
    def __init__(self, title: str, *, total_steps: int, enabled: bool = True, console: Console | None = None) -> None:
        self.title = title
        self.total_steps = total_steps
        self.enabled = enabled
        self.console = console or Console()
        self.live_mode = self.console.is_terminal
        self.rows: list[Mapping[str, Any]] = []
        self._live: Live | None = None

    def _table(self) -> Table:
        table = Table(title=f"{self.title}  ({len(self.rows)}/{self.total_steps} steps)")
        evaluated = any(_eval_reward(r) for r in self.rows)  # spec.evaluation: a column once a step evaluated
        for col in (
            "step",
            "reward",
            *(["eval reward"] if evaluated else []),
            "|Δlogprob|",
            "routing natural",
            "replay",
            "canary",
            *[f"{label} s" for _, label in PHASES],
            "step s",
        ):
            table.add_column(col, justify="right", no_wrap=True)
        for r in self.rows[-25:]:
            table.add_row(
                str(r["step"]),
                f"{r['reward_mean']:.3f}",
                *([_eval_reward(r)] if evaluated else []),
                _num(r["logprob_abs_diff_mean"]),
                _pct(r.get("routing_natural_agreement")),
                _pct(r.get("replay_applied")),
                "skipped" if r.get("skipped") else "ok" if r["canary_ok"] else "-",
                *[f"{r.get('t_' + key, 0.0):.2f}" for key, _ in PHASES],
                f"{r['step_seconds']:.2f}",
            )
        return table

    def __enter__(self) -> StepTable:
        if not self.enabled:
            return self
        if self.live_mode:
            self._live = Live(self._table(), console=self.console, refresh_per_second=4, transient=False)
            self._live.__enter__()
        else:
            self.console.print(f"{self.title}: {self.total_steps} steps", markup=False, highlight=False)
        return self

    def add(self, row: Mapping[str, Any]) -> None:
        self.rows.append(row)
        if self._live is not None:
            self._live.update(self._table())
        elif self.enabled:
            self.console.print(step_line(row, self.total_steps), markup=False, highlight=False, soft_wrap=True)

    def note(self, message: str) -> None:
        if self.enabled:
            self.console.print(message, markup=False, highlight=False, soft_wrap=True)

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(None, None, None)
            self._live = None
