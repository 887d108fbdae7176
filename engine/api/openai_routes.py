"""The OpenAI-compatible routes: ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``.

Routes stay thin: validate (pydantic models first, then the context ceiling), admit through
the gate, stream the engine's steps through a ``TextStream``. Every refusal happens before
the engine changes: a malformed body, a prompt over the context, a closed gate. Errors use
OpenAI's shape via ``policy.wire.error_body``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr
from starlette.background import BackgroundTask

from moetray.engine.api.errors import ApiError
from moetray.engine.api.fields import whole_int
from moetray.engine.api.prompts import chat_prompt, text_prompt
from moetray.engine.budget import MAX_TOKENS_CEILING
from moetray.engine.cb import Sampling
from moetray.engine.chat import ChatDelta, TextStream
from moetray.engine.core import Engine, RequestRecord
from moetray.policy.parser import CallArguments, CallEnd, CallStart

# --- request models ---------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: StrictBool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[dict[str, Any]] | None = None
    name: StrictStr | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: StrictStr | None = None
    reasoning_content: StrictStr | None = None


class ToolFunction(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    function: ToolFunction


class SamplingFields(BaseModel):
    """Fields shared by both generation routes (unknown extra fields are accepted and ignored)."""

    model_config = ConfigDict(extra="allow")
    model: StrictStr | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    max_tokens: whole_int(1, MAX_TOKENS_CEILING) | None = None
    temperature: StrictFloat | None = Field(default=None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: StrictFloat | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: whole_int(-(1 << 63), (1 << 63) - 1) | None = None
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt = Field(default=1, ge=1, le=1)
    # vLLM's extension: generate exactly max_tokens, past EOS and the end-of-turn marker.
    ignore_eos: StrictBool = False
    # Test hook (honoured only when the engine runs with --test-hooks): the real engine
    # emits exactly these ids, or the encoding of this text, then EOS.
    moetray_test_forced_tokens: list[StrictInt] | None = None
    moetray_test_forced_text: StrictStr | None = None


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: whole_int(1, MAX_TOKENS_CEILING) | None = None
    tools: list[Tool] | None = None
    tool_choice: Any = None
    reasoning_effort: StrictStr | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] = ""
    echo: StrictBool = False


# --- shared pieces ----------------------------------------------------------------------------


def _stops(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > 16:
        raise ApiError("invalid_request_error", "at most 16 stop strings are supported", param="stop")
    if any(s == "" for s in stops):
        raise ApiError("invalid_request_error", "stop strings must not be empty", param="stop")
    return stops


def _sampling(engine: Engine, body: SamplingFields) -> Sampling:
    forced = None
    if body.moetray_test_forced_tokens is not None or body.moetray_test_forced_text is not None:
        if not engine.options.test_hooks:
            raise ApiError(
                "invalid_request_error",
                "test hooks are disabled on this engine",
                param="moetray_test_forced_tokens",
            )
        if body.moetray_test_forced_tokens is not None:
            forced = tuple(body.moetray_test_forced_tokens)
        else:
            forced = tuple(engine.chat_support().encode(body.moetray_test_forced_text))
    return Sampling(
        temperature=1.0 if body.temperature is None else float(body.temperature),
        top_p=1.0 if body.top_p is None else float(body.top_p),
        seed=body.seed,
        forced_tokens=forced,
        ignore_eos=body.ignore_eos,
    )


def _usage(record: RequestRecord) -> dict[str, Any]:
    return {
        "prompt_tokens": record.prompt_tokens,
        "completion_tokens": record.generated,
        "total_tokens": record.prompt_tokens + record.generated,
        "prompt_tokens_details": {"cached_tokens": record.cached_tokens},
    }


def _sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


async def _watch_disconnect(request: Request, engine: Engine, request_id: str) -> None:
    """Cancel a non-streaming request whose client went away."""
    while True:
        await asyncio.sleep(0.2)
        if await request.is_disconnected():
            engine.cancel(request_id)
            return


class _Run:
    """One admitted request: feeds the engine's steps through its ``TextStream``.

    ``every_step`` says whether the reply needs the engine's steps as they happen: a
    streamed reply does, and so does one with a stop string (a match ends generation at
    that step). Otherwise the engine hands over the whole reply once (``Engine.stream``'s
    ``every_step=False``) and the text pipeline reads every token in one push.
    """

    def __init__(self, engine: Engine, record: RequestRecord, text: TextStream, *, every_step: bool) -> None:
        self.engine = engine
        self.record = record
        self.text = text
        self.every_step = every_step
        self.finish_reason: str | None = None
        self.calls: dict[int, dict[str, Any]] = {}

    async def deltas(self) -> AsyncIterator[ChatDelta]:
        stream = self.engine.stream(self.record, every_step=self.every_step)
        async with contextlib.aclosing(stream) as steps:
            async for step in steps:
                delta = self.text.push(step.tokens)
                if self.text.stopped is not None:
                    self.finish_reason = "stop"
                    yield self._merge(delta, self.text.finish())
                    return  # closing the step stream cancels the request and frees its pages
                if step.finished:
                    self.finish_reason = step.finish_reason
                    yield self._merge(delta, self.text.finish())
                    return
                if delta:
                    yield delta

    @staticmethod
    def _merge(a: ChatDelta, b: ChatDelta) -> ChatDelta:
        return ChatDelta(a.reasoning + b.reasoning, a.content + b.content, a.tool_events + b.tool_events)

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

    def final_reason(self) -> str:
        if self.calls and self.finish_reason in ("stop", None):
            return "tool_calls"
        return self.finish_reason or "stop"


# --- routes -----------------------------------------------------------------------------------


def build_router(engine: Engine) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        info = engine.model_info()
        data = []
        if info is not None:
            data.append(
                {
                    "id": info["id"],
                    "object": "model",
                    "created": int(engine.started_unix),
                    "owned_by": "moetray",
                    "label": info["label"],
                    "context_length": info["context_length"],
                    "architecture": info["architecture"],
                }
            )
        return {"object": "list", "data": data}

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        chat = engine.chat_support()
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        template_kwargs = chat.template_kwargs(body.reasoning_effort, body.chat_template_kwargs)
        prompt_text, prompt_ids = await chat_prompt(engine, chat, messages, tools, template_kwargs)
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_new = engine.fit_max_tokens(len(prompt_ids), requested)
        stops = _stops(body.stop) if body.ignore_eos else chat.stop_strings(_stops(body.stop))
        sampling = _sampling(engine, body)
        record = engine.admit(prompt_ids, max_new_tokens=max_new, sampling=sampling)
        text = chat.text_stream(
            prompt_ids=prompt_ids, prompt_text=prompt_text, stops=stops, tools=tools, chat=True
        )
        run = _Run(engine, record, text, every_step=body.stream or bool(stops))
        model = engine.model_id()
        created = int(time.time())
        cid = f"chatcmpl-{record.id}"
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                _chat_sse(run, cid, created, model, include_usage),
                media_type="text/event-stream",
                background=BackgroundTask(engine.abandon, record.id),
            )
        return JSONResponse(await _chat_whole(run, request, cid, created, model))

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        chat = engine.chat_support()
        if body.echo:
            raise ApiError("invalid_request_error", "echo is not supported", param="echo")
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ApiError("invalid_request_error", "one prompt per request", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt_ids = await text_prompt(engine, chat, prompt)
        else:
            vocab = len(chat.tokenizer)
            if any(t < 0 or t >= vocab for t in prompt):
                raise ApiError(
                    "invalid_request_error", f"prompt token ids must lie in [0, {vocab})", param="prompt"
                )
            prompt_ids = list(prompt)
        if not prompt_ids:
            raise ApiError("invalid_request_error", "the prompt is empty", param="prompt")
        max_new = engine.fit_max_tokens(
            len(prompt_ids), body.max_tokens if body.max_tokens is not None else 16
        )
        sampling = _sampling(engine, body)
        stops = _stops(body.stop)
        record = engine.admit(prompt_ids, max_new_tokens=max_new, sampling=sampling)
        text = chat.text_stream(prompt_ids=prompt_ids, prompt_text=None, stops=stops, tools=None, chat=False)
        run = _Run(engine, record, text, every_step=body.stream or bool(stops))
        cid = f"cmpl-{record.id}"
        created = int(time.time())
        model = engine.model_id()
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                _completion_sse(run, cid, created, model, include_usage),
                media_type="text/event-stream",
                background=BackgroundTask(engine.abandon, record.id),
            )
        watcher = asyncio.create_task(_watch_disconnect(request, engine, record.id))
        try:
            pieces = [d.content async for d in run.deltas()]
        finally:
            watcher.cancel()
        return JSONResponse(
            {
                "id": cid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "text": "".join(pieces),
                        "finish_reason": run.final_reason(),
                        "logprobs": None,
                    }
                ],
                "usage": _usage(record),
            }
        )

    return router


async def _chat_whole(
    run: _Run, request: Request, cid: str, created: int, model: str | None
) -> dict[str, Any]:
    watcher = asyncio.create_task(_watch_disconnect(request, run.engine, run.record.id))
    content, reasoning, events = [], [], []
    try:
        async for delta in run.deltas():
            content.append(delta.content)
            reasoning.append(delta.reasoning)
            events.extend(delta.tool_events)
    finally:
        watcher.cancel()
    run.tool_call_deltas(events)
    message: dict[str, Any] = {"role": "assistant", "content": "".join(content)}
    if any(reasoning):
        message["reasoning_content"] = "".join(reasoning)
    if run.calls:
        message["tool_calls"] = [
            {
                "id": c["id"],
                "type": "function",
                "function": {"name": c["name"], "arguments": c["arguments"] or "{}"},
            }
            for _, c in sorted(run.calls.items())
        ]
        if not message["content"]:
            message["content"] = None
    return {
        "id": cid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": run.final_reason(), "logprobs": None}],
        "usage": _usage(run.record),
    }


async def _chat_sse(run: _Run, cid: str, created: int, model: str | None, include_usage: bool):
    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        return _sse(
            {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
            }
        )

    yield chunk({"role": "assistant", "content": ""})
    async for delta in run.deltas():
        if delta.reasoning:
            yield chunk({"reasoning_content": delta.reasoning})
        if delta.content:
            yield chunk({"content": delta.content})
        calls = run.tool_call_deltas(delta.tool_events)
        if calls:
            yield chunk({"tool_calls": calls})
    yield chunk({}, run.final_reason())
    if include_usage:
        yield _sse(
            {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [],
                "usage": _usage(run.record),
            }
        )
    yield _sse("[DONE]")


async def _completion_sse(run: _Run, cid: str, created: int, model: str | None, include_usage: bool):
    def chunk(text: str, finish: str | None = None) -> bytes:
        return _sse(
            {
                "id": cid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}],
            }
        )

    async for delta in run.deltas():
        if delta.content:
            yield chunk(delta.content)
    yield chunk("", run.final_reason())
    if include_usage:
        yield _sse(
            {
                "id": cid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [],
                "usage": _usage(run.record),
            }
        )
    yield _sse("[DONE]")
