"""Where reasoning ends and the answer begins, and which tool was called: incremental parsing.

Generated text arrives in chunks whose edges fall anywhere, markers included (``</thi`` +
``nk>``), and a server-sent stream cannot take text back. Both parsers therefore hold the
shortest tail that could still turn out to be markup and decide only from text they have
seen in full, so the result never depends on where chunks were cut: for every chunking,
the concatenated stream equals ``parse_complete`` (which runs the same machinery on the
whole text at once).

The two compose in order: ``ReasoningParser`` splits reasoning from content and passes
tool-call text through verbatim; ``ToolCallParser`` then splits content from calls.

The package's rooms: one module per wire format, each describing its markers once, its
detector (``IDENTITIES``) and its grammar: ``think`` (qwen3, deepseek_r1, gemma4),
``harmony`` (gpt_oss, reasoning and tools), ``hermes``, ``llama3``, ``mistral``,
``qwen3_coder``, ``glm45``; ``registry`` names them (the enums, ``REASONING_MARKERS``,
``TOOL_CALL_MARKERS``, detector precedence); ``driver`` holds the two parsers; ``cursor``
the tool-call state every grammar steps through; ``common`` and ``values`` the shared
pieces. Stdlib only, like all of ``policy``.

Whitespace right after markup belongs to the markup (templates render ``</think>\\n\\n``
and a newline after each tool block) and is dropped; reasoning also sheds the whitespace
before its end marker.
"""

from .common import (
    TOOL_HOLD_MAX,
    CallArguments,
    CallEnd,
    CallStart,
    Delta,
    Event,
    ParserRefused,
    ReasoningMarkers,
    Text,
    ToolCall,
    ToolCallMarkers,
    fold_events,
)
from .driver import ReasoningParser, ToolCallParser
from .harmony import HARMONY
from .registry import (
    REASONING_MARKERS,
    TOOL_CALL_MARKERS,
    ReasoningFormat,
    ToolCallFormat,
    infer_reasoning_format,
    infer_tool_call_format,
    prompt_opens_reasoning,
)

__all__ = [
    "HARMONY",
    "REASONING_MARKERS",
    "TOOL_CALL_MARKERS",
    "TOOL_HOLD_MAX",
    "CallArguments",
    "CallEnd",
    "CallStart",
    "Delta",
    "Event",
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
