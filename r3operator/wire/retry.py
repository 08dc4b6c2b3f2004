"""Bounded retries with exponential backoff for calls to rollout engines (HTTP and Ray).

A long RL run makes thousands of engine calls; one refused connection or one engine pod restart must
not end the driver (a RayJob's `backoffLimit` would be spent by a few hiccups). Every engine call that
is safe to repeat goes through `retry_call`:

- attempt i (0-based) that fails with a *transient* error sleeps `min(cap_s, base_s * 2**i)`, of which
  the fraction `jitter` is drawn at random (so engines that failed together do not retry in lockstep),
  then tries again;
- after `attempts` tries, `EngineUnavailableError` names the call, the tries, the time waited and the last
  error; a non-transient error (HTTP 4xx, an exception raised by the engine's own code) is raised at once.

Which errors are transient is the caller's `transient` predicate (`http_transient`, `ray_transient`).
Calls inside a weight-sync bracket are NOT retried here: loading one chunk twice would write
checkpoint-layout bytes into kernel-layout storage. A failed bracket is aborted and the whole sync is
repeated (`weightsync/faults.py`).
"""

from __future__ import annotations

import http.client
import logging
import random
import time
import urllib.error
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from r3operator.settings import runtime_settings

log = logging.getLogger(__name__)
T = TypeVar("T")

# HTTP statuses that mean "not now": the server is overloaded, restarting, or a proxy lost it.
TRANSIENT_HTTP_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


class EngineUnavailableError(RuntimeError):
    """An engine call still failed after every retry (or the engine never became ready)."""


@dataclass(frozen=True)
class Backoff:
    """How often and how patiently to retry. `sleep` and `rng` are injectable so tests run instantly."""

    attempts: int = 6  # tries in all; 1 = no retry
    base_s: float = 1.0
    cap_s: float = 30.0
    jitter: float = 0.5  # fraction of each delay drawn at random: delay in [(1 - jitter) * d, d]
    sleep: Callable[[float], None] = time.sleep
    rng: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"retry attempts must be >= 1, got {self.attempts}")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"retry jitter must be within [0, 1], got {self.jitter}")
        if self.base_s < 0 or self.cap_s < self.base_s:
            raise ValueError(f"retry delays need 0 <= base_s <= cap_s, got base_s={self.base_s} cap_s={self.cap_s}")

    def delay(self, retry: int) -> float:
        """Seconds to wait before retry number `retry` (0 = the first retry)."""
        ceiling = min(self.cap_s, self.base_s * 2.0**retry)
        return ceiling * (1.0 - self.jitter * self.rng.random())

    @classmethod
    def from_env(cls, kind: str = "retry", **defaults: float | int) -> Backoff:
        """`defaults` over the class defaults; the runtime settings R3OPERATOR_ENGINE_<KIND>_ATTEMPTS,
        _BASE_S and _CAP_S (kind `retry` or `ready`, see r3operator.settings) win."""
        settings = runtime_settings()
        values: dict[str, float | int] = dict(defaults)
        for key in ("attempts", "base_s", "cap_s"):
            value = getattr(settings, f"engine_{kind}_{key}")
            if value is not None:
                values[key] = value
        return cls(**values)  # type: ignore[arg-type]


def ready_backoff() -> Backoff:
    """Patience for an engine that is (re)starting: a vLLM pod loads its model for minutes. About 9 minutes
    in all by default; R3OPERATOR_ENGINE_READY_ATTEMPTS / _BASE_S / _CAP_S override it."""
    return Backoff.from_env("ready", attempts=40, base_s=1.0, cap_s=15.0)


def retry_call(fn: Callable[[], T], *, what: str, backoff: Backoff, transient: Callable[[BaseException], bool]) -> T:
    """`fn()`, retried on transient errors with exponential backoff; `EngineUnavailableError` when spent."""
    waited = 0.0
    for attempt in range(backoff.attempts):
        try:
            return fn()
        except Exception as exc:
            if not transient(exc):
                raise
            if attempt + 1 == backoff.attempts:
                tries = f"{backoff.attempts} times over {waited:.1f} s of backoff" if attempt else "(not retried)"
                raise EngineUnavailableError(f"{what} failed {tries}; last error: {type(exc).__name__}: {exc}") from exc
            pause = backoff.delay(attempt)
            log.warning(
                "%s failed (try %d/%d): %s: %s; retrying in %.2f s",
                what,
                attempt + 1,
                backoff.attempts,
                type(exc).__name__,
                exc,
                pause,
            )
            backoff.sleep(pause)
            waited += pause
    raise AssertionError("unreachable: the loop returns or raises")  # attempts >= 1


def http_transient(exc: BaseException) -> bool:
    """Connection refused/reset, timeouts, a dropped connection, or an HTTP status in TRANSIENT_HTTP_STATUSES."""
    if isinstance(exc, urllib.error.HTTPError):
        return exc.code in TRANSIENT_HTTP_STATUSES
    return isinstance(exc, urllib.error.URLError | TimeoutError | ConnectionError | http.client.HTTPException)


def ray_transient(exc: BaseException) -> bool:
    """The actor died, is restarting or is unreachable, or a `ray.get` timed out; not an error raised by
    the engine's own code (`RayTaskError`), nor an actor whose constructor failed."""
    from ray import exceptions as rex

    if isinstance(exc, rex.RayActorError):  # ActorUnavailableError / ActorDiedError included
        return not getattr(exc, "actor_init_failed", False)  # a constructor that raised will raise again
    return isinstance(exc, rex.GetTimeoutError)
