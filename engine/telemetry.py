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
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moetray.policy.footprint import Footprint, ProbeCache, probe_footprint
from moetray.policy.wire import REQUEST_HISTORY

TTFT_SAMPLES = 512


def read_text(path: str) -> str | None:
    """``path``'s text, or None where it cannot be read: the reader ``policy.footprint``'s probes take."""
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

    def __init__(self, clock: Callable[[], float], *, window_s: float = 10.0,
                 wall: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._wall = wall
        self.window_s = window_s
        self._lock = threading.Lock()
        self._token_events: collections.deque[tuple[float, int]] = collections.deque()
        self._ttft_ms: collections.deque[float] = collections.deque(maxlen=TTFT_SAMPLES)
        self.requests_served = 0
        self.prompt_tokens_total = 0
        self.completion_tokens_total = 0
        self.cached_prompt_tokens_total = 0
        self._footprint: ProbeCache[Footprint | None] = ProbeCache(0.5, clock)
        self._history: collections.deque[dict[str, Any]] = collections.deque(maxlen=REQUEST_HISTORY)

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

    def record_finished(self, *, request_id: str, model: str | None, prompt_tokens: int,
                        completion_tokens: int, created: float, first_token_at: float | None,
                        finish_reason: str, stopped_by: str | None) -> dict[str, Any]:
        """Add one ``wire.FinishedRequest`` row to the history (the last ``REQUEST_HISTORY`` are kept).

        Times are readings of this telemetry's clock; the decode speed counts the tokens after
        the first over the time after it, and is ``None`` with fewer than two tokens.
        """
        now = self._clock()
        ttft_ms = None if first_token_at is None else round((first_token_at - created) * 1000.0, 3)
        span = None if first_token_at is None else now - first_token_at
        tok_s = (round((completion_tokens - 1) / span, 3)
                 if span is not None and span > 0 and completion_tokens > 1 else None)
        row = {"id": request_id, "finished_at": round(self._wall(), 3), "model": model,
               "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "ttft_ms": ttft_ms,
               "tok_s": tok_s, "finish_reason": finish_reason, "stopped_by": stopped_by}
        with self._lock:
            self._history.append(row)
        return row

    def history(self) -> list[dict[str, Any]]:
        """The finished requests kept, newest first (copies)."""
        with self._lock:
            return [dict(r) for r in reversed(self._history)]

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
        return self._footprint.get_or_probe(lambda: probe_footprint("self", read_text))


def device_memory(device, budget, footprint: Footprint | None) -> dict[str, object]:
    """``policy.wire.DeviceMemory`` for the device the pools live on.

    CUDA: driver totals, this process's usage from NVML when available (else torch's own
    reserved bytes), and everyone else's. CPU: the device tier *is* host RAM, so the figures
    are host RAM, labelled so; the engine's share is its PSS/RSS footprint.
    """
    if device.type == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info(device)
        engine = nvml_process_bytes(device.index or 0, os.getpid())
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


def _nvml(index: int, read: Callable[[Any, Any], int | None]) -> int | None:
    """``read(pynvml, handle of GPU index)`` between NVML's init and shutdown; ``None`` where NVML
    cannot answer (no NVIDIA driver, no such GPU)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return read(pynvml, pynvml.nvmlDeviceGetHandleByIndex(index))
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None


def nvml_process_bytes(index: int, pid: int) -> int | None:
    """Device memory of process ``pid`` on GPU ``index`` as NVML sees it, or ``None`` where NVML cannot
    say (no NVIDIA driver, or a container that hides other processes)."""

    def read(nvml: Any, handle: Any) -> int | None:
        for proc in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == pid and proc.usedGpuMemory is not None:
                return int(proc.usedGpuMemory)
        return None

    return _nvml(index, read)


def nvml_used_bytes(index: int) -> int | None:
    """Device memory in use on GPU ``index`` by every process together (NVML), or ``None`` without NVML."""
    return _nvml(index, lambda nvml, handle: int(nvml.nvmlDeviceGetMemoryInfo(handle).used))
