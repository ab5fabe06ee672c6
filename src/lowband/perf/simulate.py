"""A small discrete-event simulator: tasks with durations and dependencies on serial resources.

A task becomes *ready* when all its dependencies have finished. Each resource (``"compute"``,
``"net"``, ``"codec"``, ...) runs one task at a time, non-preemptively, taking the ready task
with the earliest ready time first (ties: lower ``priority``, then creation order). A task
whose resource is ``None`` needs no resource (a marker, or a pure delay) and runs as soon as
it is ready. All events of one instant are processed before resources pick their next task,
so ties are decided by priority rather than by event order.

A resource may be *shaped* by a token bucket (:class:`TokenBucket`, tc tbf's model of a rate
limit): a task on it carries ``shaped_bytes``, and the bytes the bucket holds when the task
starts pass at line speed, so its duration shrinks by their transfer time. Durations of
shaped tasks are therefore decided when they start.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Iterable, Optional


@dataclass
class Task:
    name: str
    resource: Optional[str]
    duration: float
    deps: list[int]
    priority: int = 0
    shaped_bytes: float = 0.0        # bytes a token bucket on the resource may let through early
    ready: float = math.nan
    start: float = math.nan
    end: float = math.nan


@dataclass
class TokenBucket:
    """A token-bucket rate limit (tc tbf) in front of a resource.

    Knobs:
        burst_bytes: bucket depth (tbf's ``burst``): bytes that pass at line speed after an idle
            period.
        refill_bytes_per_s: the nominal rate, at which the bucket refills.
        seconds_per_byte: what one byte costs in a task's duration at the shaped rate (the
            network's achieved rate), i.e. what each byte let through early saves.
        start_full: the bucket's state at time 0: full (tbf's, at the start of a run), or
            empty (a steady-state simulation: a link-bound schedule keeps the bucket empty, so
            starting there converges at once, where a full bucket takes ``burst / deficit``
            steps to drain; a compute-bound one refills it in its first idle gap either way).

    A task that starts at ``now`` finds
    ``min(burst, left + (now - last_end) * refill)`` bytes in it, spends up to its
    ``shaped_bytes`` of them, and leaves the rest for the next task; no refill is counted while
    a task runs (a message longer than the bucket drains it at the shaped rate).
    """

    burst_bytes: float
    refill_bytes_per_s: float
    seconds_per_byte: float
    start_full: bool = True
    tokens: float = field(init=False, default=0.0)
    last_end: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        if self.burst_bytes < 0 or not self.refill_bytes_per_s > 0 or self.seconds_per_byte < 0:
            raise ValueError("token bucket: burst_bytes >= 0, refill_bytes_per_s > 0 and seconds_per_byte >= 0")
        self.reset()

    def reset(self) -> None:
        """The bucket at time 0 (the start of a simulation): full, or empty (``start_full``)."""
        self.tokens, self.last_end = (self.burst_bytes if self.start_full else 0.0), 0.0

    def admit(self, now: float, duration: float, nbytes: float) -> float:
        """Duration of a task of ``duration`` (at the shaped rate) moving ``nbytes``, starting at ``now``."""
        available = min(self.burst_bytes, self.tokens + max(0.0, now - self.last_end) * self.refill_bytes_per_s)
        early = min(available, max(0.0, nbytes))
        self.tokens = available - early
        duration = max(0.0, duration - early * self.seconds_per_byte)
        self.last_end = now + duration
        return duration


@dataclass
class Graph:
    tasks: list[Task] = field(default_factory=list)
    #: resource -> its token bucket (see the module docstring)
    shapers: dict[str, TokenBucket] = field(default_factory=dict)

    def add(self, name: str, resource: Optional[str], duration: float, deps: Iterable[Optional[int]] = (),
            priority: int = 0) -> int:
        """Add a task; ``None`` entries in ``deps`` are ignored. Returns its id."""
        if duration < 0 or not math.isfinite(duration):
            raise ValueError(f"task {name!r}: duration must be finite and >= 0, got {duration}")
        ds = sorted({d for d in deps if d is not None})
        if any(d >= len(self.tasks) for d in ds):
            raise ValueError(f"task {name!r} depends on a task that does not exist yet")
        self.tasks.append(Task(name, resource, float(duration), ds, priority))
        return len(self.tasks) - 1

    def marker(self, name: str, deps: Iterable[Optional[int]]) -> int:
        """A zero-duration task that finishes when all of ``deps`` have."""
        return self.add(name, None, 0.0, deps)

    def run(self) -> float:
        """Simulate; fills each task's ready/start/end and returns the makespan."""
        n = len(self.tasks)
        for shaper in self.shapers.values():
            shaper.reset()
        waiting = [len(t.deps) for t in self.tasks]
        dependents: list[list[int]] = [[] for _ in range(n)]
        for i, t in enumerate(self.tasks):
            for d in t.deps:
                dependents[d].append(i)
        events: list[tuple[float, int, int]] = []     # (time, seq, task) completions
        queues: dict[Optional[str], list[tuple[float, int, int]]] = {}
        busy: dict[str, bool] = {}
        seq = 0

        def make_ready(i: int, now: float) -> None:
            nonlocal seq
            t = self.tasks[i]
            t.ready = now
            if t.resource is None:
                t.start = now
                t.end = now + t.duration
                seq += 1
                heapq.heappush(events, (t.end, seq, i))
            else:
                heapq.heappush(queues.setdefault(t.resource, []), (now, t.priority, i))

        def dispatch(now: float) -> None:
            nonlocal seq
            for res, q in queues.items():
                if q and not busy.get(res, False):
                    _, _, i = heapq.heappop(q)
                    t = self.tasks[i]
                    t.start = now
                    duration = t.duration         # nominal; a token bucket may shorten this run of it
                    if res in self.shapers and t.shaped_bytes > 0:
                        duration = self.shapers[res].admit(now, duration, t.shaped_bytes)
                    t.end = now + duration
                    busy[res] = True
                    seq += 1
                    heapq.heappush(events, (t.end, seq, i))

        for i in range(n):
            if waiting[i] == 0:
                make_ready(i, 0.0)
        dispatch(0.0)
        done = 0
        while events:
            now = events[0][0]
            while events and events[0][0] == now:
                _, _, i = heapq.heappop(events)
                done += 1
                t = self.tasks[i]
                if t.resource is not None:
                    busy[t.resource] = False
                for j in dependents[i]:
                    waiting[j] -= 1
                    if waiting[j] == 0:
                        make_ready(j, now)
            dispatch(now)
        if done != n:
            raise RuntimeError(f"simulation finished {done} of {n} tasks (a dependency cycle?)")
        return max((t.end for t in self.tasks), default=0.0)
