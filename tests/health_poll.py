"""``HealthPoller``: a client polling ``GET /health`` every 250 ms on its own thread, as a watchdog would.

Shared by the API tests (an in-process engine) and the supervisor tests (an engine child):
each answer's latency, or its error, is recorded.
"""

from __future__ import annotations

import threading
import time

import httpx


class HealthPoller:
    """Polls ``/health`` every ``period_s`` until the ``with`` block ends; ``latencies`` and ``errors``."""

    def __init__(self, url: str, period_s: float = 0.25) -> None:
        self.url, self.period_s = url, period_s
        self.latencies: list[float] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=10.0, trust_env=False) as client:
            while not self._stop.is_set():
                began = time.monotonic()
                try:
                    client.get(f"{self.url}/health").raise_for_status()
                    self.latencies.append(time.monotonic() - began)
                except httpx.HTTPError as exc:
                    self.errors.append(repr(exc))
                self._stop.wait(self.period_s)

    def __enter__(self) -> HealthPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
