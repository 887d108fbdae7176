"""The tool-call parser's state, which every tool grammar steps through.

A grammar's ``step(cursor, final) -> bool`` reads ``cursor.buf`` from its ``mode``, consumes
what it decided (``consume``, kept in ``raw`` for a verbatim fallback) and reports calls
through the verbs (``start_call``, ``add_parameter``, ``end_call``, ``whole_call``); it
returns True while it made progress. Text between sections is ``text_step``'s, shared by
every grammar with an opener.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .common import (
    NAME_MAX,
    CallArguments,
    CallEnd,
    CallStart,
    Event,
    Text,
    ToolCallMarkers,
    Trim,
    earliest,
    partial_tail,
)
from .values import JsonEnd, coerce, schemas, trim_value


@dataclass
class OpenCall:
    index: int
    name: str
    args: dict[str, Any] = field(default_factory=dict)


class Cursor:
    """Where one tool-call stream stands: held text, the grammar's mode, the open call."""

    def __init__(self, markers: ToolCallMarkers, tools: Sequence[Mapping[str, Any]] | None) -> None:
        self.markers = markers
        self.schemas = schemas(tools)
        self.out = Trim()
        self.events: list[Event] = []
        self.buf = ""
        self.mode = "text"  # "text" or a section state of the format's grammar
        self.raw = ""  # section text consumed since its opener, for a verbatim fallback
        self.json = JsonEnd()
        self.call: OpenCall | None = None
        self.key = ""
        self.next_index = 0
        self.section_calls = 0
        self.bare_possible = markers.bare_json_start

    # events
    def take(self) -> list[Event]:
        self._emit_text()
        events, self.events = self.events, []
        return events

    def _emit_text(self) -> None:
        text = self.out.take()
        if not text:
            return
        if self.events and isinstance(self.events[-1], Text):
            self.events[-1] = Text(self.events[-1].text + text)
        else:
            self.events.append(Text(text))

    def _emit(self, event: Event) -> None:
        self._emit_text()
        self.events.append(event)

    # calls
    def start_call(self, name: str) -> None:
        self.out.markup()
        self.call = OpenCall(self.next_index, name)
        self.next_index += 1
        self.section_calls += 1
        self._emit(CallStart(self.call.index, name))

    def add_parameter(self, key: str, raw: str) -> None:
        call = self.call
        assert call is not None
        key = key.strip()
        if not key or key in call.args:
            return
        value = coerce(trim_value(raw, self.markers.trim), self.schemas.get(call.name, {}).get(key))
        head = ", " if call.args else "{"
        call.args[key] = value
        fragment = f"{head}{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"
        self._emit(CallArguments(call.index, fragment))

    def end_call(self) -> None:
        call = self.call
        assert call is not None
        self._emit(CallArguments(call.index, "}" if call.args else "{}"))
        self._emit(CallEnd(call.index, json.dumps(call.args, ensure_ascii=False)))
        self.call = None
        self.out.markup()

    def whole_call(self, name: str, args: dict[str, Any]) -> None:
        self.start_call(name)
        arguments = json.dumps(args, ensure_ascii=False)
        assert self.call is not None
        self._emit(CallArguments(self.call.index, arguments))
        self._emit(CallEnd(self.call.index, arguments))
        self.call = None
        self.out.markup()

    # sections
    def consume(self, n: int) -> None:
        self.raw += self.buf[:n]
        self.buf = self.buf[n:]

    def enter(self, mode: str) -> None:
        self.mode = mode
        self.json = JsonEnd()

    def leave_section(self) -> None:
        self.raw = ""
        self.section_calls = 0
        self.mode = "text"

    def as_text(self) -> None:
        """The section so far was not a call: release it verbatim and read on as text."""
        self.out.text(self.raw)
        self.bare_possible = False
        self.leave_section()

    # reading pieces of a section (shared by the grammars)
    def name_end(self, end: str, final: bool) -> int | None:
        """Where ``end`` closes the name at the head of ``buf``: its index; -1 when it will not
        come (the stream ended, or more than ``NAME_MAX`` characters passed without it); None
        while it still may."""
        at = self.buf.find(end)
        if at == -1 and not final and len(self.buf) <= NAME_MAX:
            return None
        return at

    def key_step(self, end: str, next_mode: str, final: bool, *, checked: bool) -> bool:
        """A parameter's name up to ``end``: kept as ``key``, read on in ``next_mode``. A run that
        cannot be one (no ``end`` in reach; with ``checked``, a blank or over-long name) is
        skipped as debris, back in "params"."""
        at = self.name_end(end, final)
        if at is None:
            return False
        name = self.buf[:at].strip() if at != -1 else ""
        if at == -1 or (checked and not 0 < len(name) <= NAME_MAX):
            self.mode = "params"
            return True
        self.key = self.buf[:at]
        self.consume(at + len(end))
        self.mode = next_mode
        return True

    def take_marker(self, markers: list[str], final: bool) -> str | None:
        """Consume through the first of ``markers`` in ``buf`` and return it; None when none is
        there. At the end of the stream, an open call ends with the arguments seen so far."""
        hit = earliest(self.buf, markers)
        if hit is None:
            if final:
                self.buf = ""
                self.end_call()
                self.leave_section()
            return None
        at, marker = hit
        self.consume(at + len(marker))
        return marker

    def value_step(self, stops: list[str], final: bool) -> bool:
        """A parameter's value: up to its closer (``markers.param_close``, consumed) or where a
        forgotten closer should have been (another of ``stops``, left for the next step)."""
        close = self.markers.param_close
        assert close is not None
        hit = earliest(self.buf, [close, *stops])
        if hit is None and not final:
            return False
        at = len(self.buf) if hit is None else hit[0]
        self.add_parameter(self.key, self.buf[:at])
        self.consume(at + (len(close) if hit is not None and hit[1] == close else 0))
        self.mode = "params"
        return True

    def json_end(self, final: bool) -> int | None:
        """Where the JSON value at the head of ``buf`` ends; None while it has not. A value the
        stream ends inside was not a call: the section is released as text."""
        end = self.json.scan(self.buf)
        if end is None and final:
            self.consume(len(self.buf))
            self.as_text()
        return end

    def text_step(self, final: bool) -> bool:
        """Text between calls, up to the next opener (or a bare ``{`` opening the answer)."""
        buf = self.buf
        if self.bare_possible:
            lead = buf.lstrip()
            if not lead and not final:
                return False
            if lead.startswith("{"):
                self.consume(len(buf) - len(lead))
                self.enter("bare")
                return True
            self.bare_possible = False
        opener = self.markers.opener
        assert opener is not None
        at = buf.find(opener)
        if at != -1:
            self.out.text(buf[:at])
            self.buf = buf[at:]
            self.raw = ""
            self.consume(len(opener))
            self.enter("open")
            return True
        keep = 0 if final else partial_tail(buf, [opener])
        self.out.text(buf[: len(buf) - keep])
        self.buf = buf[len(buf) - keep:]
        return False


Step = Callable[[Cursor, bool], bool]
"""One grammar's step over a section (see the module docstring)."""
