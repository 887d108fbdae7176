"""One tray per user and settings store, through a QLocalServer socket.

A launch first tries to *connect*: if a tray is listening, it forwards its message
("show": raise the dashboard) and exits. Only when nobody answers does it clear a stale
socket left by a crash (``removeServer``) and listen. Clearing before connecting would
break the detection (a classic mistake in copies of this pattern).
"""

from __future__ import annotations

import hashlib
import os

from PySide6.QtCore import QObject, Signal
from PySide6.QtNetwork import QLocalServer, QLocalSocket

SHOW = "show"


def server_name(settings_path: str) -> str:
    """The socket name for one user and one settings file (tests use their own files)."""
    digest = hashlib.sha1(settings_path.encode()).hexdigest()[:12]
    return f"moetray-{os.getuid()}-{digest}"


class SingleInstance(QObject):
    """Detects a running tray and carries the second launch's message to it."""

    message_received = Signal(str)

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self._server: QLocalServer | None = None
        self._sockets: set[QLocalSocket] = set()

    def forward(self, message: str = SHOW, timeout_ms: int = 1000) -> bool:
        """Send ``message`` to a running tray; ``True`` when one took it (then exit)."""
        socket = QLocalSocket()
        socket.connectToServer(self.name)
        if not socket.waitForConnected(timeout_ms):
            return False
        socket.write((message + "\n").encode())
        socket.flush()  # may write everything at once, leaving nothing to wait for
        delivered = socket.bytesToWrite() == 0 or socket.waitForBytesWritten(timeout_ms)
        socket.disconnectFromServer()
        if socket.state() != QLocalSocket.LocalSocketState.UnconnectedState:
            socket.waitForDisconnected(timeout_ms)
        return delivered

    def listen(self) -> bool:
        """Become the running tray. Mutates the socket namespace; call after ``forward`` failed."""
        QLocalServer.removeServer(self.name)
        server = QLocalServer(self)
        server.setSocketOptions(QLocalServer.SocketOption.UserAccessOption)
        if not server.listen(self.name):
            return False
        server.newConnection.connect(self._on_connection)
        self._server = server
        return True

    @property
    def listening(self) -> bool:
        return self._server is not None and self._server.isListening()

    def close(self) -> None:
        for socket in list(self._sockets):
            socket.disconnected.disconnect(self._on_disconnected)
            socket.abort()
        self._sockets.clear()
        if self._server is not None:
            self._server.close()
            self._server = None

    def _on_connection(self) -> None:
        assert self._server is not None
        while self._server.hasPendingConnections():
            socket = self._server.nextPendingConnection()
            self._sockets.add(socket)
            socket.readyRead.connect(self._on_ready_read)
            socket.disconnected.connect(self._on_disconnected)
            self._read(socket)

    def _on_ready_read(self) -> None:
        socket = self.sender()
        if isinstance(socket, QLocalSocket):
            self._read(socket)

    def _on_disconnected(self) -> None:
        socket = self.sender()
        if isinstance(socket, QLocalSocket) and socket in self._sockets:
            self._read(socket)
            self._sockets.discard(socket)
            socket.deleteLater()

    def _read(self, socket: QLocalSocket) -> None:
        while socket.canReadLine():
            line = bytes(socket.readLine().data()).decode(errors="replace").strip()
            if line:
                self.message_received.emit(line)
