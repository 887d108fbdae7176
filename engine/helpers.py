"""One-thread helper threads: where a step's work is shared with the machine's other cores.

A step that runs at one intra-op thread (a decode step, a short prefill: see
:mod:`moetray.policy.step_threads`) leaves the other cores idle, and an OpenMP team would pay a
wake-up per product. Work that splits into independent pieces (a prefill's small expert GEMMs, the
LM head's rows) is handed instead to helper threads that each compute at one intra-op thread: a
hand-off costs ~10-30 µs once per call, not once per product.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

MAX_HELPERS = 8
"""Helper threads at most (never more than the machine's cores)."""

_helpers: ThreadPoolExecutor | None = None
_helpers_lock = threading.Lock()


def one_thread_helpers() -> ThreadPoolExecutor:
    """The process's helper threads, each pinned to one intra-op thread (made on first use;
    idle threads hold nothing and end with the interpreter)."""
    global _helpers
    with _helpers_lock:
        if _helpers is None:
            _helpers = ThreadPoolExecutor(max_workers=helper_count(), thread_name_prefix="moetray-gemm",
                                          initializer=_one_thread)
        return _helpers


def helper_count() -> int:
    """How many helper threads the pool has."""
    return max(1, min(MAX_HELPERS, os.cpu_count() or 2))


def _one_thread() -> None:
    """A helper's products run on the helper alone: OpenMP's and MKL's thread counts are per
    calling thread, so the caller's budget stays as it was (torch also records 1 as the count
    later-started ATen pool threads begin with; the engine starts none).

    The count is read first: torch sets a thread's count lazily, at its first read or parallel op,
    to the count last set by any thread, so a helper that only set 1 took the caller's 2 if the
    caller set 2 in between (a helper's first GEMMs then ran an OpenMP team of their own)."""
    torch.get_num_threads()
    torch.set_num_threads(1)


def share_out(tasks: Sequence[Callable[[], None]], threads: int) -> None:
    """Run every task once, on this thread and up to ``threads - 1`` helpers, each taking the next
    task nobody has taken; returns when all ran (re-raising a task's exception).

    Helpers run under the caller's grad mode (thread-local state a compiled task's graph guards on:
    a helper with its own default would compile the task again, mid-request). Taken, not dealt: a
    helper that starts late (its core busy with another process) leaves the
    rest to this thread, which never waits for a task that has not started, only for one a helper
    is computing. This thread runs its tasks at one intra-op thread and has its count back on return.
    """
    claim = itertools.count()  # next() is atomic under the GIL
    grad = torch.is_grad_enabled()

    def take() -> None:
        while (i := next(claim)) < len(tasks):
            tasks[i]()

    def help_out() -> None:
        with torch.set_grad_enabled(grad):
            take()

    helpers = min(threads - 1, len(tasks) - 1, helper_count())
    futures = [one_thread_helpers().submit(help_out) for _ in range(max(0, helpers))]
    before = torch.get_num_threads()
    if before != 1:
        torch.set_num_threads(1)
    try:
        take()
    finally:
        if before != 1:
            torch.set_num_threads(before)
        for future in futures:
            if not future.cancel():  # started: it is computing a task (or found none left)
                future.result()
