"""The marker-delimited reasoning formats: a start and an end marker around the reasoning.

qwen3 (also GLM-4.5+, QwQ) writes ``<think>…</think>`` and its template may open the block
in the prompt; deepseek_r1 writes the same markers but its output always starts inside
reasoning; gemma4 writes ``<|channel>thought\\n … <channel|>``. One grammar reads all three.
"""

from __future__ import annotations

from .common import TOOL_HOLD_MAX, Identities, ReasoningMarkers, Trim, partial_tail

THINK_START, THINK_END = "<think>", "</think>"  # shared by several families

QWEN3 = ReasoningMarkers(THINK_START, THINK_END, always_open=False, harmony=False)
DEEPSEEK_R1 = ReasoningMarkers(THINK_START, THINK_END, always_open=True, harmony=False)
GEMMA4 = ReasoningMarkers("<|channel>thought\n", "<channel|>", always_open=False, harmony=False)

QWEN3_IDENTITIES: Identities = ("qwen3", "qwq", "glm-4.5", "glm4.5", "glm-4.6", "glm4_moe", "glm-4.7")
DEEPSEEK_R1_IDENTITIES: Identities = ("deepseek-r1", "deepseek_r1", "deepseek r1", "r1-distill", "r1_distill")
GEMMA4_IDENTITIES: Identities = ("gemma-4", "gemma4", "gemma_4", "gemma 4")


def prompt_opens(m: ReasoningMarkers, prompt_text: str) -> bool:
    """Whether the prompt's last start marker comes after its last end marker (the template
    pre-opened the block)."""
    assert m.start is not None and m.end is not None
    return prompt_text.rfind(m.start) > prompt_text.rfind(m.end)


class ThinkSplitter:
    """Routes a marker-delimited stream to the reasoning and content sides.

    ``forced``: the output starts inside reasoning (a block may still print its start marker
    once). ``tool_opener``: a tool-call opener that ends unclosed reasoning once
    ``TOOL_HOLD_MAX`` characters pass with no end marker (see ``ReasoningParser``).
    """

    def __init__(self, markers: ReasoningMarkers, forced: bool, tool_opener: str | None,
                 reasoning: Trim, content: Trim) -> None:
        assert markers.start is not None and markers.end is not None
        self.start, self.end = markers.start, markers.end
        self.tool_opener = tool_opener
        self.reasoning, self.content = reasoning, content
        self.buf = ""
        self.phase = "head" if forced else "start"
        self.strip_start = forced

    def feed(self, text: str, final: bool) -> None:
        self.buf += text
        while self._step(final):
            pass

    def _step(self, final: bool) -> bool:
        start = self.start
        buf = self.buf
        if self.phase == "start":  # does the output open with the start marker?
            lead = buf.lstrip()
            if lead.startswith(start):
                self.buf, self.phase = lead[len(start):], "head"
                return True
            if not final and (not lead or start.startswith(lead)):
                return False
            self.phase = "content"
            return True
        if self.phase == "head":  # inside reasoning, before its first visible character
            lead = buf.lstrip()
            if self.strip_start and lead.startswith(start):
                self.buf, self.strip_start = lead[len(start):], False
                return True
            if not lead or (self.strip_start and start.startswith(lead) and not final):
                self.buf = lead
                return False
            self.buf, self.phase, self.strip_start = lead, "reasoning", False
            return True
        if self.phase == "reasoning":
            return self._reasoning_step(buf, final)
        self.content.text(buf)
        self.buf = ""
        return False

    def _reasoning_step(self, buf: str, final: bool) -> bool:
        end = self.end
        closer = buf.find(end)
        opener = self.tool_opener
        tool = buf.find(opener) if opener else -1
        if closer != -1 and (tool == -1 or closer < tool + TOOL_HOLD_MAX):
            self.reasoning.text(buf[:closer])
            self._end_reasoning(buf[closer + len(end):])
            return True
        if tool != -1:
            if closer != -1 or final or len(buf) >= tool + TOOL_HOLD_MAX + len(end) - 1:
                # No end marker within the hold window: the model went straight to a call.
                self.reasoning.text(buf[:tool])
                self._end_reasoning(buf[tool:])
                return True
            self.reasoning.text(buf[:tool])
            self.buf = buf[tool:]
            return tool > 0
        keep = 0 if final else partial_tail(buf, [end] + ([opener] if opener else []))
        self.reasoning.text(buf[: len(buf) - keep])
        self.buf = buf[len(buf) - keep:]
        return False

    def _end_reasoning(self, rest: str) -> None:
        self.reasoning.markup()
        self.content.markup()
        self.buf, self.phase = rest, "content"
