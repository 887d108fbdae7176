"""The engine child: validated, spawned in its own session, watched, restarted once, stopped.

Shape after vorta's ``BorgJob``: :func:`prepare_launch` checks every precondition and
refuses with a named :class:`LaunchRefused` before any process exists; the returned
:class:`LaunchPlan` is the exact argv and environment (the admin token travels in the
environment, never in argv). :class:`EngineSupervisor` then runs one child at a time:

- **watch**: the child's output is read without blocking and re-emitted as log lines;
  ``GET /health`` is probed every ``probe_interval_s``; a tick every ``tick_s`` notices an
  exit, or an engine that answered before and has not answered for ``unresponsive_after_s``
  (2 s by default). An engine whose last answer said it was busy (requests in flight,
  its batch loop's heartbeat advancing) is given ``busy_grace_s`` instead: a slow request
  is not a hang;
- **restart once**: an unexpected exit or hang is reported (``crashed``) and the engine is
  started again after a back-off, at most ``max_restarts`` times (1) per user start; the
  next failure is final (``gave_up``): never a restart loop;
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
from moetray.policy import wire
from moetray.policy.refused import Refused

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
LAUNCH_KINDS = ("no_such_model", "not_a_checkpoint", "port_in_use", "not_loopback", "already_running")


class LaunchRefused(Refused):
    """The engine cannot be started as asked; raised before any process exists."""

    KINDS = LAUNCH_KINDS
    message: str

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(kind, message)
        self.message = message


@dataclass(frozen=True)
class LaunchSpec:
    """What the user asked for. ``model=None`` serves the embedded default model."""

    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 0  # 0: pick a free loopback port
    device: str = "auto"
    moe_capacity: str | None = None
    kv_tokens: int | None = None
    extra_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class LaunchPlan:
    """The exact child process to start; ``env`` carries the admin token."""

    argv: tuple[str, ...]
    env: Mapping[str, str] = field(repr=False)
    base_url: str
    token: str = field(repr=False)
    model: str | None


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (the engine binds it a moment later)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def engine_command(python: str = sys.executable) -> list[str]:
    """``python -m moetray.app.cli serve``: the same code, the same environment as the tray."""
    return [python, "-m", "moetray.app.cli", "serve"]


def prepare_launch(spec: LaunchSpec, *, python: str = sys.executable, token: str | None = None,
                   environ: Mapping[str, str] | None = None) -> LaunchPlan:
    """Check ``spec`` and return the launch plan; refuses with :class:`LaunchRefused`.

    Decides the port (a free one when ``spec.port`` is 0) and the admin token (a fresh
    one per launch unless given). Refuses, in this order: a non-loopback host
    (``not_loopback``), a missing folder (``no_such_model``), a folder without
    ``config.json`` (``not_a_checkpoint``), a port already taken (``port_in_use``).
    Starts nothing.
    """
    if spec.host not in LOOPBACK_HOSTS:
        raise LaunchRefused("not_loopback",
                            f"The tray starts engines on loopback only, not on {spec.host}.")
    if spec.model is not None:
        folder = Path(spec.model).expanduser()
        if not folder.is_dir():
            raise LaunchRefused("no_such_model", f"No such model folder: {folder}")
        if not (folder / "config.json").is_file():
            raise LaunchRefused("not_a_checkpoint",
                                f"{folder} has no config.json; pick a Hugging Face checkpoint folder.")
    port = spec.port or free_port(spec.host)
    if spec.port and not port_is_free(spec.host, spec.port):
        raise LaunchRefused("port_in_use",
                            f"Port {spec.port} is in use; is another moetray engine running?")
    argv = engine_command(python)
    if spec.model is not None:
        argv += ["--model", str(Path(spec.model).expanduser().resolve())]
    argv += ["--host", spec.host, "--port", str(port), "--device", spec.device]
    if spec.moe_capacity is not None:
        argv += ["--moe-capacity", str(spec.moe_capacity)]
    if spec.kv_tokens is not None:
        argv += ["--kv-tokens", str(spec.kv_tokens)]
    argv += list(spec.extra_args)
    token = token or secrets.token_urlsafe(32)
    env = dict(os.environ if environ is None else environ)
    env.pop(wire.ADMIN_TOKEN_FILE_ENV, None)
    env[wire.ADMIN_TOKEN_ENV] = token
    env["PYTHONUNBUFFERED"] = "1"
    host = f"[{spec.host}]" if ":" in spec.host else spec.host
    return LaunchPlan(tuple(argv), env, f"http://{host}:{port}", token, spec.model)


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
    ``restarting(float)`` (back-off seconds), ``gave_up(str)`` (no restart left),
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
                 start_timeout_s: float = 180.0,
                 probe_interval_s: float = 0.5, tick_s: float = 0.1, backoff_s: float = 1.0,
                 max_restarts: int = 1, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.unresponsive_after_s = unresponsive_after_s
        self.busy_grace_s = busy_grace_s
        self.start_timeout_s = start_timeout_s
        self.probe_interval_s = probe_interval_s
        self.tick_s = tick_s
        self.backoff_s = backoff_s
        self.max_restarts = max_restarts
        self._clock = clock
        self.phase = Phase.IDLE
        self.restarts_used = 0
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
    def active(self) -> bool:
        """A child exists or is about to (restart back-off included)."""
        return self.phase in (Phase.STARTING, Phase.RUNNING, Phase.RESTARTING, Phase.STOPPING)

    # -- verbs ----------------------------------------------------------------------------

    def start(self, plan: LaunchPlan) -> None:
        """Spawn the engine for ``plan`` and reset the restart budget (a user start).

        Refuses with ``LaunchRefused("already_running")`` while a child is active.
        """
        if self.active:
            raise LaunchRefused("already_running", "An engine is already running; stop it first.")
        self._plan = plan
        self.restarts_used = 0
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
        try:
            proc = subprocess.Popen(
                list(plan.argv), env=dict(plan.env), stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as exc:
            self.last_reason = f"Could not start the engine: {exc}"
            self._set_phase(Phase.FAILED)
            self.gave_up.emit(self.last_reason)
            return
        self.spawn_count += 1
        child = _Child(plan, proc, EngineClient(plan.base_url, plan.token), self._clock())
        self._child = child
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
        """Report at once, decide restart or not, then end what is left of the child."""
        self.last_reason = reason
        give_up = self.restarts_used >= self.max_restarts
        self._set_phase(Phase.FAILED if give_up else Phase.RESTARTING)
        self.crashed.emit(reason)
        if give_up:
            self.gave_up.emit(reason)
        # A hung engine is ended without the polite phase: it would not act on SIGINT.
        await self._escalate(child, grace_s=0.0, term_grace_s=1.0)
        await self._reap(child)
        if give_up or self.phase != Phase.RESTARTING:  # a user Stop meanwhile wins
            return
        delay = self.backoff_s * (2 ** self.restarts_used)
        self.restarts_used += 1
        self.restarting.emit(delay)
        self._restart_task = asyncio.ensure_future(self._restart_after(delay))

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
