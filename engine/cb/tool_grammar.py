"""The Lark grammar of each family's tool-call wire format, for llguidance to force.

Every format is read from ``policy.parser``'s one description of it (``TOOL_CALL_MARKERS``,
``HARMONY``), so what is forced is exactly what the family's parser turns back into
``tool_calls``. Arguments are forced valid against the function's ``parameters`` schema:
JSON formats inline the schema (``%json``); the XML formats (qwen3_coder, glm45) write one
parameter per property in schema order, required ones always, optional ones at will, each
value valid for its property's type.

Builders return Lark rules; :func:`constraint_lark` assembles the ``start`` rule for a
``tool_choice`` / ``response_format`` and the reasoning block the prompt may have opened.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from moetray.engine.cb.grammar import json_item
from moetray.policy.parser import HARMONY, TOOL_CALL_MARKERS, ToolCallFormat

Literal = Callable[[str], str]
"""Text → a Lark item (a token reference when it is one special token; see GrammarCompiler.literal)."""


def _escaped(marker: str) -> str:
    """``marker`` as literal text inside a Lark ``/regex/``."""
    return re.escape(marker).replace("/", "\\/")


def _without(name: str, marker: str) -> str:
    """A terminal matching any text that does not contain ``marker``."""
    return f"{name}: /(?s:.*)/ & ~/(?s:.*{_escaped(marker)}.*)/"


def _params(function: Mapping[str, Any]) -> dict[str, Any]:
    params = function.get("parameters")
    return dict(params) if isinstance(params, Mapping) and params else {"type": "object", "properties": {}}


def _json_call(name: str, params: Mapping[str, Any], args_key: str, strict: bool) -> str:
    schema = {
        "type": "object",
        "properties": {"name": {"const": name}, args_key: params},
        "required": ["name", args_key],
        "additionalProperties": False,
    }
    return json_item(schema, strict=strict)


def _value_rule(name: str, schema: Mapping[str, Any], close: str) -> tuple[str, str]:
    """``(reference, definition)`` for one XML parameter's raw text, valid for ``schema``.

    A string is its unquoted text (a terminal that cannot contain the closing marker), an
    enum of strings one of its members, anything else the JSON text of a valid value.
    """
    if "enum" in schema and all(isinstance(v, str) for v in schema["enum"]):
        return name, f"{name}: " + " | ".join(json.dumps(v) for v in schema["enum"])
    if schema.get("type") == "string":
        limit = schema.get("maxLength")
        body = f"(?s:.{{0,{int(limit)}}})" if isinstance(limit, int) else "(?s:.*)"
        terminal = name.upper()
        return terminal, f"{terminal}: /{body}/ & ~/(?s:.*{_escaped(close)}.*)/"
    return name, f"{name}: {json_item(schema)}"


def _xml_call(
    fmt: ToolCallFormat, name: str, params: Mapping[str, Any], lit: Literal, rule: str
) -> list[str]:
    """Rules for one XML-style call of ``name`` (qwen3_coder or glm45), params in schema order."""
    m = TOOL_CALL_MARKERS[fmt]
    required = set(params.get("required") or ())
    rules, items = [], []
    for j, (key, schema) in enumerate((params.get("properties") or {}).items()):
        ref, definition = _value_rule(f"{rule}_v{j}", schema or {}, m.param_close)
        rules.append(definition)
        head = f'{lit(m.param_open)} {json.dumps(key)} {lit(m.param_name_end)} "\\n"'
        if fmt is ToolCallFormat.QWEN3_CODER:
            item = f'{head} {ref} "\\n" {lit(m.param_close)} "\\n"'
        else:
            item = f'{head} {lit(m.value_open)} {ref} {lit(m.param_close)} "\\n"'
        items.append(f"({item})" if key in required else f"({item})?")
    body = " ".join(items)
    if fmt is ToolCallFormat.QWEN3_CODER:
        call = (f'{lit(m.opener)} "\\n" {lit(m.function_open)} {json.dumps(name)} {lit(m.name_end)} "\\n" '
                f'{body} {lit(m.function_close)} "\\n" {lit(m.closer)}')
    else:
        call = f'{lit(m.opener)} {json.dumps(name)} {lit(m.name_end)} {body} {lit(m.closer)}'
    return [f"{rule}: {call}", *rules]


def calls_lark(
    fmt: ToolCallFormat,
    functions: Sequence[Mapping[str, Any]],
    *,
    lit: Literal,
    parallel: bool,
) -> list[str]:
    """Rules defining ``calls``: one call (``parallel`` false) or one or more, of these functions.

    ``functions`` are OpenAI function objects (``name``, ``parameters``, optional ``strict``).
    """
    m = TOOL_CALL_MARKERS[fmt]
    rules: list[str] = []
    names = []
    for i, fn in enumerate(functions):
        name, params, strict = fn["name"], _params(fn), fn.get("strict") is not False
        rule = f"call{i}"
        names.append(rule)
        if m.grammar in ("xml_function", "xml_arg_pairs"):
            rules += _xml_call(fmt, name, params, lit, rule)
        elif m.grammar == "json_block":
            rules.append(f'{rule}: {lit(m.opener)} "\\n" {_json_call(name, params, "arguments", strict)} '
                         f'"\\n" {lit(m.closer)}')
        elif m.grammar == "json_sequence":
            rules.append(f"{rule}: {_json_call(name, params, 'parameters', strict)}")
        elif m.grammar == "mistral":
            rules.append(f"{rule}: {_json_call(name, params, 'arguments', strict)}")
        else:  # harmony: a commentary message addressed to the function
            rules.append(
                f"{rule}: {lit(HARMONY.channel)} "
                f"{json.dumps('commentary to=' + HARMONY.functions + name + ' ')} "
                f'{lit(HARMONY.constrain)} "json" {lit(HARMONY.message)} {json_item(params, strict=strict)} '
                f"{lit(HARMONY.call)}"
            )
    rules.append("call: " + " | ".join(names))
    if m.grammar == "json_sequence":
        more = ' (";" call)*' if parallel else ""
        rules.append(f"calls: {lit(m.opener)} call{more}")
    elif m.grammar == "mistral":
        more = ' (", " call)*' if parallel else ""
        rules.append(f'calls: {lit(m.opener)} "[" call{more} "]"')
    else:
        rules.append('calls: call ("\\n" call)*' if parallel else "calls: call")
    return rules


def constraint_lark(
    *,
    body: str,
    rules: Sequence[str] = (),
    reasoning_end: str | None = None,
    lit: Literal,
) -> str:
    """A whole grammar: ``start`` is ``body`` (Lark items), after the rest of a reasoning block
    when the prompt opened one (``reasoning_end`` is its closing marker)."""
    lines = list(rules)
    if reasoning_end:
        lines.append(_without("REASONING", reasoning_end))
        lines.append(f"start: REASONING {lit(reasoning_end)} /[ \\n]*/ {body}")
    else:
        lines.append(f"start: {body}")
    return "\n".join(lines)


def text_without_calls(fmt: ToolCallFormat, *, lit: Literal) -> tuple[str, list[str]]:
    """``(body, rules)``: any answer that never opens a tool call of ``fmt`` (``tool_choice: none``)."""
    opener = TOOL_CALL_MARKERS[fmt].opener
    if fmt is ToolCallFormat.GPT_OSS or opener is None:
        marker = f"to={HARMONY.functions}"
    else:
        marker = opener
    if lit(marker).startswith("<["):  # one special token: plain text can never contain it
        return "TEXT", ["TEXT: /(?s:.*)/"]
    return "TEXT", [_without("TEXT", marker)]
