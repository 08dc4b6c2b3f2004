"""The asynchronous mode's rollout producer: a thread that keeps the engines generating while the trainer
trains, and hands finished GRPO groups to it through a bounded queue.

Pause points. The producer sends one segment at a time for every open trajectory (rollout/partial.py) and
holds the `EngineGate` while a segment is in flight. A weight update takes the gate in `paused()`: new
segments wait, the segment in flight finishes, the trainer syncs the weights (and runs the canary) with no
request on the engines, sets the new policy version and resumes. Trajectories that were not finished continue
under the new weights in their next segment: these are the partial rollouts. Without partial rollouts a
segment is a whole response (maxTokens), so an update waits for the requests in flight to finish.

The driver bounds requests rather than aborting them because the in-process engine (`vllm.LLM` in a Ray
actor) has no abort that returns what an aborted request generated: vLLM attaches routed experts to a
request's output only when it finishes. A segment boundary is a pause point both engine kinds honour.

The queue holds finished groups; when it is full the producer waits, so the rollouts run at most a queue's
worth ahead of the trainer, and `algorithm.maxStaleness` drops what is still too old when it is taken.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from r3operator.rollout.base import StaleEngineError
from r3operator.rollout.partial import Trajectory
from r3operator.routing.sample import RolloutSample
from r3operator.wire.retry import EngineUnavailableError

log = logging.getLogger("r3operator.runtime")

# generate(prompts, routed_experts_prompt_start per prompt, max_tokens, seed) -> one sample per prompt, in order
SegmentGenerate = Callable[[list[list[int]], list[int], int, int], Sequence[RolloutSample]]
# the next problem's prompt token ids, given the producer's running problem number
NextPrompt = Callable[[int], Sequence[int]]
QUEUE_POLL_S = 0.1
MAX_FAILED_SEGMENTS = 8  # in a row: the engines keep failing even after the trainer recovered them


class EngineGate:
    """Mutual exclusion between the producer's segments and the trainer's weight updates, plus the policy
    version the engines serve. A pause waits for the segment in flight; the producer waits while paused,
    and while an engine it found stale waits for the trainer thread to recover it (`recover`)."""

    def __init__(self, version: int = 0) -> None:
        self._cond = threading.Condition()
        self._paused = False
        self._busy = False
        self._recovery_needed = False
        self.version = version

    def request_recovery(self) -> None:
        """The producer found an engine off the current policy: no segment runs until `recover`."""
        with self._cond:
            self._recovery_needed = True

    def recover(self, recover_engines: Callable[[], object]) -> bool:
        """On the trainer thread, while its weights are the published version's (between updates): if the
        producer asked for it, pause and `recover_engines()` (re-sync + canary of the stale engines). Returns
        whether it ran."""
        if not self._recovery_needed:
            return False
        with self.paused():
            recover_engines()
            self.recovered()
        return True

    def recovered(self) -> None:
        """Every engine serves the current policy again (a recovery or a full weight sync finished)."""
        with self._cond:
            self._recovery_needed = False
            self._cond.notify_all()

    @contextmanager
    def segment(self) -> Iterator[int]:
        """Run one segment (the producer); yields the policy version the engines serve meanwhile."""
        with self._cond:
            while self._paused or self._recovery_needed:
                self._cond.wait()
            self._busy = True
            version = self.version
        try:
            yield version
        finally:
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Hold the engines idle (the trainer's weight update); `set_version` inside, before resuming."""
        with self._cond:
            self._paused = True
            while self._busy:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._paused = False
                self._cond.notify_all()

    def set_version(self, version: int) -> None:
        with self._cond:
            self.version = version


class ProducerFailedError(RuntimeError):
    """The producer thread stopped on an error; the trainer raises it instead of waiting forever."""


class RolloutProducer:
    """Generates `group_size` trajectories per problem, `groups_in_flight` problems at a time, segment by
    segment, and puts each finished group (a list of samples) on a queue of `queue_groups` groups."""

    def __init__(
        self,
        *,
        generate: SegmentGenerate,
        next_prompt: NextPrompt,
        gate: EngineGate,
        group_size: int,
        max_tokens: int,
        segment_tokens: int,
        groups_in_flight: int,
        queue_groups: int,
        num_experts: int,
        seed: int = 0,
    ) -> None:
        if segment_tokens < 1 or max_tokens < 1 or group_size < 1 or groups_in_flight < 1 or queue_groups < 1:
            raise ValueError("segment_tokens, max_tokens, group_size, groups_in_flight and queue_groups must be >= 1")
        self.generate = generate
        self.next_prompt = next_prompt
        self.gate = gate
        self.group_size = group_size
        self.max_tokens = max_tokens
        self.segment_tokens = min(segment_tokens, max_tokens)
        self.groups_in_flight = groups_in_flight
        self.num_experts = num_experts
        self.seed = seed
        self.queue: queue.Queue[list[RolloutSample]] = queue.Queue(maxsize=queue_groups)
        self.open: dict[int, list[Trajectory]] = {}
        self.problems_started = 0
        self.requests = 0
        self.tokens_generated = 0
        self.engine_busy_seconds = 0.0  # wall time with a segment request on the engines
        self.segments_resumed_after_update = 0
        self.failed_segments = 0  # discarded in a row (stale or unavailable engine), reset by a good one
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the rollout producer is already running")
        self._thread = threading.Thread(target=self._run, name="r3-rollout-producer", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 600.0) -> None:
        """Stop after the segment in flight; trajectories not finished are discarded."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
            if self._thread.is_alive():
                log.error("the rollout producer did not stop within %.0f s", timeout_s)
            self._thread = None

    def take(self, groups: int, *, while_waiting: Callable[[], object] | None = None) -> list[list[RolloutSample]]:
        """The next `groups` finished groups, oldest first; blocks until they are there, calling
        `while_waiting()` (the trainer's engine recovery) between polls."""
        out: list[list[RolloutSample]] = []
        while len(out) < groups:
            if while_waiting is not None:
                while_waiting()
            if self._error is not None:
                raise ProducerFailedError(f"the rollout producer stopped: {self._error}") from self._error
            if self._thread is None and self.queue.empty():
                raise RuntimeError(f"the rollout producer is not running and {len(out)} of {groups} groups are queued")
            try:
                out.append(self.queue.get(timeout=QUEUE_POLL_S))
            except queue.Empty:
                continue
        return out

    # -- the thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.run_segment()
        except BaseException as exc:  # the trainer re-raises it from take()
            log.exception("the rollout producer failed")
            self._error = exc

    def run_segment(self) -> None:
        """One round of the thread: admit new groups, generate one segment of every open trajectory (under
        the gate), queue the groups that finished."""
        self._admit()
        self._segment()
        self._hand_over()

    def _admit(self) -> None:
        while len(self.open) < self.groups_in_flight:
            problem_no = self.problems_started
            prompt = tuple(int(t) for t in self.next_prompt(problem_no))
            self.open[problem_no] = [
                Trajectory(problem_no=problem_no, choice_index=j, prompt=prompt, max_tokens=self.max_tokens)
                for j in range(self.group_size)
            ]
            self.problems_started += 1

    def _segment(self) -> None:
        """One request per distinct segment length over every open trajectory, under one policy version."""
        pending = [t for group in self.open.values() for t in group if not t.done]
        by_length: dict[int, list[Trajectory]] = {}
        for trajectory in pending:
            by_length.setdefault(min(self.segment_tokens, trajectory.remaining), []).append(trajectory)
        with self.gate.segment() as version:
            for length, trajectories in sorted(by_length.items()):
                if self._stop.is_set():
                    return
                requests = [t.request() for t in trajectories]
                seed = self.seed * 1_000_003 + self.requests * 10_007
                self.requests += 1
                begin = time.perf_counter()
                try:
                    samples = self.generate([p for p, _ in requests], [s for _, s in requests], length, seed)
                except (StaleEngineError, EngineUnavailableError) as exc:
                    # Nothing of this request is kept: its trajectories send the same segment again once the
                    # trainer thread has re-synced the engines (the gate holds the next segment until then).
                    self.failed_segments += 1
                    if self.failed_segments >= MAX_FAILED_SEGMENTS:
                        raise RuntimeError(
                            f"{self.failed_segments} rollout segments in a row failed although the trainer "
                            f"re-synced the engines in between; last error: {exc}"
                        ) from exc
                    log.warning("rollout segment discarded, waiting for the trainer to recover the engines: %s", exc)
                    self.gate.request_recovery()
                    return
                self.failed_segments = 0
                self.engine_busy_seconds += time.perf_counter() - begin
                if len(samples) != len(trajectories):
                    raise RuntimeError(f"the engine returned {len(samples)} samples for {len(trajectories)} prompts")
                for trajectory, sample in zip(trajectories, samples, strict=True):
                    if trajectory.versions and trajectory.versions[-1] != version:
                        self.segments_resumed_after_update += 1
                    trajectory.add_segment(sample, version=version, requested=length)
                    self.tokens_generated += len(sample.token_ids)

    def _hand_over(self) -> None:
        """Queue every group whose trajectories are all done (waits while the queue is full)."""
        for problem_no in sorted(self.open):
            group = self.open[problem_no]
            if not all(t.done for t in group):
                continue
            samples = [t.sample(num_experts=self.num_experts) for t in group]
            for t in group:
                if t.routes_error is not None:
                    log.warning(
                        "trajectory q%d-c%d has no usable routes: %s", t.problem_no, t.choice_index, t.routes_error
                    )
            while not self._stop.is_set():
                try:
                    self.queue.put(samples, timeout=QUEUE_POLL_S)
                    break
                except queue.Full:
                    continue
            del self.open[problem_no]
