"""The live feed: one ``/admin/events`` stream kept open, snapshots re-emitted as a signal.

Runs as one asyncio task on the Qt loop (qasync), so each snapshot costs the UI thread
one JSON decode and no blocking wait. A lost stream is reported (``disconnected``) and
reopened after ``retry_s``; ``connected`` fires when snapshots flow again.
"""

from __future__ import annotations

import asyncio

from PySide6.QtCore import QObject, Signal

from moetray.app.client import EngineClient, EngineError


class EngineLink(QObject):
    snapshot = Signal(dict)
    connected = Signal()
    disconnected = Signal(str)

    def __init__(self, *, retry_s: float = 1.0) -> None:
        super().__init__()
        self.retry_s = retry_s
        self.client: EngineClient | None = None
        self.is_connected = False
        self.received = 0
        self._task: asyncio.Task[None] | None = None

    def follow(self, client: EngineClient) -> None:
        """Stream from ``client``'s engine (replacing any previous stream). Idempotent per client."""
        if client is self.client and self._task is not None and not self._task.done():
            return
        self.stop()
        self.client = client
        self._task = asyncio.ensure_future(self._run(client))

    def stop(self) -> asyncio.Task[None] | None:
        """Close the stream (no ``disconnected`` is emitted for a deliberate stop).

        Returns the cancelled task, for callers that must see it finish (shutdown).
        """
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
        self.client = None
        self.is_connected = False
        return task

    async def close(self) -> None:
        """Stop and wait until the stream's task has really ended."""
        task = self.stop()
        if task is not None:
            await asyncio.gather(task, return_exceptions=True)

    async def _run(self, client: EngineClient) -> None:
        while True:
            try:
                async for snap in client.events():
                    self.received += 1
                    if not self.is_connected:
                        self.is_connected = True
                        self.connected.emit()
                    self.snapshot.emit(snap)
            except EngineError as exc:
                reason = exc.message
            else:  # pragma: no cover - events() always ends by raising
                reason = "the event stream ended"
            if self.is_connected or self.received == 0:
                self.is_connected = False
                self.disconnected.emit(reason)
            await asyncio.sleep(self.retry_s)
