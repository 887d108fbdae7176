"""Call values: where a JSON value ends, which JSON objects are calls, and how a parameter's
wire text becomes the JSON value its declared schema asks for."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from .common import NAME_MAX


class JsonEnd:
    """Finds where the JSON object or array starting at ``text[0]`` ends; resumes where it stopped."""

    def __init__(self) -> None:
        self.pos = 0
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def scan(self, text: str) -> int | None:
        i = self.pos
        while i < len(text):
            ch = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    self.pos = i + 1
                    return i + 1
            i += 1
        self.pos = i
        return None


def schemas(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """``{function name: {parameter: JSON schema}}`` from an OpenAI ``tools`` list."""
    found: dict[str, dict[str, Any]] = {}
    for tool in tools or ():
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            continue
        params = fn.get("parameters")
        props = params.get("properties") if isinstance(params, Mapping) else None
        found[fn["name"]] = dict(props) if isinstance(props, Mapping) else {}
    return found


def _schema_types(schema: Mapping[str, Any] | None) -> list[str] | None:
    if not isinstance(schema, Mapping):
        return None
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            types = [t for branch in schema[key] for t in (_schema_types(branch) or [])]
            return types or None
    return None  # enum, const or no type at all: no declared type to honour


def coerce(raw: str, schema: Mapping[str, Any] | None) -> Any:
    """A parameter's wire text as the JSON value its declared schema asks for.

    A declared string stays verbatim (zero-padded "018956" included); integers, numbers,
    booleans, null, objects and arrays are parsed when they parse and kept as text when
    not. An undeclared parameter gets a loose guess: JSON if it parses, else text.
    """
    types = _schema_types(schema)
    text = raw.strip()
    if types is None:
        try:
            value = json.loads(text)
        except ValueError:
            return raw
        return value if _finite(value) else raw
    if text == "null" and "null" in types:
        return None
    for kind in types:
        if kind == "integer" and re.fullmatch(r"-?\d+", text):
            return int(text)
        if kind == "number":
            try:
                number = float(text)
            except ValueError:
                continue
            if math.isfinite(number):
                return int(text) if re.fullmatch(r"-?\d+", text) else number
        if kind == "boolean" and text.lower() in ("true", "false"):
            return text.lower() == "true"
        if kind in ("object", "array"):
            try:
                value = json.loads(text)
            except ValueError:
                continue
            if isinstance(value, dict if kind == "object" else list) and _finite(value):
                return value
    return raw


def _finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    return True


def trim_value(raw: str, style: str) -> str:
    """A raw parameter value trimmed as its format says (``ToolCallMarkers.trim``)."""
    if style == "all":
        return raw.strip()
    if style == "newline":
        raw = raw[1:] if raw.startswith("\n") else raw
        return raw[:-1] if raw.endswith("\n") else raw
    return raw


def valid_name(name: str) -> bool:
    return 0 < len(name) <= NAME_MAX and not any(ch.isspace() or ch in "<>{}\"'" for ch in name)


def json_call(obj: Any) -> tuple[str, dict[str, Any]] | None:
    """``(name, arguments)`` from a JSON call object, or None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not valid_name(obj["name"]):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return None
    if args is None:
        args = {}
    if not isinstance(args, dict) or not _finite(args):
        return None
    return obj["name"], args


def json_calls(text: str) -> list[tuple[str, dict[str, Any]]] | None:
    """Every call in ``text`` (objects or arrays of objects, one after another), or None."""
    decoder = json.JSONDecoder()
    calls: list[tuple[str, dict[str, Any]]] = []
    at = 0
    while True:
        while at < len(text) and (text[at].isspace() or text[at] in ",;"):
            at += 1
        if at == len(text):
            return calls or None
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        for item in value if isinstance(value, list) else [value]:
            call = json_call(item)
            if call is None:
                return None
            calls.append(call)


def loads(text: str) -> Any:
    """``text`` as JSON, or None when it does not parse."""
    try:
        return json.loads(text)
    except ValueError:
        return None
