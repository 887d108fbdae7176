"""What one re-split did, read from the engine's reply and said in plain words.

:func:`rebuild_outcome` reads a ``POST /admin/cache/rebuild`` reply (any status) or a
snapshot's ``last_rebuild`` into an :class:`ApplyOutcome`; :meth:`ApplyOutcome.text` is
the sentence the Pools panel shows. The engine's own sentence is kept verbatim; the
durations are the engine's wall-clock figures (``waited_ms`` waiting for running
requests, ``applied_ms`` changing the pools), never the tray's guess.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from moetray.policy import wire
from moetray.ui.format import fmt_duration_ms, fmt_int


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
                   "use Restart engine.")


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


def _sentence(text: str) -> str:
    text = text.strip()
    return text if not text or text.endswith((".", "!", "?")) else text + "."


@dataclass(frozen=True)
class ApplyOutcome:
    """What one Apply did, as the engine said it: never paraphrased, never guessed.

    ``outcome`` is the rebuild outcome (``applied``, ``rejected_intact``, ``rolled_back``,
    ``latched``), ``pending`` when the engine stopped waiting for a transaction that is
    still running (``rebuild_timed_out``; the status feed shows how it ends) or
    ``unreachable`` when no answer came back. ``message`` is the engine's own sentence;
    ``kind`` its refusal kind. ``waited_ms`` and ``applied_ms`` are the engine's wall-clock
    durations (``None`` when unknown or when that phase never ran).
    """

    outcome: str
    kind: str | None
    message: str
    before: Sizes | None
    after: Sizes | None
    elapsed_ms: float | None
    prefix_cache_invalidated: bool | None
    waited_ms: float | None = None
    applied_ms: float | None = None

    @property
    def severity(self) -> str:
        return OUTCOME_SEVERITY.get(self.outcome, "error")

    @property
    def way_out(self) -> str | None:
        return LATCHED_WAY_OUT if self.outcome == "latched" else None

    def _changes(self) -> str:
        b, a = self.before, self.after
        assert b is not None and a is not None
        parts = []
        if a.moe_slots != b.moe_slots:
            parts.append(f"{fmt_int(b.moe_slots)} → {fmt_int(a.moe_slots)} expert slots")
        if a.kv_tokens != b.kv_tokens:
            parts.append(f"{fmt_int(b.kv_tokens)} → {fmt_int(a.kv_tokens)} KV tokens")
        if a.state_slots != b.state_slots:
            parts.append(f"{fmt_int(b.state_slots)} → {fmt_int(a.state_slots)} state slots")
        return ", ".join(parts) or f"{fmt_int(a.moe_slots)} expert slots, {fmt_int(a.kv_tokens)} KV tokens"

    def timing(self) -> str | None:
        """``took 159 ms, after waiting 2.1 s for running requests`` (the parts that are known)."""
        parts = []
        if self.applied_ms is not None:
            parts.append(f"took {fmt_duration_ms(self.applied_ms)}")
        if self.waited_ms is not None and self.waited_ms >= 50:
            parts.append(f"after waiting {fmt_duration_ms(self.waited_ms)} for running requests")
        if not parts and self.elapsed_ms is not None:
            parts.append(f"took {fmt_duration_ms(self.elapsed_ms)}")
        return ", ".join(parts) or None

    def text(self) -> str:
        """The outcome in plain words, as the Pools panel shows it."""
        message = _sentence(self.message)
        if self.outcome == "applied":
            text = "Applied" + (f": {self._changes()}" if self.before and self.after else "")
            timing = self.timing()
            text += f" ({timing})." if timing else "."
            if self.prefix_cache_invalidated:
                text += " Cached prompt prefixes were dropped."
            return text
        if self.outcome == "pending":
            return f"Still running: {message} The status feed shows how it ends."
        if self.outcome == "unreachable":
            return f"No answer from the engine. {message}".strip()
        if self.outcome == "rolled_back":
            return f"The re-split failed and the old sizes were restored: {message}"
        if self.outcome == "latched":
            return f"The re-split and its rollback failed: {message} {LATCHED_WAY_OUT}"
        if "nothing changed" in message.lower() or "nothing was changed" in message.lower():
            return message
        return f"{message} Nothing changed." if message else "Nothing changed."


def rebuild_outcome(status: int | None, body: Mapping[str, Any] | None) -> ApplyOutcome:
    """Read a ``POST /admin/cache/rebuild`` reply (any status) into an :class:`ApplyOutcome`.

    Decides the outcome from the body's ``outcome`` when present; an error body without
    one is read by its refusal kind: ``rolled_back`` and ``rebuild_latched``/``latched``
    name themselves, ``rebuild_timed_out`` is ``pending``, any other refusal (gate,
    arithmetic, requests still running, cancelled) changed nothing.
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
    return ApplyOutcome(
        outcome=str(outcome),
        kind=None if kind is None else str(kind),
        message=message,
        before=Sizes.from_wire(fields.get("before")),
        after=Sizes.from_wire(fields.get("after")),
        elapsed_ms=_float(fields.get("elapsed_ms")),
        prefix_cache_invalidated=fields.get("prefix_cache_invalidated"),
        waited_ms=_float(fields.get("waited_ms")),
        applied_ms=_float(fields.get("applied_ms")),
    )
