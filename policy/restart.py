"""Whether and when a crashed engine is started again: back-off within a refilling budget.

A supervisor that restarts blindly loops on a model that crashes at load (an OOM, a bad
file); one that restarts once per session gives up on a crash an hour after the last. The
rule here sits between: each crash within the last ``window_s`` seconds counts, the n-th
counted crash waits ``backoff_s[n-1]`` before the restart, and a crash beyond
``max_crashes`` in the window is final (the engine stays down until the user restarts it).
Crashes older than the window no longer count, so the budget refills with time.

Pure: the caller passes the clock's reading; no state but the crash times.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

__all__ = ["DEFAULT_BACKOFF_S", "RestartBudget", "RestartDecision"]

DEFAULT_BACKOFF_S = (1.0, 3.0, 10.0)
"""Seconds before the 1st, 2nd and 3rd restart within one window."""


@dataclass(frozen=True)
class RestartDecision:
    """What to do about one crash: restart after ``delay_s``, or give up (``delay_s`` is ``None``).

    ``crashes`` counts the crashes in the window, this one included.
    """

    restart: bool
    delay_s: float | None
    crashes: int


class RestartBudget:
    """Up to ``max_crashes`` restarts per ``window_s`` seconds, each after its back-off."""

    def __init__(self, *, backoff_s: tuple[float, ...] = DEFAULT_BACKOFF_S, max_crashes: int = 3,
                 window_s: float = 600.0) -> None:
        if max_crashes < 0 or window_s <= 0 or not backoff_s:
            raise ValueError("a restart budget needs max_crashes >= 0, window_s > 0 and a back-off")
        self.backoff_s = tuple(float(b) for b in backoff_s)
        self.max_crashes = max_crashes
        self.window_s = float(window_s)
        self._crashes: deque[float] = deque()

    def _forget_before(self, now: float) -> None:
        while self._crashes and now - self._crashes[0] >= self.window_s:
            self._crashes.popleft()

    def crashes(self, now: float) -> int:
        """Crashes counted in the window ending at ``now`` (mutates nothing but expiry)."""
        self._forget_before(now)
        return len(self._crashes)

    def on_crash(self, now: float) -> RestartDecision:
        """Records a crash at ``now`` and decides: restart after the back-off, or give up.

        Mutates the crash record. The n-th crash in the window (n ≤ ``max_crashes``)
        restarts after ``backoff_s[min(n, len) - 1]``; the next one gives up.
        """
        self._forget_before(now)
        self._crashes.append(now)
        n = len(self._crashes)
        if n > self.max_crashes:
            return RestartDecision(False, None, n)
        return RestartDecision(True, self.backoff_s[min(n, len(self.backoff_s)) - 1], n)

    def reset(self) -> None:
        """A user's own start or restart: forget the crashes (mutates)."""
        self._crashes.clear()
