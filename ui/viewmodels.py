"""The dashboard's view models: engine snapshots in, change signals out.

Each model takes plain wire data (:mod:`moetray.policy.wire` shapes) through one
``apply_*`` verb, keeps only what its panel draws, and emits its signals **only when what
it keeps really changed** (napari's rule: compare, then emit). Widgets subscribe in their
``__init__`` and redraw from the model's state, ignoring signal payloads. Nothing here
touches a widget or the network: the models need no ``QApplication``, and tests drive
them with recorded snapshots.

Unknown numbers stay ``None`` all the way to the formatter, which draws "—".
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from PySide6.QtCore import QObject, Signal

from moetray.policy import wire

HISTORY_POINTS = 120
"""Points kept per rolling chart: two minutes at the engine's 1 Hz event cadence."""
LOG_LINES = 2000
"""Engine log lines kept for the Logs panel."""


class EngineState(StrEnum):
    """What the tray shows for the engine: the gate's states plus the two the tray adds.

    ``stopped`` (no engine) exists only on the tray side; ``failed`` also covers an
    engine that exited or stopped answering.
    """

    STOPPED = "stopped"
    LOADING = "loading"
    SERVING = "serving"
    REBUILDING = "rebuilding"
    STOPPING = "stopping"
    FAILED = "failed"


class History:
    """A ring of ``(t, value)`` points for one rolling chart; ``None`` values are gaps."""

    def __init__(self, maxlen: int = HISTORY_POINTS) -> None:
        self._points: deque[tuple[float, float | None]] = deque(maxlen=maxlen)

    def append(self, t: float, value: float | None) -> None:
        self._points.append((t, value))

    def clear(self) -> None:
        self._points.clear()

    def __len__(self) -> int:
        return len(self._points)

    def times(self) -> list[float]:
        return [t for t, _ in self._points]

    def values(self) -> list[float | None]:
        return [v for _, v in self._points]

    def finite(self) -> list[float]:
        """The values as floats with gaps as NaN, the form a plot draws with gaps."""
        return [math.nan if v is None else float(v) for _, v in self._points]

    def last(self) -> float | None:
        return self._points[-1][1] if self._points else None


class _Model(QObject):
    """Base: ``_assign`` stores a field and reports whether it changed."""

    def _assign(self, name: str, value: Any) -> bool:
        if getattr(self, name, _MISSING) == value:
            return False
        setattr(self, name, value)
        return True


_MISSING = object()


# --- engine header ------------------------------------------------------------------


@dataclass(frozen=True)
class LoadStep:
    stage: str
    done: int
    total: int | None

    def fraction(self) -> float | None:
        """Share done, or ``None`` when the total is unknown (an indeterminate bar)."""
        if not self.total:
            return None
        return min(1.0, max(0.0, self.done / self.total))


class EngineModel(_Model):
    """Which engine this is and what state it is in: the header of every view.

    ``state`` is the tray's view (:class:`EngineState`); ``detail`` the one sentence
    that explains a failure or a refusal; ``attached`` is true when the tray did not
    start the engine (then Quit leaves it running).
    """

    changed = Signal()

    def __init__(self) -> None:
        super().__init__()
        self.state = EngineState.STOPPED
        self.detail: str | None = None
        self.api_url: str | None = None
        self.attached = False
        self.model_id: str | None = None
        self.model_label: str | None = None
        self.model_path: str | None = None
        self.architecture: str | None = None
        self.geometry: tuple[int, int, int] | None = None  # layers, experts, top-k
        self.context_length: int | None = None
        self.load: LoadStep | None = None
        self.uptime_s: float | None = None
        self.failure: str | None = None  # the engine's own words for why it failed (``/health``)

    def set_state(self, state: EngineState, detail: str | None = None) -> bool:
        """Set the tray-side state and its explanation; emits ``changed`` if either differs."""
        changed = self._assign("state", EngineState(state)) | self._assign("detail", detail)
        if changed:
            self.changed.emit()
        return changed

    def set_endpoint(self, api_url: str | None, *, attached: bool) -> bool:
        changed = self._assign("api_url", api_url) | self._assign("attached", attached)
        if changed:
            self.changed.emit()
        return changed

    def apply_snapshot(self, snap: Mapping[str, Any]) -> bool:
        """Take model identity, load progress and uptime from a status snapshot.

        Does not take the state: the owner decides the tray state from the snapshot's
        gate state and the process it supervises (a dead process trumps a stale gate).
        """
        model = snap.get("model")
        progress = snap.get("load_progress")
        load = (LoadStep(str(progress["stage"]), int(progress["done"]), progress.get("total"))
                if progress else None)
        changed = self._assign("load", load)
        if model:
            changed |= self._assign("model_id", model.get("id"))
            changed |= self._assign("model_label", model.get("label"))
            changed |= self._assign("model_path", model.get("path"))
            changed |= self._assign("architecture", model.get("architecture"))
            changed |= self._assign(
                "geometry", (model.get("num_layers"), model.get("num_experts"), model.get("top_k")))
            changed |= self._assign("context_length", model.get("context_length"))
        # Uptime ticks every event; it is shown, so it counts as a change.
        changed |= self._assign("uptime_s", snap.get("uptime_s"))
        if changed:
            self.changed.emit()
        return changed

    def apply_health(self, body: Mapping[str, Any]) -> bool:
        """Take load progress and any failure reason from a ``wire.Health`` body (the only
        route that answers while loading)."""
        progress = body.get("load_progress")
        load = (LoadStep(str(progress["stage"]), int(progress["done"]), progress.get("total"))
                if progress else None)
        error = body.get("error")
        changed = self._assign("load", load) | self._assign("failure", None if error is None else str(error))
        if changed:
            self.changed.emit()
        return changed

    def forget_engine(self) -> bool:
        """Drop what was learned from an engine that is gone (the endpoint stays)."""
        changed = False
        for name in ("model_id", "model_label", "model_path", "architecture", "geometry",
                     "context_length", "load", "uptime_s", "failure"):
            changed |= self._assign(name, None)
        if changed:
            self.changed.emit()
        return changed


def serving_action(state: EngineState, attached: bool) -> tuple[str, bool, str | None]:
    """The Start/Stop item for ``state``: (label, enabled, why disabled).

    One rule for the tray menu and the dashboard header. An attached engine was started
    elsewhere, so the tray neither starts nor stops it.
    """
    if attached:
        return ("Stop serving", False, "Attached to an engine started elsewhere; stop it there.")
    if state in (EngineState.STOPPED, EngineState.FAILED):
        return ("Start serving", True, None)
    if state == EngineState.STOPPING:
        return ("Stopping…", False, "The engine is stopping.")
    return ("Stop serving", True, None)


# --- memory ---------------------------------------------------------------------------


@dataclass(frozen=True)
class FootprintView:
    bytes: int
    kind: str  # "pss" or "rss": the dashboard labels which one it is

    @classmethod
    def from_wire(cls, fp: Mapping[str, Any] | None) -> FootprintView | None:
        return None if fp is None else cls(int(fp["bytes"]), str(fp["kind"]))


class MemoryModel(_Model):
    """Device memory (engine vs others, or the CPU tier's budget) and process footprints.

    The device block comes from the engine; the tray's own footprint is measured by the
    tray (``set_tray_footprint``). Histories hold the engine's device bytes and both
    footprints, one point per snapshot.
    """

    changed = Signal()
    history_changed = Signal()

    def __init__(self, maxlen: int = HISTORY_POINTS) -> None:
        super().__init__()
        self.device_kind: str | None = None
        self.device_name: str | None = None
        self.device_label: str | None = None
        self.total_bytes: int | None = None
        self.engine_bytes: int | None = None
        self.others_bytes: int | None = None
        self.budget_bytes: int | None = None
        self.engine_footprint: FootprintView | None = None
        self.tray_footprint: FootprintView | None = None
        self.engine_device_history = History(maxlen)
        self.engine_footprint_history = History(maxlen)
        self.tray_footprint_history = History(maxlen)

    @property
    def free_bytes(self) -> int | None:
        """Device memory used by nobody, when every term is known."""
        total, engine, others = self.total_bytes, self.engine_bytes, self.others_bytes
        if total is None or engine is None or others is None:
            return None
        return max(0, total - engine - others)

    def apply_snapshot(self, snap: Mapping[str, Any], t: float) -> bool:
        device = snap.get("device") or {}
        changed = self._assign("device_kind", device.get("kind"))
        changed |= self._assign("device_name", device.get("name"))
        changed |= self._assign("device_label", device.get("label"))
        for key in ("total_bytes", "engine_bytes", "others_bytes", "budget_bytes"):
            changed |= self._assign(key, device.get(key))
        changed |= self._assign("engine_footprint", FootprintView.from_wire(snap.get("footprint")))
        self.engine_device_history.append(t, self.engine_bytes)
        self.engine_footprint_history.append(
            t, None if self.engine_footprint is None else self.engine_footprint.bytes)
        self.tray_footprint_history.append(
            t, None if self.tray_footprint is None else self.tray_footprint.bytes)
        if changed:
            self.changed.emit()
        self.history_changed.emit()
        return changed

    def set_tray_footprint(self, footprint: FootprintView | None) -> bool:
        changed = self._assign("tray_footprint", footprint)
        if changed:
            self.changed.emit()
        return changed

    def clear(self) -> bool:
        changed = False
        for key in ("device_kind", "device_name", "device_label", "total_bytes", "engine_bytes",
                    "others_bytes", "budget_bytes", "engine_footprint"):
            changed |= self._assign(key, None)
        if changed:
            self.changed.emit()
        return changed


# --- experts --------------------------------------------------------------------------


def _grid(rows: Iterable[Iterable[int | None]] | None) -> tuple[tuple[int | None, ...], ...]:
    return tuple(tuple(r) for r in rows) if rows is not None else ()


def layer_hit_rates(hits: Sequence[int], misses: Sequence[int]) -> list[float | None]:
    """Hit rate per layer over the window; ``None`` for a layer that routed nothing."""
    rates: list[float | None] = []
    for h, m in zip(hits, misses, strict=True):
        rates.append(None if h + m == 0 else h / (h + m))
    return rates


class ExpertsModel(_Model):
    """Expert residency (layers × experts) with recency, hit rates and transfer per token.

    ``residency_changed`` fires only when which expert sits where, or its recency, really
    changed, so an idle engine costs the heatmap nothing.
    """

    residency_changed = Signal()
    changed = Signal()
    history_changed = Signal()

    def __init__(self, maxlen: int = HISTORY_POINTS) -> None:
        super().__init__()
        self.available = False
        self.residency: tuple[tuple[int | None, ...], ...] = ()
        self.recency: tuple[tuple[int | None, ...], ...] = ()
        self.hit_rate: float | None = None
        self.layer_rates: tuple[float | None, ...] = ()
        self.window_bytes: tuple[int, ...] = ()
        self.total_hits: int | None = None
        self.total_misses: int | None = None
        self.total_bytes: int | None = None
        self.bytes_per_token: float | None = None
        self.backend: str | None = None
        self.fetch_fraction: float | None = None
        self.hit_rate_history = History(maxlen)
        self.layer_histories: list[History] = []
        self._maxlen = maxlen

    @property
    def shape(self) -> tuple[int, int]:
        """(layers, experts) of the residency map; (0, 0) before any snapshot."""
        return (len(self.residency), len(self.residency[0]) if self.residency else 0)

    @property
    def resident_count(self) -> int:
        return sum(slot is not None for row in self.residency for slot in row)

    def heat(self) -> list[list[float | None]]:
        """One cell per (layer, expert): ``None`` when not resident, else its warmth in (0, 1].

        Warmth is ``1 / (1 + steps since last use)``: the expert used this step is 1.0,
        a resident expert never used yet (recency ``None``) is the coldest resident shade.
        """
        cells: list[list[float | None]] = []
        for layer, row in enumerate(self.residency):
            ages = self.recency[layer] if layer < len(self.recency) else ()
            out: list[float | None] = []
            for expert, slot in enumerate(row):
                if slot is None:
                    out.append(None)
                    continue
                age = ages[expert] if expert < len(ages) else None
                out.append(0.05 if age is None else 1.0 / (1.0 + max(0, age)))
            cells.append(out)
        return cells

    def qstar_split(self) -> tuple[float, float] | None:
        """(fetched, computed on CPU) shares of the misses where hybrid; ``None`` otherwise."""
        if self.backend != "hybrid" or self.fetch_fraction is None:
            return None
        return (self.fetch_fraction, 1.0 - self.fetch_fraction)

    def apply_snapshot(self, snap: Mapping[str, Any], t: float) -> bool:
        experts = snap.get("experts")
        if not experts:
            changed = self._assign("available", False)
            changed |= self._assign("residency", ())
            changed |= self._assign("recency", ())
            if changed:
                self.residency_changed.emit()
                self.changed.emit()
            return changed
        residency_changed = self._assign("residency", _grid(experts.get("residency")))
        residency_changed |= self._assign("recency", _grid(experts.get("recency")))
        rates = tuple(layer_hit_rates(experts.get("window_hits", ()), experts.get("window_misses", ())))
        changed = self._assign("available", True)
        changed |= self._assign("layer_rates", rates)
        changed |= self._assign("window_bytes", tuple(experts.get("window_bytes", ())))
        for key in ("hit_rate", "total_hits", "total_misses", "total_bytes", "bytes_per_token",
                    "backend", "fetch_fraction"):
            changed |= self._assign(key, experts.get(key))
        self.hit_rate_history.append(t, self.hit_rate)
        if len(self.layer_histories) != len(rates):
            self.layer_histories = [History(self._maxlen) for _ in rates]
        for history, rate in zip(self.layer_histories, rates, strict=True):
            history.append(t, rate)
        if residency_changed:
            self.residency_changed.emit()
        if changed or residency_changed:
            self.changed.emit()
        self.history_changed.emit()
        return changed or residency_changed


# --- throughput -----------------------------------------------------------------------


class ThroughputModel(_Model):
    """tok/s, time to first token (p50/p95), queue length and requests served."""

    changed = Signal()
    history_changed = Signal()

    def __init__(self, maxlen: int = HISTORY_POINTS) -> None:
        super().__init__()
        self.tok_s: float | None = None
        self.ttft_p50_ms: float | None = None
        self.ttft_p95_ms: float | None = None
        self.queue: int | None = None
        self.requests_served: int | None = None
        self.prompt_tokens_total: int | None = None
        self.completion_tokens_total: int | None = None
        self.active: int | None = None
        self.tok_s_history = History(maxlen)
        self.ttft_history = History(maxlen)

    def apply_snapshot(self, snap: Mapping[str, Any], t: float) -> bool:
        tp = snap.get("throughput") or {}
        changed = False
        for key in ("tok_s", "ttft_p50_ms", "ttft_p95_ms", "queue", "requests_served",
                    "prompt_tokens_total", "completion_tokens_total"):
            changed |= self._assign(key, tp.get(key))
        changed |= self._assign("active", len(snap.get("requests") or ()))
        self.tok_s_history.append(t, self.tok_s)
        self.ttft_history.append(t, self.ttft_p50_ms)
        if changed:
            self.changed.emit()
        self.history_changed.emit()
        return changed


# --- requests -------------------------------------------------------------------------


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


# --- logs -----------------------------------------------------------------------------


class LogsModel(QObject):
    """The engine's log: the last :data:`LOG_LINES` lines, appended as they arrive."""

    appended = Signal(list)  # the new lines (views may also re-read ``lines``)
    cleared = Signal()
    source_changed = Signal()

    def __init__(self, maxlen: int = LOG_LINES) -> None:
        super().__init__()
        self._lines: deque[str] = deque(maxlen=maxlen)
        self.source: str | None = None  # where the lines come from, shown above them

    @property
    def lines(self) -> list[str]:
        return list(self._lines)

    def append(self, lines: Iterable[str]) -> None:
        new = [line.rstrip("\n") for line in lines]
        if not new:
            return
        self._lines.extend(new)
        self.appended.emit(new)

    def clear(self, source: str | None = None) -> None:
        self._lines.clear()
        self.source = source
        self.cleared.emit()

    def set_source(self, source: str | None) -> None:
        """Name where the lines come from (a new engine process keeps the old lines above)."""
        if source != self.source:
            self.source = source
            self.source_changed.emit()


# --- rebuild outcome ------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    moe_slots: int
    kv_pages: int
    kv_tokens: int
    state_slots: int = 0  # recurrent-state slots; 0 on a model without the pool

    @classmethod
    def from_wire(cls, body: Mapping[str, Any] | None) -> Sizes | None:
        if not body:
            return None
        return cls(int(body["moe_slots"]), int(body["kv_pages"]), int(body["kv_tokens"]),
                   int(body.get("state_slots") or 0))


OUTCOME_SEVERITY = {"applied": "ok", "rejected_intact": "warning", "rolled_back": "warning",
                    "pending": "warning", "latched": "error", "unreachable": "error"}
LATCHED_WAY_OUT = ("The engine is latched failed and serves nothing until it restarts: "
                   "use Stop serving, then Start serving (or Restart engine).")


@dataclass(frozen=True)
class ApplyOutcome:
    """What one Apply did, as the engine said it: never paraphrased, never guessed.

    ``outcome`` is the rebuild outcome (``applied``, ``rejected_intact``, ``rolled_back``,
    ``latched``), ``pending`` when the engine stopped waiting for a transaction that is
    still running (``rebuild_timed_out``; the status feed shows how it ends) or
    ``unreachable`` when no answer came back. ``message`` is the engine's
    own sentence; ``kind`` its refusal kind.
    """

    outcome: str
    kind: str | None
    message: str
    before: Sizes | None
    after: Sizes | None
    elapsed_ms: float | None
    prefix_cache_invalidated: bool | None

    @property
    def severity(self) -> str:
        return OUTCOME_SEVERITY.get(self.outcome, "error")

    @property
    def way_out(self) -> str | None:
        return LATCHED_WAY_OUT if self.outcome == "latched" else None

    def text(self) -> str:
        """The outcome line the Pools panel shows."""
        def sizes(s: Sizes) -> str:
            state = f" / {s.state_slots} state slots" if s.state_slots else ""
            return f"{s.moe_slots} slots / {s.kv_tokens} KV tokens ({s.kv_pages} pages){state}"

        head = {"applied": "Applied", "rejected_intact": "Rejected, nothing changed",
                "rolled_back": "Rolled back to the old sizes", "latched": "LATCHED",
                "pending": "Still running",
                "unreachable": "No answer from the engine"}.get(self.outcome, self.outcome)
        parts = [head]
        if self.kind and self.outcome != "applied":
            parts[0] += f" ({self.kind})"
        if self.message:
            parts.append(self.message)
        if self.outcome == "applied" and self.before and self.after:
            parts.append(f"{sizes(self.before)} → {sizes(self.after)}")
        elif self.after:
            parts.append(f"now {sizes(self.after)}")
        if self.elapsed_ms is not None:
            parts.append(f"in {self.elapsed_ms:.0f} ms")
        if self.prefix_cache_invalidated:
            parts.append("prefix cache invalidated")
        if self.way_out:
            parts.append(self.way_out)
        return " · ".join(parts)


def rebuild_outcome(status: int | None, body: Mapping[str, Any] | None) -> ApplyOutcome:
    """Read a ``POST /admin/cache/rebuild`` reply (any status) into an :class:`ApplyOutcome`.

    Decides the outcome from the body's ``outcome`` when present; an error body without
    one is read by its refusal kind: ``rolled_back`` and ``rebuild_latched``/``latched``
    name themselves, ``rebuild_timed_out`` is ``pending``, any other refusal (gate,
    arithmetic, idle timeout) changed nothing.
    ``status=None`` means the request got no reply at all. Mutates nothing.
    """
    if status is None or body is None:
        message = "" if body is None else str(body.get("message", ""))
        return ApplyOutcome("unreachable", None, message, None, None, None, None)
    fields: Mapping[str, Any] = body.get("error", body) if isinstance(body.get("error"), dict) else body
    kind = fields.get("kind") if "error" in body else None
    outcome = fields.get("outcome")
    if outcome is None:
        if status < 300:
            outcome = "applied"
        elif kind == "rolled_back":
            outcome = "rolled_back"
        elif kind in ("rebuild_latched", "latched"):
            outcome = "latched"
        elif kind == "rebuild_timed_out":
            outcome = "pending"
        else:
            outcome = "rejected_intact"
    message = str(fields.get("message") or "")
    if not message and kind:
        message = wire.refusal_for(str(kind)).summary
    elapsed = fields.get("elapsed_ms")
    return ApplyOutcome(
        outcome=str(outcome),
        kind=None if kind is None else str(kind),
        message=message,
        before=Sizes.from_wire(fields.get("before")),
        after=Sizes.from_wire(fields.get("after")),
        elapsed_ms=None if elapsed is None else float(elapsed),
        prefix_cache_invalidated=fields.get("prefix_cache_invalidated"),
    )
