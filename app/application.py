"""The one application object: owns the tray, the supervisor, the live feed and the dashboard.

vorta's ``VortaApp`` shape. Windows and the tray talk to this object (its verbs and its
domain signals), never to each other and never to the engine. Every engine call goes
through :class:`~moetray.app.client.EngineClient`; every number shown goes through the
:class:`~moetray.ui.dashboard_model.DashboardModel`.

Two ways to have an engine:

- **supervised** (default): the tray serves at once on its first launch (``serve_on_start``)
  on 127.0.0.1:8765, or the next free port, which it then names; Stop serving and Quit
  run prepare-stop, wait for the receipt, then end the child (the device memory is freed);
- **attached** (``--attach URL``): the engine runs elsewhere; the tray watches and
  controls it (re-split, cancel) but never starts or stops it.

State changes, crashes and refusals are also logged (``moetray.app``, to stderr), so a
terminal user or a bug report sees them.
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
from moetray.app.catalog import ModelCatalog
from moetray.app.client import EngineClient, EngineError
from moetray.app.link import EngineLink
from moetray.app.settings import DEMO_MODEL, LAN, Settings
from moetray.app.supervisor import EngineSupervisor, LaunchRefused, LaunchSpec, Phase, prepare_launch
from moetray.app.tray import TrayController, TraySnapshot, model_title, populate_model_menu
from moetray.policy.footprint import Footprint, ProbeCache, probe_footprint
from moetray.ui.dashboard_model import DashboardModel
from moetray.ui.outcome import rebuild_outcome
from moetray.ui.pools_model import ApplyRefused
from moetray.ui.settings_dialog import SettingsDialog, SettingsValues
from moetray.ui.theme import themes
from moetray.ui.viewmodels import EngineState, FootprintView

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
                 *, supervisor: EngineSupervisor | None = None, catalog: ModelCatalog | None = None) -> None:
        super().__init__()
        self.qapp = qapp
        self.settings = settings
        self.options = options
        self.model = DashboardModel()
        self.supervisor = supervisor or EngineSupervisor()
        self.catalog = catalog or ModelCatalog()
        self.link = EngineLink()
        self.window: DashboardWindow | None = None  # built on first open
        self.settings_dialog: SettingsDialog | None = None
        self.tray: TrayController | None = None
        self.attached_client: EngineClient | None = None
        self.gate_state: str | None = None
        self.current_model: str | None = None
        self.port_note: str | None = None  # the port moved: said in the menu until serving stops
        self._to_remember: str | None = None  # remembered once the engine serves it, never if refused
        self._served: int | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._shutdown_started = False
        # Reading our own smaps_rollup costs ~10 ms (Qt maps many libraries): once per 10 s.
        self._tray_probe: ProbeCache[Footprint | None] = ProbeCache(10.0, time.monotonic)
        self._model_menu: QMenu | None = None

    # -- wiring ----------------------------------------------------------------------

    def initialize(self) -> None:
        """Connect the parts, apply the theme; creates the tray icon (or not, where none exists)."""
        sup = self.supervisor
        sup.phase_changed.connect(self._on_phase)
        sup.health.connect(self._on_health)
        sup.log_lines.connect(self.model.logs.append)
        sup.crashed.connect(self._on_crashed)
        sup.gave_up.connect(self._on_gave_up)
        sup.restarting.connect(self._on_restarting)
        self.link.snapshot.connect(self._on_snapshot)
        self.link.disconnected.connect(self._on_disconnected)
        self.link.connected.connect(self._recompute_state)
        self.notified.connect(self._show_notification)
        themes().apply(self.settings.theme)
        if not self.options.no_tray and TrayController.available():
            self.tray = TrayController(self, self.tray_snapshot)
            self.tray.menu.aboutToShow.connect(self._refresh_catalog_if_old)
        self.current_model = self.settings.last_model if self.options.attach is None else None

    async def start(self) -> None:
        """Phase two of bootstrap: attach, or end a dead tray's engine and serve; then show."""
        if self.options.attach:
            url = self.options.attach.rstrip("/")
            if url.endswith("/v1"):
                url = url[:-3]
            self.attached_client = EngineClient(url, self.options.admin_token)
            self.model.engine.set_endpoint(self.attached_client.api_url, attached=True)
            self.model.logs.set_source(f"Attached to {url}: its log is where it runs.")
            self.model.engine.set_state(EngineState.LOADING, f"Connecting to {url}…")
            self.link.follow(self.attached_client)
        else:
            for orphan in await self.supervisor.records.end_orphans():
                self.model.logs.append([f"[moetray] ended engine pid {orphan.engine_pid} "
                                        f"({orphan.base_url}), left running by tray pid {orphan.tray_pid}"])
            self.spawn(self.catalog.refresh())
            if self.settings.serve_on_start:
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
            recent=tuple(self.settings.recent_models), crashes=engine.crash_count,
            last_crash=engine.last_crash, port_note=self.port_note, catalog=self.catalog.rows,
            catalog_note=self.catalog.error)

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
            log.info("engine %s%s", state.value, f": {detail}" if detail else "")
            self.state_changed.emit()
        if state == EngineState.SERVING and self._to_remember is not None:
            # Only a model the engine actually serves becomes the last and a recent one.
            self.settings.remember_model(self._to_remember)
            self._to_remember = None
        if state in (EngineState.STOPPED, EngineState.FAILED) and self.model.pools.gate_state is not None:
            self.model.pools.clear()  # no engine to re-split: the slider says so
        if self.tray is not None:
            self.tray.set_state(state, self._tooltip())

    def _tooltip(self) -> str:
        engine = self.model.engine
        lines = [f"moetray — {engine.state.value}"]
        if engine.model_label:
            lines.append(engine.model_label)
        if engine.api_url:
            lines.append(engine.api_url)
        if engine.detail:
            lines.append(engine.detail)
        return "\n".join(lines)

    # -- supervisor and feed events ----------------------------------------------------

    def _on_phase(self, phase: str) -> None:
        plan = self.supervisor.plan
        if phase == Phase.STARTING and plan is not None:
            self.model.engine.set_endpoint(plan.base_url + "/v1", attached=False)
            self.model.logs.set_source(f"Engine output (pid {self.supervisor.pid})")
        elif phase == Phase.RUNNING and self.supervisor.client is not None:
            self.link.follow(self.supervisor.client)
        elif phase in (Phase.IDLE, Phase.FAILED, Phase.RESTARTING):
            # The engine is gone: no URL to copy, and every chart line ends here.
            self.link.stop()
            self.gate_state = None
            self.model.forget_engine(time.monotonic())
            if phase == Phase.IDLE:
                self.port_note = None
        self.model.engine.set_crashes(self.supervisor.crash_count, self.supervisor.last_reason
                                      if self.supervisor.crash_count else None)
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
        served = (snap.get("throughput") or {}).get("requests_served")
        if served != self._served:
            self._served = served
            if self.window is not None:
                self.spawn(self.refresh_history())

    def _on_disconnected(self, reason: str) -> None:
        if self.options.attach:
            self.gate_state = None
            self.model.engine.set_state(EngineState.FAILED, f"Engine unreachable: {reason}")
        self._recompute_state()

    def _on_crashed(self, reason: str) -> None:
        sup = self.supervisor
        self.model.logs.append([f"[moetray] {reason}"])
        log.warning("engine crashed: %s (%d in the last 10 min)", reason, sup.crash_count)
        self.model.engine.set_crashes(sup.crash_count, reason)
        if sup.phase == Phase.RESTARTING:
            self.notified.emit("moetray: engine crashed",
                               f"{reason} Restarting it (crash {sup.crash_count} of "
                               f"{sup.restart_budget.max_crashes} allowed in 10 minutes).", True)

    def _on_restarting(self, delay: float) -> None:
        self.model.logs.append([f"[moetray] restarting the engine in {delay:.0f} s"])
        log.info("restarting the engine in %.0f s", delay)

    def _on_gave_up(self, reason: str) -> None:
        count = self.supervisor.crash_count
        self.model.logs.append([f"[moetray] not restarting again: {reason}"])
        log.error("engine down after %d crashes in 10 minutes: %s", count, reason)
        self.notified.emit("moetray: engine stopped",
                           f"{reason} It crashed {count} times in 10 minutes, so it stays down: "
                           "use Restart engine in the menu.", True)
        self._recompute_state()

    def _measure_tray(self) -> None:
        fp = self._tray_probe.get_or_probe(lambda: probe_footprint(os.getpid(), _read_text))
        self.model.memory.set_tray_footprint(
            None if fp is None else FootprintView(fp.bytes, fp.kind.value))

    def _show_notification(self, title: str, message: str, is_error: bool) -> None:
        (log.warning if is_error else log.info)("%s: %s", title, message)
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

    def launch_spec(self, model: str) -> LaunchSpec:
        """The engine the settings ask for, serving ``model`` (a taken port moves to the next free one)."""
        s = self.settings
        api_key = s.api_key(create=True) if s.host == LAN else None
        return LaunchSpec(model=model or None, host=s.host, port=s.port, port_fallback=True, device=s.device,
                          kv_tokens=s.kv_tokens, threads=s.threads, api_key=api_key,
                          extra_args=tuple(s.engine_args))

    def start_serving(self, folder: str | None = None) -> bool:
        """Validate and spawn the engine for ``folder`` (default: the chosen model).

        Refusals (bad folder, bad address) are shown, not raised; returns whether it started.
        The model is remembered as last and recent only once the engine serves it.
        """
        if self.options.attach:
            return False
        folder = self.current_model if folder is None else folder
        folder = DEMO_MODEL if folder is None else folder
        try:
            plan = prepare_launch(self.launch_spec(folder))
            self.supervisor.start(plan)
        except (LaunchRefused, PermissionError) as refused:
            message = getattr(refused, "message", str(refused))
            self.model.engine.set_state(self.model.engine.state, message)
            self.notified.emit("moetray: cannot start the engine", message, True)
            self.state_changed.emit()
            return False
        self.current_model = folder
        self._to_remember = folder
        self.port_note = None
        if plan.port_moved:
            self.port_note = (f"Port {plan.requested_port} is taken: serving on {plan.port} "
                              f"({plan.base_url}/v1)")
            self.notified.emit("moetray: another port", self.port_note, False)
        self.model.logs.append([f"[moetray] started: {' '.join(plan.argv)}"])
        self._recompute_state()
        return True

    async def stop_serving(self, why: str = "Stop serving from the tray") -> dict[str, Any] | None:
        """prepare-stop (drain, seal, receipt), then end the child; returns the receipt.

        A prepare-stop that fails is logged and the child is ended anyway: the user asked
        for the memory back.
        """
        if self.options.attach or not self.supervisor.active:
            return None
        receipt = None
        client = self.supervisor.client
        self.model.logs.append([f"[moetray] {why}"])
        log.info("%s", why)
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
        await self.stop_serving("Restarting the engine")
        return self.start_serving()

    def choose_model(self, folder: str) -> None:
        """Serve ``folder`` (or the demo default): restarts a running engine on the new model."""
        self.current_model = folder
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

    def _refresh_catalog_if_old(self) -> None:
        if not self.options.attach:
            self.spawn(self.catalog.refresh())

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

    # -- re-split -----------------------------------------------------------------------

    async def apply_pools(self) -> None:
        """Apply the slider's selection through ``POST /admin/cache/rebuild``; show the outcome.

        While the engine waits for running requests, the snapshot feed shows how long and
        the panel offers Stop them and apply / Cancel (:meth:`stop_running_for_resplit`,
        :meth:`cancel_resplit`).
        """
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
        (log.info if outcome.severity == "ok" else log.warning)("re-split: %s", outcome.text())
        if outcome.severity == "error":
            self.notified.emit("moetray: re-split", outcome.text(), True)
        await self.refresh_status()

    async def stop_running_for_resplit(self) -> None:
        """"Stop them and apply": the requests a waiting re-split waits for are stopped."""
        client = self.client
        if client is None:
            return
        self.model.pools.mark_stopping_running()
        try:
            body = await client.rebuild_stop_running()
            self.model.logs.append([f"[moetray] stopped {len(body.get('stopped') or [])} request(s) "
                                    "so the re-split applies"])
        except EngineError as exc:
            self.model.logs.append([f"[moetray] stop-and-apply refused ({exc.kind}): {exc.message}"])

    async def cancel_resplit(self) -> None:
        """"Cancel": a re-split still waiting gives up; its Apply reply says nothing changed."""
        client = self.client
        if client is None:
            return
        try:
            await client.rebuild_cancel()
        except EngineError as exc:
            self.model.logs.append([f"[moetray] cancel refused ({exc.kind}): {exc.message}"])

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

    # -- requests -------------------------------------------------------------------------

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

    async def refresh_history(self) -> None:
        """The engine's feed of finished requests into the history table."""
        client = self.client
        if client is None:
            return
        try:
            body = await client.request_history()
        except EngineError as exc:
            self.model.history.set_error(exc.message)
            return
        self.model.history.apply_history(body)

    # -- settings -------------------------------------------------------------------------

    def settings_values(self) -> SettingsValues:
        s = self.settings
        return SettingsValues(model=self.current_model or DEMO_MODEL, host=s.host, port=s.port,
                              kv_tokens=s.kv_tokens, threads=s.threads, autostart=autostart.is_enabled(),
                              serve_on_start=s.serve_on_start, theme=s.theme)

    def open_settings(self) -> SettingsDialog:
        """Show the Settings dialog (not blocking the loop); OK applies it (:meth:`apply_settings`)."""
        if self.settings_dialog is not None and self.settings_dialog.isVisible():
            self.settings_dialog.raise_()
            return self.settings_dialog
        models = [(DEMO_MODEL, "Demo model (embedded default)")]
        models += [(r.launch_value, r.name) for r in self.catalog.rows if r.servable and not r.is_demo]
        models += [(f, model_title(f)) for f in self.settings.recent_models]
        dialog = SettingsDialog(self.settings_values(), models=models,
                                engine_running=self.supervisor.active,
                                api_key_path=str(self.settings.api_key_path), paths=self._paths_text(),
                                parent=self.window)

        def browse() -> None:
            folder = QFileDialog.getExistingDirectory(dialog, "Open a Hugging Face MoE checkpoint folder",
                                                      str(Path.home()))
            if folder:
                dialog.add_model(folder, model_title(folder))

        dialog.browse_requested.connect(browse)
        dialog.accepted.connect(lambda: self.apply_settings(dialog.values(), restart=dialog.restart_now))
        self.settings_dialog = dialog
        dialog.open()
        return dialog

    def apply_settings(self, values: SettingsValues, *, restart: bool = False) -> None:
        """Store ``values``; the theme and start-up ones apply now, the engine ones at its next
        start, or now when ``restart``."""
        before = self.settings_values()
        s = self.settings
        s.host, s.port, s.kv_tokens, s.threads = values.host, values.port, values.kv_tokens, values.threads
        s.serve_on_start = values.serve_on_start
        s.theme = values.theme
        s.sync()
        themes().apply(values.theme)
        if values.autostart != before.autostart:
            self.set_autostart(values.autostart)
        changed = values.engine_changes(before)
        if changed:
            self.model.logs.append([f"[moetray] settings changed: {', '.join(changed)}"])
        self.current_model = values.model
        if restart and self.supervisor.active:
            self.spawn(self.restart_engine())
        self._refresh_settings_view()

    def set_autostart(self, enabled: bool) -> None:
        path = autostart.set_enabled(enabled)
        self.model.logs.append([f"[moetray] autostart {'on' if enabled else 'off'}: {path}"])
        self._refresh_settings_view()

    def _paths_text(self) -> str:
        return (f"Settings: {self.settings.path}\nAutostart entry: {autostart.autostart_path()}\n"
                f"LAN API key: {self.settings.api_key_path}")

    # -- window ------------------------------------------------------------------------

    def _build_window(self) -> DashboardWindow:
        from moetray.ui.dashboard import DashboardWindow

        window = DashboardWindow(self.model)
        window.header.start_stop_clicked.connect(self.toggle_serving)
        window.header.copy_url_clicked.connect(self.copy_api_url)
        window.header.quit_clicked.connect(self.quit)
        window.pools.apply_clicked.connect(lambda: self.spawn(self.apply_pools()))
        window.pools.restart_clicked.connect(lambda: self.spawn(self.restart_engine()))
        window.pools.stop_running_clicked.connect(lambda: self.spawn(self.stop_running_for_resplit()))
        window.pools.cancel_clicked.connect(lambda: self.spawn(self.cancel_resplit()))
        window.requests.stop_clicked.connect(lambda rid: self.spawn(self.cancel_request(rid)))
        window.requests.stop_all_clicked.connect(lambda: self.spawn(self.cancel_all()))
        window.requests.history_shown.connect(lambda: self.spawn(self.refresh_history()))
        window.settings.settings_clicked.connect(self.open_settings)
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
        if self.window is None:
            return
        v = self.settings_values()
        where = "this computer only" if v.host != LAN else "the local network (API key required)"
        summary = (f"Model: {model_title(v.model)} · API on {where}, port {v.port or 'any free'} · "
                   f"context: {v.kv_tokens or 'planned by the engine'} · "
                   f"threads: {v.threads or 'automatic'}\n"
                   f"Serve on start: {'on' if v.serve_on_start else 'off'} · start at login: "
                   f"{'on' if v.autostart else 'off'} · theme: {v.theme}")
        self.window.settings.set_values(summary, self._paths_text())

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
            await self.stop_serving("Quit: stopping the engine")
        except Exception:  # noqa: BLE001 - shutdown must complete
            log.exception("stopping the engine during shutdown failed")
            await self.supervisor.stop(grace_s=1.0, term_grace_s=1.0)
        pending = [t for t in self._tasks if not t.done() and t is not asyncio.current_task()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        if self.attached_client is not None:
            await self.attached_client.aclose()
        if self.settings_dialog is not None:
            self.settings_dialog.close()
        if self.window is not None:
            self.window.hide()
        if self.tray is not None:
            self.tray.hide()
        self.settings.sync()
