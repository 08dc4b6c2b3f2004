"""Step progress: a rich live table on a terminal; one plain line per step in a non-TTY log (CI).

Rich's `Live` cannot refresh in place without a terminal and squeezes a wide table into 80 columns, so
a CI log gets a header line and then one self-describing line per step instead.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from r3operator.runtime.step_record import StepRecord

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


def _eval_reward(row: StepRecord) -> str:
    """The held-out eval reward of a step that evaluated (spec.evaluation), else ""."""
    return "" if row.eval_reward is None else f"{float(row.eval_reward):.3f}"


def _eval(row: StepRecord) -> str:
    reward = _eval_reward(row)
    return f"eval reward {reward}  " if reward else ""


ETA_WINDOW = 10
"""Steps whose mean time the ETA extrapolates: recent enough to follow a run that speeds up or slows down, long enough
to spread an evaluation step's extra time."""


def trained_tokens_per_second(row: StepRecord) -> float:
    """Tokens the trainer read this step (prompts and responses) over the step's seconds: verl's throughput figure."""
    return (row.tokens + row.prompt_tokens) / row.step_seconds if row.step_seconds > 0 else 0.0


def eta_seconds(rows: list[StepRecord], total_steps: int) -> float | None:
    """Seconds until step `total_steps`, at the mean time of the last `ETA_WINDOW` steps (None before a step)."""
    if not rows:
        return None
    recent = [r.step_seconds for r in rows[-ETA_WINDOW:]]
    return max(total_steps - rows[-1].step, 0) * sum(recent) / len(recent)


def duration(seconds: float) -> str:
    """`45s`, `12m03s`, `1h02m`: a countdown a person reads at a glance."""
    whole = round(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


def _eta(eta: float | None) -> str:
    return "" if eta is None else f"  ETA {duration(eta)}"


def step_line(row: StepRecord, total_steps: int, eta: float | None = None) -> str:
    """One plain-text progress line (the non-TTY form), every field named; `eta`: seconds left (`eta_seconds`)."""
    times = " ".join(f"{label} {row.phase_seconds.get(key, 0.0):.2f}s" for key, label in PHASES)
    if row.phase_seconds.get("eval") is not None:
        times += f" eval {float(row.phase_seconds['eval']):.2f}s"
    if row.skipped:
        return (
            f"step {row.step}/{total_steps}  SKIPPED: no usable samples ({row.samples_dropped} of "
            f"{row.samples} dropped), no update  reward {row.reward_mean:.3f}  {_eval(row)}"
            f"step {row.step_seconds:.2f}s{_eta(eta)}"
        )
    if row.nonfinite_updates:
        times += f"  NON-FINITE: {row.nonfinite_updates} update(s) not applied"
    return (
        f"step {row.step}/{total_steps}  reward {row.reward_mean:.3f}  {_eval(row)}"
        f"|dlogprob| mean {_num(row.logprob_abs_diff_mean)} max {_num(row.logprob_abs_diff_max)}  "
        f"routing natural {_pct(row.routing_natural_agreement)} replay {_pct(row.replay_applied)}  "
        f"canary {'ok' if row.canary_ok else '-'}  {times}  step {row.step_seconds:.2f}s  "
        f"tok/s {trained_tokens_per_second(row):,.0f}{_eta(eta)}"
    )


class StepTable:
    def __init__(self, title: str, *, total_steps: int, enabled: bool = True, console: Console | None = None) -> None:
        self.title = title
        self.total_steps = total_steps
        self.enabled = enabled
        self.console = console or Console()
        self.live_mode = self.console.is_terminal
        self.rows: list[StepRecord] = []
        self._live: Live | None = None

    def _table(self) -> Table:
        done = f"{self.rows[-1].step}/{self.total_steps}" if self.rows else f"0/{self.total_steps}"
        table = Table(title=f"{self.title}  (step {done}{_eta(eta_seconds(self.rows, self.total_steps))})")
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
            "tok/s",
        ):
            table.add_column(col, justify="right", no_wrap=True)
        for r in self.rows[-25:]:
            table.add_row(
                str(r.step),
                f"{r.reward_mean:.3f}",
                *([_eval_reward(r)] if evaluated else []),
                _num(r.logprob_abs_diff_mean),
                _pct(r.routing_natural_agreement),
                _pct(r.replay_applied),
                "skipped" if r.skipped else "ok" if r.canary_ok else "-",
                *[f"{r.phase_seconds.get(key, 0.0):.2f}" for key, _ in PHASES],
                f"{r.step_seconds:.2f}",
                f"{trained_tokens_per_second(r):,.0f}",
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

    def add(self, row: StepRecord) -> None:
        self.rows.append(row)
        if self._live is not None:
            self._live.update(self._table())
        elif self.enabled:
            line = step_line(row, self.total_steps, eta_seconds(self.rows, self.total_steps))
            self.console.print(line, markup=False, highlight=False, soft_wrap=True)

    def note(self, message: str) -> None:
        if self.enabled:
            self.console.print(message, markup=False, highlight=False, soft_wrap=True)

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(None, None, None)
            self._live = None
