"""The supervisor tells a busy engine from a hung one, with a real engine child.

The engine runs as the tray starts it (:func:`prepare_launch` → ``moetray serve`` in its own
session, the admin token in the environment) under an :class:`EngineSupervisor` with the
tray's watchdog settings. A 4 MB prompt keeps the engine rendering and tokenizing for many
seconds: ``/health`` must keep answering (every 250 ms poll within 2 s) and the supervisor must
never call it hung. An engine that really stops (SIGSTOP) is still declared hung, also when
its last answer said it was busy.
"""

from __future__ import annotations

import os
import re
import signal
import threading

import httpx
import pytest
from health_poll import HealthPoller
from live import is_zombie, pid_exists, private_xdg_dirs, run_async

from moetray.app.supervisor import EngineSupervisor, LaunchSpec, Phase, prepare_launch
from moetray.policy.restart import RestartBudget

START_MS = 240000
SMALL_POOLS = ("--budget-bytes", str(4 * 1024 * 1024), "--moe-capacity", "10")
FOUR_MB = 4 << 20


@pytest.fixture
def supervisor(qapp, qloop, qtbot, tmp_path, monkeypatch):
    """``start(model, **settings)`` → a supervisor with a serving engine child; ended after the test."""
    private_xdg_dirs(tmp_path, monkeypatch)
    started: list[EngineSupervisor] = []

    def start(model, **settings) -> EngineSupervisor:
        sup = EngineSupervisor(**settings)
        sup.healths, sup.crashes = [], []
        sup.health.connect(sup.healths.append)
        sup.crashed.connect(sup.crashes.append)
        started.append(sup)
        sup.start(prepare_launch(LaunchSpec(model=str(model), extra_args=SMALL_POOLS)))
        qtbot.waitUntil(lambda: bool(sup.healths) and sup.healths[-1].get("state") == "serving",
                        timeout=START_MS)
        return sup

    yield start
    for sup in started:
        pid = sup.pid
        try:
            run_async(qtbot, sup.stop(), timeout_ms=60000)
        finally:  # never leave an engine behind, even when the test broke the loop
            if pid is not None and pid_exists(pid):
                os.killpg(pid, signal.SIGCONT)
                os.killpg(pid, signal.SIGKILL)


def test_a_4mb_prompt_keeps_health_answering_and_the_engine_alive(supervisor, tiny_model, qtbot):
    """Issue 11, defect 1, against the engine child: the prompt is rendered and tokenized in a
    worker (seconds on this tokenizer), so every /health poll answers within 2 s meanwhile,
    the supervisor's own probes keep succeeding, and its PID is the same afterwards."""
    sup = supervisor(tiny_model)  # the tray's defaults: silent for 2 s (not busy) is hung
    pid, url = sup.pid, sup.plan.base_url
    system = {"role": "system", "content": "word " * (FOUR_MB // 5)}
    body = {"messages": [system, {"role": "user", "content": "hi"}], "max_tokens": 2}
    replies: list[httpx.Response | str] = []

    def send() -> None:
        try:
            replies.append(httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600, trust_env=False))
        except httpx.HTTPError as exc:  # the engine went away under the request
            replies.append(repr(exc))

    sender = threading.Thread(target=send)
    with HealthPoller(url) as polls:
        sender.start()
        probes_before = len(sup.healths)
        qtbot.waitUntil(lambda: not sender.is_alive(), timeout=600000)  # Qt and the supervisor run
        probes_during = len(sup.healths) - probes_before
    reply = replies[0]
    assert isinstance(reply, httpx.Response) and reply.status_code == 400, (reply, sup.crashes)
    assert reply.json()["error"]["kind"] == "context_length_exceeded"  # counted by the tokenizer
    assert polls.errors == [] and len(polls.latencies) >= 3, (polls.errors, polls.latencies)
    assert max(polls.latencies) < 2.0, polls.latencies
    assert probes_during >= 2  # the supervisor really watched while the prompt was worked on
    assert sup.crashes == [] and sup.phase == Phase.RUNNING and sup.spawn_count == 1
    assert sup.pid == pid and pid_exists(pid)


def test_a_stopped_engine_is_hung_even_when_it_was_busy(supervisor, tiny_model, qtbot):
    """SIGSTOP while a request runs: the last /health said busy, so the supervisor waits out its
    busy grace instead of the 2 s, and then declares the silent engine hung all the same."""
    sup = supervisor(tiny_model, busy_grace_s=6.0, restart_budget=RestartBudget(max_crashes=0))
    pid, url = sup.pid, sup.plan.base_url
    body = {"prompt": "go on", "max_tokens": 100000, "ignore_eos": True, "stream": True}
    stream = threading.Thread(target=_read_until_cut, args=(url, body), daemon=True)
    stream.start()
    qtbot.waitUntil(lambda: (sup.healths[-1].get("heartbeat") or {}).get("busy") is True, timeout=60000)
    os.kill(pid, signal.SIGSTOP)  # alive but silent: only the /health watchdog can tell
    try:
        with qtbot.waitSignal(sup.gave_up, timeout=60000) as gave_up:
            pass
    finally:
        if pid_exists(pid):
            os.kill(pid, signal.SIGCONT)
    reason = gave_up.args[0]
    assert "stopped answering" in reason
    silent_s = float(re.search(r"no /health reply for ([\d.]+) s", reason).group(1))
    # busy: the grace applied (not the 2 s) and ran out. The reason rounds to 0.1 s, so a silence
    # just past the grace reads as the grace itself.
    assert silent_s >= sup.busy_grace_s
    assert sup.phase == Phase.FAILED and sup.spawn_count == 1
    qtbot.waitUntil(lambda: not pid_exists(pid) or is_zombie(pid), timeout=20000)
    stream.join(timeout=30)


def _read_until_cut(url: str, body: dict) -> None:
    """Read a stream until the engine goes away under it."""
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120, trust_env=False) as reply:
            for _ in reply.iter_lines():
                pass
    except httpx.HTTPError:
        pass
