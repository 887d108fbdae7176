"""Runs the real tray (``start_app``, the same bootstrap as ``moetray``) on an X server and
reports what a user would see, for ``test_real_x_tray.py``.

Usage: ``python xvfb_driver.py OUT_DIR MODEL_DIR TAB [TAB …]`` with ``DISPLAY`` set and
``QT_QPA_PLATFORM=xcb``. The tray starts serving MODEL_DIR itself (supervised, small pools)
and writes ``OUT_DIR/serving.json`` (API URL, engine pid); once ``traffic-done`` exists it
writes ``report.json`` (tray availability, visibility, geometry, the menu as rebuilt on
open), then for each TAB
shows the dashboard on that tab, writes ``ready-<i>`` and waits for ``shot-<i>`` (the test
takes a root-window screenshot meanwhile); then opens the tray menu, writes
``ready-menu``, waits for ``shot-menu``, and quits through the app's own Quit.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from driver_files import publish
from PySide6.QtCore import QEvent, QObject, QPoint
from PySide6.QtWidgets import QApplication, QSystemTrayIcon

from moetray.app import compat
from moetray.app.main import Prepared, start_app
from moetray.app.settings import SETTINGS_FILE, Settings
from moetray.app.single_instance import SingleInstance, server_name
from moetray.app.tray import menu_texts
from moetray.ui.viewmodels import EngineState


class PaintCounter(QObject):
    """Counts the paint events ``widget`` receives (so a screenshot waits for pixels, not a delay)."""

    def __init__(self, widget) -> None:
        super().__init__(widget)
        self.count = 0
        widget.installEventFilter(self)

    def eventFilter(self, watched, event) -> bool:  # noqa: N802 - Qt's name
        if event.type() == QEvent.Type.Paint:
            self.count += 1
        return False


async def wait_until(condition, what: str, timeout_s: float = 60.0) -> None:
    """Poll ``condition`` on the running loop; ``TimeoutError`` naming ``what`` at the deadline."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        if loop.time() > deadline:
            raise TimeoutError(f"waited {timeout_s:g} s for {what}")
        await asyncio.sleep(0.05)


async def wait_file(path: Path, timeout_s: float = 60.0) -> None:
    await wait_until(path.exists, f"the test to write {path.name}", timeout_s)


async def next_snapshot(app) -> None:
    """One more engine snapshot than now has reached the tray (the charts have moved)."""
    seen = app.model.snapshots
    await wait_until(lambda: app.model.snapshots > seen, "the next engine snapshot")


async def drive(app, out: Path, model: str, tabs: list[str]) -> None:
    # What the tray did, in the driver's log (the test shows its tail when a step fails).
    app.supervisor.phase_changed.connect(lambda phase: print(f"[driver] supervisor: {phase}", flush=True))
    app.model.logs.appended.connect(lambda lines: print(*lines, sep="\n", flush=True))
    try:
        app.start_serving(model)
        await wait_until(lambda: app.model.engine.state == EngineState.SERVING, "the engine to serve",
                         timeout_s=240)
        publish(out / "serving.json", json.dumps({"api_url": app.model.engine.api_url,
                                                      "pid": app.supervisor.pid}))
        await wait_file(out / "traffic-done", timeout_s=240)
        # The test's three requests are in the tray's figures (so the menu shows a rate).
        await wait_until(lambda: (app.model.throughput.requests_served or 0) >= 3,
                         "the tray to see the three served requests")
        tray = app.tray
        report = {"tray_available": QSystemTrayIcon.isSystemTrayAvailable(), "tray": tray is not None}
        if tray is not None:
            tray.rebuild_menu()  # what aboutToShow does when the user opens it
            geometry = tray.icon.geometry()
            report.update(visible=tray.icon.isVisible(), state=tray.state.value, variant=tray.variant,
                          geometry=[geometry.x(), geometry.y(), geometry.width(), geometry.height()],
                          menu=menu_texts(tray.menu), tooltip=tray.icon.toolTip())
        publish(out / "report.json", json.dumps(report, indent=1))
        app.open_dashboard()
        window = app.window
        window.move(0, 30)
        window.resize(1100, 760)
        for i, tab in enumerate(tabs):
            window.show_tab(tab)
            await next_snapshot(app)
            (out / f"ready-{i}").touch()
            await wait_file(out / f"shot-{i}")
        if tray is not None:
            window.hide()
            geometry = tray.icon.geometry()
            painted = PaintCounter(tray.menu)
            tray.menu.popup(QPoint(max(0, geometry.x() - 220), geometry.bottom() + 2))
            await wait_until(lambda: painted.count > 0, "the tray menu to be painted")
            (out / "ready-menu").touch()
            await wait_file(out / "shot-menu")
            tray.menu.hide()
    except Exception as exc:  # noqa: BLE001 - the test reads this file
        publish(out / "error.txt", repr(exc))
    finally:
        app.quit()


def main(argv: list[str]) -> int:
    out, model, *tabs = argv
    out_dir = Path(out)
    qapp = QApplication(sys.argv[:1])
    compat.prepare_qt(qapp)
    settings = Settings.at(out_dir / SETTINGS_FILE)
    settings.serve_on_start = False  # the driver starts it, on the model it is given
    settings.port = 0
    settings.engine_args = ["--budget-bytes", str(4 * 1024 * 1024), "--moe-capacity", "10",
                            "--link-gbps", "0.01"]
    single = SingleInstance(server_name(settings.path))
    single.listen()
    prepared = Prepared(hidden=True, attach=None, admin_token=None, no_tray=False, settings_file=None)

    def started(app) -> None:
        # An idle engine on a loaded shared machine can miss /health for seconds while the
        # screenshots are taken; hang detection is proven by test_supervisor_live (SIGSTOP).
        app.supervisor.unresponsive_after_s = 30.0
        app.spawn(drive(app, out_dir, model, tabs))

    return compat.run(qapp, lambda: start_app(qapp, settings, prepared, single, started=started))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
