"""A real engine server on a free loopback port, in this process, for engine and API tests.

``LiveEngine(model_dir, tmp_path, **options)`` starts ``moetray.engine`` exactly as
``moetray serve`` does (``Engine`` + the FastAPI app under uvicorn, on a real socket) but in a
background thread, so tests can reach the ``Engine`` object too (its pools for integrity
checks and the re-split fault seam, ``rebuild_faults.py``). The admin token is fixed
(``ADMIN_TOKEN``); test hooks are on.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
from bounded import COLD_START_S

from moetray.engine.api.security import Credentials, HostPolicy
from moetray.engine.core import Engine, EngineOptions
from moetray.engine.serve import bind_socket, make_server

ADMIN_TOKEN = "test-admin-token"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


class LiveEngine:
    def __init__(
        self,
        model_dir: Path | None,
        tmp_path: Path,
        *,
        api_key: str | None = None,
        allowed_hosts: tuple[str, ...] = (),
        wait: bool = True,
        load: bool = True,
        max_body_bytes: int | None = None,
        **options,
    ) -> None:
        defaults = dict(
            budget_bytes=256 << 20,
            kv_tokens=2048,
            page_size=16,
            max_batch_tokens=64,
            test_hooks=True,
            outbox_dir=tmp_path / "outbox",
            rebuild_idle_timeout_s=20.0,
        )
        defaults.update(options)
        self.engine = Engine(EngineOptions(model_dir=model_dir, **defaults))
        self.credentials = Credentials(admin_token=ADMIN_TOKEN, api_key=api_key, token_file=None)
        self.server = make_server(
            self.engine,
            self.credentials,
            HostPolicy(frozenset(allowed_hosts)),
            log_level="warning",
            load_on_startup=load,
            **({} if max_body_bytes is None else {"max_body_bytes": max_body_bytes}),
        )
        sock = bind_socket("127.0.0.1", 0)
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        if wait and load:
            self.wait_state({"serving"})

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60.0, **kw)

    def wait_state(self, states: set[str], timeout: float = COLD_START_S) -> dict:
        """Poll /health until the state is one of ``states``; a first load on a cold machine also
        compiles the decode step (a lossy format), hence the generous default."""
        deadline = time.monotonic() + timeout
        last: dict = {}
        while time.monotonic() < deadline:
            try:
                last = httpx.get(f"{self.url}/health", timeout=5.0).json()
                if last.get("state") in states:
                    return last
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"waited {timeout:g} s for the engine to reach {sorted(states)}: {last}")

    def status(self) -> dict:
        return httpx.get(f"{self.url}/admin/status", headers=ADMIN, timeout=10.0).json()

    def wait_idle(self, timeout: float = 30.0) -> dict:
        """The status once the engine is idle: no request listed, and none still held by the
        batch loop (a cancelled request leaves the list at once but keeps its pages until
        the loop's next step boundary; the engine's own ``activity`` counts it)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.engine.activity().is_idle():
                snap = self.status()
                if not snap["requests"]:
                    return snap
            time.sleep(0.02)
        raise TimeoutError(f"waited {timeout:g} s for the engine to be idle: requests still in flight")

    def close(self) -> None:
        """Stop the server thread and the engine; a server that will not stop fails by name."""
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.engine.shutdown()
        if self.thread.is_alive():
            raise TimeoutError(f"waited 30 s for the engine server on port {self.port} to stop")
