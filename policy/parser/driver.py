"""The incremental driver: the two parsers a response stream is fed through, chunk by chunk.

Each holds the format's reader (``think``/``harmony`` for reasoning, a ``Cursor`` stepped by
the format's grammar for tool calls), feeds it what arrives and hands out what became final.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .common import Delta, Event, ParserRefused, ToolCall, Trim, fold_events
from .cursor import Cursor
from .harmony import HarmonyCalls, HarmonyReasoning
from .registry import TOOL_CALL_STEPS, ReasoningFormat, ToolCallFormat
from .think import ThinkSplitter


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
        markers = fmt.markers
        forced = force_reasoning or markers.always_open
        self._reasoning = Trim(glued=True, hold_trailing=True)
        self._content = Trim()
        self._closed = False
        self._reader: HarmonyReasoning | ThinkSplitter
        if markers.harmony:
            self._reader = HarmonyReasoning(forced, self._reasoning, self._content)
        else:
            opener = tool_format.opener() if tool_format is not None else None
            self._reader = ThinkSplitter(markers, forced, opener, self._reasoning, self._content)

    def push(self, text: str) -> Delta:
        """Feed one chunk; return the reasoning and content that became final.

        Mutates the parser. Refuses with ``ParserRefused("stream_finished")`` after ``flush``.
        """
        self._check_open()
        self._reader.feed(text, final=False)
        return Delta(self._reasoning.take(), self._content.take())

    def flush(self) -> Delta:
        """End the stream: release everything held (a marker prefix, a held tool block, trailing
        whitespace) to the side it belongs to. Only whitespace touching markup is dropped.

        Mutates (closes the parser). Refuses with ``ParserRefused("stream_finished")`` when
        already flushed.
        """
        self._check_open()
        self._reader.feed("", final=True)
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
        self._cursor = Cursor(fmt.markers, tools)
        self._harmony = HarmonyCalls(self._cursor) if fmt.markers.grammar == "harmony" else None
        self._closed = False

    def push(self, text: str) -> list[Event]:
        """Feed one chunk; return the events it completed (possibly none).

        Mutates the parser. Refuses with ``ParserRefused("stream_finished")`` after ``flush``.
        """
        self._check_open()
        self._run(text, final=False)
        return self._cursor.take()

    def flush(self) -> list[Event]:
        """End the stream: finish or release whatever is held. An unfinished call that already
        started is closed with the arguments seen so far; a block that never became a call is
        released as text. Mutates (closes the parser); refuses with
        ``ParserRefused("stream_finished")`` when already flushed.
        """
        self._check_open()
        self._run("", final=True)
        self._cursor.out.flush()
        self._closed = True
        return self._cursor.take()

    def parse_complete(self, text: str) -> tuple[str, list[ToolCall]]:
        """``(content, calls)`` for a whole answer, by a fresh parser of the same settings.

        ``self`` is untouched. Each call has ``index``, ``name`` and ``arguments`` (a JSON
        object string, ``"{}"`` when empty).
        """
        fresh = ToolCallParser(self.fmt, self.tools)
        return fold_events([*fresh.push(text), *fresh.flush()])

    def _check_open(self) -> None:
        if self._closed:
            raise ParserRefused("stream_finished", "the parser was already flushed")

    def _run(self, text: str, final: bool) -> None:
        if self._harmony is not None:
            self._harmony.feed(text, final)
            return
        cursor, section_step = self._cursor, TOOL_CALL_STEPS[self.fmt]
        cursor.buf += text
        while cursor.text_step(final) if cursor.mode == "text" else section_step(cursor, final):
            pass
