"""The formats by wire name: each one's markers, grammar and detector, and the precedence
in which detectors are tried. A format module describes itself; this table names it."""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import TypeVar

from . import glm45, harmony, hermes, llama3, mistral, qwen3_coder, think
from .common import Identities, ParserRefused, ReasoningMarkers, ToolCallMarkers
from .cursor import Step


class ReasoningFormat(StrEnum):
    """How a model family marks its reasoning; the value is the wire name."""

    QWEN3 = "qwen3"  # <think>…</think>; the template may open it in the prompt
    DEEPSEEK_R1 = "deepseek_r1"  # <think>…</think>, output always starts inside reasoning
    GEMMA4 = "gemma4"  # <|channel>thought\n … <channel|>
    GPT_OSS = "gpt_oss"  # harmony channels: analysis is reasoning, final is the answer

    @classmethod
    def parse(cls, name: str) -> ReasoningFormat:
        """The format for a wire name or alias (case, '-' and '.' ignored).

        Pure. Refuses with ``ParserRefused("unknown_format")`` for anything else.
        """
        return _parse_format(cls, _REASONING_ALIASES, name, "reasoning format")

    @property
    def markers(self) -> ReasoningMarkers:
        return REASONING_MARKERS[self]


class ToolCallFormat(StrEnum):
    """How a model family writes tool calls; the value is the wire name."""

    HERMES = "hermes"  # <tool_call>{"name", "arguments"}</tool_call> (Qwen2.5/Qwen3/Hermes)
    LLAMA3 = "llama3"  # <|python_tag|>{"name", "parameters"}; a bare JSON answer is a call too
    MISTRAL = "mistral"  # [TOOL_CALLS][{…}] or [TOOL_CALLS]name[ARGS]{…}
    QWEN3_CODER = "qwen3_coder"  # <tool_call><function=NAME><parameter=KEY>value</parameter>…
    GLM45 = "glm45"  # <tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>…</tool_call>
    GPT_OSS = "gpt_oss"  # harmony message addressed to=functions.NAME

    @classmethod
    def parse(cls, name: str) -> ToolCallFormat:
        """As ``ReasoningFormat.parse``, for a tool-call format."""
        return _parse_format(cls, _TOOL_ALIASES, name, "tool-call format")

    @property
    def markers(self) -> ToolCallMarkers:
        return TOOL_CALL_MARKERS[self]

    def opener(self) -> str | None:
        """The text that starts a tool call, or None where no single marker does (gpt_oss)."""
        return TOOL_CALL_MARKERS[self].opener


def _wire_key(name: str) -> str:
    return name.strip().lower().replace("-", "_").replace(".", "")


_F = TypeVar("_F", bound=StrEnum)


def _parse_format(enum: type[_F], aliases: Mapping[str, _F], name: str, what: str) -> _F:
    """``enum``'s member for a wire name or one of its ``aliases``; refuses anything else."""
    key = _wire_key(name)
    found = aliases.get(key) or next((f for f in enum if f.value == key), None)
    if found is None:
        raise ParserRefused("unknown_format", f"unknown {what} {name!r}", name)
    return found


_REASONING_ALIASES = {
    "glm": ReasoningFormat.QWEN3,
    "glm45": ReasoningFormat.QWEN3,
    "deepseekr1": ReasoningFormat.DEEPSEEK_R1,
    "gptoss": ReasoningFormat.GPT_OSS,
}

_TOOL_ALIASES = {
    "qwen": ToolCallFormat.HERMES,
    "qwen25": ToolCallFormat.HERMES,
    "llama3_json": ToolCallFormat.LLAMA3,
    "llama": ToolCallFormat.LLAMA3,
    "glm": ToolCallFormat.GLM45,
    "glm4_moe": ToolCallFormat.GLM45,
    "gptoss": ToolCallFormat.GPT_OSS,
    "qwen3coder": ToolCallFormat.QWEN3_CODER,
}

REASONING_MARKERS: dict[ReasoningFormat, ReasoningMarkers] = {
    ReasoningFormat.QWEN3: think.QWEN3,
    ReasoningFormat.DEEPSEEK_R1: think.DEEPSEEK_R1,
    ReasoningFormat.GEMMA4: think.GEMMA4,
    ReasoningFormat.GPT_OSS: harmony.REASONING,
}

TOOL_CALL_MARKERS: dict[ToolCallFormat, ToolCallMarkers] = {
    ToolCallFormat.HERMES: hermes.MARKERS,
    ToolCallFormat.LLAMA3: llama3.MARKERS,
    ToolCallFormat.MISTRAL: mistral.MARKERS,
    ToolCallFormat.QWEN3_CODER: qwen3_coder.MARKERS,
    ToolCallFormat.GLM45: glm45.MARKERS,
    ToolCallFormat.GPT_OSS: harmony.TOOL_CALLS,
}

TOOL_CALL_STEPS: dict[ToolCallFormat, Step] = {
    ToolCallFormat.HERMES: hermes.step,
    ToolCallFormat.LLAMA3: llama3.step,
    ToolCallFormat.MISTRAL: mistral.step,
    ToolCallFormat.QWEN3_CODER: qwen3_coder.step,
    ToolCallFormat.GLM45: glm45.step,
}
"""The section grammar of every format read through a ``Cursor`` (gpt_oss reads harmony messages)."""


# --- choosing a format -------------------------------------------------------------------

_REASONING_RULES: tuple[tuple[Identities, ReasoningFormat], ...] = (
    (harmony.IDENTITIES, ReasoningFormat.GPT_OSS),
    # R1 distills are named after their student ("DeepSeek-R1-Distill-Qwen"): before qwen.
    (think.DEEPSEEK_R1_IDENTITIES, ReasoningFormat.DEEPSEEK_R1),
    (think.GEMMA4_IDENTITIES, ReasoningFormat.GEMMA4),
    (think.QWEN3_IDENTITIES, ReasoningFormat.QWEN3),
)

_TOOL_RULES: tuple[tuple[Identities, ToolCallFormat | None], ...] = (
    (harmony.IDENTITIES, ToolCallFormat.GPT_OSS),
    (qwen3_coder.IDENTITIES, ToolCallFormat.QWEN3_CODER),
    (glm45.IDENTITIES, ToolCallFormat.GLM45),
    # DeepSeek (distills included) speaks its own tool grammar, which is not implemented:
    # say so rather than fall through to the student's family below.
    (("deepseek",), None),
    (hermes.IDENTITIES, ToolCallFormat.HERMES),
    (mistral.IDENTITIES, ToolCallFormat.MISTRAL),
    (llama3.IDENTITIES, ToolCallFormat.LLAMA3),
)


def infer_reasoning_format(checkpoint_identity: str) -> ReasoningFormat | None:
    """The reasoning format a checkpoint most likely speaks, or None when nothing matches.

    ``checkpoint_identity`` is any identifying text (repo name, folder, ``model_type``,
    architecture). Specific families are tried before general ones (an R1 distill named
    after Qwen is R1, not Qwen3). Pure; refuses nothing. An explicit choice should win.
    """
    ident = checkpoint_identity.lower()
    return next((fmt for keys, fmt in _REASONING_RULES if any(k in ident for k in keys)), None)


def infer_tool_call_format(checkpoint_identity: str) -> ToolCallFormat | None:
    """The tool-call format a checkpoint most likely speaks, or None when unknown.

    Same conventions as ``infer_reasoning_format``: specific before general (Qwen3-Coder
    before Qwen), and no blind fallback for an unknown family.
    """
    ident = checkpoint_identity.lower()
    for keys, fmt in _TOOL_RULES:
        if any(k in ident for k in keys):
            return fmt
    return None


def prompt_opens_reasoning(fmt: ReasoningFormat, prompt_text: str) -> bool:
    """Whether generation starts inside a reasoning block, read from the rendered prompt.

    True for always-open formats; for marker formats, when the prompt's last start marker
    comes after its last end marker (the template pre-opened ``<think>``); for harmony, when
    the prompt ends inside the body of an analysis message. Pure; refuses nothing. Use the
    result as ``ReasoningParser(fmt, force_reasoning=...)``.
    """
    m = fmt.markers
    if m.always_open:
        return True
    if m.harmony:
        return harmony.prompt_opens_analysis(prompt_text)
    return think.prompt_opens(m, prompt_text)
