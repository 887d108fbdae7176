"""Supervisor mechanics on small real child processes (the live engine tests cover the rest).

A Python one-liner stands in for the engine where the rule is about processes, not HTTP:
how a stop escalates, that a gone process counts as stopped, that output becomes log
lines, and that a user start renews the one-restart budget.
"""

from __future__ import annotations

import signal
import sys

import pytest
from live import run_async

from moetray.app.supervisor import EngineSupervisor, LaunchPlan, LaunchRefused, Phase

IGNORE_SIGINT_AND_SIGTERM = (
    "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
    "signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(120)")
EXIT_3_ON_SIGINT = (
    "import signal, sys, time; signal.signal(signal.SIGINT, lambda *a: sys.exit(3)); "
    "print('ready', flush=True); time.sleep(120)")
SLEEPER = "import time; print('ready', flush=True); time.sleep(120)"


def plan(code: str) -> LaunchPlan:
    env = {"PATH": "/usr/bin:/bin"}
    return LaunchPlan((sys.executable, "-c", code), env, "http://127.0.0.1:9", "t", None)


@pytest.fixture
def sup(qloop, qtbot):
    supervisor = EngineSupervisor(backoff_s=0.05, start_timeout_s=600)
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


def test_one_restart_per_user_start(sup, qtbot):
    _ready(sup, qtbot, SLEEPER)
    with qtbot.waitSignal(sup.log_lines, timeout=60000):  # restarted: the new child says ready
        sup._child.proc.kill()
    assert sup.restarts_used == 1 and sup.spawn_count == 2
    with qtbot.waitSignal(sup.gave_up, timeout=60000):
        sup._child.proc.kill()
    assert sup.phase == Phase.FAILED and sup.spawn_count == 2
    _ready(sup, qtbot, SLEEPER)  # the user starts again: a fresh budget
    assert sup.restarts_used == 0 and sup.phase == Phase.STARTING
