"""``HealthPoller``: a client polling ``GET /health`` every 250 ms on its own thread, as a watchdog would.

Shared by the API tests (an in-process engine) and the supervisor tests (an engine child):
each answer's latency, or its error, is recorded. Other routes (``/admin/status``) may be
polled in the same round.
"""

from __future__ import annotations

import threading
import time

import httpx


class HealthPoller:
    """Polls ``paths`` every ``period_s`` until the ``with`` block ends; ``latencies`` and ``errors``."""

    def __init__(
        self, url: str, period_s: float = 0.25, *, paths: tuple[str, ...] = ("/health",),
        headers: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        self.url, self.period_s, self.paths, self.headers = url, period_s, paths, headers or {}
        self.latencies: list[float] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=10.0, trust_env=False, headers=self.headers) as client:
            while not self._stop.is_set():
                for path in self.paths:
                    began = time.monotonic()
                    try:
                        client.get(f"{self.url}{path}").raise_for_status()
                        self.latencies.append(time.monotonic() - began)
                    except httpx.HTTPError as exc:
                        self.errors.append(f"{path}: {exc!r}")
                self._stop.wait(self.period_s)

    def __enter__(self) -> HealthPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
