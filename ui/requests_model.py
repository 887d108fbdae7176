"""The Requests panel's models: the requests in flight, and the last finished ones.

:class:`RequestsModel` is the live table (each row with its Stop), fed by snapshots and
``GET /admin/requests``; :class:`RequestHistoryModel` holds the engine's feed of finished
requests (``GET /admin/requests/history``, ``wire.FinishedRequest`` rows), so the history
is the engine's account, not whatever the dashboard happened to see.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from PySide6.QtCore import Signal

from moetray.ui.viewmodels import _Model


@dataclass(frozen=True)
class RequestRow:
    id: str
    state: str  # queued / prefill / decode, or "stopping" once a Stop was acknowledged
    tokens: int
    prompt_tokens: int
    age_s: float


class RequestsModel(_Model):
    """The live request table and which rows have a Stop in flight.

    A row stays until the engine stops listing it: a Stop is shown as "stopping" at once,
    and the row disappears with the next snapshot or ``/admin/requests`` reply that no
    longer lists it. Rows are never hidden on the tray's say-so alone. Once a fresh list
    has confirmed a stopped row gone, a snapshot taken before the stop (still in flight
    on the 1 Hz stream) cannot bring it back for ``stale_s`` seconds.
    """

    rows_changed = Signal()

    def __init__(self, *, stale_s: float = 3.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.rows: tuple[RequestRow, ...] = ()
        self.stopping: frozenset[str] = frozenset()
        self._gone: dict[str, float] = {}
        self._stale_s = stale_s
        self._clock = clock

    def apply_requests(self, requests: Iterable[Mapping[str, Any]], *, fresh: bool = False) -> bool:
        """Replace the table with the engine's list; forgets Stops for rows that are gone.

        ``fresh`` marks a list fetched after a Stop: stopped rows it no longer lists are
        remembered as gone, so an older snapshot arriving next does not resurrect them.
        """
        now = self._clock()
        self._gone = {rid: t for rid, t in self._gone.items() if now - t < self._stale_s}
        rows = tuple(
            RequestRow(str(r["id"]), str(r["state"]), int(r.get("tokens") or 0),
                       int(r.get("prompt_tokens") or 0), float(r.get("age_s") or 0.0))
            for r in requests if str(r["id"]) not in self._gone)
        live = {r.id for r in rows}
        if fresh:
            for rid in self.stopping - live:
                self._gone[rid] = now
        changed = self._assign("rows", rows)
        changed |= self._assign("stopping", frozenset(self.stopping & live))
        if changed:
            self.rows_changed.emit()
        return changed

    def apply_snapshot(self, snap: Mapping[str, Any]) -> bool:
        return self.apply_requests(snap.get("requests") or ())

    def mark_stopping(self, request_ids: Iterable[str]) -> bool:
        """Record that a Stop was sent for these rows (only rows still listed)."""
        live = {r.id for r in self.rows}
        changed = self._assign("stopping", frozenset(self.stopping | (set(request_ids) & live)))
        if changed:
            self.rows_changed.emit()
        return changed

    def unmark_stopping(self, request_id: str) -> bool:
        """A Stop failed: show the row's own state again."""
        changed = self._assign("stopping", frozenset(self.stopping - {request_id}))
        if changed:
            self.rows_changed.emit()
        return changed

    def display_state(self, row: RequestRow) -> str:
        return "stopping" if row.id in self.stopping else row.state

    def clear(self) -> bool:
        return self.apply_requests(())


@dataclass(frozen=True)
class FinishedRow:
    """One finished request, as the engine recorded it (``wire.FinishedRequest``)."""

    id: str
    finished_at: float  # seconds since the epoch
    model: str | None
    prompt_tokens: int
    completion_tokens: int
    ttft_ms: float | None
    tok_s: float | None
    finish_reason: str
    stopped_by: str | None

    @classmethod
    def from_wire(cls, row: Mapping[str, Any]) -> FinishedRow:
        ttft, rate = row.get("ttft_ms"), row.get("tok_s")
        return cls(str(row["id"]), float(row["finished_at"]), row.get("model"),
                   int(row.get("prompt_tokens") or 0), int(row.get("completion_tokens") or 0),
                   None if ttft is None else float(ttft), None if rate is None else float(rate),
                   str(row.get("finish_reason") or ""), row.get("stopped_by"))


class RequestHistoryModel(_Model):
    """The engine's last finished requests, newest first; emits ``changed`` on a real change."""

    changed = Signal()

    def __init__(self) -> None:
        super().__init__()
        self.rows: tuple[FinishedRow, ...] = ()
        self.capacity: int | None = None
        self.error: str | None = None

    def apply_history(self, body: Mapping[str, Any]) -> bool:
        """Take one ``GET /admin/requests/history`` reply (``{"requests": [...], "capacity": N}``)."""
        rows = tuple(sorted((FinishedRow.from_wire(r) for r in body.get("requests") or ()),
                            key=lambda r: r.finished_at, reverse=True))
        changed = self._assign("rows", rows) | self._assign("capacity", body.get("capacity"))
        changed |= self._assign("error", None)
        if changed:
            self.changed.emit()
        return changed

    def set_error(self, message: str | None) -> bool:
        """The feed could not be read (an older engine, a lost connection): say so, keep the rows."""
        changed = self._assign("error", message)
        if changed:
            self.changed.emit()
        return changed
