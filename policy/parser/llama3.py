"""llama3: ``<|python_tag|>{"name", "parameters"}; {…}``, and a bare JSON answer is a call too."""

from __future__ import annotations

from .common import Identities, ToolCallMarkers
from .cursor import Cursor
from .values import json_call, loads

MARKERS = ToolCallMarkers("json_sequence", "<|python_tag|>", separator=";", bare_json_start=True)
IDENTITIES: Identities = ("llama-3", "llama3", "llama_3", "llama-4", "llama4")


def step(c: Cursor, final: bool) -> bool:
    """Call objects joined by the separator; the section ends at anything else."""
    if c.mode in ("open", "bare", "next"):  # a call object must follow
        lead = c.buf.lstrip()
        if not lead and not final:
            return False
        c.consume(len(c.buf) - len(lead))
        if lead.startswith("{"):
            c.enter("object")
        elif c.mode == "next":  # a separator with no call after it was debris
            c.leave_section()
        else:
            c.as_text()
        return True
    if c.mode == "object":
        end = c.json_end(final)
        if end is None:
            return final
        call = json_call(loads(c.buf[:end]))
        c.consume(end)
        if call is None:
            c.as_text()
            return True
        c.whole_call(*call)
        c.raw = ""
        c.bare_possible = False
        c.mode = "after"
        return True
    # after an object: a separator continues the section, anything else ends it
    lead = c.buf.lstrip()
    if not lead and not final:
        return False
    separator = c.markers.separator
    if separator and lead.startswith(separator):
        c.consume(len(c.buf) - len(lead) + len(separator))
        c.mode = "next"
        return True
    c.leave_section()
    return True
