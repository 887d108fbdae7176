"""mistral: ``[TOOL_CALLS][{…}, …]`` or ``[TOOL_CALLS]NAME[CALL_ID]id[ARGS]{…}``."""

from __future__ import annotations

from .common import NAME_MAX, Identities, ToolCallMarkers
from .cursor import Cursor
from .values import json_call, loads, valid_name

MARKERS = ToolCallMarkers("mistral", "[TOOL_CALLS]", args_marker="[ARGS]", call_id_marker="[CALL_ID]")
IDENTITIES: Identities = ("mistral", "mixtral", "ministral", "magistral", "devstral", "codestral")


def step(c: Cursor, final: bool) -> bool:
    """A JSON array of calls, or one name with its arguments object."""
    m = c.markers
    assert m.args_marker is not None
    if c.mode == "open":
        lead = c.buf.lstrip()
        if not lead and not final:
            return False
        c.consume(len(c.buf) - len(lead))
        c.enter("array" if lead.startswith("[") else "name")
        return True
    if c.mode == "name":
        at = c.buf.find(m.args_marker)
        if at == -1:
            if final or len(c.buf) > 2 * NAME_MAX:
                c.consume(len(c.buf))
                c.as_text()
                return True
            return False
        head = c.buf[:at]
        if m.call_id_marker and m.call_id_marker in head:
            head = head[: head.find(m.call_id_marker)]
        name = head.strip()
        c.consume(at + len(m.args_marker))
        if not valid_name(name):
            c.as_text()
            return True
        c.key = name
        c.enter("args_lead")
        return True
    if c.mode == "args_lead":
        lead = c.buf.lstrip()
        if not lead and not final:
            return False
        c.consume(len(c.buf) - len(lead))
        if not lead.startswith("{"):
            c.as_text()
            return True
        c.enter("args")
        return True
    # "array" (a JSON list of calls) or "args" (one arguments object)
    end = c.json_end(final)
    if end is None:
        return final
    value = loads(c.buf[:end])
    c.consume(end)
    if c.mode == "array":
        calls = [json_call(item) for item in value] if isinstance(value, list) and value else None
        if not calls or any(call is None for call in calls):
            c.as_text()
            return True
        for call in calls:
            assert call is not None
            c.whole_call(*call)
    else:
        one = json_call({"name": c.key, "arguments": value})
        if one is None:
            c.as_text()
            return True
        c.whole_call(*one)
    c.leave_section()
    return True
