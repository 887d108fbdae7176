"""A request's controls turned into what the engine runs, refusing by name before admission.

Which model name is served, which content parts the model can read, how a request samples
(penalties, ``logit_bias``, log-probabilities) and what its output is constrained to
(``tool_choice``, ``parallel_tool_calls``, ``response_format``): each refusal is a
``wire.REFUSALS`` kind with the offending field as ``param``, as OpenAI's clients expect.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from moetray.engine.api.errors import ApiError
from moetray.engine.api.schemas import GenerationFields
from moetray.engine.cb import Grammar, Sampling, json_item
from moetray.engine.cb.tool_grammar import calls_lark, constraint_lark, text_then_calls, text_without_calls
from moetray.engine.core import Engine

DEFAULT_MODEL_NAME = "default"
"""The name every engine answers to, whatever it serves."""
TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text"})
"""Content parts the served models read; any other part (images, audio, files) is refused."""


# --- models -------------------------------------------------------------------------------------


def served_names(engine: Engine) -> list[str]:
    """The names a request's ``model`` may give: the id, ``default``, the folder, each alias."""
    names = [engine.model_id(), DEFAULT_MODEL_NAME]
    if engine.served is not None:
        names.append(engine.served.loaded.info.path.name)
    names += list(engine.options.model_aliases)
    return list(dict.fromkeys(n for n in names if n))


def check_model(engine: Engine, name: str | None) -> None:
    """Refuse (404 ``model_not_found``) a ``model`` this engine does not serve; None means the served one."""
    if name is None or engine.options.accept_any_model or engine.model_id() is None:
        return
    if name not in served_names(engine):
        raise ApiError(
            "model_not_found",
            f"the model {name!r} does not exist here; this engine serves {engine.model_id()!r} "
            f"(also answers to: {', '.join(served_names(engine)[1:])})",
            param="model",
        )


# --- content ------------------------------------------------------------------------------------


def check_content(messages: Sequence[Mapping[str, Any]], *, field: str = "messages") -> None:
    """Refuse (400 ``unsupported_content``) a content part the model cannot read, instead of dropping it."""
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind not in TEXT_PART_TYPES:
                raise ApiError(
                    "unsupported_content",
                    f"this model reads text only; {field}[{i}].content[{j}] is of type {kind!r}",
                    param=f"{field}[{i}].content[{j}]",
                )


# --- sampling -----------------------------------------------------------------------------------


def logit_bias(bias: Mapping[str, float] | None, vocab: int) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as (token id, bias) pairs; refuses ids outside the vocabulary or values outside ±100."""
    if not bias:
        return ()
    out = []
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if not 0 <= token < vocab:
            raise ApiError(
                "invalid_request_error", f"logit_bias keys must be token ids in [0, {vocab}), got {key!r}",
                param="logit_bias",
            )
        if not -100.0 <= float(value) <= 100.0:
            raise ApiError(
                "invalid_request_error", f"logit_bias values must lie in [-100, 100], got {value}",
                param="logit_bias",
            )
        out.append((token, float(value)))
    return tuple(out)


def forced_tokens(engine: Engine, body: GenerationFields | Any) -> tuple[int, ...] | None:
    """The test hook's forced ids (refused unless the engine runs with test hooks)."""
    tokens = getattr(body, "moetray_test_forced_tokens", None)
    text = getattr(body, "moetray_test_forced_text", None)
    if tokens is None and text is None:
        return None
    if not engine.options.test_hooks:
        raise ApiError(
            "invalid_request_error",
            "test hooks are disabled on this engine",
            param="moetray_test_forced_tokens",
        )
    if tokens is not None:
        return tuple(tokens)
    assert text is not None  # one of the two is set (the early return above)
    return tuple(engine.chat_support().encode(text))


def sampling_for(
    engine: Engine, body: Any, *, logprobs: int | None = None, grammar: Grammar | None = None
) -> Sampling:
    """The request's sampling (one choice; :func:`for_choice` varies the seed per choice)."""
    chat = engine.chat_support()
    vocab = chat.grammars.vocab_size
    return Sampling(
        temperature=1.0 if body.temperature is None else float(body.temperature),
        top_p=1.0 if body.top_p is None else float(body.top_p),
        seed=getattr(body, "seed", None),
        forced_tokens=forced_tokens(engine, body),
        ignore_eos=getattr(body, "ignore_eos", False),
        presence_penalty=float(getattr(body, "presence_penalty", None) or 0.0),
        frequency_penalty=float(getattr(body, "frequency_penalty", None) or 0.0),
        logit_bias=logit_bias(getattr(body, "logit_bias", None), vocab),
        logprobs=logprobs,
        grammar=grammar,
    )


def for_choice(sampling: Sampling, index: int) -> Sampling:
    """Choice ``index``'s sampling: a seeded request's choices differ yet each stays repeatable."""
    if index == 0 or sampling.seed is None:
        return sampling
    return replace(sampling, seed=sampling.seed + index)


# --- constraints ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class OutputPlan:
    """What a chat request's output may be.

    ``prompt_tools`` reach the prompt; ``parser_tools`` are what the tool-call parser looks
    for (None: every answer is text); ``body`` is the grammar's ``start`` items and ``rules``
    its other rules (no ``body``: unconstrained).
    """

    prompt_tools: list[dict[str, Any]] | None
    parser_tools: list[dict[str, Any]] | None
    body: str | None = None
    rules: tuple[str, ...] = ()
    param: str | None = None  # the field a grammar refusal names


def _tool_mode(tool_choice: Any, names: Sequence[str]) -> tuple[str, str | None]:
    """``(mode, name)``: mode is none / auto / required / named; refuses anything else."""
    if tool_choice is None:
        return ("auto" if names else "none"), None
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise ApiError(
                "invalid_request_error",
                f"tool_choice must be 'none', 'auto', 'required' or a function, got {tool_choice!r}",
                param="tool_choice",
            )
        if tool_choice == "required" and not names:
            raise ApiError("invalid_request_error", "tool_choice 'required' needs tools", param="tool_choice")
        return tool_choice, None
    fn = tool_choice.get("function") if isinstance(tool_choice.get("function"), Mapping) else tool_choice
    name = fn.get("name")
    if tool_choice.get("type") != "function" or not isinstance(name, str):
        raise ApiError(
            "invalid_request_error",
            "tool_choice must be {'type': 'function', 'function': {'name': ...}}",
            param="tool_choice",
        )
    if name not in names:
        raise ApiError(
            "invalid_request_error",
            f"tool_choice names {name!r}, which is not among the tools ({', '.join(names) or 'none given'})",
            param="tool_choice",
        )
    return "named", name


def _answer_item(response_format: Mapping[str, Any] | None) -> str | None:
    """The Lark item an answer must match under ``response_format`` (None: free text)."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_item({"type": "object"}, strict=False)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, Mapping) else None
        if not isinstance(spec, Mapping) or not isinstance(schema, Mapping):
            raise ApiError(
                "invalid_request_error",
                "response_format json_schema needs {'json_schema': {'name', 'schema'}}",
                param="response_format",
            )
        return json_item(schema, strict=bool(spec.get("strict", False)))
    raise ApiError(
        "invalid_request_error",
        f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
        param="response_format",
    )


def plan_output(
    chat,
    *,
    tools: list[dict[str, Any]] | None,
    tool_choice: Any,
    parallel_tool_calls: bool,
    response_format: Mapping[str, Any] | None,
) -> OutputPlan:
    """Decide what the output may be; refuses a bad ``tool_choice`` / ``response_format`` by name.

    ``tool_choice``: ``none`` masks the tool-call opener; ``auto`` lets the model decide
    (at most one call when ``parallel_tool_calls`` is false); ``required`` / a named function
    force one call (or more, when parallel) whose arguments validate against the schema.
    ``response_format`` constrains a text answer to JSON (an object, or one valid for a schema).
    """
    functions = [t["function"] for t in tools or []]
    names = [f["name"] for f in functions]
    mode, name = _tool_mode(tool_choice, names)
    answer = _answer_item(response_format)
    fmt = chat.tool_format
    if tools and fmt is None and not chat.template_renders_tools:
        raise ApiError(
            "tools_unsupported",
            "this model's tool-call format is unknown and its chat template has no tool section",
            param="tools",
        )
    if fmt is None and mode in ("required", "named"):
        raise ApiError(
            "tools_unsupported", "this model's tool-call format is unknown: a call cannot be forced",
            param="tool_choice",
        )
    lit = chat.grammars.literal
    parser_tools = tools if tools and mode != "none" and fmt is not None else None
    if mode in ("required", "named"):
        chosen = [f for f in functions if mode == "required" or f["name"] == name]
        rules = calls_lark(fmt, chosen, lit=lit, parallel=parallel_tool_calls)
        return OutputPlan(tools, parser_tools, "calls", tuple(rules), "tools")
    if mode == "none":
        if answer is not None:
            return OutputPlan(tools, None, answer, (), "response_format")
        if tools and fmt is not None:
            body, rules = text_without_calls(fmt, lit=lit)
            return OutputPlan(tools, None, body, tuple(rules), "tools")
        return OutputPlan(tools, None)
    # auto
    if not tools or fmt is None:
        return OutputPlan(tools, parser_tools, answer, (), "response_format")
    rules = calls_lark(fmt, functions, lit=lit, parallel=parallel_tool_calls)
    if answer is not None:
        return OutputPlan(tools, parser_tools, f"({answer} | calls)", tuple(rules), "response_format")
    if not parallel_tool_calls and fmt.opener() is not None:
        body, rules = text_then_calls(fmt, functions, lit=lit)
        return OutputPlan(tools, parser_tools, body, tuple(rules), "tools")
    return OutputPlan(tools, parser_tools)


async def compile_plan(chat, plan: OutputPlan, prompt_text: str | None) -> Grammar | None:
    """The plan's grammar, compiled off the event loop (None when the output is free)."""
    if plan.body is None:
        return None
    lark = constraint_lark(
        body=plan.body,
        rules=plan.rules,
        reasoning_end=chat.open_reasoning_end(prompt_text) if prompt_text is not None else None,
        lit=chat.grammars.literal,
    )
    return await asyncio.to_thread(chat.grammars.compile, lark, param=plan.param)
