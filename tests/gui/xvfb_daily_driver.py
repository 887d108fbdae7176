"""Runs the real tray (``start_app``, the bootstrap of ``moetray``) on an X server for
``test_real_x_daily.py`` and reports what a user would see, in files under OUT_DIR.

Usage: ``python xvfb_daily_driver.py OUT_DIR first`` or ``… OUT_DIR second MODEL_DIR``,
with ``DISPLAY`` set and ``QT_QPA_PLATFORM=xcb``. The driver never clicks Start serving:

- ``first``: a fresh settings file (nothing in it). Writes ``serving.json`` once the tray
  serves on its own; then, for each of ``light`` and ``dark``, sets that theme, shows the
  Experts and Pools tabs and opens the tray menu, writing ``ready-<theme>-<what>`` and
  waiting for ``shot-<theme>-<what>`` (the test takes a screenshot meanwhile); then waits
  to be killed (the test checks that its engine ends with it).
- ``second``: settings naming MODEL_DIR as the last model (the port is left at 8765, which
  the first tray holds). Writes ``serving-<n>.json`` each time the engine serves (pid, URL,
  the port note, later notifications, the tray menu) until ``crashes-done`` appears (the
  test kills the engine in between); then, once ``stream-running`` appears, Applies a
  re-split through the app, writes ``waiting.json`` when the Pools panel says what it waits
  for (and waits for ``shot-waiting``), and ``applied.json`` with the outcome and the wall
  time of the Apply; then quits through the app's own Quit.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from driver_files import publish
from PySide6.QtCore import QPoint
from PySide6.QtWidgets import QApplication

from moetray.app import compat
from moetray.app.main import Prepared, setup_logging, start_app
from moetray.app.settings import SETTINGS_FILE, Settings
from moetray.app.single_instance import SingleInstance, server_name
from moetray.app.tray import menu_texts
from moetray.ui.viewmodels import EngineState

WINDOW = (0, 30, 900, 700)
"""Where the dashboard is placed for screenshots (x, y, width, height): at most 900 px wide."""


async def wait_file(path: Path, timeout_s: float = 600.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not path.exists():
        if loop.time() > deadline:
            raise TimeoutError(f"{path} did not appear")
        await asyncio.sleep(0.05)


async def wait_until(condition, what: str, timeout_s: float = 300.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        if loop.time() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def report(app, notes: list) -> dict:
    tray = app.tray
    menu = None
    if tray is not None:
        tray.rebuild_menu()  # what aboutToShow does when the user opens it
        menu = menu_texts(tray.menu)
    engine = app.model.engine
    return {"pid": app.supervisor.pid, "api_url": engine.api_url, "port_note": app.port_note,
            "notes": notes, "menu": menu, "tray": tray is not None,
            "visible": tray is not None and tray.icon.isVisible(), "crashes": app.supervisor.crash_count,
            "state": engine.state.value, "last_crash": engine.last_crash}


async def shoot(out: Path, name: str) -> None:
    await asyncio.sleep(1.2)  # one more event, so the charts have moved
    (out / f"ready-{name}").touch()
    await wait_file(out / f"shot-{name}")


async def first(app, out: Path, notes: list) -> None:
    await wait_until(lambda: app.model.engine.state == EngineState.SERVING, "the first launch to serve", 600)
    publish(out / "serving.json", json.dumps(report(app, notes)))
    await wait_file(out / "traffic-done")
    app.open_dashboard()
    window = app.window
    window.move(WINDOW[0], WINDOW[1])
    window.resize(WINDOW[2], WINDOW[3])
    for theme in ("light", "dark"):
        app.apply_settings(replace(app.settings_values(), theme=theme))
        window.show()
        for tab in ("Experts", "Pools"):
            window.show_tab(tab)
            await shoot(out, f"{theme}-{tab.lower()}")
        if app.tray is not None:
            window.hide()
            geometry = app.tray.icon.geometry()
            app.tray.menu.popup(QPoint(max(0, geometry.x() - 300), geometry.bottom() + 2))
            await shoot(out, f"{theme}-menu")
            app.tray.menu.hide()
    (out / "shots-done").touch()
    await asyncio.sleep(3600)  # until the test kills this tray


async def second(app, out: Path, notes: list) -> None:
    seen: list[int] = []
    while not (out / "crashes-done").exists():
        pid = app.supervisor.pid
        if app.model.engine.state == EngineState.SERVING and pid is not None and pid not in seen:
            publish(out / f"serving-{len(seen)}.json", json.dumps(report(app, notes)))
            seen.append(pid)
        await asyncio.sleep(0.05)
    await wait_until(lambda: app.model.engine.state == EngineState.SERVING and app.model.pools.enabled,
                     "serving with pools to re-split")
    await wait_file(out / "stream-running")
    pools = app.model.pools
    limits = pools.limits
    pools.select_slots(limits.moe_min if pools.current.moe_slots != limits.moe_min else limits.moe_max)
    app.open_dashboard()
    window = app.window
    window.move(WINDOW[0], WINDOW[1])
    window.resize(WINDOW[2], WINDOW[3])
    window.show_tab("Pools")
    started = time.time()
    task = app.spawn(app.apply_pools())
    ended: list[float] = []
    task.add_done_callback(lambda _: ended.append(time.time()))  # the Apply's own end, not ours
    await wait_until(lambda: pools.waiting_text() is not None, "the Pools panel to say what it waits for", 60)
    publish(out / "waiting.json", json.dumps({"text": window.pools.outcome_text, "started": started}))
    await asyncio.sleep(1.2)  # the seconds counter moves on screen
    (out / "ready-waiting").touch()
    await wait_file(out / "shot-waiting", 120)
    await task
    wall_ms = (ended[0] - started) * 1000.0
    outcome = pools.outcome
    publish(out / "applied.json", json.dumps({
        "outcome": outcome.outcome, "text": outcome.text(), "waited_ms": outcome.waited_ms,
        "applied_ms": outcome.applied_ms, "elapsed_ms": outcome.elapsed_ms, "wall_ms": wall_ms,
        "started": started, "pid": app.supervisor.pid, "pools_text": window.pools.outcome_text}))
    await wait_file(out / "quit")


def main(argv: list[str]) -> int:
    out, mode, *rest = argv
    out_dir = Path(out)
    setup_logging()  # as `moetray` does: its notes reach stderr
    qapp = QApplication(sys.argv[:1])
    compat.prepare_qt(qapp)
    settings = Settings.at(out_dir / SETTINGS_FILE)
    if mode == "second":
        settings.remember_model(rest[0])  # last used: served at start, like any daily launch
        settings.engine_args = ["--budget-bytes", str(4 * 1024 * 1024), "--moe-capacity", "10",
                                "--test-hooks", "--test-step-delay-ms", "40", "--rebuild-idle-timeout", "120"]
        settings.sync()
    single = SingleInstance(server_name(settings.path))
    single.listen()
    prepared = Prepared(hidden=True, attach=None, admin_token=None, no_tray=False, settings_file=None)
    notes: list = []

    def started(app) -> None:
        # This test is about serving, ports, kills and re-splits on a machine shared with other
        # jobs, where a loading engine may miss /health for seconds; hang detection is proven
        # by test_supervisor_live (SIGSTOP). A kill is still noticed within one tick.
        app.supervisor.unresponsive_after_s = 30.0
        app.notified.connect(lambda title, message, error: notes.append([title, message, error]))

        async def drive() -> None:
            try:
                await (first(app, out_dir, notes) if mode == "first" else second(app, out_dir, notes))
            except Exception as exc:  # noqa: BLE001 - the test reads this file
                publish(out_dir / "error.txt", repr(exc))
            finally:
                app.quit()

        app.spawn(drive())

    return compat.run(qapp, lambda: start_app(qapp, settings, prepared, single, started=started))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
