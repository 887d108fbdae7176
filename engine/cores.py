"""What the machine's cores are doing: the load other programs put on them, and whether decode steps
(and short prefills) get the engine's whole thread budget (a team) on it.

The rule is :func:`moetray.policy.step_threads.team_serves_decode`; this room measures its input
(the kernel's CPU counters, through psutil) and keeps its state (the choice in force) for the
generation thread, which asks before every step it would otherwise keep on one thread.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable

import psutil

from moetray.policy.step_threads import (
    TEAM_LEAVE_WINDOW_S,
    TEAM_RETURN_WINDOW_S,
    openmp_workers_spin,
    others_load,
    team_serves_decode,
)

log = logging.getLogger(__name__)

SAMPLE_INTERVAL_S = 0.1
"""Seconds between two readings of the CPU counters: a choice reads windows of 0.2 and 0.5 s
(:func:`~moetray.policy.step_threads.others_load`) that end at most this long ago."""


class OthersLoad:
    """Cores that other programs kept busy over a recent window: the machine's busy time (steal
    included: a hypervisor's other guests take the cores too) less this process's own CPU time
    (its children, an inductor compile worker, count as others: they compete for the same cores).

    Sampled every interval by a daemon thread from the first reading on, into a history as long as
    the longest window, so a decode step after an idle spell reads the latest moments, not an
    average over the spell: read lazily, the first step of a request averaged in whatever ran
    since the previous request (in ``bench decode`` the other servers' rounds, at two busy cores),
    and ran its first half second on one thread. The thread holds the instance weakly and ends at
    its first wake-up after it is dropped."""

    def __init__(self, interval_s: float = SAMPLE_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._process = psutil.Process()
        keep = math.ceil(TEAM_LEAVE_WINDOW_S / interval_s) + 1
        # (monotonic s, machine busy s, own s)
        self._history: deque[tuple[float, float, float]] = deque(maxlen=keep)
        self.readings = 0

    def cores(self, window_s: float = TEAM_LEAVE_WINDOW_S) -> float | None:
        """Others' busy cores over the latest ``window_s`` (the newest reading back to the latest one
        at least that much older); None until so long has passed since the first call (which starts
        the sampling)."""
        if not self._history:
            self.sample()
            threading.Thread(target=_sample_every, args=(weakref.ref(self), self.interval_s),
                             name="moetray-others-load", daemon=True).start()
        history = tuple(self._history)  # the sampler appends meanwhile
        now, busy, own = history[-1]
        for then, busy_then, own_then in reversed(history[:-1]):
            if now - then >= 0.95 * window_s:  # a margin for the sleeps' rounding
                return max(0.0, ((busy - busy_then) - (own - own_then)) / (now - then))
        return None

    def sample(self) -> None:
        """Read the counters into the history."""
        times = psutil.cpu_times()
        # Linux counts guest time inside user and nice already; idle and iowait are not busy.
        not_busy = ("idle", "iowait", "guest", "guest_nice")
        busy = sum(times) - sum(getattr(times, name, 0.0) for name in not_busy)
        own_times = self._process.cpu_times()
        if self._history:
            self.readings += 1
        self._history.append((time.monotonic(), busy, own_times.user + own_times.system))


def _sample_every(ref: weakref.ref[OthersLoad], interval_s: float) -> None:
    while True:
        time.sleep(interval_s)
        load = ref()
        if load is None:
            return
        load.sample()
        del load  # only the weak reference between samples


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask where the platform has one)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


class DecodeTeam:
    """Whether decode steps and short prefills run on the whole thread budget now, re-decided on
    the measured load before each (the latest window's reading, sampled in the background from
    construction on where a team can form at all); counts the steps each way.

    ``spinning`` defaults to what libgomp read from this process's environment at start (the
    engine's ``serve`` sets it before torch loads); ``load`` to :class:`OthersLoad`."""

    def __init__(self, budget: int, *, spinning: bool | None = None,
                 load: Callable[[float], float | None] | None = None, cores: int | None = None) -> None:
        self.budget = budget
        if spinning is None:
            env = os.environ
            spinning = openmp_workers_spin(env.get("OMP_WAIT_POLICY"), env.get("GOMP_SPINCOUNT"))
        self.spinning = spinning
        self.cores = usable_cores() if cores is None else cores
        self.load = OthersLoad().cores if load is None else load
        # Whether any load lets decode steps on the team (their graphs are compiled at start).
        self.possible = team_serves_decode(0.0, cores=self.cores, budget=budget, spinning=spinning,
                                           on_team=False)
        if self.possible:
            # Start sampling now: read first at the first step, the load is None for a window, and a
            # served engine's first request ran its prefill and first half second of decode on one
            # thread (measured: a 43-token prefill 280-340 ms against 150-200 on the team after it).
            self.load(TEAM_RETURN_WINDOW_S)
        self.on_team = False
        self.team_steps = 0
        self.one_thread_steps = 0

    def decides(self) -> bool:
        """The choice for the decode step about to run (and counts it); the load is read only where
        a team can form."""
        others = None
        if self.possible:
            lasting = self.load(TEAM_LEAVE_WINDOW_S) if self.on_team else None
            others = others_load(self.load(TEAM_RETURN_WINDOW_S), lasting, on_team=self.on_team)
        on_team = team_serves_decode(others, cores=self.cores, budget=self.budget, spinning=self.spinning,
                                     on_team=self.on_team)
        if on_team != self.on_team:
            log.info("decode steps on %d thread(s): other programs keep %.2f cores busy",
                     self.budget if on_team else 1, others or 0.0)
            self.on_team = on_team
        if self.on_team:
            self.team_steps += 1
        else:
            self.one_thread_steps += 1
        return self.on_team
