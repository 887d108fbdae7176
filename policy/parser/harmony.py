"""gpt_oss's harmony grammar, for reasoning and tool calls both.

``[<|start|>role]<|channel|>NAME [to=RECIPIENT] [<|constrain|>json]<|message|>BODY
(<|end|>|<|call|>|<|return|>)``: the analysis channel is reasoning, a message addressed
``to=functions.NAME`` is a call, the rest is the answer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .common import HEADER_MAX, Identities, ReasoningMarkers, ToolCallMarkers, Trim, earliest, partial_tail
from .cursor import Cursor
from .values import json_call


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

REASONING = ReasoningMarkers(None, None, always_open=False, harmony=True)
TOOL_CALLS = ToolCallMarkers("harmony", None)
IDENTITIES: Identities = ("gpt_oss", "gpt-oss", "gptoss")

_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL_NAME = re.compile(r"[^\s<]*")


def read_header(raw: str) -> tuple[str | None, str | None]:
    """``(channel, recipient)`` named in a harmony header (markers included or not)."""
    channel = None
    at = raw.rfind(HARMONY.channel)
    if at != -1:
        name = _CHANNEL_NAME.match(raw, at + len(HARMONY.channel))
        channel = name.group(0) if name and name.group(0) else None
    recipient = _RECIPIENT.search(raw)
    return channel, recipient.group(1) if recipient else None


def prompt_opens_analysis(prompt_text: str) -> bool:
    """Whether the prompt ends inside the body of an analysis message."""
    at = prompt_text.rfind(HARMONY.message)
    if at == -1:
        return False
    after = prompt_text[at + len(HARMONY.message):]
    if any(tok in after for tok in (*HARMONY.terminators, *HARMONY.header_starts)):
        return False
    head_from = max(prompt_text.rfind(tok, 0, at) for tok in (HARMONY.start, *HARMONY.terminators))
    channel, _ = read_header(prompt_text[max(head_from, 0):at])
    return channel == HARMONY.analysis


@dataclass
class Header:
    channel: str | None
    recipient: str | None
    raw: str  # the header as written, start marker through <|message|>


class Scanner:
    """Splits harmony text into outside text, message headers, bodies and message ends.

    ``feed`` returns events ``("text", s)``, ``("header", Header)``, ``("body", s)`` and
    ``("end", terminator_or_None)``; partial control tokens are held until they resolve.
    """

    _TOKENS = (HARMONY.start, HARMONY.channel, HARMONY.message, *HARMONY.terminators)

    def __init__(self, body_channel: str | None = None) -> None:
        self.buf = ""
        self.mode = "body" if body_channel is not None else "outside"
        self.events: list[tuple[str, Any]] = []
        if body_channel is not None:
            self.events.append(("header", Header(body_channel, None, "")))

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
            hit = earliest(buf, self._TOKENS)
            if hit is None:
                keep = 0 if final else partial_tail(buf, self._TOKENS)
                self._emit("text", buf[: len(buf) - keep])
                self.buf = buf[len(buf) - keep:]
                return False
            at, tok = hit
            self._emit("text", buf[:at])
            if tok in HARMONY.header_starts:
                self.buf, self.mode = buf[at:], "header"
            elif tok == HARMONY.message:  # a body with no header
                self.events.append(("header", Header(None, None, tok)))
                self.buf, self.mode = buf[at + len(tok):], "body"
            else:  # a stray terminator is markup
                self.events.append(("end", tok))
                self.buf = buf[at + len(tok):]
            return True
        if self.mode == "header":
            message = buf.find(HARMONY.message)
            stop = earliest(buf, HARMONY.terminators)
            if message != -1 and message <= HEADER_MAX and (stop is None or message < stop[0]):
                raw = buf[: message + len(HARMONY.message)]
                channel, recipient = read_header(raw)
                self.events.append(("header", Header(channel, recipient, raw)))
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
        hit = earliest(buf, (*HARMONY.terminators, *HARMONY.header_starts))
        if hit is None:
            keep = 0 if final else partial_tail(buf, self._TOKENS)
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


class HarmonyReasoning:
    """Reasoning side: analysis → reasoning, tool messages → content verbatim (for the
    tool-call parser), the rest → content."""

    def __init__(self, forced: bool, reasoning: Trim, content: Trim) -> None:
        self.scanner = Scanner(HARMONY.analysis if forced else None)
        self.reasoning, self.content = reasoning, content
        self.route = "content"

    def feed(self, text: str, final: bool) -> None:
        for kind, value in self.scanner.feed(text, final):
            self._event(kind, value)

    def _event(self, kind: str, value: Any) -> None:
        if kind == "text":
            self.content.text(value)
        elif kind == "header":
            self.reasoning.markup()
            self.content.markup()
            recipient = value.recipient or ""
            if recipient.startswith(HARMONY.functions):
                self.route = "tool"
                self.content.raw(value.raw)
            elif value.channel == HARMONY.analysis or recipient:
                self.route = "reasoning"
            else:
                self.route = "content"
        elif kind == "body":
            if self.route == "tool":
                self.content.raw(value)
            elif self.route == "reasoning":
                self.reasoning.text(value)
            else:
                self.content.text(value)
        else:  # end of a message
            if self.route == "tool":
                self.content.raw(HARMONY.call)
            self.route = "content"
            self.reasoning.markup()
            self.content.markup()


class HarmonyCalls:
    """Tool-call side: a message addressed to ``functions.NAME`` is a call; other bodies are text."""

    def __init__(self, cursor: Cursor) -> None:
        self.scanner = Scanner()
        self.cursor = cursor
        self.header: Header | None = None
        self.body: list[str] = []

    def feed(self, text: str, final: bool) -> None:
        for kind, value in self.scanner.feed(text, final):
            self._event(kind, value)

    def _event(self, kind: str, value: Any) -> None:
        out = self.cursor.out
        if kind == "text":
            out.text(value)
        elif kind == "header":
            out.markup()
            recipient = value.recipient or ""
            self.header = value if recipient.startswith(HARMONY.functions) else None
            self.body = []
        elif kind == "body":
            if self.header is not None:
                self.body.append(value)
            else:
                out.text(value)
        else:
            header, self.header = self.header, None
            out.markup()
            if header is None:
                return
            body = "".join(self.body)
            name = (header.recipient or "")[len(HARMONY.functions):]
            call = json_call({"name": name, "arguments": body if body.strip() else {}})
            if call is None:
                out.raw(header.raw + body + (value or ""))
                out.markup()
                return
            self.cursor.whole_call(*call)
