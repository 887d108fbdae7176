"""From chat messages to prompt ids, and from sampled ids to streamable text, reasoning and tool calls.

``ChatSupport`` is built once per loaded model by *probing* its tokenizer's chat template:
which tool-call and reasoning markup it renders (``policy.parser`` formats, inferred from
the checkpoint's identity when the template says nothing), the string that ends an
assistant turn (``policy.turn``) and the reasoning-effort controls it consumes
(``policy.effort``), and the single token that opens a tool call (``policy.anchor``).

``TextStream`` is one response's text pipeline: ``policy.detokenize`` turns ids into text
that is safe to stream (no half characters, no partial stop strings, no special tokens),
``ReasoningParser`` splits reasoning from the answer and ``ToolCallParser`` splits the
answer from tool calls. Every piece it returns is final: SSE cannot take text back.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from moetray.engine.cb import GrammarCompiler
from moetray.policy.anchor import resolve_anchor_token
from moetray.policy.detokenize import IncrementalDetokenizer
from moetray.policy.effort import (
    EffortProfile,
    ThinkingProfile,
    probe_effort,
    probe_thinking,
    template_kwargs_for_request,
)
from moetray.policy.parser import (
    ReasoningFormat,
    ReasoningParser,
    Text,
    ToolCallFormat,
    ToolCallParser,
    infer_reasoning_format,
    infer_tool_call_format,
    prompt_opens_reasoning,
)
from moetray.policy.tool_prompt import with_tool_block
from moetray.policy.turn import end_of_turn_stops, probe_end_of_turn

log = logging.getLogger("moetray.engine.chat")

_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "probe_tool",
        "description": "probe",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
    },
}


def _normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages as templates expect them: text parts joined, tool-call arguments as objects."""
    out = []
    for message in messages:
        m = dict(message)
        content = m.get("content")
        if isinstance(content, list):
            m["content"] = "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
        elif content is None:
            m["content"] = ""
        calls = m.get("tool_calls")
        if calls:
            fixed = []
            for call in calls:
                call = dict(call)
                fn = dict(call.get("function") or {})
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        fn["arguments"] = json.loads(args) if args.strip() else {}
                    except json.JSONDecodeError:
                        pass
                call["function"] = fn
                fixed.append(call)
            m["tool_calls"] = fixed
        out.append(m)
    return out


@dataclass
class ChatDelta:
    """What one push made final: reasoning text, answer text and tool-call events."""

    reasoning: str = ""
    content: str = ""
    tool_events: list[Any] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_events)


class TextStream:
    """One response's text pipeline (see the module docstring). Not thread-safe; one per request."""

    def __init__(
        self,
        support: ChatSupport,
        *,
        prompt_ids: Sequence[int],
        stops: Sequence[str],
        reasoning: ReasoningFormat | None,
        force_reasoning: bool,
        tools: Sequence[Mapping[str, Any]] | None,
        tool_format: ToolCallFormat | None,
    ) -> None:
        tok = support.tokenizer
        self.detok = IncrementalDetokenizer(
            lambda ids: tok.decode(list(ids), skip_special_tokens=False),
            stop=stops,
            special_ids=support.special_ids,
            prompt_ids=prompt_ids,
        )
        self.reasoning = None
        if reasoning is not None:
            self.reasoning = ReasoningParser(
                reasoning, force_reasoning, tool_format=tool_format if tools else None
            )
        self.tools = ToolCallParser(tool_format, tools) if tools and tool_format is not None else None
        self.text_out: list[str] = []
        self.reasoning_out: list[str] = []

    @property
    def stopped(self) -> str | None:
        """The stop string that ended the response, or None."""
        return self.detok.stopped

    @property
    def finished(self) -> bool:
        return self.detok.finished

    def push(self, token_ids: Sequence[int]) -> ChatDelta:
        """Feed newly sampled ids; return what became final. Stops early at a matched stop string."""
        text = []
        for token in token_ids:
            if self.detok.finished:
                break
            text.append(self.detok.push(token))
        return self._route("".join(text), final=False)

    def finish(self) -> ChatDelta:
        """The end of the response: release everything held back."""
        text = "" if self.detok.finished else self.detok.finish()
        return self._route(text, final=True)

    def _route(self, text: str, *, final: bool) -> ChatDelta:
        delta = ChatDelta()
        if self.reasoning is not None:
            r = self.reasoning.push(text) if text else None
            parts = [r] if r is not None else []
            if final:
                parts.append(self.reasoning.flush())
            delta.reasoning = "".join(p.reasoning for p in parts)
            content = "".join(p.content for p in parts)
        else:
            content = text
        if self.tools is not None:
            events = self.tools.push(content) if content else []
            if final:
                events += self.tools.flush()
            delta.content = "".join(e.text for e in events if isinstance(e, Text))
            delta.tool_events = [e for e in events if not isinstance(e, Text)]
        else:
            delta.content = content
        self.text_out.append(delta.content)
        self.reasoning_out.append(delta.reasoning)
        return delta


@dataclass
class ChatSupport:
    """What this checkpoint's chat template speaks, learned by rendering it."""

    tokenizer: Any
    reasoning_format: ReasoningFormat | None
    tool_format: ToolCallFormat | None
    grammars: GrammarCompiler  # constrained decoding and token bytes over this tokenizer
    end_of_turn: str | None = None
    turn_stops: tuple[str, ...] = ()  # end-of-turn text to stop on (multi-token markers)
    turn_stop_ids: tuple[int, ...] = ()  # end-of-turn marker that is one token: stop on the id
    effort: EffortProfile = field(default_factory=EffortProfile.inert)
    thinking: ThinkingProfile = field(default_factory=ThinkingProfile)
    anchor_token: int | None = None
    special_ids: frozenset[int] = frozenset()
    template_renders_tools: bool = False  # the template has a tool section of its own

    @classmethod
    def probe(
        cls, tokenizer, info, *, eos_ids: Sequence[int] = (), vocab_size: int | None = None
    ) -> ChatSupport:
        """Learn the template by rendering: formats, end of turn, effort and thinking, the anchor
        token, whether it renders ``tools`` itself; build the grammar compiler's tokenizer view
        (on the loading thread, so no request waits for it).

        Formats fall back to the checkpoint's identity when the template renders no markup;
        a ``moetray.json`` sidecar may name them explicitly. ``vocab_size`` is the model's
        logits width (the grammar masks cover it).
        """
        identity = " ".join(
            str(x) for x in (info.model_id, info.architecture, info.sidecar.get("family", ""))
        )
        tool_format = _probe_tool_format(tokenizer) or infer_tool_call_format(identity)
        if info.sidecar.get("tool_call_format"):
            tool_format = ToolCallFormat.parse(info.sidecar["tool_call_format"])
        reasoning = _probe_reasoning_format(tokenizer) or infer_reasoning_format(identity)
        if info.sidecar.get("reasoning_format"):
            reasoning = ReasoningFormat.parse(info.sidecar["reasoning_format"])
        render = _renderer(tokenizer)
        eos_text = tokenizer.eos_token
        end_of_turn = probe_end_of_turn(render, tokenizer.bos_token, eos=eos_text)
        anchor = None
        if tool_format is not None:
            anchor = resolve_anchor_token(
                tool_format.opener(), lambda s: tokenizer.encode(s, add_special_tokens=False)
            )
        special = set(getattr(tokenizer, "all_special_ids", []) or []) | set(eos_ids)
        stops = end_of_turn_stops(end_of_turn, eos_text)
        stop_ids: tuple[int, ...] = ()
        if stops:
            # A marker that is a single (usually special, so never shown) token ends the turn by
            # id, like EOS; only a multi-token marker is matched as text.
            ids = tokenizer.encode(stops[0], add_special_tokens=False)
            if len(ids) == 1:
                stop_ids, stops = (int(ids[0]),), ()
                special.add(stop_ids[0])  # a terminator is never shown as text
        grammars = GrammarCompiler(
            tokenizer, vocab_size=vocab_size or len(tokenizer), eos_ids=[*eos_ids, *stop_ids]
        )
        support = cls(
            tokenizer=tokenizer,
            reasoning_format=reasoning,
            tool_format=tool_format,
            end_of_turn=end_of_turn,
            turn_stops=stops,
            turn_stop_ids=stop_ids,
            effort=probe_effort(render),
            thinking=probe_thinking(render),
            anchor_token=anchor,
            special_ids=frozenset(special),
            template_renders_tools=_renders_tools(tokenizer),
            grammars=grammars,
        )
        grammars.prepare()
        log.info(
            "chat template: tools=%s reasoning=%s end_of_turn=%r effort=%s thinking=%s anchor=%s",
            tool_format,
            reasoning,
            end_of_turn,
            [e.value for e in support.effort.supported],
            support.thinking.default,
            anchor,
        )
        return support

    # -- prompts --------------------------------------------------------------------------------

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """The chat template's text for ``messages`` (raises on a template error).

        When the template has no tool section, ``tools`` reach the prompt as a tool-use
        system block in this family's format (``policy.tool_prompt``).
        """
        if tools and not self.template_renders_tools and self.tool_format is not None:
            messages, tools = with_tool_block(messages, self.tool_format, tools), None
        return self.tokenizer.apply_chat_template(
            _normalize_messages(messages),
            tools=list(tools) if tools else None,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **template_kwargs,
        )

    def template_kwargs(
        self, reasoning_effort: str | None, chat_template_kwargs: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """The chat-template variables for a request: its own kwargs, plus the effort snapped to
        what this template speaks (``policy.effort``). Raises ``EffortRefused`` for an effort
        no dialect knows."""
        return template_kwargs_for_request(
            reasoning_effort, chat_template_kwargs, self.effort, self.thinking
        ).kwargs

    def encode(self, text: str) -> list[int]:
        """Token ids of rendered text; the template already placed any BOS it wants."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def open_reasoning_end(self, prompt_text: str) -> str | None:
        """The marker that closes a reasoning block the prompt left open, or None.

        A grammar that forces the answer must let such a block finish first. Harmony
        channels are not markers: None.
        """
        fmt = self.reasoning_format
        if fmt is None or fmt.markers.end is None or not prompt_opens_reasoning(fmt, prompt_text):
            return None
        return fmt.markers.end

    def stop_strings(self, requested: Sequence[str]) -> list[str]:
        """The request's stops plus the probed end-of-turn marker (``policy.turn``; none when it is EOS)."""
        stops = [s for s in requested if s]
        stops += [s for s in self.turn_stops if s not in stops]
        return stops

    def text_stream(
        self,
        *,
        prompt_ids: Sequence[int],
        prompt_text: str | None,
        stops: Sequence[str],
        tools: Sequence[Mapping[str, Any]] | None,
        chat: bool,
    ) -> TextStream:
        reasoning = self.reasoning_format if chat else None
        force = bool(
            reasoning is not None
            and prompt_text is not None
            and prompt_opens_reasoning(reasoning, prompt_text)
        )
        return TextStream(
            self,
            prompt_ids=prompt_ids,
            stops=stops,
            reasoning=reasoning,
            force_reasoning=force,
            tools=tools if chat else None,
            tool_format=self.tool_format,
        )


def _renderer(tokenizer):
    """``render(messages, **kwargs) -> str`` over the tokenizer's chat template, for the probes."""

    def render(messages, **kwargs) -> str:
        return tokenizer.apply_chat_template(list(messages), tokenize=False, **kwargs)

    return render


def _render_safe(tokenizer, messages, **kwargs) -> str | None:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except Exception:
        return None


def _renders_tools(tokenizer) -> bool:
    """Whether the template writes the ``tools`` it is given into the prompt."""
    text = _render_safe(tokenizer, [{"role": "user", "content": "hi"}], tools=[_PROBE_TOOL])
    return text is not None and "probe_tool" in text


def _probe_tool_format(tokenizer) -> ToolCallFormat | None:
    """Which tool-call markup the template writes for an assistant tool call, if any."""
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "id": "call_0", "function": {"name": "probe_tool", "arguments": {"q": "x"}}}
        ],
    }
    text = _render_safe(tokenizer, [{"role": "user", "content": "hi"}, call], tools=[_PROBE_TOOL])
    if not text or "probe_tool" not in text:
        return None
    for fmt in ToolCallFormat:
        opener = fmt.opener()
        if opener and opener in text:
            return fmt
    return None


def _probe_reasoning_format(tokenizer) -> ReasoningFormat | None:
    """Which reasoning markup the template writes around an assistant's reasoning, if any."""
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "ANSWER", "reasoning_content": "PONDER"},
        {"role": "user", "content": "again"},
    ]
    text = _render_safe(tokenizer, messages)
    if not text or "PONDER" not in text:
        return None
    for fmt in ReasoningFormat:
        m = fmt.markers
        if m.start and m.end and m.start in text and m.end in text:
            return fmt
    return None
