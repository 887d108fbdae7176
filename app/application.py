"""The one application object: owns the tray, the supervisor, the live feed and the dashboard.

vorta's ``VortaApp`` shape. Windows and the tray talk to this object (its verbs and its
domain signals), never to each other and never to the engine. Every engine call goes
through :class:`~moetray.app.client.EngineClient`; every number shown goes through the
:class:`~moetray.ui.dashboard_model.DashboardModel`.

Two ways to have an engine:

- **supervised** (default): Start serving spawns ``moetray serve`` through the
  :class:`~moetray.app.supervisor.EngineSupervisor`; Stop serving and Quit run
  prepare-stop, wait for the receipt, then end the child (the device memory is freed);
- **attached** (``--attach URL``): the engine runs elsewhere; the tray watches and
  controls it (re-split, cancel) but never starts or stops it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from PySide6.QtCore import QObject, Signal
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QApplication, QFileDialog, QMenu

from moetray.app import autostart
from moetray.app.client import EngineClient, EngineError
from moetray.app.link import EngineLink
from moetray.app.settings import DEMO_MODEL, Settings
from moetray.app.supervisor import EngineSupervisor, LaunchRefused, LaunchSpec, Phase, prepare_launch
from moetray.app.tray import TrayController, TraySnapshot, populate_model_menu
from moetray.policy.footprint import Footprint, ProbeCache, probe_footprint
from moetray.ui.dashboard_model import DashboardModel
from moetray.ui.pools_model import ApplyRefused
from moetray.ui.viewmodels import EngineState, FootprintView, rebuild_outcome

if TYPE_CHECKING:
    from moetray.ui.dashboard import DashboardWindow

log = logging.getLogger("moetray.app")

DRAIN_TIMEOUT_S = 5.0
"""How long prepare-stop lets running requests finish before it aborts them."""


@dataclass(frozen=True)
class AppOptions:
    hidden: bool = False
    attach: str | None = None
    admin_token: str | None = None  # for --attach: the engine's admin token
    no_tray: bool = False  # run window-only even where a tray exists


def _read_text(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


class MoetrayApp(QObject):
    """Domain signals: ``state_changed`` (the tray state or its detail changed) and
    ``notified(title, message, is_error)`` (crashes, refusals, outcomes worth a bubble)."""

    state_changed = Signal()
    notified = Signal(str, str, bool)
    quit_requested = Signal()

    def __init__(self, qapp: QApplication, settings: Settings, options: AppOptions,
                 *, supervisor: EngineSupervisor | None = None) -> None:
        super().__init__()
        self.qapp = qapp
        self.settings = settings
        self.options = options
        self.model = DashboardModel()
        self.supervisor = supervisor or EngineSupervisor()
        self.link = EngineLink()
        self.window: DashboardWindow | None = None  # built on first open
        self.tray: TrayController | None = None
        self.attached_client: EngineClient | None = None
        self.gate_state: str | None = None
        self.current_model: str | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._shutdown_started = False
        # Reading our own smaps_rollup costs ~10 ms (Qt maps many libraries): once per 10 s.
        self._tray_probe: ProbeCache[Footprint | None] = ProbeCache(10.0, time.monotonic)
        self._model_menu: QMenu | None = None

    # -- wiring ----------------------------------------------------------------------

    def initialize(self) -> None:
        """Connect the parts; creates the tray icon (or not, where no tray exists)."""
        sup = self.supervisor
        sup.phase_changed.connect(self._on_phase)
        sup.health.connect(self._on_health)
        sup.log_lines.connect(self.model.logs.append)
        sup.crashed.connect(self._on_crashed)
        sup.gave_up.connect(self._on_gave_up)
        sup.restarting.connect(lambda delay: self.model.logs.append(
            [f"[moetray] restarting the engine in {delay:.1f} s (once)"]))
        self.link.snapshot.connect(self._on_snapshot)
        self.link.disconnected.connect(self._on_disconnected)
        self.link.connected.connect(self._recompute_state)
        self.notified.connect(self._show_notification)
        if not self.options.no_tray and TrayController.available():
            self.tray = TrayController(self, self.tray_snapshot)
        self.current_model = self.settings.last_model if self.options.attach is None else None

    async def start(self) -> None:
        """Phase two of bootstrap: attach or (optionally) serve, then show the tray or window."""
        if self.options.attach:
            url = self.options.attach.rstrip("/")
            if url.endswith("/v1"):
                url = url[:-3]
            self.attached_client = EngineClient(url, self.options.admin_token)
            self.model.engine.set_endpoint(self.attached_client.api_url, attached=True)
            self.model.logs.set_source(f"Attached to {url}: its log is where it runs.")
            self.model.engine.set_state(EngineState.LOADING, f"Connecting to {url}…")
            self.link.follow(self.attached_client)
        elif self.settings.serve_on_start:
            self.start_serving()
        self._recompute_state()
        if self.tray is not None:
            self.tray.show()
            if not self.options.hidden:
                self.open_dashboard()
        else:
            # No tray to live in: the window is the app (even with --hidden).
            self.open_dashboard()

    # -- state -----------------------------------------------------------------------

    @property
    def client(self) -> EngineClient | None:
        """The client of the engine being shown (attached, or the supervised child)."""
        return self.attached_client or self.supervisor.client

    def tray_snapshot(self) -> TraySnapshot:
        engine = self.model.engine
        return TraySnapshot(
            state=engine.state, detail=engine.detail, model_label=engine.model_label,
            tok_s=self.model.throughput.tok_s, api_url=engine.api_url,
            attached=engine.attached, current_model=self.current_model,
            recent=tuple(self.settings.recent_models))

    def _derive_state(self) -> tuple[EngineState, str | None]:
        gate = self.gate_state
        if self.options.attach:
            if not self.link.is_connected:
                return EngineState.FAILED, self.model.engine.detail or "The engine is unreachable."
            return EngineState(gate) if gate else EngineState.LOADING, None
        phase = self.supervisor.phase
        if phase == Phase.IDLE:
            return EngineState.STOPPED, None
        if phase == Phase.STARTING:
            return EngineState.LOADING, "Starting the engine process…"
        if phase == Phase.RESTARTING:
            return EngineState.LOADING, f"Restarting after a crash: {self.supervisor.last_reason}"
        if phase == Phase.STOPPING:
            return EngineState.STOPPING, None
        if phase == Phase.FAILED:
            return EngineState.FAILED, self.supervisor.last_reason
        state = EngineState(gate) if gate else EngineState.LOADING
        if state == EngineState.FAILED:
            reason = self.model.engine.failure
            if reason:
                return state, f"The engine failed: {reason}"
            return state, "The engine reports it failed; see Logs, then restart."
        load = self.model.engine.load
        if state == EngineState.LOADING and load is not None:
            total = "?" if load.total is None else str(load.total)
            return state, f"Loading: {load.stage} ({load.done}/{total})"
        return state, None

    def _recompute_state(self) -> None:
        state, detail = self._derive_state()
        if self.model.engine.set_state(state, detail):
            self.state_changed.emit()
        if state in (EngineState.STOPPED, EngineState.FAILED) and self.model.pools.gate_state is not None:
            self.model.pools.clear()  # no engine to re-split: the slider says so
        if self.tray is not None:
            self.tray.set_state(state, self._tooltip())

    def _tooltip(self) -> str:
        engine = self.model.engine
        lines = [f"moetray — {engine.state.value}"]
        if engine.model_label:
            lines.append(engine.model_label)
        if engine.detail:
            lines.append(engine.detail)
        return "\n".join(lines)

    # -- supervisor and feed events ----------------------------------------------------

    def _on_phase(self, phase: str) -> None:
        if phase == Phase.RUNNING and self.supervisor.client is not None:
            self.link.follow(self.supervisor.client)
        elif phase in (Phase.IDLE, Phase.FAILED, Phase.RESTARTING):
            self.link.stop()
            self.gate_state = None
            self.model.forget_engine()
        self._recompute_state()

    def _on_health(self, body: dict) -> None:
        state = body.get("state")
        if state in {s.value for s in EngineState}:
            self.gate_state = state
        self.model.engine.apply_health(body)
        self._recompute_state()

    def _on_snapshot(self, snap: Mapping[str, Any]) -> None:
        self.gate_state = snap.get("state") or self.gate_state
        self._measure_tray()
        self.model.apply_snapshot(snap, time.monotonic())
        self._recompute_state()

    def _on_disconnected(self, reason: str) -> None:
        if self.options.attach:
            self.gate_state = None
            self.model.engine.set_state(EngineState.FAILED, f"Engine unreachable: {reason}")
        self._recompute_state()

    def _on_crashed(self, reason: str) -> None:
        self.model.logs.append([f"[moetray] {reason}"])
        more = " Restarting it once." if self.supervisor.restarts_used < self.supervisor.max_restarts \
            else ""
        self.notified.emit("moetray: engine crashed", reason + more, True)

    def _on_gave_up(self, reason: str) -> None:
        self.model.logs.append([f"[moetray] not restarting again: {reason}"])
        self.notified.emit("moetray: engine failed",
                           f"{reason} It was restarted once already; use Start serving to try again.", True)
        self._recompute_state()

    def _measure_tray(self) -> None:
        fp = self._tray_probe.get_or_probe(lambda: probe_footprint(os.getpid(), _read_text))
        self.model.memory.set_tray_footprint(
            None if fp is None else FootprintView(fp.bytes, fp.kind.value))

    def _show_notification(self, title: str, message: str, is_error: bool) -> None:
        if self.tray is not None:
            self.tray.notify(title, message, error=is_error)

    # -- verbs (the tray, the window and tests call these) ----------------------------

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``coro`` on the loop, keeping a reference and logging a failure."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)

        def done(t: asyncio.Task[Any]) -> None:
            self._tasks.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.error("moetray task failed", exc_info=t.exception())
                self.model.logs.append([f"[moetray] internal error: {t.exception()!r}"])

        task.add_done_callback(done)
        return task

    def start_serving(self, folder: str | None = None) -> bool:
        """Validate and spawn the engine for ``folder`` (default: the last model).

        Refusals (bad folder, busy port) are shown, not raised; returns whether it started.
        """
        if self.options.attach:
            return False
        folder = self.current_model if folder is None else folder
        folder = DEMO_MODEL if folder is None else folder
        spec = LaunchSpec(model=folder or None, port=self.settings.port, device=self.settings.device,
                          extra_args=tuple(self.settings.engine_args))
        try:
            plan = prepare_launch(spec)
            self.supervisor.start(plan)
        except LaunchRefused as refused:
            self.model.engine.set_state(self.model.engine.state, refused.message)
            self.notified.emit("moetray: cannot start the engine", refused.message, True)
            self.state_changed.emit()
            return False
        self.current_model = folder
        self.settings.remember_model(folder)
        self.model.engine.set_endpoint(plan.base_url + "/v1", attached=False)
        self.model.logs.set_source(f"Engine output (pid {self.supervisor.pid})")
        self.model.logs.append([f"[moetray] started: {' '.join(plan.argv)}"])
        self._recompute_state()
        return True

    async def stop_serving(self) -> dict[str, Any] | None:
        """prepare-stop (drain, seal, receipt), then end the child; returns the receipt.

        A prepare-stop that fails is logged and the child is ended anyway: the user asked
        for the memory back.
        """
        if self.options.attach or not self.supervisor.active:
            return None
        receipt = None
        client = self.supervisor.client
        self.link.stop()
        if client is not None and self.supervisor.phase == Phase.RUNNING:
            self.model.engine.set_state(EngineState.STOPPING, "Draining requests…")
            try:
                receipt = await client.prepare_stop(drain_timeout_s=DRAIN_TIMEOUT_S)
                self.model.logs.append([f"[moetray] stop receipt: {receipt}"])
            except EngineError as exc:
                self.model.logs.append([f"[moetray] prepare-stop failed ({exc.kind}): {exc.message}"])
        code = await self.supervisor.stop()
        self.model.logs.append([f"[moetray] engine ended (exit code {code})"])
        self._recompute_state()
        return receipt

    def toggle_serving(self) -> None:
        if self.supervisor.active:
            self.spawn(self.stop_serving())
        else:
            self.start_serving()

    async def restart_engine(self) -> bool:
        await self.stop_serving()
        return self.start_serving()

    def choose_model(self, folder: str) -> None:
        """Serve ``folder`` (or the demo default): restarts a running engine on the new model."""
        self.current_model = folder
        self.settings.remember_model(folder)
        if self.options.attach:
            return
        if self.supervisor.active:
            self.spawn(self.restart_engine())
        else:
            self.start_serving(folder)

    def open_model_folder(self) -> None:
        folder = QFileDialog.getExistingDirectory(
            self.window, "Open a Hugging Face MoE checkpoint folder", str(Path.home()))
        if folder:
            self.choose_model(folder)

    def copy_api_url(self) -> str | None:
        url = self.model.engine.api_url
        if url:
            QGuiApplication.clipboard().setText(url)
        return url

    def open_dashboard(self) -> None:
        window = self.window if self.window is not None else self._build_window()
        window.raise_window()

    def quit(self) -> None:
        """Ask the bootstrap to shut down (Quit, last window, SIGTERM and Ctrl-C all land here)."""
        self.quit_requested.emit()

    async def apply_pools(self) -> None:
        """Apply the slider's selection through ``POST /admin/cache/rebuild``; show the outcome."""
        pools = self.model.pools
        client = self.client
        try:
            target = pools.begin_apply()
        except ApplyRefused as refused:
            self.model.logs.append([f"[moetray] apply refused: {refused.reason}"])
            return
        if client is None:
            pools.finish_apply(rebuild_outcome(None, {"message": "No engine is running."}))
            return
        try:
            status, body = await client.rebuild(moe_slots=target.moe_slots, kv_tokens=target.kv_tokens,
                                                state_slots=target.state_slots)
            outcome = rebuild_outcome(status, body)
        except EngineError as exc:
            outcome = rebuild_outcome(None, {"message": exc.message})
        pools.finish_apply(outcome)
        self.model.logs.append([f"[moetray] re-split: {outcome.text()}"])
        if outcome.severity == "error":
            self.notified.emit("moetray: re-split", outcome.text(), True)
        await self.refresh_status()

    async def refresh_status(self) -> None:
        """One ``GET /admin/status`` now, instead of waiting for the next event."""
        client = self.client
        if client is None:
            return
        try:
            snap = await client.status()
        except EngineError:
            return
        self._on_snapshot(snap)

    async def cancel_request(self, request_id: str) -> bool:
        """Stop one request; the row shows "stopping" until the engine stops listing it."""
        client = self.client
        if client is None:
            return False
        self.model.requests.mark_stopping([request_id])
        try:
            await client.cancel(request_id)
        except EngineError as exc:
            if exc.kind != "not_found":  # already finished: nothing to stop
                self.model.requests.unmark_stopping(request_id)
                self.model.logs.append([f"[moetray] stop {request_id} refused ({exc.kind}): {exc.message}"])
                return False
        await self.refresh_requests()
        return True

    async def cancel_all(self) -> int:
        ids = [row.id for row in self.model.requests.rows]
        results = await asyncio.gather(*(self.cancel_request(rid) for rid in ids))
        return sum(results)

    async def refresh_requests(self) -> None:
        client = self.client
        if client is None:
            return
        try:
            rows = await client.requests()
        except EngineError:
            return
        self.model.requests.apply_requests(rows, fresh=True)

    def set_autostart(self, enabled: bool) -> None:
        path = autostart.set_enabled(enabled)
        self.model.logs.append([f"[moetray] autostart {'on' if enabled else 'off'}: {path}"])
        self._refresh_settings_view()

    def set_serve_on_start(self, enabled: bool) -> None:
        self.settings.serve_on_start = enabled
        self._refresh_settings_view()

    # -- window ------------------------------------------------------------------------

    def _build_window(self) -> DashboardWindow:
        from moetray.ui.dashboard import DashboardWindow

        window = DashboardWindow(self.model)
        window.header.start_stop_clicked.connect(self.toggle_serving)
        window.header.copy_url_clicked.connect(self.copy_api_url)
        window.header.quit_clicked.connect(self.quit)
        window.pools.apply_clicked.connect(lambda: self.spawn(self.apply_pools()))
        window.pools.restart_clicked.connect(lambda: self.spawn(self.restart_engine()))
        window.requests.stop_clicked.connect(lambda rid: self.spawn(self.cancel_request(rid)))
        window.requests.stop_all_clicked.connect(lambda: self.spawn(self.cancel_all()))
        window.settings.autostart_toggled.connect(self.set_autostart)
        window.settings.serve_on_start_toggled.connect(self.set_serve_on_start)
        window.closed.connect(self._window_closed)
        menu = QMenu(window)
        menu.aboutToShow.connect(lambda: populate_model_menu(menu, self.tray_snapshot(), self))
        populate_model_menu(menu, self.tray_snapshot(), self)
        window.set_model_menu(menu)
        self._model_menu = menu
        self.window = window
        self._refresh_settings_view()
        return window

    def _refresh_settings_view(self) -> None:
        if self.window is not None:
            self.window.settings.set_values(
                autostart=autostart.is_enabled(), serve_on_start=self.settings.serve_on_start,
                paths=f"Settings: {self.settings.path}\nAutostart entry: {autostart.autostart_path()}")

    def _window_closed(self) -> None:
        if self.tray is None:  # the window was the whole app: closing it is Quit
            self.quit()

    # -- shutdown --------------------------------------------------------------------------

    async def shutdown(self) -> None:
        """Idempotent teardown: stop the feed, stop a supervised engine (receipt first), close UI.

        An attached engine keeps running. Failures are logged, never raised: shutdown must
        reach its end.
        """
        if self._shutdown_started:
            return
        self._shutdown_started = True
        await self.link.close()
        try:
            await self.stop_serving()
        except Exception:  # noqa: BLE001 - shutdown must complete
            log.exception("stopping the engine during shutdown failed")
            await self.supervisor.stop(grace_s=1.0, term_grace_s=1.0)
        pending = [t for t in self._tasks if not t.done() and t is not asyncio.current_task()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        if self.attached_client is not None:
            await self.attached_client.aclose()
        if self.window is not None:
            self.window.hide()
        if self.tray is not None:
            self.tray.hide()
        self.settings.sync()
