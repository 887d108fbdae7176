"""`moetray` on a machine without a display serves the default model headless.

The README's run command must work on this machine kind, which has no screen: Qt would
abort with a platform-plugin error, so the tray command falls back to what one click
means — the engine with the default model — and says so.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from bounded import COLD_START_S, exit_code

from moetray.app.cli import has_display


@pytest.mark.parametrize(
    ("environ", "platform", "expected"),
    [
        ({}, "linux", False),
        ({"DISPLAY": ":0"}, "linux", True),
        ({"WAYLAND_DISPLAY": "wayland-0"}, "linux", True),
        ({"QT_QPA_PLATFORM": "offscreen"}, "linux", True),
        ({"DISPLAY": ""}, "linux", False),
        ({}, "darwin", True),
        ({}, "win32", True),
    ],
)
def test_a_window_needs_a_display_only_on_linux(environ, platform, expected):
    """Without this check a headless `moetray` dies in Qt instead of serving."""
    assert has_display(environ, platform) is expected


@pytest.mark.slow
@pytest.mark.timeout(COLD_START_S + 300)  # a cold start compiles the demo's decode step
def test_moetray_without_a_display_serves_the_default_model_and_stops_on_ctrl_c(tmp_path, processes):
    from moetray.engine.demo import ensure_demo_model
    from moetray.engine.serve import DEFAULT_PORT

    ensure_demo_model()  # built once per machine; the headless engine then loads it
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", DEFAULT_PORT)) != 0, f"port {DEFAULT_PORT} is taken"
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM")}
    env["XDG_RUNTIME_DIR"] = str(tmp_path)  # the admin token file lands here, not in the user's dir
    log = tmp_path / "stderr.log"
    with open(log, "w") as err_file:
        proc = processes.spawn([sys.executable, "-m", "moetray.app.cli"], env=env, stderr=err_file,
                               stdout=subprocess.DEVNULL, text=True)
    deadline, health = time.monotonic() + COLD_START_S, None  # a cold first start compiles the decode step
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            health = httpx.get(f"http://127.0.0.1:{DEFAULT_PORT}/health", timeout=2).json()
            if health["state"] == "serving":
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    assert health is not None and health["state"] == "serving", f"waited {COLD_START_S:g} s: {health}"
    proc.send_signal(signal.SIGINT)
    assert exit_code(proc, 60, "the headless engine to end on Ctrl-C") == 0
    err = log.read_text()
    assert "no display" in err and "headless" in err
    assert "Traceback" not in err
    assert "PySide6" not in err
