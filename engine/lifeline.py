"""The engine ends with the tray that started it, however the tray ended.

A tray that crashes or is killed (SIGKILL: no clean exit, no Stop) must not leave its engine
holding device memory. The tray names itself in ``wire.PARENT_PID_ENV``; the engine then:

- on Linux asks the kernel to send it SIGTERM when its parent dies (``PR_SET_PDEATHSIG``),
  the graceful path every stop takes;
- everywhere, watches its parent from a daemon thread (``os.getppid()`` changes when the
  parent is gone): it says so in the log, sends itself SIGTERM where the kernel could not,
  and, if the graceful stop has not ended the process within ``grace_s`` (a stream that
  does not close, a wedged loop), exits hard. A parent already gone when the watch starts
  (it died during the engine's start-up) counts as gone at once.

Headless ``moetray serve`` (no tray) sets no parent and watches nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import sys
import threading
import time

from moetray.policy.wire import PARENT_PID_ENV

log = logging.getLogger("moetray.engine.lifeline")

PR_SET_PDEATHSIG = 1
"""``prctl`` option (linux/prctl.h): the signal this process gets when its parent dies."""
GRACE_S = 10.0


def _pdeathsig(sig: int) -> bool:
    """Ask the Linux kernel for ``sig`` on parent death; whether it took the request."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _parent_gone(parent_pid: int, grace_s: float, kernel_signals: bool) -> None:
    log.warning("the tray (pid %d) that started this engine is gone: stopping", parent_pid)
    if not kernel_signals:
        os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    log.error("the engine did not stop within %.0f s of its tray's end: exiting now", grace_s)
    os._exit(1)


def watch_parent(parent: str | None, *, poll_s: float = 0.5,
                 grace_s: float = GRACE_S) -> threading.Thread | None:
    """Tie this process's life to the tray's pid ``parent`` (the env value); no-op without one.

    Returns the watching thread (a daemon). Must run in the main thread before the server
    starts, so the kernel's SIGTERM finds the server's handler.
    """
    if not parent:
        return None
    try:
        parent_pid = int(parent)
    except ValueError:
        log.warning("ignoring %s=%r: not a pid", PARENT_PID_ENV, parent)
        return None
    kernel_signals = _pdeathsig(signal.SIGTERM)
    if os.getppid() != parent_pid:
        kernel_signals = False  # it died before the request: the kernel will not signal

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        _parent_gone(parent_pid, grace_s, kernel_signals)

    thread = threading.Thread(target=watch, name="moetray-lifeline", daemon=True)
    thread.start()
    return thread
