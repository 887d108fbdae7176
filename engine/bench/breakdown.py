"""Where a served decode step's time goes, measured inside the engine while it serves.

:class:`StepBreakdown` wraps, on a loaded engine, the calls the generation loop makes in
one step and adds up their wall time per category:

- ``attention``: every decoder layer's attention module (projections, rotary, the paged
  KV write and read, the attention kernel);
- ``experts``: the experts runtime's calls (routing read, planning, copies, expert GEMMs);
  under a compiled decode step neither this nor ``attention`` is timed apart (null: both are
  inside its graph, in ``forward_other``);
- ``forward_other``: the rest of the model forward (embedding, norms, routers, shared
  experts, the LM head);
- ``sampler``: the step's compute outside the model forward (logits processors, argmax or
  sampling, writing the next tokens);
- ``scheduler``: scheduling and batch preparation before the forward, and the bookkeeping
  after it (request states, the prefix ledger), less ``outputs``;
- ``outputs``: handing the step's outputs to the server's event loop (or to a tap).

Each step is classified when it ends: a *decode* step is one where every query token
yields a logit (each scheduled request decodes one token); anything else is a prefill step
and is counted apart. The event loop's share (HTTP, SSE, detokenization) runs on another
thread and is measured there as CPU time (:func:`thread_cpu_seconds`). Wrapping costs a
clock read per wrapped call (about 60 per step for a 30-layer model); :meth:`uninstall`
restores every wrapped attribute.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from moetray.engine.cb.compiled_step import decode_step_of

_ABSENT = object()

CATEGORIES = ("attention", "experts", "forward_other", "sampler", "scheduler", "outputs")
"""The step's parts, in the order the tables show them."""


def thread_cpu_seconds(native_id: int, pid: int | None = None) -> float | None:
    """User + system CPU seconds of one OS thread so far (Linux ``/proc``); None where unreadable."""
    pid = pid or os.getpid()
    try:
        with open(f"/proc/{pid}/task/{native_id}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks  # utime, stime (fields 14, 15 of stat)


@dataclass
class _Step:
    start: float
    parts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0.0))
    forward: float = 0.0
    compute: float = 0.0
    query_tokens: int = 0
    logits: int = 0


@dataclass
class BreakdownTotals:
    """Sums over the steps since the last :meth:`StepBreakdown.reset`."""

    decode_steps: int = 0
    decode_tokens: int = 0
    decode_wall_s: float = 0.0
    decode_parts_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0.0))
    prefill_steps: int = 0
    prefill_wall_s: float = 0.0
    window_s: float = 0.0
    layers_timed: bool = True  # False under a compiled decode step: attention, experts inside its graph

    def per_step_ms(self) -> dict[str, float | None]:
        """Milliseconds per decode step, by category, plus ``step`` (their sum and what no wrapper saw)."""
        n = self.decode_steps
        if not n:
            return {**dict.fromkeys(CATEGORIES), "step": None}
        out: dict[str, float | None] = {k: v / n * 1e3 for k, v in self.decode_parts_s.items()}
        if not self.layers_timed:
            out["attention"] = out["experts"] = None  # counted in forward_other
        out["step"] = self.decode_wall_s / n * 1e3
        return out


class StepBreakdown:
    """Times the generation loop's parts on a running engine (see the module docstring).

    ``model`` is the served transformers model, ``runtime`` its experts runtime and
    ``processor`` the substrate's batch processor (``BatchRunner.manager.batch_processor``).
    Thread model: the wrapped calls run on the generation thread; :meth:`totals` and
    :meth:`reset` may be called from another thread (they take the lock).
    """

    def __init__(self, model, runtime, processor) -> None:
        self.model = model
        self.runtime = runtime
        self.processor = processor
        self.generation_thread: int | None = None  # native id, seen on the first wrapped step
        self._lock = threading.Lock()
        self._step: _Step | None = None
        self._totals = BreakdownTotals()
        self._since = time.perf_counter()
        self._restore: list[tuple[Any, str, Any]] = []
        self._layers_timed = True

    # --- installation --------------------------------------------------------------------

    def _wrap(self, owner: Any, name: str, wrapper: Callable[[Callable], Callable]) -> None:
        original = getattr(owner, name)
        self._restore.append((owner, name, vars(owner).get(name, _ABSENT)))
        setattr(owner, name, wrapper(original))

    def install(self) -> StepBreakdown:
        """Wrap the step's calls (idempotent per instance: a second call does nothing)."""
        if self._restore:
            return self
        # A compiled decode step traces its attention modules and the experts' arithmetic into one
        # graph: a timer there would break it, so neither is timed apart (both stay in forward_other).
        self._layers_timed = decode_step_of(self.model) is None
        for module in self.model.modules():
            attn = getattr(module, "self_attn", None)
            if self._layers_timed and attn is not None and hasattr(attn, "forward"):
                self._wrap(attn, "forward", self._timed_part("attention"))
        self._wrap(self.runtime, "forward", self._timed_part("experts"))
        self._wrap(self.model, "forward", self._timed_forward)
        runner = self.processor.model_runner
        self._wrap(runner, "_forward_process_and_sample", self._timed_compute)
        self._wrap(self.processor, "prepare_next_batch", self._timed_prepare)
        self._wrap(self.processor, "update_batch", self._timed_update)
        self._wrap(self.processor.output_router, "deliver_batch", self._timed_part("outputs"))
        return self

    def uninstall(self) -> None:
        """Put every wrapped attribute back as it was (an instance attribute that an earlier
        wrapper set is restored; otherwise the class's method shows through again)."""
        for owner, name, previous in reversed(self._restore):
            if previous is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, previous)
        self._restore.clear()

    # --- wrappers ------------------------------------------------------------------------

    def _timed(self, fn: Callable, book: Callable[[_Step, float, dict[str, Any]], None]) -> Callable:
        """``fn`` with its wall time handed to ``book(step, seconds, kwargs)`` when a step is open."""
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                step = self._step
                if step is not None:
                    book(step, time.perf_counter() - t0, kwargs)
        return timed

    def _timed_part(self, category: str) -> Callable[[Callable], Callable]:
        def book(step: _Step, seconds: float, kwargs: dict[str, Any]) -> None:
            step.parts[category] += seconds
        return lambda fn: self._timed(fn, book)

    def _timed_forward(self, fn: Callable) -> Callable:
        def book(step: _Step, seconds: float, kwargs: dict[str, Any]) -> None:
            step.forward += seconds
            ids = kwargs.get("input_ids")
            keep: Any = kwargs.get("logits_indices", kwargs.get("logits_to_keep"))
            step.query_tokens = int(ids.shape[-1]) if ids is not None else 0
            step.logits = int(keep.numel()) if hasattr(keep, "numel") else 0
        return self._timed(fn, book)

    def _timed_compute(self, fn: Callable) -> Callable:
        def book(step: _Step, seconds: float, kwargs: dict[str, Any]) -> None:
            step.compute += seconds
        return self._timed(fn, book)

    def _timed_prepare(self, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            if self.generation_thread is None:
                self.generation_thread = threading.get_native_id()
            step = _Step(start=time.perf_counter())
            self._step = step
            ready = fn(*args, **kwargs)
            step.parts["scheduler"] += time.perf_counter() - step.start
            if not ready:
                self._step = None
            return ready
        return timed

    def _timed_update(self, fn: Callable) -> Callable:
        def book(step: _Step, seconds: float, kwargs: dict[str, Any]) -> None:
            step.parts["scheduler"] += seconds - step.parts["outputs"]
            self._commit(step, time.perf_counter())
            self._step = None  # the step ends here
        return self._timed(fn, book)

    def _commit(self, step: _Step, end: float) -> None:
        parts = step.parts
        parts["forward_other"] = max(0.0, step.forward - parts["attention"] - parts["experts"])
        parts["sampler"] = max(0.0, step.compute - step.forward)
        wall = end - step.start
        with self._lock:
            t = self._totals
            if step.query_tokens and step.query_tokens == step.logits:
                t.decode_steps += 1
                t.decode_tokens += step.logits
                t.decode_wall_s += wall
                for key, value in parts.items():
                    t.decode_parts_s[key] += value
            else:
                t.prefill_steps += 1
                t.prefill_wall_s += wall

    # --- reading ---------------------------------------------------------------------------

    def reset(self) -> None:
        """Start a new window (totals zeroed)."""
        with self._lock:
            self._totals = BreakdownTotals()
            self._since = time.perf_counter()

    def totals(self) -> BreakdownTotals:
        """A copy of the sums since the last reset, with the window's length."""
        with self._lock:
            t = self._totals
            return BreakdownTotals(
                decode_steps=t.decode_steps, decode_tokens=t.decode_tokens, decode_wall_s=t.decode_wall_s,
                decode_parts_s=dict(t.decode_parts_s), prefill_steps=t.prefill_steps,
                prefill_wall_s=t.prefill_wall_s, window_s=time.perf_counter() - self._since,
                layers_timed=self._layers_timed)
