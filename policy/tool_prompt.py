"""What a prompt says about tools when the chat template has no tool section of its own.

Many chat templates (small instruct models, ChatML fine-tunes) ignore ``tools=``: the
model would never hear of them. For such a template the engine injects a tool-use system
block written in the model family's own tool-call format (``policy.parser``'s one
description of it), so whatever the model answers in that format the family's parser turns
into ``tool_calls``. Earlier assistant tool calls are written back in the same format, and
tool results go in as user turns, since such a template knows no ``tool`` role.

Pure: messages and tools in, messages out.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from moetray.policy.parser import HARMONY, TOOL_CALL_MARKERS, ToolCallFormat

EXAMPLE_CALL = {"name": "<function-name>", "arguments": {"<parameter>": "<value>"}}
"""The call the tool block shows as its example of the format."""
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
"""How a tool's result is marked in the user turn that carries it."""


def _raw(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _arguments(call: Mapping[str, Any]) -> dict[str, Any]:
    args = call.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return {}
    return dict(args) if isinstance(args, Mapping) else {}


def render_tool_calls(fmt: ToolCallFormat, calls: Sequence[Mapping[str, Any]]) -> str:
    """Calls (``name``, ``arguments`` as an object or JSON text) written in ``fmt``'s wire format.

    Exactly the text the family's ``ToolCallParser`` reads back into these calls. Pure;
    refuses nothing (unparseable argument text counts as no arguments).
    """
    m = TOOL_CALL_MARKERS[fmt]
    items = [(str(c.get("name", "")), _arguments(c)) for c in calls]

    def dump(obj: object) -> str:
        return json.dumps(obj, ensure_ascii=False)

    def xml(head: str, param: str, tail: str) -> str:
        """Each call as ``head`` (naming it), one ``param`` per argument, then ``tail``."""
        return "\n".join(
            head.format(m=m, n=n)
            + "".join(param.format(m=m, k=k, v=_raw(v)) for k, v in a.items())
            + tail.format(m=m)
            for n, a in items
        )

    if m.grammar == "json_block":
        return "\n".join(f"{m.opener}\n{dump({'name': n, 'arguments': a})}\n{m.closer}" for n, a in items)
    if m.grammar == "json_sequence":
        return f"{m.opener}" + ";".join(dump({"name": n, "parameters": a}) for n, a in items)
    if m.grammar == "mistral":
        return f"{m.opener}" + dump([{"name": n, "arguments": a} for n, a in items])
    if m.grammar == "xml_function":
        return xml(
            "{m.opener}\n{m.function_open}{n}{m.name_end}\n",
            "{m.param_open}{k}{m.param_name_end}\n{v}\n{m.param_close}\n",
            "{m.function_close}\n{m.closer}",
        )
    if m.grammar == "xml_arg_pairs":
        return xml(
            "{m.opener}{n}{m.name_end}",
            "{m.param_open}{k}{m.param_name_end}\n{m.value_open}{v}{m.param_close}\n",
            "{m.closer}",
        )
    return "".join(
        f"{HARMONY.channel}commentary to={HARMONY.functions}{n} {HARMONY.constrain}json"
        f"{HARMONY.message}{dump(a)}{HARMONY.call}"
        for n, a in items
    )


def tool_system_block(fmt: ToolCallFormat, tools: Sequence[Mapping[str, Any]]) -> str:
    """The system text that tells a model about ``tools`` (OpenAI tool objects) and ``fmt``."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\n"
        "You may call one or more of these functions to answer. Their signatures (JSON Schema) "
        f"are inside <tools></tools>:\n<tools>\n{listed}\n</tools>\n\n"
        "To call a function, answer with the call in exactly this form, one per call:\n"
        f"{render_tool_calls(fmt, [EXAMPLE_CALL])}"
    )


def with_tool_block(
    messages: Sequence[Mapping[str, Any]], fmt: ToolCallFormat, tools: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """``messages`` for a template without a tool section: the tool block leads the system turn.

    The block is put before an existing system (or developer) message's text, or becomes a
    system message of its own. Assistant ``tool_calls`` are written into the assistant's
    text in ``fmt``; ``tool`` messages become user turns carrying the result. Pure (the
    input is not mutated); refuses nothing.
    """
    block = tool_system_block(fmt, tools)
    out: list[dict[str, Any]] = []
    for message in messages:
        m = dict(message)
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            calls = [c.get("function") or {} for c in m.pop("tool_calls")]
            text = _content_text(m.get("content"))
            m["content"] = (text + "\n" if text else "") + render_tool_calls(fmt, calls)
        elif role == "tool":
            result = _content_text(m.get("content"))
            m = {"role": "user", "content": f"{TOOL_RESPONSE_OPEN}\n{result}\n{TOOL_RESPONSE_CLOSE}"}
        out.append(m)
    if out and out[0].get("role") in ("system", "developer"):
        first = dict(out[0], role="system")
        first["content"] = f"{block}\n\n{_content_text(first.get('content'))}".rstrip()
        out[0] = first
    else:
        out.insert(0, {"role": "system", "content": block})
    return out


def _content_text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    return "" if content is None else str(content)
