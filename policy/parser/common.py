"""What every format shares: the refusal, the limits, the marker records, the output
events, and the three text tools of incremental parsing (a partial-marker tail, the
earliest marker, whitespace trimming around markup)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, NamedTuple

from moetray.policy.detokenize import stop_prefix_holdback
from moetray.policy.refused import Refused


class ParserRefused(Refused, ValueError):
    """A parser request that cannot be honoured; nothing changed.

    ``.kind`` is ``unknown_format`` (``.name`` is not a wire name or alias of the enum) or
    ``stream_finished`` (``push``/``flush`` after ``flush``).
    """

    KINDS = ("unknown_format", "stream_finished")
    name: str | None  # the format name asked for (``unknown_format``), set by ``Refused``

    def __init__(self, kind: str, message: str, name: str | None = None) -> None:
        super().__init__(kind, message, name=name)


TOOL_HOLD_MAX = 512
"""After a tool-call opener appears inside unclosed reasoning, how many characters are held
to tell a real call (the model skipped the closer) from a quoted one (a closer follows)."""
NAME_MAX = 128
"""Longest function or parameter name accepted; a longer run is not a name but text."""
HEADER_MAX = 256
"""Longest harmony message header; a longer run without ``<|message|>`` is not a header."""


# --- the marker records (each format module fills one) -----------------------------------


@dataclass(frozen=True)
class ReasoningMarkers:
    start: str | None  # opens a reasoning block
    end: str | None  # closes it
    always_open: bool  # the output begins inside reasoning, whatever the prompt shows
    harmony: bool  # channel grammar (see HARMONY) instead of start/end markers


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


TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"  # shared by several families

Identities = tuple[str, ...]
"""A format's detector: substrings of a checkpoint's identity (repo name, ``model_type``…)
that say it speaks the format; the registry tries them in precedence order."""


# --- output ------------------------------------------------------------------------------


class Delta(NamedTuple):
    """Text that became final after one push: the reasoning part and the answer part."""

    reasoning: str = ""
    content: str = ""


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


@dataclass(frozen=True)
class ToolCall:
    """One finished call, as ``fold_events`` gathers it."""

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


# --- text tools --------------------------------------------------------------------------


def partial_tail(text: str, markers: Iterable[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``markers``
    (what a stream holds back; the stop-string rule, ``detokenize.stop_prefix_holdback``)."""
    return stop_prefix_holdback(text, markers)


def earliest(text: str, markers: Iterable[str], start: int = 0) -> tuple[int, str] | None:
    """``(position, marker)`` of the first of ``markers`` in ``text`` from ``start``, or None."""
    best: tuple[int, str] | None = None
    for marker in markers:
        at = text.find(marker, start)
        if at != -1 and (best is None or at < best[0]):
            best = (at, marker)
    return best


class Trim:
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
