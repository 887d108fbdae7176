"""One generation request's choices as they run: text, tool calls, log-probabilities, ``n``.

A :class:`ChoiceRun` feeds one admitted request's steps through its ``TextStream`` and
keeps the tool calls and log-probabilities that go with them; :func:`run_choices` runs the
``n`` choices of one request, the first alone until its prefill is done so the others find
the prompt in the prefix cache (one prefill, not ``n``), and interleaves their output.
The OpenAI wire shapes of log-probabilities and finish reasons are written here, once, for
every route.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from moetray.engine.cb import TokenLogprob
from moetray.engine.chat import ChatDelta, TextStream
from moetray.engine.core import Engine, RequestRecord
from moetray.policy.parser import CallArguments, CallEnd, CallStart

OPENAI_FINISH_REASONS = ("stop", "length", "tool_calls", "content_filter")
"""The only ``finish_reason`` values clients accept; an admin Stop is ``stop`` plus ``stop_reason``."""


@dataclass
class Piece:
    """What one choice made final in one step: text and events, and the log-probabilities of
    the tokens behind it (held back with the text when the text is held back)."""

    index: int
    delta: ChatDelta
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: bool = False


class ChoiceRun:
    """One admitted request (one choice): feeds the engine's steps through its ``TextStream``.

    ``every_step`` says whether the reply needs the engine's steps as they happen: a
    streamed reply does, and so does one with a stop string (a match ends generation at
    that step) or one whose prefill the other choices wait for. Otherwise the engine hands
    over the whole reply once (``Engine.stream``'s ``every_step=False``).
    """

    def __init__(
        self, engine: Engine, record: RequestRecord, text: TextStream, *, index: int, every_step: bool
    ) -> None:
        self.engine = engine
        self.record = record
        self.text = text
        self.index = index
        self.every_step = every_step
        self.finish_reason: str | None = None
        self.cancelled = False
        self.calls: dict[int, dict[str, Any]] = {}
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        self.started = asyncio.Event()  # the prefill is over (first step) or the request ended

    async def pieces(self) -> AsyncGenerator[Piece, None]:
        held: list[TokenLogprob] = []
        stream = self.engine.stream(self.record, every_step=self.every_step)
        try:
            async with contextlib.aclosing(stream) as steps:
                async for step in steps:
                    self.started.set()
                    held += step.logprobs or []
                    delta = self.text.push(step.tokens)
                    ended = self.text.stopped is not None or step.finished
                    if ended:
                        self.finish_reason = "stop" if self.text.stopped is not None else step.finish_reason
                        delta = _merge(delta, self.text.finish())
                    if delta or ended:
                        yield self._piece(delta, held, ended)
                        held = []
                    if ended:
                        return  # closing the step stream cancels the request and frees its pages
        finally:
            self.started.set()

    def _piece(self, delta: ChatDelta, held: list[TokenLogprob], finished: bool) -> Piece:
        self.content.append(delta.content)
        self.reasoning.append(delta.reasoning)
        self.logprobs += held
        return Piece(self.index, delta, list(held), finished)

    def tool_call_deltas(self, events) -> list[dict[str, Any]]:
        """OpenAI ``delta.tool_calls`` entries for parser events (arguments streamed prefix-stably)."""
        out = []
        for ev in events:
            if isinstance(ev, CallStart):
                call = {"id": f"call_{uuid.uuid4().hex[:24]}", "name": ev.name, "arguments": ""}
                self.calls[ev.index] = call
                out.append(
                    {
                        "index": ev.index,
                        "id": call["id"],
                        "type": "function",
                        "function": {"name": ev.name, "arguments": ""},
                    }
                )
            elif isinstance(ev, CallArguments):
                self.calls[ev.index]["arguments"] += ev.fragment
                out.append({"index": ev.index, "function": {"arguments": ev.fragment}})
            elif isinstance(ev, CallEnd):
                call = self.calls[ev.index]
                rest = (
                    ev.arguments[len(call["arguments"]) :]
                    if ev.arguments.startswith(call["arguments"])
                    else None
                )
                if rest is None:  # not prefix-stable: the parser's final word wins
                    call["arguments"] = ev.arguments
                elif rest:
                    call["arguments"] = ev.arguments
                    out.append({"index": ev.index, "function": {"arguments": rest}})
        return out

    def tool_calls(self) -> list[dict[str, Any]]:
        """The finished calls in OpenAI's ``message.tool_calls`` shape."""
        return [
            {
                "id": c["id"],
                "type": "function",
                "function": {"name": c["name"], "arguments": c["arguments"] or "{}"},
            }
            for _, c in sorted(self.calls.items())
        ]

    def finish(self) -> dict[str, Any]:
        """``finish_reason`` (OpenAI's values only) and, after an admin Stop, ``stop_reason``."""
        reason = self.finish_reason
        if reason == "cancelled":
            return {"finish_reason": "stop", "stop_reason": "cancelled"}
        if self.calls and reason in ("stop", None):
            return {"finish_reason": "tool_calls"}
        return {"finish_reason": reason or "stop"}


def _merge(a: ChatDelta, b: ChatDelta) -> ChatDelta:
    return ChatDelta(a.reasoning + b.reasoning, a.content + b.content, a.tool_events + b.tool_events)


async def run_choices(runs: Sequence[ChoiceRun]) -> AsyncGenerator[Piece, None]:
    """Every piece of every choice, interleaved as they come; the first choice prefills alone.

    Choices after the first start once the first one's prefill is done, so the prompt's
    pages are in the prefix cache for them. Leaving the iteration early cancels every
    choice still running.
    """
    if len(runs) == 1:
        async with contextlib.aclosing(runs[0].pieces()) as pieces:
            async for piece in pieces:
                yield piece
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def produce(run: ChoiceRun) -> None:
        try:
            if run is not runs[0]:
                await runs[0].started.wait()
            async with contextlib.aclosing(run.pieces()) as pieces:
                async for piece in pieces:
                    queue.put_nowait(piece)
        except Exception as exc:  # handed to the consumer, which raises it
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.create_task(produce(run)) for run in runs]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# --- log-probabilities on the wire ----------------------------------------------------------------

TokenBytes = Callable[[Sequence[int]], list[bytes]]


def chat_logprobs(entries: Sequence[TokenLogprob], token_bytes: TokenBytes) -> dict[str, Any]:
    """OpenAI chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}], "refusal": null}``."""
    ids = sorted({e.token for e in entries} | {t for e in entries for t, _ in e.top})
    raw = dict(zip(ids, token_bytes(ids), strict=True))

    def item(token: int, logprob: float) -> dict[str, Any]:
        data = raw[token]
        return {"token": data.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(data)}

    return {
        "content": [
            {**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries
        ],
        "refusal": None,
    }


def completion_logprobs(
    entries: Sequence[TokenLogprob], token_bytes: TokenBytes, *, offset: int
) -> dict[str, Any]:
    """OpenAI completions ``logprobs``: ``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``.

    ``offset`` is the text length before the first of these tokens (a stream's later chunks
    continue the count).
    """
    ids = sorted({e.token for e in entries} | {t for e in entries for t, _ in e.top})
    text = {t: b.decode("utf-8", errors="replace") for t, b in zip(ids, token_bytes(ids), strict=True)}
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(text[e.token])
    return {
        "tokens": [text[e.token] for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{text[t]: lp for t, lp in e.top} for e in entries],
        "text_offset": offsets,
    }


def usage(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """OpenAI ``usage`` for one request's choices: the prompt once, every choice's completion."""
    first = records[0]
    completion = sum(r.generated for r in records)
    return {
        "prompt_tokens": first.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": first.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": first.cached_tokens},
    }
