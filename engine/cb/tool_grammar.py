"""The Lark grammar of each family's tool-call wire format, for llguidance to force.

Every format is read from ``policy.parser``'s one description of it (``TOOL_CALL_MARKERS``,
``HARMONY``), so what is forced is exactly what the family's parser turns back into
``tool_calls``. Arguments are forced valid against the function's ``parameters`` schema:
JSON formats inline the schema (``%json``); the XML formats (qwen3_coder, glm45) write one
parameter per property in schema order, required ones always, optional ones at will, each
value valid for its property's type.

llguidance's lexer is greedy: a free-text terminal followed by a marker would swallow the
marker's first characters. Free text that a marker ends is therefore one terminal that runs
*through* the first occurrence of the marker (:func:`_through`).

Builders return Lark rules; :func:`constraint_lark` assembles the ``start`` rule, after the
rest of a reasoning block the prompt opened.
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


def _escaped(text: str) -> str:
    """``text`` as literal text inside a Lark ``/regex/``."""
    return re.escape(text).replace("\\\n", "\\n").replace("/", "\\/")


def _without(name: str, marker: str) -> str:
    """A terminal matching any text that does not contain ``marker``."""
    return f"{name}: /(?s:.*)/ & ~/(?s:.*{_escaped(marker)}.*)/"


def _through(name: str, marker: str, body: str = "(?s:.*)") -> str:
    """A terminal matching ``body`` text up to and including the first ``marker``."""
    m = _escaped(marker)
    return f"{name}: /{body}{m}/ & ~/(?s:.*{m}.+)/"


def _is_token(item: str) -> bool:
    return item.startswith("<[")


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


def _value(name: str, schema: Mapping[str, Any], end: str, lit: Literal) -> tuple[str, list[str]]:
    """``(items, rules)`` for one XML parameter's raw text followed by ``end`` (its closing markup).

    A string is its unquoted text (one terminal through ``end``), an enum of strings one of
    its members, anything else the JSON text of a valid value.
    """
    closing = " ".join(lit(part) if part.startswith("<") else json.dumps(part) for part in _split(end))
    if "enum" in schema and all(isinstance(v, str) for v in schema["enum"]):
        return f"{name} {closing}", [f"{name}: " + " | ".join(json.dumps(v) for v in schema["enum"])]
    markup_is_token = any(_is_token(lit(p)) for p in _split(end) if p.startswith("<"))
    if schema.get("type") == "string" and not markup_is_token:
        limit = schema.get("maxLength")
        body = f"(?s:.{{0,{int(limit)}}})" if isinstance(limit, int) else "(?s:.*)"
        return name.upper(), [_through(name.upper(), end, body)]
    if schema.get("type") == "string":  # the closing markup is special tokens: text cannot hold them
        return f"{name.upper()} {closing}", [f"{name.upper()}: /(?s:.*)/"]
    return f"{name} {closing}", [f"{name}: {json_item(schema)}"]


def _split(end: str) -> list[str]:
    """``"\\n</parameter>"`` → ``["\\n", "</parameter>"]``: markup apart from plain text."""
    return [p for p in re.split(r"(<[^>]*>)", end) if p]


def _xml_call(
    fmt: ToolCallFormat, name: str, params: Mapping[str, Any], lit: Literal, rule: str
) -> list[str]:
    """Rules for one XML-style call of ``name`` after its opener (qwen3_coder or glm45)."""
    m = TOOL_CALL_MARKERS[fmt]
    param_open, param_name_end, param_close = m.param_open, m.param_name_end, m.param_close
    name_end, closer = m.name_end, m.closer
    assert param_open and param_name_end and param_close and name_end and closer, fmt
    required = set(params.get("required") or ())
    rules: list[str] = []
    items: list[str] = []
    for j, (key, schema) in enumerate((params.get("properties") or {}).items()):
        head = f'{lit(param_open)} {json.dumps(key)} {lit(param_name_end)} "\\n"'
        if fmt is ToolCallFormat.QWEN3_CODER:
            value, value_rules = _value(f"{rule}_v{j}", schema or {}, "\n" + param_close, lit)
            item = f'{head} {value} "\\n"'
        else:
            assert m.value_open is not None, fmt
            value, value_rules = _value(f"{rule}_v{j}", schema or {}, param_close, lit)
            item = f'{head} {lit(m.value_open)} {value} "\\n"'
        rules += value_rules
        items.append(f"({item})" if key in required else f"({item})?")
    body = " ".join(items)
    if fmt is ToolCallFormat.QWEN3_CODER:
        assert m.function_open is not None and m.function_close is not None, fmt
        call = (f'"\\n" {lit(m.function_open)} {json.dumps(name)} {lit(name_end)} "\\n" '
                f'{body} {lit(m.function_close)} "\\n" {lit(closer)}')
    else:
        call = f'{json.dumps(name)} {lit(name_end)} {body} {lit(closer)}'
    return [f"{rule}: {call}", *rules]


def calls_lark(
    fmt: ToolCallFormat,
    functions: Sequence[Mapping[str, Any]],
    *,
    lit: Literal,
    parallel: bool,
    opened: bool = False,
) -> list[str]:
    """Rules defining ``calls``: one call (``parallel`` false) or one or more, of these functions.

    ``functions`` are OpenAI function objects (``name``, ``parameters``, optional ``strict``).
    ``opened``: the format's opener has already been matched (by a text terminal running
    through it), so ``calls`` starts right after it.
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
            assert m.closer is not None, fmt
            args = _json_call(name, params, "arguments", strict)
            rules.append(f'{rule}: "\\n" {args} "\\n" {lit(m.closer)}')
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
    opener = "" if opened or m.opener is None else lit(m.opener)
    if m.grammar == "json_sequence":
        more = ' (";" call)*' if parallel else ""
        rules.append(f"calls: {opener} call{more}")
    elif m.grammar == "mistral":
        more = ' (", " call)*' if parallel else ""
        rules.append(f'calls: {opener} "[" call{more} "]"')
    elif m.opener is None:  # harmony
        rules.append("calls: call")
    else:
        more = f' ("\\n" {lit(m.opener)} call)*' if parallel else ""
        rules.append(f"calls: {opener} call{more}")
    return rules


def text_then_calls(
    fmt: ToolCallFormat, functions: Sequence[Mapping[str, Any]], *, lit: Literal
) -> tuple[str, list[str]]:
    """``(body, rules)``: text, then at most one call (``tool_choice: auto`` without parallel calls)."""
    opener = TOOL_CALL_MARKERS[fmt].opener
    assert opener is not None, fmt
    text, rules = text_without_calls(fmt, lit=lit)
    calls = calls_lark(fmt, functions, lit=lit, parallel=False, opened=not _is_token(lit(opener)))
    if _is_token(lit(opener)):  # text can never hold a special token: it ends the text by itself
        return f"{text} | {text} calls", [*rules, *calls]
    return f"{text} | TEXT_OPEN calls", [*rules, _through("TEXT_OPEN", opener), *calls]


def text_without_calls(fmt: ToolCallFormat, *, lit: Literal) -> tuple[str, list[str]]:
    """``(body, rules)``: any answer that never opens a tool call of ``fmt`` (``tool_choice: none``)."""
    opener = TOOL_CALL_MARKERS[fmt].opener
    marker = f"to={HARMONY.functions}" if opener is None else opener
    if _is_token(lit(marker)):  # one special token: plain text can never contain it
        return "TEXT", ["TEXT: /(?s:.*)/"]
    return "TEXT", [_without("TEXT", marker)]


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
    if not reasoning_end:
        lines.append(f"start: {body}")
    elif _is_token(lit(reasoning_end)):
        lines += ["REASONING: /(?s:.*)/", f"start: REASONING {lit(reasoning_end)} /[ \\n]*/ ({body})"]
    else:
        lines += [_through("REASONING", reasoning_end), f"start: REASONING /[ \\n]*/ ({body})"]
    return "\n".join(lines)
