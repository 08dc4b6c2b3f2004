"""Run a real Prometheus server on 127.0.0.1 with a temporary TSDB, and query it over HTTP.

Used by the tests (every dashboard expr parses and returns series), and by `dashboard-preview`.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import yaml


class PrometheusNotFound(RuntimeError):
    pass


class PromQLError(RuntimeError):
    """Prometheus rejected an expression (`errorType` bad_data is a parse error)."""

    def __init__(self, expr: str, error_type: str, error: str) -> None:
        super().__init__(f"{error_type}: {error} in {expr!r}")
        self.expr, self.error_type, self.error = expr, error_type, error


def find_binary(name: str) -> str | None:
    """`name` on PATH, else in .tools/bin of the current directory (where `make tools` puts it)."""
    found = shutil.which(name)
    if found:
        return found
    local = Path.cwd() / ".tools" / "bin" / name
    return str(local) if local.exists() and os.access(local, os.X_OK) else None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class ScrapeTarget:
    job: str
    address: str  # host:port
    labels: dict[str, str] = field(default_factory=dict)
    # True for exporters whose own labels must win (the operator's namespace/rljob labels), as
    # kube-state-metrics-style exporters are scraped; the chart's Pod/ServiceMonitor sets it too.
    honor_labels: bool = False


class PrometheusServer:
    def __init__(
        self,
        targets: list[ScrapeTarget],
        rule_files: list[Path] | None = None,
        *,
        interval: str = "1s",
        binary: str | None = None,
        retention: str = "1d",
        blocks: Path | None = None,
    ) -> None:
        resolved = binary or find_binary("prometheus")
        if resolved is None:
            raise PrometheusNotFound("prometheus not found on PATH or in .tools/bin (run `make tools`)")
        self.binary = resolved
        self.targets, self.rule_files, self.interval, self.retention = targets, rule_files or [], interval, retention
        self.blocks = blocks  # TSDB blocks to serve (observability/backfill.py), copied into the server's own storage
        self.port = 0
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def config(self) -> dict[str, Any]:
        return {
            "global": {"scrape_interval": self.interval, "evaluation_interval": self.interval},
            "rule_files": [str(p.resolve()) for p in self.rule_files],
            "scrape_configs": [
                {
                    "job_name": t.job,
                    "honor_labels": t.honor_labels,
                    "scrape_interval": self.interval,
                    "static_configs": [{"targets": [t.address], "labels": t.labels}],
                }
                for t in self.targets
            ],
        }

    def start(self, timeout: float = 30.0) -> Self:
        self._dir = tempfile.TemporaryDirectory(prefix="r3-prometheus-")
        root = Path(self._dir.name)
        config = root / "prometheus.yml"
        config.write_text(yaml.safe_dump(self.config(), sort_keys=False))
        if self.blocks is not None:
            shutil.copytree(self.blocks, root / "tsdb")
        self.port = free_port()
        log = (root / "prometheus.log").open("wb")
        self._proc = subprocess.Popen(
            [
                self.binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={root / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                f"--storage.tsdb.retention.time={self.retention}",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"prometheus exited ({self._proc.returncode}): {self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as resp:
                    if resp.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"prometheus not ready after {timeout}s")

    def log_tail(self, lines: int = 20) -> str:
        if self._dir is None:
            return ""
        path = Path(self._dir.name) / "prometheus.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # --- HTTP API ----------------------------------------------------------------------------------------

    def _api(self, path: str, params: dict[str, str], expr: str) -> Any:
        data = urllib.parse.urlencode(params).encode()
        request = urllib.request.Request(f"{self.url}{path}", data=data, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=10) as resp:
                body = json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            body = json.loads(exc.read() or b"{}")
        if body.get("status") != "success":
            raise PromQLError(expr, body.get("errorType", "unknown"), body.get("error", "no error text"))
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        params = {"query": expr, **({"time": f"{at:.3f}"} if at is not None else {})}
        return list(self._api("/api/v1/query", params, expr)["result"])

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        params = {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"}
        return list(self._api("/api/v1/query_range", params, expr)["result"])

    def active_targets(self) -> list[dict[str, Any]]:
        with urllib.request.urlopen(f"{self.url}/api/v1/targets", timeout=10) as resp:
            return list(json.loads(resp.read())["data"]["activeTargets"])

    def wait_for(self, expr: str, timeout: float = 20.0, poll: float = 0.25) -> list[dict[str, Any]]:
        """Poll until `expr` returns at least one series; returns it, or [] at the timeout."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(expr)
            if result or time.monotonic() >= deadline:
                return result
            time.sleep(poll)
