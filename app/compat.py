"""qasync quirks, in one place (FeelUOwn keeps its own in ``utils/compat.py``).

- Python 3.11 has no ``asyncio.run(loop_factory=...)``; ``asyncio.Runner`` takes one.
- A loop bound to a ``QApplication`` must be made after the application exists, and
  tasks only created once it runs (qasync issue 121).
- Closing the last window would stop the loop: a tray app turns that off (issue 39).
- Futures still pending at shutdown raise when the loop closes (PR 32): the runner
  cancels them, and :func:`cancel_pending` does it for loops we did not start.
- Signal handlers go through the loop (``add_signal_handler``: the wake-up fd is a socket
  notifier on the Qt loop), so SIGTERM and Ctrl-C reach Python while Qt is in ``exec``.
- Tests drive a loop that is "already running" under pytest-qt's event processing:
  :func:`attach_loop` makes one and :func:`detach_loop` undoes it without
  ``QApplication.exit()`` (which, with no ``exec()`` running, leaves every later nested
  event loop dead).
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Coroutine
from typing import Any

import qasync
from PySide6.QtWidgets import QApplication


def prepare_qt(app: QApplication) -> None:
    """Settings every moetray Qt process needs before its loop starts."""
    app.setQuitOnLastWindowClosed(False)


def run(app: QApplication, main: Callable[[], Coroutine[Any, Any, int]]) -> int:
    """Run ``main()`` on a qasync loop bound to ``app`` until it returns; returns its result."""
    with asyncio.Runner(loop_factory=lambda: qasync.QEventLoop(app)) as runner:
        return runner.run(main())


class EarlyExit:
    """Catches SIGINT/SIGTERM from process start until the loop's own handlers take over.

    Without it, a signal during start-up (Qt and the settings loading, the loop not yet
    running) would kill the process with no shutdown, and ``asyncio.Runner`` would turn a
    Ctrl-C into ``KeyboardInterrupt``. ``requested`` says whether one arrived meanwhile.
    """

    def __init__(self) -> None:
        self.requested = False
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._note)

    def _note(self, signum, frame) -> None:
        self.requested = True


def install_exit_signals(callback: Callable[[], None]) -> list[signal.Signals]:
    """Route SIGINT and SIGTERM to ``callback`` through the running loop; returns those installed."""
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, callback)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread / platform
            continue
        installed.append(sig)
    return installed


def remove_exit_signals(sigs: list[signal.Signals]) -> None:
    loop = asyncio.get_running_loop()
    for sig in sigs:
        loop.remove_signal_handler(sig)


def cancel_pending(loop: asyncio.AbstractEventLoop) -> int:
    """Cancel every task still pending on ``loop``; returns how many."""
    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for task in tasks:
        task.cancel()
    return len(tasks)


def attach_loop(app: QApplication) -> asyncio.AbstractEventLoop:
    """A qasync loop that counts as running while Qt processes events (for tests)."""
    return qasync.QEventLoop(app, already_running=True)


def detach_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Undo :func:`attach_loop`: cancel what is pending, let it unwind, then close the loop."""
    cancel_pending(loop)
    for _ in range(3):
        QApplication.processEvents()
    # loop.stop() would call QApplication.exit(): with no exec() running that leaves Qt's
    # "quit now" flag set, and every later QEventLoop.exec() (pytest-qt's waits) returns at
    # once without processing events. Mark the loop stopped without it.
    loop._QEventLoop__is_running = False  # type: ignore[attr-defined]  # qasync's own flag, as above
    asyncio.events._set_running_loop(None)
    loop.close()
