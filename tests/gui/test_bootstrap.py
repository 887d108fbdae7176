"""Bootstrap and exit paths: one instance, SIGTERM and Ctrl-C, the last window, one shutdown.

The process-level rules run the real ``moetray`` command (offscreen Qt, no engine); the
in-process ones drive ``start_app`` and the app object on the test's qasync loop.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from bounded import exit_code, wait_qt
from live import run_async

from moetray.app.application import AppOptions, MoetrayApp
from moetray.app.main import Prepared, PrepareRefused, parse_args, prepare, start_app
from moetray.app.settings import Settings
from moetray.app.single_instance import SingleInstance, server_name
from moetray.ui.viewmodels import EngineState


def tray_process(processes, settings: Path, tmp_path: Path, *args: str) -> subprocess.Popen:
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", XDG_CONFIG_HOME=str(tmp_path / "config"))
    return processes.spawn([sys.executable, "-m", "moetray.app.cli", "--settings", str(settings), *args],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def wait_listening(settings: Path, proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """Until the tray's single-instance socket exists (an outside process: polled)."""
    socket = Path("/tmp") / server_name(str(settings))
    deadline = time.monotonic() + timeout_s
    while not socket.exists():
        assert proc.poll() is None, proc.stdout.read().decode()
        assert time.monotonic() < deadline, f"waited {timeout_s:g} s for the tray's single-instance socket"
        time.sleep(0.05)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_shuts_the_tray_down_cleanly(tmp_path, sig, processes):
    settings = tmp_path / "moetray.conf"
    tray = tray_process(processes, settings, tmp_path, "--no-tray")
    wait_listening(settings, tray)
    tray.send_signal(sig)
    assert exit_code(tray, 60, f"the tray to end on {sig.name}") == 0, tray.stdout.read().decode()


def test_a_second_launch_hands_over_to_the_first_and_exits(tmp_path, processes):
    settings = tmp_path / "moetray.conf"
    first = tray_process(processes, settings, tmp_path, "--no-tray")
    wait_listening(settings, first)
    second = tray_process(processes, settings, tmp_path, "--no-tray")
    out, _ = second.communicate(timeout=60)
    assert second.returncode == 0 and b"already running" in out
    assert first.poll() is None  # the first one keeps running (and raised its window)
    first.send_signal(signal.SIGTERM)
    assert exit_code(first, 60, "the first tray to end on SIGTERM") == 0


def test_bad_arguments_are_refused_in_one_sentence_before_qt():
    with pytest.raises(PrepareRefused, match="--attach needs an http"):
        prepare(parse_args(["--attach", "localhost:8080"]), environ={})
    with pytest.raises(PrepareRefused, match="only applies with --attach"):
        prepare(parse_args(["--token-file", "/x"]), environ={})


def test_attach_token_comes_from_a_file_or_the_environment(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    from_file = prepare(parse_args(["--attach", "http://127.0.0.1:1", "--token-file", str(token_file)]),
                        environ={})
    from_env = prepare(parse_args(["--attach", "http://127.0.0.1:1"]),
                       environ={"MOETRAY_ADMIN_TOKEN_FILE": str(token_file)})
    assert from_file.admin_token == from_env.admin_token == "s3cret"


@pytest.fixture
def offline_app(qapp, qloop, qtbot, tmp_path):
    app = MoetrayApp(qapp, Settings.at(tmp_path / "moetray.conf"), AppOptions(no_tray=True))
    app.initialize()
    yield app
    run_async(qtbot, app.shutdown())
    if app.window is not None:
        app.window.deleteLater()


def test_closing_the_window_without_a_tray_is_quit(offline_app, qtbot):
    offline_app.open_dashboard()
    with qtbot.waitSignal(offline_app.quit_requested, timeout=30000):
        offline_app.window.close()


def test_a_refused_start_is_shown_and_spawns_nothing(offline_app, qtbot):
    notes = []
    offline_app.notified.connect(lambda *args: notes.append(args))
    assert not offline_app.start_serving("/no/such/checkpoint")
    assert offline_app.supervisor.spawn_count == 0
    assert offline_app.model.engine.state == EngineState.STOPPED
    assert "No such model folder" in offline_app.model.engine.detail
    assert notes and notes[0][2] is True


def test_shutdown_runs_once_however_many_exit_paths_fire(qapp, qloop, qtbot, tmp_path):
    settings = Settings.at(tmp_path / "moetray.conf")
    single = SingleInstance(server_name(settings.path))
    single.listen()
    sentinel = asyncio.get_event_loop().create_future()
    apps = []
    prepared = Prepared(hidden=True, attach=None, admin_token=None, no_tray=True, settings_file=None)
    task = asyncio.ensure_future(start_app(qapp, settings, prepared, single, sentinel, started=apps.append))
    wait_qt(qtbot, lambda: bool(apps), 30000, "start_app to build the app")
    shutdowns = []
    original = apps[0].shutdown

    async def counting_shutdown():
        shutdowns.append(1)
        await original()

    apps[0].shutdown = counting_shutdown
    # The tray's Quit, the window's Quit button and the last window closing, all at once.
    # (aboutToQuit is wired the same way; emitting it here would end pytest-qt's own loop.)
    apps[0].quit()
    apps[0].window.header.quit.click()
    apps[0].window.close()
    wait_qt(qtbot, task.done, 30000, "start_app to return after the quit")
    assert task.result() == 0 and shutdowns == [1]
    assert not single.listening
    apps[0].window.deleteLater()
