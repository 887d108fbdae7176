"""qwen3_coder (Qwen3-Coder, Qwen3.5): ``<tool_call><function=NAME><parameter=KEY>value</parameter>…
</function></tool_call>``; one prefix-stable arguments fragment per parameter."""

from __future__ import annotations

from .common import NAME_MAX, TOOL_CALL_CLOSE, TOOL_CALL_OPEN, Identities, ToolCallMarkers, earliest
from .cursor import Cursor
from .values import valid_name

MARKERS = ToolCallMarkers(
    "xml_function", TOOL_CALL_OPEN, TOOL_CALL_CLOSE, function_open="<function=",
    function_close="</function>", name_end=">", param_open="<parameter=", param_name_end=">",
    param_close="</parameter>", trim="newline")
IDENTITIES: Identities = ("qwen3-coder", "qwen3_coder", "qwen3coder", "qwen3.5", "qwen3_5")


def step(c: Cursor, final: bool) -> bool:
    """Functions inside one section, each with its parameters; a forgotten closer is forgiven."""
    m = c.markers
    assert m.function_open and m.function_close and m.closer and m.name_end
    assert m.param_open and m.param_name_end and m.param_close
    buf = c.buf
    if c.mode == "open":  # between functions of one section
        hit = earliest(buf, [m.function_open, m.closer])
        if hit is None:
            if not final:
                return False
            if c.section_calls == 0:
                c.consume(len(buf))
                c.as_text()
            else:  # an unclosed section ends after its last function; the rest is text
                c.out.text(buf)
                c.buf = ""
                c.leave_section()
            return True
        at, marker = hit
        c.consume(at + len(marker))
        if marker == m.closer:
            if c.section_calls == 0:
                c.as_text()
            else:
                c.out.markup()
                c.leave_section()
        else:
            c.mode = "name"
        return True
    if c.mode == "name":
        at = buf.find(m.name_end)
        if at == -1 and not final and len(buf) <= NAME_MAX:
            return False
        name = buf[:at].strip() if at != -1 else ""
        if not valid_name(name):
            c.consume(len(buf) if at == -1 else at + len(m.name_end))
            if c.section_calls == 0:
                c.as_text()
            else:  # debris after the section's calls
                c.leave_section()
            return True
        c.consume(at + len(m.name_end))
        c.start_call(name)
        c.mode = "params"
        return True
    if c.mode == "params":
        hit = earliest(buf, [m.param_open, m.function_close, m.closer])
        if hit is None:
            if final:
                c.buf = ""
                c.end_call()
                c.leave_section()
            return final
        at, marker = hit
        c.consume(at + len(marker))
        if marker == m.param_open:
            c.mode = "param_name"
            return True
        c.end_call()
        if marker == m.closer:
            c.leave_section()
        else:
            c.mode = "open"
        return True
    if c.mode == "param_name":
        at = buf.find(m.param_name_end)
        if at == -1 and not final and len(buf) <= NAME_MAX:
            return False
        if at == -1 or not buf[:at].strip() or len(buf[:at].strip()) > NAME_MAX:
            c.mode = "params"  # not a parameter: skip past the marker as debris
            return True
        c.key = buf[:at]
        c.consume(at + len(m.param_name_end))
        c.mode = "value"
        return True
    # value: ends at </parameter>, or where a forgotten one should have been
    hit = earliest(buf, [m.param_close, m.param_open, m.function_close, m.closer])
    if hit is None and not final:
        return False
    at = len(buf) if hit is None else hit[0]
    c.add_parameter(c.key, buf[:at])
    c.consume(at + (len(m.param_close) if hit is not None and hit[1] == m.param_close else 0))
    c.mode = "params"
    return True
