"""glm45 (GLM-4.5/4.6/4.7): ``<tool_call>NAME\\n<arg_key>K</arg_key><arg_value>V</arg_value>…
</tool_call>``; one prefix-stable arguments fragment per parameter."""

from __future__ import annotations

from .common import NAME_MAX, TOOL_CALL_CLOSE, TOOL_CALL_OPEN, Identities, ToolCallMarkers, earliest
from .cursor import Cursor
from .values import valid_name

MARKERS = ToolCallMarkers(
    "xml_arg_pairs", TOOL_CALL_OPEN, TOOL_CALL_CLOSE, name_end="\n", param_open="<arg_key>",
    param_name_end="</arg_key>", value_open="<arg_value>", param_close="</arg_value>")
IDENTITIES: Identities = ("glm-4.5", "glm4.5", "glm-4.6", "glm-4.7", "glm4_moe", "glm")


def step(c: Cursor, final: bool) -> bool:
    """One call per section: its name, then key/value pairs up to the closer."""
    m = c.markers
    assert m.closer and m.name_end and m.param_open and m.param_name_end
    assert m.value_open and m.param_close
    buf = c.buf
    if c.mode == "open":  # the function name
        hit = earliest(buf, [m.name_end, m.param_open, m.closer])
        if hit is None and not final and len(buf) <= NAME_MAX:
            return False
        at = len(buf) if hit is None else hit[0]
        name = buf[:at].strip()
        if not valid_name(name):
            c.consume(len(buf) if hit is None else at + len(hit[1]))
            c.as_text()
            return True
        c.consume(at + (len(m.name_end) if hit is not None and hit[1] == m.name_end else 0))
        c.start_call(name)
        c.mode = "params"
        return True
    if c.mode == "params":
        marker = c.take_marker([m.param_open, m.closer], final)
        if marker is None:
            return final
        if marker == m.param_open:
            c.mode = "param_name"
        else:
            c.end_call()
            c.leave_section()
        return True
    if c.mode == "param_name":
        return c.key_step(m.param_name_end, "value_open", final, checked=False)
    if c.mode == "value_open":
        lead = buf.lstrip()
        if lead.startswith(m.value_open):
            c.consume(len(buf) - len(lead) + len(m.value_open))
            c.mode = "value"
            return True
        if not final and (not lead or m.value_open.startswith(lead)):
            return False
        c.add_parameter(c.key, "")
        c.mode = "params"
        return True
    return c.value_step([m.param_open, m.closer], final)
