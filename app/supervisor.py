"""The engine child: validated, spawned in its own session, watched, restarted with back-off, stopped.

Shape after vorta's ``BorgJob``: :func:`prepare_launch` checks every precondition and
refuses with a named :class:`LaunchRefused` before any process exists; the returned
:class:`LaunchPlan` is the exact argv and environment (the admin token and a LAN API key
travel in the environment, never in argv). :class:`EngineSupervisor` then runs one child
at a time:

- **watch**: the child's output is read without blocking and re-emitted as log lines;
  ``GET /health`` is probed every ``probe_interval_s``; a tick every ``tick_s`` notices an
  exit, or an engine that answered before and has not answered for ``unresponsive_after_s``
  (2 s by default). An engine whose last answer said it was busy (requests in flight,
  its batch loop's heartbeat advancing) is given ``busy_grace_s`` instead: a slow request
  is not a hang;
- **restart with back-off**: an unexpected exit or hang is reported (``crashed``) and the
  engine is started again as :class:`~moetray.policy.restart.RestartBudget` decides (1 s,
  3 s, 10 s for up to 3 crashes within 10 minutes; the budget refills). Past it the engine
  stays down (``gave_up``) until the user restarts it: never a restart loop;
- **no orphan**: the child is told its parent's pid (``wire.PARENT_PID_ENV``) and ends when
  the tray dies without a clean exit; each running engine is recorded
  (:class:`~moetray.app.orphans.EngineRecords`) so a later tray ends one a dead tray left;
- **stop by escalation**: SIGINT → wait → SIGTERM to the group → wait → SIGKILL to the
  group; a process that is already gone counts as stopped.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from PySide6.QtCore import QObject, Signal

from moetray.app.client import EngineClient, EngineError
from moetray.app.orphans import EngineRecords
from moetray.policy import wire
from moetray.policy.refused import Refused
from moetray.policy.restart import RestartBudget

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
LAN_HOSTS = ("0.0.0.0", "::")
LAUNCH_KINDS = ("no_such_model", "not_a_checkpoint", "port_in_use", "not_loopback", "already_running")
MODEL_NAME_PREFIXES = ("hf:", "ollama:", "lmstudio:")
"""Names ``moetray models`` lists and ``moetray serve --model`` resolves (besides ``demo``)."""
PORT_SEARCH = 50
"""How many ports after a taken one are tried before any free port is taken."""


class LaunchRefused(Refused):
    """The engine cannot be started as asked; raised before any process exists."""

    KINDS = LAUNCH_KINDS
    message: str

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(kind, message)
        self.message = message


@dataclass(frozen=True)
class LaunchSpec:
    """What the user asked for. ``model=None`` serves the embedded default model.

    ``port`` 0 picks any free port; with ``port_fallback`` a taken port moves to the next
    free one (the tray's way) instead of refusing (``port_in_use``). A LAN ``host`` needs
    ``api_key``.
    """

    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 0
    port_fallback: bool = False
    device: str = "auto"
    moe_capacity: str | None = None
    kv_tokens: int | None = None
    threads: int | None = None
    api_key: str | None = field(default=None, repr=False)
    extra_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class LaunchPlan:
    """The exact child process to start; ``env`` carries the admin token (and any API key).

    ``requested_port`` is the port asked for; ``port`` the one the engine will listen on
    (they differ when the asked one was taken and the plan moved on).
    """

    argv: tuple[str, ...]
    env: Mapping[str, str] = field(repr=False)
    base_url: str
    token: str = field(repr=False)
    model: str | None
    port: int = 0
    requested_port: int = 0

    @property
    def port_moved(self) -> bool:
        return bool(self.requested_port) and self.port != self.requested_port


def _socket_family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (the engine binds it a moment later)."""
    with socket.socket(_socket_family(host)) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_is_free(host: str, port: int) -> bool:
    """Whether the engine could listen on ``host:port`` now.

    Binds as the engine does (``SO_REUSEADDR``), so a port whose old connections linger in
    TIME_WAIT after a restart still counts as free; only a listener makes it taken.
    """
    with socket.socket(_socket_family(host)) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def pick_port(host: str, port: int, *, fallback: bool) -> int:
    """``port`` if free; else, with ``fallback``, the next free one (or any free one).

    ``port`` 0 means any free port. Refuses a taken port without ``fallback`` with
    ``LaunchRefused("port_in_use")``.
    """
    if port == 0:
        return free_port(host)
    if port_is_free(host, port):
        return port
    if not fallback:
        raise LaunchRefused("port_in_use", f"Port {port} is in use; is another moetray engine running?")
    for candidate in range(port + 1, min(port + 1 + PORT_SEARCH, 65536)):
        if port_is_free(host, candidate):
            return candidate
    return free_port(host)


def is_model_name(model: str) -> bool:
    """A name from ``moetray models`` (``hf:ORG/NAME``, ``ollama:NAME:TAG``, …), not a path."""
    return model == "demo" or model.startswith(MODEL_NAME_PREFIXES)


def _check_model(model: str) -> str:
    """The ``--model`` value: a name as is, a path resolved; refuses a path that is no checkpoint."""
    if is_model_name(model):
        return model
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return str(path.resolve())
    if not path.is_dir():
        raise LaunchRefused("no_such_model", f"No such model folder: {path}")
    if not (path / "config.json").is_file() and not any(path.glob("*.gguf")):
        raise LaunchRefused("not_a_checkpoint",
                            f"{path} has no config.json; pick a Hugging Face checkpoint folder.")
    return str(path.resolve())


def engine_command(python: str = sys.executable) -> list[str]:
    """``python -m moetray.app.cli serve``: the same code, the same environment as the tray."""
    return [python, "-m", "moetray.app.cli", "serve"]


def prepare_launch(spec: LaunchSpec, *, python: str = sys.executable, token: str | None = None,
                   environ: Mapping[str, str] | None = None) -> LaunchPlan:
    """Check ``spec`` and return the launch plan; refuses with :class:`LaunchRefused`.

    Decides the port (:func:`pick_port`) and the admin token (a fresh one per launch
    unless given). Refuses, in this order: an address that is neither loopback nor a LAN
    address with an API key (``not_loopback``), a missing model (``no_such_model``), a
    folder that is no checkpoint (``not_a_checkpoint``), a port already taken without
    fallback (``port_in_use``). Starts nothing.
    """
    if spec.host not in LOOPBACK_HOSTS and not (spec.host in LAN_HOSTS and spec.api_key):
        raise LaunchRefused("not_loopback",
                            f"The tray serves on {spec.host} only with an API key (Settings → Address).")
    model = None if spec.model is None else _check_model(spec.model)
    port = pick_port(spec.host, spec.port, fallback=spec.port_fallback)
    argv = engine_command(python)
    if model is not None:
        argv += ["--model", model]
    argv += ["--host", spec.host, "--port", str(port), "--device", spec.device]
    if spec.moe_capacity is not None:
        argv += ["--moe-capacity", str(spec.moe_capacity)]
    if spec.kv_tokens is not None:
        argv += ["--kv-tokens", str(spec.kv_tokens)]
    if spec.threads is not None:
        argv += ["--threads", str(spec.threads)]
    argv += list(spec.extra_args)
    token = token or secrets.token_urlsafe(32)
    env = dict(os.environ if environ is None else environ)
    env.pop(wire.ADMIN_TOKEN_FILE_ENV, None)
    env.pop(wire.API_KEY_ENV, None)
    env[wire.ADMIN_TOKEN_ENV] = token
    if spec.api_key:
        env[wire.API_KEY_ENV] = spec.api_key
    env["PYTHONUNBUFFERED"] = "1"
    shown = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(spec.host, spec.host)  # the tray talks locally
    host = f"[{shown}]" if ":" in shown else shown
    return LaunchPlan(tuple(argv), env, f"http://{host}:{port}", token, spec.model, port, spec.port)


class Phase(StrEnum):
    """The supervisor's own state (the engine's gate state comes from ``/health``)."""

    IDLE = "idle"  # no child
    STARTING = "starting"  # spawned, no answer from /health yet
    RUNNING = "running"  # answered /health at least once
    RESTARTING = "restarting"  # waiting out the back-off after a crash
    STOPPING = "stopping"  # ending the child on purpose
    FAILED = "failed"  # crashed and out of restarts, or could not start


@dataclass
class _Child:
    plan: LaunchPlan
    proc: subprocess.Popen[bytes]
    client: EngineClient
    started: float
    last_ok: float | None = None
    busy: bool = False  # the last /health said requests were in flight
    intentional: bool = False
    partial: bytes = b""
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)


class EngineSupervisor(QObject):
    """Runs at most one engine child on the running asyncio (qasync) loop.

    Signals: ``phase_changed(str)``, ``health(dict)`` (each ``/health`` body),
    ``log_lines(list)``, ``crashed(str)`` (an unexpected exit or hang, with the reason),
    ``restarting(float)`` (back-off seconds), ``gave_up(str)`` (past the restart budget),
    ``exited(int)`` (any exit, with the return code).
    """

    phase_changed = Signal(str)
    health = Signal(dict)
    log_lines = Signal(list)
    crashed = Signal(str)
    restarting = Signal(float)
    gave_up = Signal(str)
    exited = Signal(int)

    def __init__(self, *, unresponsive_after_s: float = 2.0, busy_grace_s: float = 60.0,
                 start_timeout_s: float = 180.0, probe_interval_s: float = 0.5, tick_s: float = 0.1,
                 restart_budget: RestartBudget | None = None, records: EngineRecords | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.unresponsive_after_s = unresponsive_after_s
        self.busy_grace_s = busy_grace_s
        self.start_timeout_s = start_timeout_s
        self.probe_interval_s = probe_interval_s
        self.tick_s = tick_s
        self.restart_budget = restart_budget or RestartBudget()
        self.records = records or EngineRecords()
        self._clock = clock
        self.phase = Phase.IDLE
        self.spawn_count = 0
        self.last_reason: str | None = None
        self.last_returncode: int | None = None
        self._child: _Child | None = None
        self._plan: LaunchPlan | None = None
        self._restart_task: asyncio.Task[None] | None = None

    # -- public state ----------------------------------------------------------------

    @property
    def client(self) -> EngineClient | None:
        """The client of the current child (``None`` when there is none)."""
        return self._child.client if self._child else None

    @property
    def pid(self) -> int | None:
        return self._child.proc.pid if self._child else None

    @property
    def plan(self) -> LaunchPlan | None:
        return self._plan

    @property
    def crash_count(self) -> int:
        """Crashes counted against the restart budget now (those of the last window)."""
        return self.restart_budget.crashes(self._clock())

    @property
    def active(self) -> bool:
        """A child exists or is about to (restart back-off included)."""
        return self.phase in (Phase.STARTING, Phase.RUNNING, Phase.RESTARTING, Phase.STOPPING)

    # -- verbs ----------------------------------------------------------------------------

    def start(self, plan: LaunchPlan) -> None:
        """Spawn the engine for ``plan`` and refill the restart budget (a user start).

        Refuses with ``LaunchRefused("already_running")`` while a child is active.
        """
        if self.active:
            raise LaunchRefused("already_running", "An engine is already running; stop it first.")
        self._plan = plan
        self.restart_budget.reset()
        self.last_reason = None
        self._spawn()

    async def stop(self, *, grace_s: float = 5.0, term_grace_s: float = 3.0) -> int | None:
        """End the child by escalation and wait for it; returns its exit code.

        Cancels a pending restart. SIGINT first (the engine's graceful path), SIGTERM to
        its process group after ``grace_s``, SIGKILL after ``term_grace_s`` more. A child
        that is already gone is success. Idempotent.
        """
        if self._restart_task is not None:
            self._restart_task.cancel()
            self._restart_task = None
        child = self._child
        if child is None:
            if self.phase != Phase.IDLE and self.phase != Phase.FAILED:
                self._set_phase(Phase.IDLE)
            return self.last_returncode
        child.intentional = True
        self._set_phase(Phase.STOPPING)
        code = await self._escalate(child, grace_s=grace_s, term_grace_s=term_grace_s)
        await self._reap(child)
        self._set_phase(Phase.IDLE)
        return code

    # -- internals -----------------------------------------------------------------------

    def _set_phase(self, phase: Phase) -> None:
        if phase != self.phase:
            self.phase = phase
            self.phase_changed.emit(phase.value)

    def _spawn(self) -> None:
        plan = self._plan
        assert plan is not None
        env = dict(plan.env)
        env[wire.PARENT_PID_ENV] = str(os.getpid())  # the child ends when this tray dies
        try:
            proc = subprocess.Popen(
                list(plan.argv), env=env, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as exc:
            self.last_reason = f"Could not start the engine: {exc}"
            self._set_phase(Phase.FAILED)
            self.gave_up.emit(self.last_reason)
            return
        self.spawn_count += 1
        child = _Child(plan, proc, EngineClient(plan.base_url, plan.token), self._clock())
        self._child = child
        self.records.record(proc.pid, plan.base_url)
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        os.set_blocking(fd, False)
        loop = asyncio.get_running_loop()
        loop.add_reader(fd, self._on_output, child)
        child.tasks = [asyncio.ensure_future(self._probe_loop(child)),
                       asyncio.ensure_future(self._tick_loop(child))]
        self._set_phase(Phase.STARTING)

    def _on_output(self, child: _Child) -> None:
        assert child.proc.stdout is not None
        fd = child.proc.stdout.fileno()
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            asyncio.get_running_loop().remove_reader(fd)
            if child.partial:
                self.log_lines.emit([child.partial.decode(errors="replace")])
                child.partial = b""
            return
        data = child.partial + chunk
        *lines, child.partial = data.split(b"\n")
        if lines:
            self.log_lines.emit([line.decode(errors="replace").rstrip("\r") for line in lines])

    async def _probe_loop(self, child: _Child) -> None:
        """Probe ``/health`` at a steady cadence; record the last answer's time."""
        while child.proc.poll() is None:
            began = self._clock()
            try:
                body = await child.client.health(timeout_s=max(self.unresponsive_after_s, 0.5))
            except EngineError:
                body = None
            if body is not None and child is self._child:
                child.last_ok = self._clock()
                child.busy = bool((body.get("heartbeat") or {}).get("busy"))
                if self.phase == Phase.STARTING:
                    self._set_phase(Phase.RUNNING)
                self.health.emit(dict(body))
            await asyncio.sleep(max(0.0, self.probe_interval_s - (self._clock() - began)))

    async def _tick_loop(self, child: _Child) -> None:
        """Notice an exit or a hang within one tick; hand either to ``_on_crash``."""
        while True:
            await asyncio.sleep(self.tick_s)
            if child is not self._child or child.intentional:
                return
            code = child.proc.poll()
            now = self._clock()
            if code is not None:
                reason = f"The engine exited with code {code}."
            elif child.last_ok is not None and now - child.last_ok > (
                    self.busy_grace_s if child.busy else self.unresponsive_after_s):
                reason = (f"The engine stopped answering (no /health reply for "
                          f"{now - child.last_ok:.1f} s).")
            elif child.last_ok is None and now - child.started > self.start_timeout_s:
                reason = f"The engine did not answer within {self.start_timeout_s:.0f} s of starting."
            else:
                continue
            asyncio.ensure_future(self._on_crash(child, reason))
            return

    async def _on_crash(self, child: _Child, reason: str) -> None:
        """Report at once, let the restart budget decide, then end what is left of the child."""
        self.last_reason = reason
        decision = self.restart_budget.on_crash(self._clock())
        self._set_phase(Phase.RESTARTING if decision.restart else Phase.FAILED)
        self.crashed.emit(reason)
        if not decision.restart:
            self.gave_up.emit(reason)
        # A hung engine is ended without the polite phase: it would not act on SIGINT.
        await self._escalate(child, grace_s=0.0, term_grace_s=1.0)
        await self._reap(child)
        if not decision.restart or self.phase != Phase.RESTARTING:  # a user Stop meanwhile wins
            return
        assert decision.delay_s is not None
        self.restarting.emit(decision.delay_s)
        self._restart_task = asyncio.ensure_future(self._restart_after(decision.delay_s))

    async def _restart_after(self, delay: float) -> None:
        await asyncio.sleep(delay)
        self._restart_task = None
        if self.phase == Phase.RESTARTING:
            self._spawn()

    async def _escalate(self, child: _Child, *, grace_s: float, term_grace_s: float) -> int | None:
        proc = child.proc
        steps: list[tuple[Callable[[], None], float]] = []
        if grace_s > 0:
            steps.append((lambda: os.kill(proc.pid, signal.SIGINT), grace_s))
        steps.append((lambda: _signal_group(proc.pid, signal.SIGTERM, wake=True), term_grace_s))
        steps.append((lambda: _signal_group(proc.pid, signal.SIGKILL), 5.0))
        for send, wait_s in steps:
            if proc.poll() is not None:
                break
            try:
                send()
            except ProcessLookupError:
                break
            deadline = self._clock() + wait_s
            while proc.poll() is None and self._clock() < deadline:
                await asyncio.sleep(0.02)
        code = proc.poll()
        self.last_returncode = code
        return code

    async def _reap(self, child: _Child) -> None:
        others = [t for t in child.tasks if t is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)
        if child.proc.stdout is not None:
            try:
                asyncio.get_running_loop().remove_reader(child.proc.stdout.fileno())
            except (ValueError, OSError):
                pass
            child.proc.stdout.close()
        if child is self._child:
            self._child = None
        self.records.forget(child.proc.pid)
        await child.client.aclose()
        code = child.proc.poll()
        if code is not None:
            self.last_returncode = code
            self.exited.emit(code)


def _signal_group(pid: int, sig: signal.Signals, *, wake: bool = False) -> None:
    """Signal the child's whole session (it leads its own group); wake it if stopped."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        raise
    except PermissionError:
        os.kill(pid, sig)
    if wake:
        try:
            os.killpg(pid, signal.SIGCONT)
        except (ProcessLookupError, PermissionError):
            pass
