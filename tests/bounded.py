"""Bounded waiting and owned processes, for every test and harness.

Every wait has a deadline and, when it runs out, says what it waited for (a hang must cost
one named failure, not the CI budget). Every process a test starts runs in its own session
and is ended with its whole group when the test ends, failed or not: the ``processes``
fixture (tests/conftest.py) hands out a :class:`Processes` that does both.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

POLL_S = 0.05
COLD_START_S = 900.0
"""Seconds an engine may take to serve after a cold start: a lossy format compiles its decode step
first (minutes on a 2-core CPU). Measured: over 300 s for the demo on a 2-core host with 16.8 GB/s
of memory bandwidth while the test suite ran beside it. A test that waits this long raises its own
``pytest.mark.timeout`` above the suite's 300 s."""


def wait_until(condition: Callable[[], T], timeout_s: float, what: str, *, poll_s: float = POLL_S) -> T:
    """``condition()``'s first truthy value, polled every ``poll_s``; ``TimeoutError`` naming
    ``what`` once ``timeout_s`` pass without one (for outside state no signal reports)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"waited {timeout_s:g} s for {what}")
        time.sleep(poll_s)


def join(thread: threading.Thread, timeout_s: float, what: str) -> None:
    """Join ``thread``; ``TimeoutError`` naming ``what`` if it is still running at the deadline."""
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"waited {timeout_s:g} s for {what} (thread {thread.name} still running)")


def wait_qt(qtbot, condition: Callable[[], object], timeout_ms: int, what: str) -> None:
    """``qtbot.waitUntil`` (Qt keeps processing events) with a failure that names ``what``."""
    try:
        qtbot.waitUntil(condition, timeout=timeout_ms)
    except qtbot.TimeoutError:
        raise TimeoutError(f"waited {timeout_ms} ms for {what}") from None


def exit_code(proc: subprocess.Popen, timeout_s: float, what: str) -> int:
    """``proc``'s exit code; ``TimeoutError`` naming ``what`` if it has not exited by the deadline."""
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"waited {timeout_s:g} s for {what} (pid {proc.pid} still running)") from None


def end_group(pid: int, *, grace_s: float = 10.0) -> None:
    """End the process group led by ``pid``: SIGTERM, then SIGKILL after ``grace_s``.

    A group that is already gone is done. Reaps ``pid`` when it is our child.
    """
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pid, sig)
            if sig == signal.SIGTERM:
                os.killpg(pid, signal.SIGCONT)  # a stopped process acts on SIGTERM only once woken
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not _group_alive(pid):
                return
            time.sleep(POLL_S)


def _group_alive(pgid: int) -> bool:
    try:
        os.waitpid(pgid, os.WNOHANG)  # reap our own child so it does not linger as a zombie
    except ChildProcessError:
        pass
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return any(_pgid_of(pid) == pgid and not _zombie(pid) for pid in _pids())


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _pgid_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except (ProcessLookupError, PermissionError):
        return None


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


class Processes:
    """The processes one test started; :meth:`close` ends each one's whole group (SIGTERM, then
    SIGKILL after ``grace_s``)."""

    def __init__(self, grace_s: float = 10.0) -> None:
        self.grace_s = grace_s
        self.groups: list[int] = []

    def spawn(self, argv: list[str], **popen: object) -> subprocess.Popen:
        """``subprocess.Popen(argv, **popen)`` in a new session (its own process group), owned."""
        proc = subprocess.Popen(argv, start_new_session=True, **popen)
        self.groups.append(proc.pid)
        return proc

    def adopt(self, pid: int) -> None:
        """Own a group some child started on its own (e.g. the engine a tray under test spawned)."""
        self.groups.append(pid)

    def close(self) -> None:
        for pid in reversed(self.groups):
            end_group(pid, grace_s=self.grace_s)
        self.groups.clear()

