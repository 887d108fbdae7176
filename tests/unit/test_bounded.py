"""The test harness's own guarantees: a wait fails by name, and an owned process group ends.

Every other test relies on these (tests/bounded.py): a hang must cost one named failure,
and a process a test started must not outlive it, children included.
"""

from __future__ import annotations

import os
import sys

import pytest
from bounded import Processes, end_group, wait_until


def test_a_wait_that_runs_out_names_what_it_waited_for():
    with pytest.raises(TimeoutError, match="waited 0.1 s for the moon"):
        wait_until(lambda: False, 0.1, "the moon")
    assert wait_until(lambda: 42, 5, "an answer") == 42


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie has ended: only its parent has not read its status yet
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_closing_ends_the_whole_group_children_included(tmp_path):
    """A spawned process that started a child of its own (an engine under a tray) is ended
    with that child, even one that ignores SIGTERM."""
    pidfile = tmp_path / "grandchild.pid"
    grandchild_code = ("import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                       f"open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(600)")
    code = (f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {grandchild_code!r}]); "
            "time.sleep(600)")
    owned = Processes(grace_s=0.5)
    try:
        parent = owned.spawn([sys.executable, "-c", code])
        grandchild = int(wait_until(lambda: pidfile.exists() and pidfile.read_text(), 60,
                                    "the grandchild's pid"))
    finally:
        owned.close()
    assert not _alive(parent.pid)
    assert not _alive(grandchild)  # it ignored SIGTERM: the group's SIGKILL ended it


def test_ending_a_group_that_is_already_gone_is_done():
    owned = Processes()
    proc = owned.spawn([sys.executable, "-c", "pass"])
    proc.wait(60)
    end_group(proc.pid)  # no error, no wait
    owned.close()
