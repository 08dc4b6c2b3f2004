"""Run an :class:`UpPlan`: engine processes, their /health, the trainer; restarts and a clean shutdown.

Each child runs in its own session (process group), so a signal reaches the whole tree a container would
hold (``vllm serve`` forks its engine core); on Linux each also gets SIGTERM if this process dies. A dead
engine is started again with the same argv and env after a back-off, as the kubelet restarts a container;
the driver waits for it and re-syncs its weights (weightsync/faults.py). The trainer's exit ends the run and
is the exit code; Ctrl-C or SIGTERM stop every child (SIGTERM, the pod's grace period, SIGKILL).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import selectors
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from r3operator.cli.up.plan import ENV_DROPPED, ProcessSpec, UpPlan

RESTART_BASE_S = 1.0
RESTART_CAP_S = 30.0
"""Back-off between restarts of a dead engine (the kubelet's starts at 10 s; a local run waits less)."""
HEALTH_TIMEOUT_S = 2.0
TAIL_LINES = 20
WAITING_REPORT_S = 60.0  # how often `up` says which engines it still waits for, and the last line each logged
PR_SET_PDEATHSIG = 1

Say = Callable[[str], None]


class UpFailed(RuntimeError):
    """Up could not bring the topology up; the message says which process and why (its log's tail)."""


class Stopped(BaseException):
    """SIGTERM to `up` itself."""


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def host_environment(environ: dict[str, str]) -> dict[str, str]:
    """What every child inherits beneath its own env: this environment minus what marks a pod."""
    return {k: v for k, v in environ.items() if k not in ENV_DROPPED}


@dataclass
class Child:
    spec: ProcessSpec
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    started_at: float = 0.0
    healthy: bool = False
    restart_at: float | None = None
    history: list[dict[str, Any]] = field(default_factory=list)

    def tail(self, lines: int = TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


class Runner:
    def __init__(
        self,
        plan: UpPlan,
        *,
        environ: dict[str, str],
        say: Say,
        echo: Callable[[bytes], None],
        max_restarts: int = 5,
        waiting_report_s: float = WAITING_REPORT_S,
    ) -> None:
        self.plan = plan
        self.waiting_report_s = waiting_report_s
        self.base_env = host_environment(environ)
        self.say = say
        self.echo = echo
        self.max_restarts = max_restarts
        self.log_dir = plan.run_dir / "logs"
        self.engines = [Child(e, self.log_dir / f"{e.name}.log") for e in plan.engines]
        self.trainer = Child(plan.trainer, self.log_dir / "trainer.log")
        self._trainer_log: IO[bytes] | None = None
        self._selector = selectors.DefaultSelector()

    # -- files -------------------------------------------------------------------------------------
    def prepare(self) -> None:
        """The run directory: logs, every volume's host directory, the ConfigMap's files."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for host in self.plan.host_dirs.values():
            Path(host).mkdir(parents=True, exist_ok=True)
        for path, text in self.plan.config_files.items():
            Path(path).write_text(text)
        if self.plan.vllm_entry_point is not None:
            from r3operator.cli.up.vllm_cli import write_entry_point

            write_entry_point(self.plan.vllm_entry_point)

    def write_manifest(self) -> None:
        data = self.plan.as_json()
        for proc in data["processes"]:
            child = self._child(proc["name"])
            proc["log"] = str(child.log_path)
            proc["starts"] = child.history
        tmp = self.plan.run_dir / ".up.json.tmp"
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        tmp.replace(self.plan.run_dir / "up.json")

    def _child(self, name: str) -> Child:
        return next(c for c in [*self.engines, self.trainer] if c.spec.name == name)

    # -- processes ---------------------------------------------------------------------------------
    def _start(self, child: Child, *, pipe: bool = False) -> None:
        child.starts += 1
        log = child.log_path.open("ab")
        log.write(
            f"==> start {child.starts} of {child.spec.name} ({child.spec.pod}) at "
            f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n".encode()
        )
        log.flush()
        child.proc = subprocess.Popen(
            child.spec.argv,
            env={**self.base_env, **child.spec.env},
            cwd=self.plan.run_dir,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if pipe else log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        if pipe:
            self._trainer_log = log
            assert child.proc.stdout is not None
            self._selector.register(child.proc.stdout.fileno(), selectors.EVENT_READ)
        else:
            log.close()
        child.started_at = time.monotonic()
        child.healthy = False
        child.restart_at = None
        child.history.append({"pid": child.proc.pid, "startedAt": time.time()})
        self.write_manifest()

    def _healthy(self, child: Child) -> bool:
        url = child.spec.health_url
        if url is None:  # a --headless worker: its leader answers /health only once every DP rank joined
            return True
        try:
            with urllib.request.urlopen(url, timeout=HEALTH_TIMEOUT_S) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def start_engines(self) -> None:
        """Start every engine and wait for all of them; an engine that exits before it is healthy fails `up`
        at once with its log's tail (a crash loop of a broken command line would only hide the cause)."""
        for child in self.engines:
            self._start(child)
            gpus = ",".join(child.spec.gpus) or "-"
            port = f"port {child.spec.port}" if child.spec.port is not None else f"no HTTP (group {child.spec.group})"
            self.say(
                f"  started {child.spec.name} ({child.spec.pod}) pid {child.proc.pid if child.proc else '?'} "
                f"{port} GPUs {gpus}  log {child.log_path}"
            )
        waiting = list(self.engines)
        report_at = time.monotonic() + self.waiting_report_s
        while waiting:
            if time.monotonic() >= report_at:  # a start that hangs (a port taken, a download) shows while it does
                report_at += self.waiting_report_s
                for child in waiting:
                    last = child.tail(1) or "(nothing logged yet)"
                    elapsed = time.monotonic() - child.started_at
                    self.say(
                        f"  still waiting for {child.spec.name} ({elapsed:.0f} s of its "
                        f"{child.spec.startup_budget_s:.0f} s): {last}"
                    )
            for child in list(waiting):
                assert child.proc is not None
                code = child.proc.poll()
                if code is not None:
                    raise UpFailed(
                        f"{child.spec.name} exited with code {code} before it was healthy; last lines of "
                        f"{child.log_path}:\n{child.tail()}"
                    )
                elapsed = time.monotonic() - child.started_at
                if self._healthy(child):
                    child.healthy = True
                    waiting.remove(child)
                    if child.spec.health_url is not None:
                        self.say(f"  {child.spec.name} healthy after {elapsed:.1f} s ({child.spec.health_url})")
                elif elapsed > child.spec.startup_budget_s:
                    raise UpFailed(
                        f"{child.spec.name} not healthy after {elapsed:.0f} s (the rendered startupProbe's "
                        f"budget); last lines of {child.log_path}:\n{child.tail()}"
                    )
            time.sleep(0.5 if waiting else 0)

    def run_trainer(self) -> int:
        """Start the trainer, relay its output, restart dead engines, until the trainer exits; its exit code."""
        self._start(self.trainer, pipe=True)
        gpus = ",".join(self.trainer.spec.gpus) or "-"
        pid = self.trainer.proc.pid if self.trainer.proc else "?"
        self.say(f"  started trainer ({self.trainer.spec.pod}) pid {pid} GPUs {gpus}  log {self.trainer.log_path}")
        assert self.trainer.proc is not None
        while True:
            self._relay(timeout=0.5)
            code = self.trainer.proc.poll()
            if code is not None:
                self._drain()
                # The trainer may have seen a restarted engine answer before the last watch pass did: the
                # account of the run ends with what the engines are now.
                now = time.monotonic()
                for child in self.engines:
                    if child.proc is not None and child.proc.poll() is None:
                        self._note_recovery(child, now)
                return code
            self._watch_engines()

    def _relay(self, *, timeout: float) -> None:
        if not self._selector.get_map():
            time.sleep(timeout)
            return
        for key, _ in self._selector.select(timeout):
            data = os.read(key.fd, 1 << 16)
            if not data:  # EOF: the trainer closed its output
                self._selector.unregister(key.fd)
                continue
            if self._trainer_log is not None:
                self._trainer_log.write(data)
                self._trainer_log.flush()
            self.echo(data)

    def _drain(self, within_s: float = 5.0) -> None:
        """The trainer's last output (its report): read to EOF, but not longer than ``within_s``."""
        deadline = time.monotonic() + within_s
        while self._selector.get_map() and time.monotonic() < deadline:
            self._relay(timeout=0.2)

    def _note_recovery(self, child: Child, now: float) -> None:
        if not child.healthy and self._healthy(child):
            child.healthy = True
            self.say(f"  {child.spec.name} healthy again after {now - child.started_at:.1f} s (start {child.starts})")

    def _watch_engines(self) -> None:
        now = time.monotonic()
        for child in self.engines:
            assert child.proc is not None
            code = child.proc.poll()
            if code is None:
                self._note_recovery(child, now)
                continue
            if child.restart_at is None:
                self._schedule_restart(child, code, now)
            elif now >= child.restart_at:
                self._start(child)

    def _schedule_restart(self, child: Child, code: int, now: float) -> None:
        """As the kubelet restarts a container, with its back-off; a LeaderWorkerSet group's member takes
        the whole group with it (``RecreateGroupOnPodRestart``: its DP ranks share one collective)."""
        _signal_group(child, signal.SIGKILL)  # what it forked dies with it, as with a container
        restarts = child.starts - 1
        if restarts >= self.max_restarts:
            raise UpFailed(
                f"{child.spec.name} exited with code {code} after {self.max_restarts} restarts; "
                f"last lines of {child.log_path}:\n{child.tail()}"
            )
        delay = min(RESTART_CAP_S, RESTART_BASE_S * 2**restarts)
        child.restart_at = now + delay
        child.history[-1]["exitCode"] = code
        self.say(
            f"  {child.spec.name} exited with code {code}; restarting it in {delay:.0f} s "
            f"(restart {restarts + 1}/{self.max_restarts}), as the kubelet restarts a container"
        )
        members = [c for c in self.engines if child.spec.group is not None and c.spec.group == child.spec.group]
        for member in members:
            if member is child or member.restart_at is not None:
                continue
            assert member.proc is not None
            _signal_group(member, signal.SIGKILL)
            member.history[-1]["exitCode"] = member.proc.wait()
            member.restart_at = child.restart_at
            self.say(f"  {member.spec.name} stopped with it: group {child.spec.group} restarts whole")
        self.write_manifest()

    # -- shutdown ----------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """SIGTERM every live child's process group, wait up to its pod's grace period, then SIGKILL."""
        live = [c for c in [self.trainer, *self.engines] if c.proc is not None and c.proc.poll() is None]
        for child in live:
            _signal_group(child, signal.SIGTERM)
        deadline = time.monotonic() + max((c.spec.grace_s for c in live), default=0.0)
        for child in live:
            assert child.proc is not None
            try:
                child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.say(f"  {child.spec.name} did not stop within {child.spec.grace_s:.0f} s; killing it")
        for child in [self.trainer, *self.engines]:
            # The group also holds what the child forked (vLLM's engine core): kill leftovers either way.
            _signal_group(child, signal.SIGKILL)
            if child.proc is not None:
                child.proc.wait()
        self._drain(within_s=1.0)
        if self._trainer_log is not None:
            self._trainer_log.close()
        self.write_manifest()


def _signal_group(child: Child, sig: signal.Signals) -> None:
    if child.proc is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.proc.pid, sig)


def exit_status(code: int) -> int:
    """A child's returncode as a shell reports it (killed by signal N: 128 + N)."""
    return 128 - code if code < 0 else code


def raise_on_sigterm() -> None:
    def handler(_signum: int, _frame: Any) -> None:
        raise Stopped()

    signal.signal(signal.SIGTERM, handler)
