"""Where reasoning ends and the answer begins, and which tool was called: incremental parsing.

Generated text arrives in chunks whose edges fall anywhere, markers included (``</thi`` +
``nk>``), and a server-sent stream cannot take text back. Both parsers therefore hold the
shortest tail that could still turn out to be markup and decide only from text they have
seen in full, so the result never depends on where chunks were cut: for every chunking,
the concatenated stream equals ``parse_complete`` (which runs the same machinery on the
whole text at once).

The two compose in order: ``ReasoningParser`` splits reasoning from content and passes
tool-call text through verbatim; ``ToolCallParser`` then splits content from calls.

Every wire format is described once, in ``REASONING_MARKERS``, ``TOOL_CALL_MARKERS`` and
``HARMONY``; the parsers read their markers from those tables and nowhere else.
Whitespace right after markup belongs to the markup (templates render ``</think>\\n\\n``
and a newline after each tool block) and is dropped; reasoning also sheds the whitespace
before its end marker.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal, NamedTuple, TypeVar

__all__ = [
    "HARMONY",
    "REASONING_MARKERS",
    "TOOL_CALL_MARKERS",
    "TOOL_HOLD_MAX",
    "CallArguments",
    "CallEnd",
    "CallStart",
    "Delta",
    "ParserRefused",
    "ReasoningFormat",
    "ReasoningMarkers",
    "ReasoningParser",
    "Text",
    "ToolCall",
    "ToolCallFormat",
    "ToolCallMarkers",
    "ToolCallParser",
    "fold_events",
    "infer_reasoning_format",
    "infer_tool_call_format",
    "prompt_opens_reasoning",
]

TOOL_HOLD_MAX = 512
"""After a tool-call opener appears inside unclosed reasoning, how many characters are held
to tell a real call (the model skipped the closer) from a quoted one (a closer follows)."""
NAME_MAX = 128
"""Longest function or parameter name accepted; a longer run is not a name but text."""
HEADER_MAX = 256
"""Longest harmony message header; a longer run without ``<|message|>`` is not a header."""


class ParserRefused(ValueError):
    """A parser request that cannot be honoured; nothing changed.

    ``.kind`` is ``unknown_format`` (``.name`` is not a wire name or alias of the enum) or
    ``stream_finished`` (``push``/``flush`` after ``flush``).
    """

    KINDS = ("unknown_format", "stream_finished")

    def __init__(self, kind: str, message: str, name: str | None = None) -> None:
        assert kind in self.KINDS, kind
        self.kind = kind
        self.name = name
        super().__init__(message)


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


# --- the wire formats, each described once ---------------------------------------------


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


_REASONING_ALIASES = {
    "glm": ReasoningFormat.QWEN3,
    "glm45": ReasoningFormat.QWEN3,
    "deepseekr1": ReasoningFormat.DEEPSEEK_R1,
    "gptoss": ReasoningFormat.GPT_OSS,
}


@dataclass(frozen=True)
class ReasoningMarkers:
    start: str | None  # opens a reasoning block
    end: str | None  # closes it
    always_open: bool  # the output begins inside reasoning, whatever the prompt shows
    harmony: bool  # channel grammar (see HARMONY) instead of start/end markers


THINK_START, THINK_END = "<think>", "</think>"  # shared by several families

REASONING_MARKERS: dict[ReasoningFormat, ReasoningMarkers] = {
    ReasoningFormat.QWEN3: ReasoningMarkers(THINK_START, THINK_END, always_open=False, harmony=False),
    ReasoningFormat.DEEPSEEK_R1: ReasoningMarkers(THINK_START, THINK_END, always_open=True, harmony=False),
    ReasoningFormat.GEMMA4: ReasoningMarkers("<|channel>thought\n", "<channel|>", always_open=False,
                                             harmony=False),
    ReasoningFormat.GPT_OSS: ReasoningMarkers(None, None, always_open=False, harmony=True),
}


@dataclass(frozen=True)
class HarmonyTokens:
    start: str = "<|start|>"  # role header
    channel: str = "<|channel|>"  # channel name follows
    message: str = "<|message|>"  # header ends, body begins
    end: str = "<|end|>"  # body ends, more messages may follow
    ret: str = "<|return|>"  # final answer ends
    call: str = "<|call|>"  # tool call ends
    constrain: str = "<|constrain|>"  # argument format hint inside a header
    analysis: str = "analysis"  # the reasoning channel
    functions: str = "functions."  # recipient prefix of a function call

    @property
    def terminators(self) -> tuple[str, ...]:
        return (self.end, self.ret, self.call)

    @property
    def header_starts(self) -> tuple[str, ...]:
        return (self.start, self.channel)


HARMONY = HarmonyTokens()
"""gpt-oss's harmony grammar: ``[<|start|>role]<|channel|>NAME [to=RECIPIENT] [<|constrain|>json]
<|message|>BODY(<|end|>|<|call|>|<|return|>)``."""


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
        """The format for a wire name or alias (case, '-' and '.' ignored).

        Pure. Refuses with ``ParserRefused("unknown_format")`` for anything else.
        """
        return _parse_format(cls, _TOOL_ALIASES, name, "tool-call format")

    @property
    def markers(self) -> ToolCallMarkers:
        return TOOL_CALL_MARKERS[self]

    def opener(self) -> str | None:
        """The text that starts a tool call, or None where no single marker does (gpt_oss)."""
        return TOOL_CALL_MARKERS[self].opener


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

Grammar = Literal["json_block", "json_sequence", "mistral", "xml_function", "xml_arg_pairs", "harmony"]


@dataclass(frozen=True)
class ToolCallMarkers:
    """Everything a parser needs to read one tool-call wire format."""

    grammar: Grammar
    opener: str | None  # starts a tool-call section
    closer: str | None = None  # ends it
    function_open: str | None = None  # xml_function: "<function=" NAME name_end
    function_close: str | None = None
    name_end: str | None = None
    param_open: str | None = None  # "<parameter=" KEY param_name_end / "<arg_key>" KEY …
    param_name_end: str | None = None
    value_open: str | None = None  # xml_arg_pairs: "<arg_value>"
    param_close: str | None = None
    trim: Literal["none", "newline", "all"] = "none"  # how a raw parameter value is trimmed
    separator: str | None = None  # json_sequence: between two call objects
    bare_json_start: bool = False  # an answer that opens with "{" may be a call with no opener
    args_marker: str | None = None  # mistral: "[TOOL_CALLS]NAME[ARGS]{…}"
    call_id_marker: str | None = None  # mistral: "NAME[CALL_ID]id[ARGS]{…}"

    @property
    def streams_arguments(self) -> bool:
        """True when arguments arrive as prefix-stable fragments (one per parameter)."""
        return self.grammar in ("xml_function", "xml_arg_pairs")


TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"  # shared by several families

TOOL_CALL_MARKERS: dict[ToolCallFormat, ToolCallMarkers] = {
    ToolCallFormat.HERMES: ToolCallMarkers("json_block", TOOL_CALL_OPEN, TOOL_CALL_CLOSE),
    ToolCallFormat.LLAMA3: ToolCallMarkers("json_sequence", "<|python_tag|>", separator=";",
                                           bare_json_start=True),
    ToolCallFormat.MISTRAL: ToolCallMarkers("mistral", "[TOOL_CALLS]", args_marker="[ARGS]",
                                            call_id_marker="[CALL_ID]"),
    ToolCallFormat.QWEN3_CODER: ToolCallMarkers(
        "xml_function", TOOL_CALL_OPEN, TOOL_CALL_CLOSE, function_open="<function=",
        function_close="</function>", name_end=">", param_open="<parameter=", param_name_end=">",
        param_close="</parameter>", trim="newline"),
    ToolCallFormat.GLM45: ToolCallMarkers(
        "xml_arg_pairs", TOOL_CALL_OPEN, TOOL_CALL_CLOSE, name_end="\n", param_open="<arg_key>",
        param_name_end="</arg_key>", value_open="<arg_value>", param_close="</arg_value>"),
    ToolCallFormat.GPT_OSS: ToolCallMarkers("harmony", None),
}


# --- choosing a format -------------------------------------------------------------------

_REASONING_RULES: tuple[tuple[tuple[str, ...], ReasoningFormat], ...] = (
    (("gpt_oss", "gpt-oss", "gptoss"), ReasoningFormat.GPT_OSS),
    # R1 distills are named after their student ("DeepSeek-R1-Distill-Qwen"): before qwen.
    (("deepseek-r1", "deepseek_r1", "deepseek r1", "r1-distill", "r1_distill"), ReasoningFormat.DEEPSEEK_R1),
    (("gemma-4", "gemma4", "gemma_4", "gemma 4"), ReasoningFormat.GEMMA4),
    (("qwen3", "qwq", "glm-4.5", "glm4.5", "glm-4.6", "glm4_moe", "glm-4.7"), ReasoningFormat.QWEN3),
)

_TOOL_RULES: tuple[tuple[tuple[str, ...], ToolCallFormat | None], ...] = (
    (("gpt_oss", "gpt-oss", "gptoss"), ToolCallFormat.GPT_OSS),
    (("qwen3-coder", "qwen3_coder", "qwen3coder", "qwen3.5", "qwen3_5"), ToolCallFormat.QWEN3_CODER),
    (("glm-4.5", "glm4.5", "glm-4.6", "glm-4.7", "glm4_moe", "glm"), ToolCallFormat.GLM45),
    # DeepSeek (distills included) speaks its own tool grammar, which is not implemented:
    # say so rather than fall through to the student's family below.
    (("deepseek",), None),
    (("qwen", "qwq", "hermes"), ToolCallFormat.HERMES),
    (("mistral", "mixtral", "ministral", "magistral", "devstral", "codestral"), ToolCallFormat.MISTRAL),
    (("llama-3", "llama3", "llama_3", "llama-4", "llama4"), ToolCallFormat.LLAMA3),
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
        at = prompt_text.rfind(HARMONY.message)
        if at == -1:
            return False
        after = prompt_text[at + len(HARMONY.message):]
        if any(tok in after for tok in (*HARMONY.terminators, *HARMONY.header_starts)):
            return False
        head_from = max(prompt_text.rfind(tok, 0, at) for tok in (HARMONY.start, *HARMONY.terminators))
        channel, _ = _harmony_header(prompt_text[max(head_from, 0):at])
        return channel == HARMONY.analysis
    assert m.start is not None and m.end is not None
    return prompt_text.rfind(m.start) > prompt_text.rfind(m.end)


# --- shared pieces -----------------------------------------------------------------------


class Delta(NamedTuple):
    """Text that became final after one push: the reasoning part and the answer part."""

    reasoning: str = ""
    content: str = ""


def _partial_tail(text: str, markers: Iterable[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``markers``."""
    longest = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), longest, -1):
            if marker.startswith(text[len(text) - k:]):
                longest = k
                break
    return longest


def _earliest(text: str, markers: Iterable[str], start: int = 0) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for marker in markers:
        at = text.find(marker, start)
        if at != -1 and (best is None or at < best[0]):
            best = (at, marker)
    return best


class _Trim:
    """One output side: whitespace right after markup is dropped, other text passes unchanged.

    With ``hold_trailing`` (the reasoning side), trailing whitespace is also held until
    more text follows (released) or markup does (dropped), so a reasoning block carries
    none of the newlines around its markers. Both decisions depend only on the text,
    never on chunk edges.
    """

    def __init__(self, glued: bool = False, hold_trailing: bool = False) -> None:
        self.glued = glued  # right after markup: leading whitespace is markup's
        self.hold_trailing = hold_trailing
        self.pending = ""  # trailing whitespace not yet known to be text
        self.out: list[str] = []

    def text(self, s: str) -> None:
        if self.glued:
            s = s.lstrip()
            if not s:
                return
            self.glued = False
        s = self.pending + s
        body = s.rstrip() if self.hold_trailing else s
        self.pending = s[len(body):]
        if body:
            self.out.append(body)

    def raw(self, s: str) -> None:
        """Markup passed through verbatim (a tool message for the next parser)."""
        self.pending = ""
        self.glued = False
        if s:
            self.out.append(s)

    def markup(self) -> None:
        self.pending = ""
        self.glued = True

    def flush(self) -> None:
        if self.pending:
            self.out.append(self.pending)
        self.pending = ""

    def take(self) -> str:
        text = "".join(self.out)
        self.out.clear()
        return text


_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL_NAME = re.compile(r"[^\s<]*")


def _harmony_header(raw: str) -> tuple[str | None, str | None]:
    """``(channel, recipient)`` named in a harmony header (markers included or not)."""
    channel = None
    at = raw.rfind(HARMONY.channel)
    if at != -1:
        name = _CHANNEL_NAME.match(raw, at + len(HARMONY.channel))
        channel = name.group(0) if name and name.group(0) else None
    recipient = _RECIPIENT.search(raw)
    return channel, recipient.group(1) if recipient else None


@dataclass
class _Header:
    channel: str | None
    recipient: str | None
    raw: str  # the header as written, start marker through <|message|>


class _HarmonyScanner:
    """Splits harmony text into outside text, message headers, bodies and message ends.

    ``feed`` returns events ``("text", s)``, ``("header", _Header)``, ``("body", s)`` and
    ``("end", terminator_or_None)``; partial control tokens are held until they resolve.
    """

    _TOKENS = (HARMONY.start, HARMONY.channel, HARMONY.message, *HARMONY.terminators)

    def __init__(self, body_channel: str | None = None) -> None:
        self.buf = ""
        self.mode = "body" if body_channel is not None else "outside"
        self.events: list[tuple[str, Any]] = []
        if body_channel is not None:
            self.events.append(("header", _Header(body_channel, None, "")))

    def feed(self, text: str, final: bool) -> list[tuple[str, Any]]:
        self.buf += text
        while self._step(final):
            pass
        events, self.events = self.events, []
        return events

    def _step(self, final: bool) -> bool:
        buf = self.buf
        if not buf:
            if final and self.mode == "body":
                self.events.append(("end", None))
                self.mode = "outside"
            return False
        if self.mode == "outside":
            hit = _earliest(buf, self._TOKENS)
            if hit is None:
                keep = 0 if final else _partial_tail(buf, self._TOKENS)
                self._emit("text", buf[: len(buf) - keep])
                self.buf = buf[len(buf) - keep:]
                return False
            at, tok = hit
            self._emit("text", buf[:at])
            if tok in HARMONY.header_starts:
                self.buf, self.mode = buf[at:], "header"
            elif tok == HARMONY.message:  # a body with no header
                self.events.append(("header", _Header(None, None, tok)))
                self.buf, self.mode = buf[at + len(tok):], "body"
            else:  # a stray terminator is markup
                self.events.append(("end", tok))
                self.buf = buf[at + len(tok):]
            return True
        if self.mode == "header":
            message = buf.find(HARMONY.message)
            stop = _earliest(buf, HARMONY.terminators)
            if message != -1 and message <= HEADER_MAX and (stop is None or message < stop[0]):
                raw = buf[: message + len(HARMONY.message)]
                channel, recipient = _harmony_header(raw)
                self.events.append(("header", _Header(channel, recipient, raw)))
                self.buf, self.mode = buf[len(raw):], "body"
                return True
            if stop is not None and stop[0] <= HEADER_MAX:  # a header that never opened a body
                self.events.append(("end", stop[1]))
                self.buf, self.mode = buf[stop[0] + len(stop[1]):], "outside"
                return True
            if len(buf) > HEADER_MAX + len(HARMONY.message):  # not a header: drop the marker only
                marker = next(t for t in HARMONY.header_starts if buf.startswith(t))
                self.events.append(("end", None))
                self.buf, self.mode = buf[len(marker):], "outside"
                return True
            if final:  # an unfinished header is markup that never completed
                self.buf, self.mode = "", "outside"
                self.events.append(("end", None))
            return False
        # body
        hit = _earliest(buf, (*HARMONY.terminators, *HARMONY.header_starts))
        if hit is None:
            keep = 0 if final else _partial_tail(buf, self._TOKENS)
            self._emit("body", buf[: len(buf) - keep])
            self.buf = buf[len(buf) - keep:]
            if final:
                self.events.append(("end", None))
                self.mode = "outside"
            return False
        at, tok = hit
        self._emit("body", buf[:at])
        if tok in HARMONY.terminators:
            self.events.append(("end", tok))
            self.buf = buf[at + len(tok):]
        else:
            self.events.append(("end", None))
            self.buf = buf[at:]
            self.mode = "header"
            return True
        self.mode = "outside"
        return True

    def _emit(self, kind: str, text: str) -> None:
        if text:
            self.events.append((kind, text))


# --- reasoning ---------------------------------------------------------------------------


class ReasoningParser:
    """Splits one response stream into reasoning and content.

    ``force_reasoning`` says the output starts inside reasoning because the prompt opened
    it (see ``prompt_opens_reasoning``). ``tool_format`` (optional) names the tool-call
    format whose opener ends unclosed reasoning: if the model skips the end marker and
    starts a call, the call goes to content once ``TOOL_HOLD_MAX`` characters pass with no
    end marker; an end marker within that window wins, so a quoted opener stays reasoning.
    Tool messages of the harmony grammar go to content verbatim, for ``ToolCallParser``.
    """

    def __init__(self, fmt: ReasoningFormat, force_reasoning: bool = False, *,
                 tool_format: ToolCallFormat | None = None) -> None:
        self.fmt = fmt
        self.force_reasoning = force_reasoning
        self.tool_format = tool_format
        self._markers = fmt.markers
        forced = force_reasoning or self._markers.always_open
        self._reasoning = _Trim(glued=True, hold_trailing=True)
        self._content = _Trim()
        self._closed = False
        if self._markers.harmony:
            self._scanner = _HarmonyScanner(HARMONY.analysis if forced else None)
            self._route = "content"
        else:
            self._buf = ""
            self._phase = "head" if forced else "start"
            self._strip_start = forced  # a forced block may still print its start marker once
            self._tool_opener = tool_format.opener() if tool_format is not None else None

    def push(self, text: str) -> Delta:
        """Feed one chunk; return the reasoning and content that became final.

        Mutates the parser. Refuses with ``ParserRefused("stream_finished")`` after ``flush``.
        """
        self._check_open()
        self._run(text, final=False)
        return Delta(self._reasoning.take(), self._content.take())

    def flush(self) -> Delta:
        """End the stream: release everything held (a marker prefix, a held tool block, trailing
        whitespace) to the side it belongs to. Only whitespace touching markup is dropped.

        Mutates (closes the parser). Refuses with ``ParserRefused("stream_finished")`` when
        already flushed.
        """
        self._check_open()
        self._run("", final=True)
        self._reasoning.flush()
        self._content.flush()
        self._closed = True
        return Delta(self._reasoning.take(), self._content.take())

    def parse_complete(self, text: str) -> Delta:
        """Parse a whole response with a fresh parser of the same settings; ``self`` is untouched."""
        fresh = ReasoningParser(self.fmt, self.force_reasoning, tool_format=self.tool_format)
        first, rest = fresh.push(text), fresh.flush()
        return Delta(first.reasoning + rest.reasoning, first.content + rest.content)

    def _check_open(self) -> None:
        if self._closed:
            raise ParserRefused("stream_finished", "the parser was already flushed")

    def _run(self, text: str, final: bool) -> None:
        if self._markers.harmony:
            for event in self._scanner.feed(text, final):
                self._harmony_event(*event)
            return
        self._buf += text
        while self._think_step(final):
            pass

    # harmony: analysis → reasoning, tool messages → content verbatim, the rest → content
    def _harmony_event(self, kind: str, value: Any) -> None:
        if kind == "text":
            self._content.text(value)
        elif kind == "header":
            self._reasoning.markup()
            self._content.markup()
            recipient = value.recipient or ""
            if recipient.startswith(HARMONY.functions):
                self._route = "tool"
                self._content.raw(value.raw)
            elif value.channel == HARMONY.analysis or recipient:
                self._route = "reasoning"
            else:
                self._route = "content"
        elif kind == "body":
            if self._route == "tool":
                self._content.raw(value)
            elif self._route == "reasoning":
                self._reasoning.text(value)
            else:
                self._content.text(value)
        else:  # end of a message
            if self._route == "tool":
                self._content.raw(HARMONY.call)
            self._route = "content"
            self._reasoning.markup()
            self._content.markup()

    # start/end markers
    def _think_step(self, final: bool) -> bool:
        start, end = self._markers.start, self._markers.end
        assert start is not None and end is not None
        buf = self._buf
        if self._phase == "start":  # does the output open with the start marker?
            lead = buf.lstrip()
            if lead.startswith(start):
                self._buf, self._phase = lead[len(start):], "head"
                return True
            if not final and (not lead or start.startswith(lead)):
                return False
            self._phase = "content"
            return True
        if self._phase == "head":  # inside reasoning, before its first visible character
            lead = buf.lstrip()
            if self._strip_start and lead.startswith(start):
                self._buf, self._strip_start = lead[len(start):], False
                return True
            if not lead or (self._strip_start and start.startswith(lead) and not final):
                self._buf = lead
                return False
            self._buf, self._phase, self._strip_start = lead, "reasoning", False
            return True
        if self._phase == "reasoning":
            return self._reasoning_step(buf, end, final)
        self._content.text(buf)
        self._buf = ""
        return False

    def _reasoning_step(self, buf: str, end: str, final: bool) -> bool:
        closer = buf.find(end)
        opener = self._tool_opener
        tool = buf.find(opener) if opener else -1
        if closer != -1 and (tool == -1 or closer < tool + TOOL_HOLD_MAX):
            self._reasoning.text(buf[:closer])
            self._end_reasoning(buf[closer + len(end):])
            return True
        if tool != -1:
            if closer != -1 or final or len(buf) >= tool + TOOL_HOLD_MAX + len(end) - 1:
                # No end marker within the hold window: the model went straight to a call.
                self._reasoning.text(buf[:tool])
                self._end_reasoning(buf[tool:])
                return True
            self._reasoning.text(buf[:tool])
            self._buf = buf[tool:]
            return tool > 0
        keep = 0 if final else _partial_tail(buf, [end] + ([opener] if opener else []))
        self._reasoning.text(buf[: len(buf) - keep])
        self._buf = buf[len(buf) - keep:]
        return False

    def _end_reasoning(self, rest: str) -> None:
        self._reasoning.markup()
        self._content.markup()
        self._buf, self._phase = rest, "content"


# --- tool calls --------------------------------------------------------------------------


@dataclass(frozen=True)
class Text:
    """Plain answer text."""

    text: str


@dataclass(frozen=True)
class CallStart:
    """A call began; its name is final."""

    index: int
    name: str


@dataclass(frozen=True)
class CallArguments:
    """The next fragment of a call's arguments JSON; fragments concatenate to ``CallEnd.arguments``."""

    index: int
    fragment: str


@dataclass(frozen=True)
class CallEnd:
    """A call ended; ``arguments`` is its complete arguments JSON object."""

    index: int
    arguments: str


Event = Text | CallStart | CallArguments | CallEnd


class ToolCall(NamedTuple):
    index: int
    name: str
    arguments: str  # a JSON object, "{}" when the call has none


def fold_events(events: Iterable[Event]) -> tuple[str, list[ToolCall]]:
    """The answer text and the finished calls that a sequence of parser events describes. Pure."""
    text: list[str] = []
    names: dict[int, str] = {}
    calls: list[ToolCall] = []
    for ev in events:
        if isinstance(ev, Text):
            text.append(ev.text)
        elif isinstance(ev, CallStart):
            names[ev.index] = ev.name
        elif isinstance(ev, CallEnd):
            calls.append(ToolCall(ev.index, names[ev.index], ev.arguments))
    return "".join(text), calls


@dataclass
class _OpenCall:
    index: int
    name: str
    args: dict[str, Any] = field(default_factory=dict)


class _JsonEnd:
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


def _schemas(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, dict[str, Any]]:
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


def _coerce(raw: str, schema: Mapping[str, Any] | None) -> Any:
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


def _trim(raw: str, style: str) -> str:
    if style == "all":
        return raw.strip()
    if style == "newline":
        raw = raw[1:] if raw.startswith("\n") else raw
        return raw[:-1] if raw.endswith("\n") else raw
    return raw


def _valid_name(name: str) -> bool:
    return 0 < len(name) <= NAME_MAX and not any(ch.isspace() or ch in "<>{}\"'" for ch in name)


def _json_call(obj: Any) -> tuple[str, dict[str, Any]] | None:
    """``(name, arguments)`` from a JSON call object, or None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not _valid_name(obj["name"]):
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


def _json_calls(text: str) -> list[tuple[str, dict[str, Any]]] | None:
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
            call = _json_call(item)
            if call is None:
                return None
            calls.append(call)


class ToolCallParser:
    """Splits one answer stream into text and tool calls, as events.

    ``push(text)`` returns ``Text``, ``CallStart``, ``CallArguments`` and ``CallEnd``
    events; no event is ever empty. Invoke/parameter formats (``qwen3_coder``, ``glm45``)
    stream one prefix-stable fragment per parameter; JSON formats emit each call whole once
    it is complete. ``tools`` is the request's OpenAI ``tools`` list: parameter values of
    the XML-style formats are typed by its schemas. Calls to undeclared tools are reported
    as they are. A block that opens like a call but does not parse as one is text.
    """

    def __init__(self, fmt: ToolCallFormat, tools: Sequence[Mapping[str, Any]] | None = None) -> None:
        self.fmt = fmt
        self.tools = tools
        self._m = fmt.markers
        self._schemas = _schemas(tools)
        self._out = _Trim()
        self._events: list[Event] = []
        self._buf = ""
        self._mode = "text"  # "text" or a section state of the format's grammar
        self._raw = ""  # section text consumed since its opener, for a verbatim fallback
        self._json = _JsonEnd()
        self._call: _OpenCall | None = None
        self._key = ""
        self._next_index = 0
        self._section_calls = 0
        self._bare_possible = self._m.bare_json_start
        self._closed = False
        if self._m.grammar == "harmony":
            self._scanner = _HarmonyScanner()
            self._header: _Header | None = None
            self._body: list[str] = []

    # public verbs
    def push(self, text: str) -> list[Event]:
        """Feed one chunk; return the events it completed (possibly none).

        Mutates the parser. Refuses with ``ParserRefused("stream_finished")`` after ``flush``.
        """
        self._check_open()
        self._run(text, final=False)
        return self._take()

    def flush(self) -> list[Event]:
        """End the stream: finish or release whatever is held. An unfinished call that already
        started is closed with the arguments seen so far; a block that never became a call is
        released as text. Mutates (closes the parser); refuses with
        ``ParserRefused("stream_finished")`` when already flushed.
        """
        self._check_open()
        self._run("", final=True)
        self._out.flush()
        self._closed = True
        return self._take()

    def parse_complete(self, text: str) -> tuple[str, list[ToolCall]]:
        """``(content, calls)`` for a whole answer, by a fresh parser of the same settings.

        ``self`` is untouched. Each call has ``index``, ``name`` and ``arguments`` (a JSON
        object string, ``"{}"`` when empty).
        """
        fresh = ToolCallParser(self.fmt, self.tools)
        return fold_events([*fresh.push(text), *fresh.flush()])

    # plumbing
    def _check_open(self) -> None:
        if self._closed:
            raise ParserRefused("stream_finished", "the parser was already flushed")

    def _take(self) -> list[Event]:
        self._emit_text()
        events, self._events = self._events, []
        return events

    def _emit_text(self) -> None:
        text = self._out.take()
        if not text:
            return
        if self._events and isinstance(self._events[-1], Text):
            self._events[-1] = Text(self._events[-1].text + text)
        else:
            self._events.append(Text(text))

    def _emit(self, event: Event) -> None:
        self._emit_text()
        self._events.append(event)

    def _run(self, text: str, final: bool) -> None:
        if self._m.grammar == "harmony":
            for event in self._scanner.feed(text, final):
                self._harmony_event(*event)
            return
        self._buf += text
        while self._step(final):
            pass

    def _step(self, final: bool) -> bool:
        if self._mode == "text":
            return self._text_step(final)
        handler = {
            "json_block": self._json_block_step,
            "json_sequence": self._json_sequence_step,
            "mistral": self._mistral_step,
            "xml_function": self._xml_function_step,
            "xml_arg_pairs": self._xml_pairs_step,
        }[self._m.grammar]
        return handler(final)

    # calls
    def _start_call(self, name: str) -> None:
        self._out.markup()
        self._call = _OpenCall(self._next_index, name)
        self._next_index += 1
        self._section_calls += 1
        self._emit(CallStart(self._call.index, name))

    def _add_parameter(self, key: str, raw: str) -> None:
        call = self._call
        assert call is not None
        key = key.strip()
        if not key or key in call.args:
            return
        value = _coerce(_trim(raw, self._m.trim), self._schemas.get(call.name, {}).get(key))
        head = ", " if call.args else "{"
        call.args[key] = value
        fragment = f"{head}{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"
        self._emit(CallArguments(call.index, fragment))

    def _end_call(self) -> None:
        call = self._call
        assert call is not None
        self._emit(CallArguments(call.index, "}" if call.args else "{}"))
        self._emit(CallEnd(call.index, json.dumps(call.args, ensure_ascii=False)))
        self._call = None
        self._out.markup()

    def _whole_call(self, name: str, args: dict[str, Any]) -> None:
        self._start_call(name)
        arguments = json.dumps(args, ensure_ascii=False)
        assert self._call is not None
        self._emit(CallArguments(self._call.index, arguments))
        self._emit(CallEnd(self._call.index, arguments))
        self._call = None
        self._out.markup()

    def _consume(self, n: int) -> None:
        self._raw += self._buf[:n]
        self._buf = self._buf[n:]

    def _enter(self, mode: str) -> None:
        self._mode = mode
        self._json = _JsonEnd()

    def _leave_section(self) -> None:
        self._raw = ""
        self._section_calls = 0
        self._mode = "text"

    def _as_text(self) -> None:
        """The section so far was not a call: release it verbatim and read on as text."""
        self._out.text(self._raw)
        self._bare_possible = False
        self._leave_section()

    # text between calls
    def _text_step(self, final: bool) -> bool:
        buf = self._buf
        if self._bare_possible:
            lead = buf.lstrip()
            if not lead and not final:
                return False
            if lead.startswith("{"):
                self._consume(len(buf) - len(lead))
                self._enter("bare")
                return True
            self._bare_possible = False
        opener = self._m.opener
        assert opener is not None
        at = buf.find(opener)
        if at != -1:
            self._out.text(buf[:at])
            self._buf = buf[at:]
            self._raw = ""
            self._consume(len(opener))
            self._enter("open")
            return True
        keep = 0 if final else _partial_tail(buf, [opener])
        self._out.text(buf[: len(buf) - keep])
        self._buf = buf[len(buf) - keep:]
        return False

    # hermes: <tool_call> JSON </tool_call>
    def _json_block_step(self, final: bool) -> bool:
        closer = self._m.closer
        assert closer is not None
        at = self._buf.find(closer)
        if at == -1 and not final:
            return False
        body = self._buf if at == -1 else self._buf[:at]
        calls = _json_calls(body)
        self._consume(len(self._buf) if at == -1 else at + len(closer))
        if calls is None:
            self._as_text()
            return True
        for name, args in calls:
            self._whole_call(name, args)
        self._leave_section()
        return True

    # llama3: <|python_tag|> {…} ; {…}   (or a bare {…} that opens the answer)
    def _json_sequence_step(self, final: bool) -> bool:
        if self._mode in ("open", "bare", "next"):  # a call object must follow
            lead = self._buf.lstrip()
            if not lead and not final:
                return False
            self._consume(len(self._buf) - len(lead))
            if lead.startswith("{"):
                self._enter("object")
            elif self._mode == "next":  # a separator with no call after it was debris
                self._leave_section()
            else:
                self._as_text()
            return True
        if self._mode == "object":
            end = self._json.scan(self._buf)
            if end is None:
                if final:
                    self._consume(len(self._buf))
                    self._as_text()
                return final
            call = _json_call(_loads(self._buf[:end]))
            self._consume(end)
            if call is None:
                self._as_text()
                return True
            self._whole_call(*call)
            self._raw = ""
            self._bare_possible = False
            self._mode = "after"
            return True
        # after an object: a separator continues the section, anything else ends it
        lead = self._buf.lstrip()
        if not lead and not final:
            return False
        separator = self._m.separator
        if separator and lead.startswith(separator):
            self._consume(len(self._buf) - len(lead) + len(separator))
            self._mode = "next"
            return True
        self._leave_section()
        return True

    # mistral: [TOOL_CALLS] [ {…}, … ]   or   [TOOL_CALLS] name [CALL_ID] id [ARGS] {…}
    def _mistral_step(self, final: bool) -> bool:
        m = self._m
        assert m.args_marker is not None
        if self._mode == "open":
            lead = self._buf.lstrip()
            if not lead and not final:
                return False
            self._consume(len(self._buf) - len(lead))
            self._enter("array" if lead.startswith("[") else "name")
            return True
        if self._mode == "name":
            at = self._buf.find(m.args_marker)
            if at == -1:
                if final or len(self._buf) > 2 * NAME_MAX:
                    self._consume(len(self._buf))
                    self._as_text()
                    return True
                return False
            head = self._buf[:at]
            if m.call_id_marker and m.call_id_marker in head:
                head = head[: head.find(m.call_id_marker)]
            name = head.strip()
            self._consume(at + len(m.args_marker))
            if not _valid_name(name):
                self._as_text()
                return True
            self._key = name
            self._enter("args_lead")
            return True
        if self._mode == "args_lead":
            lead = self._buf.lstrip()
            if not lead and not final:
                return False
            self._consume(len(self._buf) - len(lead))
            if not lead.startswith("{"):
                self._as_text()
                return True
            self._enter("args")
            return True
        # "array" (a JSON list of calls) or "args" (one arguments object)
        end = self._json.scan(self._buf)
        if end is None:
            if final:
                self._consume(len(self._buf))
                self._as_text()
            return final
        value = _loads(self._buf[:end])
        self._consume(end)
        if self._mode == "array":
            calls = [_json_call(item) for item in value] if isinstance(value, list) and value else None
            if not calls or any(c is None for c in calls):
                self._as_text()
                return True
            for call in calls:
                assert call is not None
                self._whole_call(*call)
        else:
            call = _json_call({"name": self._key, "arguments": value})
            if call is None:
                self._as_text()
                return True
            self._whole_call(*call)
        self._leave_section()
        return True

    # qwen3_coder: <tool_call> <function=NAME> <parameter=KEY> value </parameter> … </function> </tool_call>
    def _xml_function_step(self, final: bool) -> bool:
        m = self._m
        assert m.function_open and m.function_close and m.closer and m.name_end
        assert m.param_open and m.param_name_end and m.param_close
        buf = self._buf
        if self._mode == "open":  # between functions of one section
            hit = _earliest(buf, [m.function_open, m.closer])
            if hit is None:
                if not final:
                    return False
                if self._section_calls == 0:
                    self._consume(len(buf))
                    self._as_text()
                else:  # an unclosed section ends after its last function; the rest is text
                    self._out.text(buf)
                    self._buf = ""
                    self._leave_section()
                return True
            at, marker = hit
            self._consume(at + len(marker))
            if marker == m.closer:
                if self._section_calls == 0:
                    self._as_text()
                else:
                    self._out.markup()
                    self._leave_section()
            else:
                self._mode = "name"
            return True
        if self._mode == "name":
            at = buf.find(m.name_end)
            if at == -1 and not final and len(buf) <= NAME_MAX:
                return False
            name = buf[:at].strip() if at != -1 else ""
            if not _valid_name(name):
                self._consume(len(buf) if at == -1 else at + len(m.name_end))
                if self._section_calls == 0:
                    self._as_text()
                else:  # debris after the section's calls
                    self._leave_section()
                return True
            self._consume(at + len(m.name_end))
            self._start_call(name)
            self._mode = "params"
            return True
        if self._mode == "params":
            hit = _earliest(buf, [m.param_open, m.function_close, m.closer])
            if hit is None:
                if final:
                    self._buf = ""
                    self._end_call()
                    self._leave_section()
                return final
            at, marker = hit
            self._consume(at + len(marker))
            if marker == m.param_open:
                self._mode = "param_name"
                return True
            self._end_call()
            if marker == m.closer:
                self._leave_section()
            else:
                self._mode = "open"
            return True
        if self._mode == "param_name":
            at = buf.find(m.param_name_end)
            if at == -1 and not final and len(buf) <= NAME_MAX:
                return False
            if at == -1 or not buf[:at].strip() or len(buf[:at].strip()) > NAME_MAX:
                self._mode = "params"  # not a parameter: skip past the marker as debris
                return True
            self._key = buf[:at]
            self._consume(at + len(m.param_name_end))
            self._mode = "value"
            return True
        # value: ends at </parameter>, or where a forgotten one should have been
        hit = _earliest(buf, [m.param_close, m.param_open, m.function_close, m.closer])
        if hit is None and not final:
            return False
        at = len(buf) if hit is None else hit[0]
        self._add_parameter(self._key, buf[:at])
        self._consume(at + (len(m.param_close) if hit is not None and hit[1] == m.param_close else 0))
        self._mode = "params"
        return True

    # glm45: <tool_call>NAME\n <arg_key>K</arg_key> <arg_value>V</arg_value> … </tool_call>
    def _xml_pairs_step(self, final: bool) -> bool:
        m = self._m
        assert m.closer and m.name_end and m.param_open and m.param_name_end
        assert m.value_open and m.param_close
        buf = self._buf
        if self._mode == "open":  # the function name
            hit = _earliest(buf, [m.name_end, m.param_open, m.closer])
            if hit is None and not final and len(buf) <= NAME_MAX:
                return False
            at = len(buf) if hit is None else hit[0]
            name = buf[:at].strip()
            if not _valid_name(name):
                self._consume(len(buf) if hit is None else at + len(hit[1]))
                self._as_text()
                return True
            self._consume(at + (len(m.name_end) if hit is not None and hit[1] == m.name_end else 0))
            self._start_call(name)
            self._mode = "params"
            return True
        if self._mode == "params":
            hit = _earliest(buf, [m.param_open, m.closer])
            if hit is None:
                if final:
                    self._buf = ""
                    self._end_call()
                    self._leave_section()
                return final
            at, marker = hit
            self._consume(at + len(marker))
            if marker == m.param_open:
                self._mode = "param_name"
            else:
                self._end_call()
                self._leave_section()
            return True
        if self._mode == "param_name":
            at = buf.find(m.param_name_end)
            if at == -1 and not final and len(buf) <= NAME_MAX:
                return False
            if at == -1:
                self._mode = "params"
                return True
            self._key = buf[:at]
            self._consume(at + len(m.param_name_end))
            self._mode = "value_open"
            return True
        if self._mode == "value_open":
            lead = buf.lstrip()
            if lead.startswith(m.value_open):
                self._consume(len(buf) - len(lead) + len(m.value_open))
                self._mode = "value"
                return True
            if not final and (not lead or m.value_open.startswith(lead)):
                return False
            self._add_parameter(self._key, "")
            self._mode = "params"
            return True
        hit = _earliest(buf, [m.param_close, m.param_open, m.closer])
        if hit is None and not final:
            return False
        at = len(buf) if hit is None else hit[0]
        self._add_parameter(self._key, buf[:at])
        self._consume(at + (len(m.param_close) if hit is not None and hit[1] == m.param_close else 0))
        self._mode = "params"
        return True

    # gpt_oss: a harmony message addressed to functions.NAME is a call; other bodies are text
    def _harmony_event(self, kind: str, value: Any) -> None:
        if kind == "text":
            self._out.text(value)
        elif kind == "header":
            self._out.markup()
            recipient = value.recipient or ""
            self._header = value if recipient.startswith(HARMONY.functions) else None
            self._body = []
        elif kind == "body":
            if self._header is not None:
                self._body.append(value)
            else:
                self._out.text(value)
        else:
            header, self._header = self._header, None
            self._out.markup()
            if header is None:
                return
            body = "".join(self._body)
            name = (header.recipient or "")[len(HARMONY.functions):]
            call = _json_call({"name": name, "arguments": body if body.strip() else {}})
            if call is None:
                self._out.raw(header.raw + body + (value or ""))
                self._out.markup()
                return
            self._whole_call(*call)


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None
