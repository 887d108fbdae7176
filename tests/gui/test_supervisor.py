"""Supervisor mechanics on small real child processes (the live engine tests cover the rest).

A Python one-liner stands in for the engine where the rule is about processes, not HTTP:
how a stop escalates, that a gone process counts as stopped, that output becomes log
lines, that restarts follow the restart budget (and a user start refills it), that the
child is told its parent, and that an engine left by a dead tray is found and ended.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from live import run_async

from moetray.app.orphans import EngineRecords
from moetray.app.supervisor import EngineSupervisor, LaunchPlan, LaunchRefused, Phase
from moetray.policy import wire
from moetray.policy.restart import RestartBudget

IGNORE_SIGINT_AND_SIGTERM = (
    "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
    "signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(120)")
EXIT_3_ON_SIGINT = (
    "import signal, sys, time; signal.signal(signal.SIGINT, lambda *a: sys.exit(3)); "
    "print('ready', flush=True); time.sleep(120)")
SLEEPER = "import time; print('ready', flush=True); time.sleep(120)"
SAYS_ITS_PARENT = (f"import os, time; print('parent', os.environ['{wire.PARENT_PID_ENV}'], flush=True); "
                   "time.sleep(120)")


def plan(code: str) -> LaunchPlan:
    env = {"PATH": "/usr/bin:/bin"}
    return LaunchPlan((sys.executable, "-c", code), env, "http://127.0.0.1:9", "t", None)


@pytest.fixture
def sup(qloop, qtbot, tmp_path):
    supervisor = EngineSupervisor(restart_budget=RestartBudget(backoff_s=(0.05, 0.1, 0.2)),
                                  records=EngineRecords(tmp_path / "records"), start_timeout_s=600)
    yield supervisor
    run_async(qtbot, supervisor.stop(grace_s=0.1, term_grace_s=0.1))


def _ready(sup, qtbot, code):
    with qtbot.waitSignal(sup.log_lines, timeout=60000) as lines:
        sup.start(plan(code))
    assert lines.args[0] == ["ready"]  # the child's output arrives as log lines


def test_stop_escalates_to_sigkill_for_a_child_that_ignores_the_polite_signals(sup, qtbot):
    _ready(sup, qtbot, IGNORE_SIGINT_AND_SIGTERM)
    code = run_async(qtbot, sup.stop(grace_s=0.2, term_grace_s=0.2))
    assert code == -signal.SIGKILL and sup.phase == Phase.IDLE


def test_stop_asks_with_sigint_first(sup, qtbot):
    _ready(sup, qtbot, EXIT_3_ON_SIGINT)
    assert run_async(qtbot, sup.stop(grace_s=10, term_grace_s=10)) == 3  # no SIGTERM needed


def test_a_child_already_gone_counts_as_stopped(sup, qtbot):
    sup.tick_s = 3600  # keep the watchdog out of this race: the rule is about stop() itself
    _ready(sup, qtbot, SLEEPER)
    child = sup._child.proc
    child.kill()
    child.wait(30)
    assert run_async(qtbot, sup.stop(grace_s=0.1, term_grace_s=0.1)) == -signal.SIGKILL
    assert sup.phase == Phase.IDLE


def test_a_second_start_while_running_is_refused(sup, qtbot):
    _ready(sup, qtbot, SLEEPER)
    with pytest.raises(LaunchRefused) as refused:
        sup.start(plan(SLEEPER))
    assert refused.value.kind == "already_running"


def test_restarts_follow_the_budget_then_the_engine_stays_down_until_a_user_start(sup, qtbot):
    _ready(sup, qtbot, SLEEPER)
    delays = []
    sup.restarting.connect(delays.append)
    for crash in range(1, 4):  # three crashes in the window: each restarted, with growing back-off
        with qtbot.waitSignal(sup.log_lines, timeout=60000):  # the new child says ready
            sup._child.proc.kill()
        assert sup.crash_count == crash and sup.spawn_count == crash + 1
    assert delays == [0.05, 0.1, 0.2]
    with qtbot.waitSignal(sup.gave_up, timeout=60000):  # the fourth is past the budget
        sup._child.proc.kill()
    assert sup.phase == Phase.FAILED and sup.spawn_count == 4 and sup._restart_task is None
    _ready(sup, qtbot, SLEEPER)  # the user starts again: a fresh budget
    assert sup.crash_count == 0 and sup.phase == Phase.STARTING


def test_the_child_is_told_its_parent_and_recorded_while_it_runs(sup, qtbot):
    with qtbot.waitSignal(sup.log_lines, timeout=10000) as lines:
        sup.start(plan(SAYS_ITS_PARENT))
    assert lines.args[0] == [f"parent {os.getpid()}"]
    records = list(sup.records.folder.glob("engine-*.json"))
    assert [r.name for r in records] == [f"engine-{sup.pid}.json"]
    assert sup.records.orphans() == []  # its tray (this process) is alive: not an orphan
    run_async(qtbot, sup.stop(grace_s=0.1, term_grace_s=0.1))
    assert list(sup.records.folder.glob("engine-*.json")) == []


FAKE_TRAY = """
import subprocess, sys, time
from pathlib import Path
from moetray.app.orphans import EngineRecords
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
EngineRecords(Path(sys.argv[1])).record(child.pid, "http://127.0.0.1:9")
print(child.pid, flush=True)
time.sleep(300)
"""


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def test_an_engine_left_by_a_killed_tray_is_found_and_ended(qloop, qtbot, tmp_path):
    folder = tmp_path / "records"
    tray = subprocess.Popen([sys.executable, "-c", FAKE_TRAY, str(folder)], stdout=subprocess.PIPE, text=True)
    engine_pid = int(tray.stdout.readline())
    try:
        records = EngineRecords(folder)
        assert records.orphans() == []  # its tray lives: not ours to end
        tray.kill()  # the tray dies without a clean exit
        tray.wait(10)
        orphans = records.orphans()
        assert [(o.engine_pid, o.tray_pid) for o in orphans] == [(engine_pid, tray.pid)]
        ended = run_async(qtbot, records.end_orphans(term_grace_s=5.0))
        assert [o.engine_pid for o in ended] == [engine_pid]
        deadline = time.monotonic() + 10
        while not _gone(engine_pid):
            assert time.monotonic() < deadline, "the orphaned engine is still running"
            time.sleep(0.05)
        assert list(folder.glob("engine-*.json")) == []
    finally:
        if tray.poll() is None:
            tray.kill()
        if not _gone(engine_pid):
            os.kill(engine_pid, signal.SIGKILL)
