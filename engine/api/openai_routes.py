"""The OpenAI-compatible routes: ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``.

Routes stay thin: validate (``schemas`` first, then ``controls``: model, content, tools,
output format, sampling; then the context ceiling), admit every choice through the gate,
stream the engine's steps through ``runs``. Every refusal happens before the engine
changes: a malformed body, an unknown model, a prompt over the context, a closed gate.
Errors use OpenAI's shape via ``policy.wire.error_body``. ``/v1/responses`` lives in
``responses_routes`` and starts its runs with :func:`start_chat`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from moetray.engine.api import controls
from moetray.engine.api.errors import ApiError
from moetray.engine.api.prompts import chat_prompt, text_prompt
from moetray.engine.api.runs import (
    ChoiceRun,
    TokenBytes,
    chat_logprobs,
    completion_logprobs,
    run_choices,
    usage,
)
from moetray.engine.api.schemas import ChatRequest, CompletionRequest
from moetray.engine.cb import Sampling
from moetray.engine.core import Engine, RequestRecord

# --- shared pieces ----------------------------------------------------------------------------


def _one_prompt(prompt: str | list[int] | list[str]) -> str | list[int]:
    """A completion's one prompt: its text or its token ids (a list of texts must hold one).

    The schema keeps a list all ids or all texts, so the filters below only tell them apart.
    """
    if isinstance(prompt, str):
        return prompt
    texts = [p for p in prompt if isinstance(p, str)]
    if texts:
        if len(prompt) != 1:
            raise ApiError("invalid_request_error", "one prompt per request", param="prompt")
        return texts[0]
    return [p for p in prompt if isinstance(p, int)]


def _stops(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > 16:
        raise ApiError("invalid_request_error", "at most 16 stop strings are supported", param="stop")
    if any(s == "" for s in stops):
        raise ApiError("invalid_request_error", "stop strings must not be empty", param="stop")
    return stops


def _sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


async def _watch_disconnect(request: Request, engine: Engine, records: Sequence[RequestRecord]) -> None:
    """Cancel a non-streaming request's choices when its client went away."""
    while True:
        await asyncio.sleep(0.2)
        if await request.is_disconnected():
            for record in records:
                engine.cancel(record.id, by="client")
            return


def _abandon_all(engine: Engine, records: Sequence[RequestRecord]) -> BackgroundTask:
    def abandon() -> None:
        for record in records:
            engine.abandon(record.id)

    return BackgroundTask(abandon)


def admit_choices(
    engine: Engine, prompt_ids: list[int], *, n: int, max_new_tokens: int, sampling: Sampling
) -> list[RequestRecord]:
    """Admit ``n`` choices of one prompt, all or none (a refusal releases the ones admitted)."""
    records: list[RequestRecord] = []
    try:
        for i in range(n):
            choice = controls.for_choice(sampling, i)
            records.append(engine.admit(prompt_ids, max_new_tokens=max_new_tokens, sampling=choice))
    except BaseException:
        for record in records:
            engine.abandon(record.id)
        raise
    return records


@dataclass
class ChatStart:
    """A chat request admitted: its choices, ready to run."""

    runs: list[ChoiceRun]
    records: list[RequestRecord]
    token_bytes: TokenBytes  # GrammarCompiler.token_bytes


async def start_chat(
    engine: Engine,
    *,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    tool_choice: Any,
    parallel_tool_calls: bool,
    response_format: dict[str, Any] | None,
    body: Any,
    max_tokens: int | None,
    stops: list[str],
    n: int = 1,
    logprobs: int | None = None,
    stream: bool,
    template_kwargs: dict[str, Any] | None = None,
) -> ChatStart:
    """Validate, render, constrain and admit a chat request (shared by chat and responses)."""
    chat = engine.chat_support()
    controls.check_model(engine, body.model)
    controls.check_content(messages)
    plan = controls.plan_output(
        chat,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel_tool_calls,
        response_format=response_format,
    )
    prompt_text, prompt_ids = await chat_prompt(
        engine, chat, messages, plan.prompt_tools, template_kwargs or {}
    )
    max_new = engine.fit_max_tokens(len(prompt_ids), max_tokens)
    stops = stops if getattr(body, "ignore_eos", False) else chat.stop_strings(stops)
    grammar = await controls.compile_plan(chat, plan, prompt_text)
    sampling = controls.sampling_for(engine, body, logprobs=logprobs, grammar=grammar)
    records = admit_choices(engine, prompt_ids, n=n, max_new_tokens=max_new, sampling=sampling)
    runs = [
        ChoiceRun(
            engine,
            record,
            chat.text_stream(
                prompt_ids=prompt_ids,
                prompt_text=prompt_text,
                stops=stops,
                tools=plan.parser_tools,
                chat=True,
            ),
            index=i,
            every_step=stream or bool(stops) or n > 1,
        )
        for i, record in enumerate(records)
    ]
    return ChatStart(runs, records, chat.grammars.token_bytes)


def _head(response_id: str, engine: Engine) -> dict[str, Any]:
    return {"id": response_id, "created": int(time.time()), "model": engine.model_id()}


def _model_card(engine: Engine) -> dict[str, Any] | None:
    info = engine.model_info()
    if info is None:
        return None
    return {
        "id": info["id"],
        "object": "model",
        "created": int(engine.started_unix),
        "owned_by": "moetray",
        "label": info["label"],
        "context_length": info["context_length"],
        "architecture": info["architecture"],
        "aliases": controls.served_names(engine)[1:],
    }


# --- routes -----------------------------------------------------------------------------------


def build_router(engine: Engine) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        card = _model_card(engine)
        return {"object": "list", "data": [card] if card is not None else []}

    @router.get("/v1/models/{model:path}")
    async def get_model(model: str) -> dict[str, Any]:
        card = _model_card(engine)
        if card is None:
            engine.chat_support()  # no model served yet: refuses with the gate's state
            card = _model_card(engine)  # the load ended in between (a served model stays served)
            assert card is not None
        controls.check_model(engine, model)
        return card

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        await engine.gate.hold()  # a re-split under way: wait for it, not a refusal
        chat = engine.chat_support()
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(
                "invalid_request_error", "top_logprobs needs logprobs: true", param="top_logprobs"
            )
        start = await start_chat(
            engine,
            messages=[m.model_dump(exclude_none=True) for m in body.messages],
            tools=[t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None,
            tool_choice=body.tool_choice,
            parallel_tool_calls=body.parallel_tool_calls,
            response_format=body.response_format,
            body=body,
            max_tokens=body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens,
            stops=_stops(body.stop),
            n=body.n,
            logprobs=(body.top_logprobs or 0) if body.logprobs else None,
            stream=body.stream,
            template_kwargs=chat.template_kwargs(body.reasoning_effort, body.chat_template_kwargs),
        )
        head = _head(f"chatcmpl-{start.records[0].id}", engine)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                _chat_sse(start, head, include_usage, body.logprobs),
                media_type="text/event-stream",
                background=_abandon_all(engine, start.records),
            )
        return JSONResponse(await _chat_whole(start, request, head, body.logprobs))

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        await engine.gate.hold()
        chat = engine.chat_support()
        controls.check_model(engine, body.model)
        if body.echo:
            raise ApiError("invalid_request_error", "echo is not supported", param="echo")
        prompt = _one_prompt(body.prompt)
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
        sampling = controls.sampling_for(engine, body, logprobs=body.logprobs)
        stops = _stops(body.stop)
        records = admit_choices(engine, prompt_ids, n=body.n, max_new_tokens=max_new, sampling=sampling)
        runs = [
            ChoiceRun(
                engine,
                record,
                chat.text_stream(
                    prompt_ids=prompt_ids, prompt_text=None, stops=stops, tools=None, chat=False
                ),
                index=i,
                every_step=body.stream or bool(stops) or body.n > 1,
            )
            for i, record in enumerate(records)
        ]
        start = ChatStart(runs, records, chat.grammars.token_bytes)
        head = _head(f"cmpl-{records[0].id}", engine)
        logprobs = body.logprobs is not None
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                _completion_sse(start, head, include_usage, logprobs),
                media_type="text/event-stream",
                background=_abandon_all(engine, records),
            )
        watcher = asyncio.create_task(_watch_disconnect(request, engine, records))
        try:
            async for _ in run_choices(runs):
                pass
        finally:
            watcher.cancel()
        choices = []
        for run in runs:
            choices.append(
                {
                    "index": run.index,
                    "text": "".join(run.content),
                    "logprobs": completion_logprobs(run.logprobs, start.token_bytes, offset=0)
                    if logprobs
                    else None,
                    **run.finish(),
                }
            )
        return JSONResponse(
            {"object": "text_completion", **head, "choices": choices, "usage": usage(records)}
        )

    return router


async def _chat_whole(
    start: ChatStart, request: Request, head: dict[str, Any], logprobs: bool
) -> dict[str, Any]:
    runs = start.runs
    watcher = asyncio.create_task(_watch_disconnect(request, runs[0].engine, start.records))
    events: dict[int, list] = {run.index: [] for run in runs}
    try:
        async for piece in run_choices(runs):
            events[piece.index].extend(piece.delta.tool_events)
    finally:
        watcher.cancel()
    choices = []
    for run in runs:
        run.tool_call_deltas(events[run.index])
        message: dict[str, Any] = {"role": "assistant", "content": "".join(run.content)}
        if any(run.reasoning):
            message["reasoning_content"] = "".join(run.reasoning)
        if run.calls:
            message["tool_calls"] = run.tool_calls()
            if not message["content"]:
                message["content"] = None
        choices.append(
            {
                "index": run.index,
                "message": message,
                "logprobs": chat_logprobs(run.logprobs, start.token_bytes) if logprobs else None,
                **run.finish(),
            }
        )
    return {"object": "chat.completion", **head, "choices": choices, "usage": usage(start.records)}


async def _chat_sse(start: ChatStart, head: dict[str, Any], include_usage: bool, logprobs: bool):
    def chunk(index: int, delta: dict[str, Any], lp=None, finish: dict[str, Any] | None = None) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": None, **(finish or {})}
        return _sse({"object": "chat.completion.chunk", **head, "choices": [choice]})

    runs = {run.index: run for run in start.runs}
    for run in start.runs:
        yield chunk(run.index, {"role": "assistant", "content": ""})
    async for piece in run_choices(start.runs):
        run, delta = runs[piece.index], piece.delta
        lp = chat_logprobs(piece.logprobs, start.token_bytes) if logprobs and piece.logprobs else None
        out: list[dict[str, Any]] = []
        if delta.reasoning:
            out.append({"reasoning_content": delta.reasoning})
        if delta.content:
            out.append({"content": delta.content})
        calls = run.tool_call_deltas(delta.tool_events)
        if calls:
            out.append({"tool_calls": calls})
        for j, d in enumerate(out):
            yield chunk(piece.index, d, lp if j == 0 else None)
        if piece.finished:
            yield chunk(piece.index, {}, None if out else lp, run.finish())
    if include_usage:
        yield _sse({"object": "chat.completion.chunk", **head, "choices": [], "usage": usage(start.records)})
    yield _sse("[DONE]")


async def _completion_sse(start: ChatStart, head: dict[str, Any], include_usage: bool, logprobs: bool):
    offsets = {run.index: 0 for run in start.runs}

    def chunk(index: int, text: str, entries, finish: dict[str, Any] | None = None) -> bytes:
        lp = None
        if logprobs and entries:
            lp = completion_logprobs(entries, start.token_bytes, offset=offsets[index])
        offsets[index] += len(text)
        choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": None, **(finish or {})}
        return _sse({"object": "text_completion", **head, "choices": [choice]})

    runs = {run.index: run for run in start.runs}
    async for piece in run_choices(start.runs):
        if piece.delta.content:
            yield chunk(piece.index, piece.delta.content, piece.logprobs)
        if piece.finished:
            rest = [] if piece.delta.content else piece.logprobs
            yield chunk(piece.index, "", rest, runs[piece.index].finish())
    if include_usage:
        yield _sse({"object": "text_completion", **head, "choices": [], "usage": usage(start.records)})
    yield _sse("[DONE]")


