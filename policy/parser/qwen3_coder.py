"""qwen3_coder (Qwen3-Coder, Qwen3.5): ``<tool_call><function=NAME><parameter=KEY>value</parameter>…
</function></tool_call>``; one prefix-stable arguments fragment per parameter."""

from __future__ import annotations

from .common import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, Identities, ToolCallMarkers, earliest
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
        if marker == m.function_open:
            c.mode = "name"
        elif c.section_calls == 0:  # a closer before any function: not a call
            c.as_text()
        else:
            c.out.markup()
            c.leave_section()
        return True
    if c.mode == "name":
        end = c.name_end(m.name_end, final)
        if end is None:
            return False
        name = buf[:end].strip() if end != -1 else ""
        if not valid_name(name):
            c.consume(len(buf) if end == -1 else end + len(m.name_end))
            if c.section_calls == 0:
                c.as_text()
            else:  # debris after the section's calls
                c.leave_section()
            return True
        c.consume(end + len(m.name_end))
        c.start_call(name)
        c.mode = "params"
        return True
    if c.mode == "params":
        taken = c.take_marker([m.param_open, m.function_close, m.closer], final)
        if taken is None:
            return final
        if taken == m.param_open:
            c.mode = "param_name"
            return True
        c.end_call()
        if taken == m.closer:
            c.leave_section()
        else:
            c.mode = "open"
        return True
    if c.mode == "param_name":
        return c.key_step(m.param_name_end, "value", final, checked=True)
    # value: ends at </parameter>, or where a forgotten one should have been
    return c.value_step([m.param_open, m.function_close, m.closer], final)
