"""Throughput, latency and memory figures for ``GET /admin/status`` and ``/admin/events``.

Counters are exact totals; rates are over a sliding window of ``window_s`` seconds of the
passed-in clock. An unknown figure is ``None`` (JSON ``null``), never 0: no tok/s before
the first token, no TTFT percentile before the first request, no footprint where
``/proc`` cannot be read, no GPU figure on a machine without one.
"""

from __future__ import annotations

import collections
import math
import os
import threading
from collections.abc import Callable
from pathlib import Path

from moetray.policy.footprint import Footprint, ProbeCache, probe_footprint

TTFT_SAMPLES = 512


def _read_text(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile of an ascending list; ``None`` for an empty one."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(q / 100.0 * len(sorted_values)))
    return sorted_values[rank - 1]


class Telemetry:
    """Counters and windows fed by the request path; read by the snapshot builder."""

    def __init__(self, clock: Callable[[], float], *, window_s: float = 10.0) -> None:
        self._clock = clock
        self.window_s = window_s
        self._lock = threading.Lock()
        self._token_events: collections.deque[tuple[float, int]] = collections.deque()
        self._ttft_ms: collections.deque[float] = collections.deque(maxlen=TTFT_SAMPLES)
        self.requests_served = 0
        self.prompt_tokens_total = 0
        self.completion_tokens_total = 0
        self.cached_prompt_tokens_total = 0
        self._footprint: ProbeCache[Footprint | None] = ProbeCache(0.5, clock)

    def tokens(self, n: int) -> None:
        """``n`` tokens were generated just now."""
        if n <= 0:
            return
        now = self._clock()
        with self._lock:
            self._token_events.append((now, n))
            self._trim(now)

    def first_token(self, ttft_s: float) -> None:
        with self._lock:
            self._ttft_ms.append(ttft_s * 1000.0)

    def finished(self, *, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> None:
        """A request left the engine (done, stopped or cancelled): its tokens count."""
        with self._lock:
            self.requests_served += 1
            self.prompt_tokens_total += prompt_tokens
            self.completion_tokens_total += completion_tokens
            self.cached_prompt_tokens_total += cached_tokens

    def _trim(self, now: float) -> None:
        horizon = now - self.window_s
        while self._token_events and self._token_events[0][0] < horizon:
            self._token_events.popleft()

    def tok_s(self) -> float | None:
        """Generated tokens per second over the window; ``None`` until a token was generated."""
        now = self._clock()
        with self._lock:
            self._trim(now)
            if not self._token_events and self.completion_tokens_total == 0:
                return None
            return sum(n for _, n in self._token_events) / self.window_s

    def ttft(self) -> tuple[float | None, float | None]:
        with self._lock:
            values = sorted(self._ttft_ms)
        return percentile(values, 50), percentile(values, 95)

    def footprint(self) -> Footprint | None:
        """This process's PSS (or RSS), cached for half a second; ``None`` when unreadable."""
        return self._footprint.get_or_probe(lambda: probe_footprint("self", _read_text))


def device_memory(device, budget, footprint: Footprint | None) -> dict[str, object]:
    """``policy.wire.DeviceMemory`` for the device the pools live on.

    CUDA: driver totals, this process's usage from NVML when available (else torch's own
    reserved bytes), and everyone else's. CPU: the device tier *is* host RAM, so the figures
    are host RAM, labelled so; the engine's share is its PSS/RSS footprint.
    """
    if device.type == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info(device)
        engine = _nvml_process_bytes(device)
        if engine is None:
            engine = int(torch.cuda.memory_reserved(device))
        others = total - free - engine
        return {
            "kind": "cuda",
            "name": budget.name,
            "label": budget.label,
            "total_bytes": int(total),
            "engine_bytes": int(engine),
            "others_bytes": int(others) if others >= 0 else None,
            "budget_bytes": budget.budget_bytes,
        }
    host_total: int | None = None
    host_used: int | None = None
    try:
        import psutil

        vm = psutil.virtual_memory()
        host_total, host_used = int(vm.total), int(vm.total - vm.available)
    except Exception:  # pragma: no cover - psutil is a dependency
        pass
    mine = footprint.bytes if footprint is not None else None
    rest = host_used - mine if host_used is not None and mine is not None and host_used >= mine else None
    return {
        "kind": "cpu",
        "name": budget.name,
        "label": budget.label,
        "total_bytes": host_total,
        "engine_bytes": mine,
        "others_bytes": rest,
        "budget_bytes": budget.budget_bytes,
    }


def _nvml_process_bytes(device) -> int | None:
    """This process's device memory as NVML sees it, or ``None`` where NVML cannot say."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            index = device.index or 0
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid == os.getpid() and proc.usedGpuMemory is not None:
                    return int(proc.usedGpuMemory)
            return None
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None
