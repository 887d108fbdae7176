"""Engines a dead tray left behind: recorded while they run, ended by the next tray.

The engine child ends by itself when its tray dies (it watches its parent: see
``engine/lifeline.py``). This is the second line, for an engine that could not act on
that (stopped, wedged, or on a platform without the watch): every tray records each engine
it starts in the user's runtime directory, one JSON file per engine, with both processes'
start times so a recycled pid is never mistaken for them. A tray that starts ends every
recorded engine whose tray is gone, by escalation (SIGTERM to its session, then SIGKILL),
and removes the record. Records of a live tray (another settings file) are left alone.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import tempfile
from dataclasses import dataclass
from pathlib import Path

import psutil

log = logging.getLogger("moetray.app")


def records_dir() -> Path:
    """``$XDG_RUNTIME_DIR/moetray/engines`` (per user), else a per-user temporary folder."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) if runtime else Path(tempfile.gettempdir()) / f"moetray-{os.getuid()}"
    return base / "moetray" / "engines"


def _started(pid: int) -> float | None:
    """The process's start time (its identity together with the pid), or ``None`` if it is gone."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc.create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def _same(pid: int, started: float) -> bool:
    now = _started(pid)
    return now is not None and abs(now - started) < 0.05


@dataclass(frozen=True)
class Orphan:
    engine_pid: int
    tray_pid: int
    base_url: str


class EngineRecords:
    """The record folder of one user; ``record``/``forget`` by the supervisor, ``orphans`` by a new tray."""

    def __init__(self, folder: Path | None = None, *, tray_pid: int | None = None) -> None:
        self.folder = folder or records_dir()
        self.tray_pid = os.getpid() if tray_pid is None else tray_pid

    def _path(self, engine_pid: int) -> Path:
        return self.folder / f"engine-{engine_pid}.json"

    def record(self, engine_pid: int, base_url: str) -> None:
        """Note that this tray runs ``engine_pid`` (atomic write; a failure is logged, not raised)."""
        started, tray_started = _started(engine_pid), _started(self.tray_pid)
        if started is None or tray_started is None:
            return
        body = {"engine_pid": engine_pid, "engine_started": started, "tray_pid": self.tray_pid,
                "tray_started": tray_started, "base_url": base_url}
        try:
            self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
            tmp = self._path(engine_pid).with_suffix(".partial")
            tmp.write_text(json.dumps(body))
            os.replace(tmp, self._path(engine_pid))
        except OSError as exc:
            log.warning("could not record engine %d in %s: %s", engine_pid, self.folder, exc)

    def forget(self, engine_pid: int) -> None:
        self._path(engine_pid).unlink(missing_ok=True)

    def orphans(self) -> list[Orphan]:
        """Recorded engines still running whose tray is gone; stale records are removed.

        Mutates the folder: a record whose engine is gone is deleted.
        """
        found = []
        for path in sorted(self.folder.glob("engine-*.json")):
            try:
                body = json.loads(path.read_text())
                engine = (int(body["engine_pid"]), float(body["engine_started"]))
                tray = (int(body["tray_pid"]), float(body["tray_started"]))
            except (OSError, ValueError, KeyError, TypeError):
                path.unlink(missing_ok=True)
                continue
            if not _same(*engine):
                path.unlink(missing_ok=True)  # the engine is gone: nothing to end
                continue
            if _same(*tray):
                continue  # its tray lives (another settings file): not ours to end
            found.append(Orphan(engine[0], tray[0], str(body.get("base_url", ""))))
        return found

    async def end_orphans(self, *, term_grace_s: float = 5.0) -> list[Orphan]:
        """End every orphaned engine (SIGTERM to its session, SIGKILL after ``term_grace_s``).

        Returns those ended; their records are removed. A process already gone is success.
        """
        orphans = self.orphans()
        for orphan in orphans:
            log.warning("ending engine pid %d (%s) left running by tray pid %d, which is gone",
                        orphan.engine_pid, orphan.base_url, orphan.tray_pid)
            for sig, wait_s in ((signal.SIGTERM, term_grace_s), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(orphan.engine_pid, sig)
                except ProcessLookupError:
                    break
                except PermissionError:
                    os.kill(orphan.engine_pid, sig)
                loop = asyncio.get_running_loop()
                deadline = loop.time() + wait_s
                while _started(orphan.engine_pid) is not None and loop.time() < deadline:
                    await asyncio.sleep(0.05)
                if _started(orphan.engine_pid) is None:
                    break
            self.forget(orphan.engine_pid)
        return orphans
