"""hermes (Qwen2.5, Qwen3, Hermes): ``<tool_call>{"name", "arguments"}</tool_call>``."""

from __future__ import annotations

from .common import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, Identities, ToolCallMarkers
from .cursor import Cursor
from .values import json_calls

MARKERS = ToolCallMarkers("json_block", TOOL_CALL_OPEN, TOOL_CALL_CLOSE)
IDENTITIES: Identities = ("qwen", "qwq", "hermes")


def step(c: Cursor, final: bool) -> bool:
    """A section is one or more JSON call objects up to the closer; anything else is text."""
    closer = c.markers.closer
    assert closer is not None
    at = c.buf.find(closer)
    if at == -1 and not final:
        return False
    body = c.buf if at == -1 else c.buf[:at]
    calls = json_calls(body)
    c.consume(len(c.buf) if at == -1 else at + len(closer))
    if calls is None:
        c.as_text()
        return True
    for name, args in calls:
        c.whole_call(name, args)
    c.leave_section()
    return True
