"""``POST /v1/responses``: OpenAI's Responses API (what Codex CLI and OpenAI's agents SDK speak).

The request is translated into a chat request (``input`` items → messages, flat function
tools → chat tools, ``text.format`` → ``response_format``) and runs through the same path as
``/v1/chat/completions`` (:func:`openai_routes.start_chat`). The reply is a ``response``
object whose ``output`` holds ``reasoning``, ``message`` and ``function_call`` items; a
streamed reply is OpenAI's event sequence (``response.created`` … ``response.completed``),
each event with its ``type`` and ``sequence_number``. Responses are not stored: ``store``
is reported false and ``previous_response_id`` is refused by name.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Mapping
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from moetray.engine.api.errors import ApiError
from moetray.engine.api.openai_routes import ChatStart, _abandon_all, _watch_disconnect, start_chat
from moetray.engine.api.runs import ChoiceRun, run_choices
from moetray.engine.api.schemas import ResponsesRequest
from moetray.engine.core import Engine
from moetray.policy.parser import CallArguments, CallEnd, CallStart


def _text(content: Any) -> Any:
    """A Responses content value as chat content (parts keep their type so images are refused)."""
    if isinstance(content, list):
        return [
            dict(p, type="text") if p.get("type") in ("input_text", "output_text") else p for p in content
        ]
    return content


def chat_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """``instructions`` and ``input`` as chat messages (consecutive function calls share one turn)."""
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
        return messages
    for i, item in enumerate(body.input):
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item.get("role", "user"), "content": _text(item.get("content"))})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id") or item.get("id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "")},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": item.get("call_id"),
                    "content": output if isinstance(output, str) else json.dumps(output),
                }
            )
        elif kind == "reasoning":
            continue
        else:
            raise ApiError(
                "unsupported_content",
                f"input[{i}] is of type {kind!r}, which this engine cannot read",
                param=f"input[{i}]",
            )
    return messages


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Flat Responses function tools as chat tools; other tool types are refused by name."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            raise ApiError(
                "unsupported_parameter",
                f"tools[{i}] is of type {tool.get('type')!r}; this engine runs function tools only",
                param=f"tools[{i}]",
            )
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, Mapping) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def chat_response_format(text: Mapping[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if not isinstance(fmt, Mapping):
        return None
    if fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    return dict(fmt)


class _Output:
    """The response's ``output`` items as they form, and the stream events that build them."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item receiving deltas
        self.calls: dict[int, dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []

    def _emit(self, kind: str, **fields: Any) -> None:
        self.events.append({"type": kind, **fields})

    def _start(self, item: dict[str, Any]) -> dict[str, Any]:
        self._close()
        self.items.append(item)
        self.open = item
        self._emit("response.output_item.added", output_index=len(self.items) - 1, item=_snapshot(item))
        if item["type"] in ("message", "reasoning"):
            part = (
                {"type": "output_text", "text": "", "annotations": []}
                if item["type"] == "message"
                else {"type": "reasoning_text", "text": ""}
            )
            item["content"].append(part)
            self._emit(
                "response.content_part.added",
                item_id=item["id"],
                output_index=len(self.items) - 1,
                content_index=0,
                part=dict(part),
            )
        return item

    def _close(self) -> None:
        item, self.open = self.open, None
        if item is None:
            return
        index = self.items.index(item)
        item["status"] = "completed"
        if item["type"] in ("message", "reasoning"):
            part = item["content"][0]
            done = (
                "response.output_text.done" if item["type"] == "message" else "response.reasoning_text.done"
            )
            self._emit(done, item_id=item["id"], output_index=index, content_index=0, text=part["text"])
            self._emit(
                "response.content_part.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=dict(part),
            )
        self._emit("response.output_item.done", output_index=index, item=_snapshot(item))

    def _text(self, kind: str, text: str) -> None:
        if not text:
            return
        item = self.open
        if item is None or item["type"] != kind:
            prefix = "msg" if kind == "message" else "rs"
            item = {
                "type": kind,
                "id": f"{prefix}_{uuid.uuid4().hex[:24]}",
                "status": "in_progress",
                "content": [],
            }
            if kind == "message":
                item["role"] = "assistant"
            else:
                item["summary"] = []
            self._start(item)
        item["content"][0]["text"] += text
        delta = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        self._emit(
            delta, item_id=item["id"], output_index=len(self.items) - 1, content_index=0, delta=text
        )

    def feed(self, delta) -> None:
        self._text("reasoning", delta.reasoning)
        self._text("message", delta.content)
        for ev in delta.tool_events:
            if isinstance(ev, CallStart):
                item = self._start(
                    {
                        "type": "function_call",
                        "id": f"fc_{uuid.uuid4().hex[:24]}",
                        "call_id": f"call_{uuid.uuid4().hex[:24]}",
                        "name": ev.name,
                        "arguments": "",
                        "status": "in_progress",
                    }
                )
                self.calls[ev.index] = item
            elif isinstance(ev, CallArguments | CallEnd):
                item = self.calls[ev.index]
                index = self.items.index(item)
                if isinstance(ev, CallArguments):
                    item["arguments"] += ev.fragment
                    self._emit(
                        "response.function_call_arguments.delta",
                        item_id=item["id"],
                        output_index=index,
                        delta=ev.fragment,
                    )
                    continue
                rest = (
                    ev.arguments[len(item["arguments"]) :]
                    if ev.arguments.startswith(item["arguments"])
                    else ""
                )
                if rest:
                    self._emit(
                        "response.function_call_arguments.delta",
                        item_id=item["id"],
                        output_index=index,
                        delta=rest,
                    )
                item["arguments"] = ev.arguments or "{}"
                self._emit(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    arguments=item["arguments"],
                )
                self._close()

    def finish(self) -> None:
        self._close()


def _snapshot(item: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(item))


def _response(
    body: ResponsesRequest,
    rid: str,
    created: int,
    model: str | None,
    status: str,
    output: _Output | None,
    start: ChatStart | None,
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "model": model,
        "output": _snapshot({"o": output.items})["o"] if output else [],
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tools": body.tools or [],
        "tool_choice": body.tool_choice or "auto",
        "parallel_tool_calls": body.parallel_tool_calls,
        "text": body.text or {"format": {"type": "text"}},
        "previous_response_id": None,
        "reasoning": body.reasoning,
        "store": False,
        "error": None,
        "incomplete_details": None,
        "metadata": {},
        "usage": None,
    }
    if start is not None and status != "in_progress":
        record = start.records[0]
        out["usage"] = {
            "input_tokens": record.prompt_tokens,
            "input_tokens_details": {"cached_tokens": record.cached_tokens},
            "output_tokens": record.generated,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": record.prompt_tokens + record.generated,
        }
    if status == "incomplete":
        out["incomplete_details"] = {"reason": "max_output_tokens"}
    return out


def _status(run: ChoiceRun) -> str:
    return "incomplete" if run.finish()["finish_reason"] == "length" else "completed"


def build_router(engine: Engine) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        chat = engine.chat_support()
        if body.previous_response_id is not None:
            raise ApiError(
                "unsupported_parameter",
                "this engine keeps no responses: send the whole conversation as input instead",
                param="previous_response_id",
            )
        effort = (body.reasoning or {}).get("effort")
        start = await start_chat(
            engine,
            messages=chat_messages(body),
            tools=chat_tools(body.tools),
            tool_choice=chat_tool_choice(body.tool_choice),
            parallel_tool_calls=body.parallel_tool_calls,
            response_format=chat_response_format(body.text),
            body=body,
            max_tokens=body.max_output_tokens,
            stops=[],
            stream=body.stream,
            template_kwargs=chat.template_kwargs(effort),
        )
        rid, created, model = f"resp_{start.records[0].id}", int(time.time()), engine.model_id()
        run = start.runs[0]
        output = _Output()
        if not body.stream:
            watcher = asyncio.create_task(_watch_disconnect(request, engine, start.records))
            try:
                async for piece in run_choices(start.runs):
                    output.feed(piece.delta)
            finally:
                watcher.cancel()
            output.finish()
            return JSONResponse(_response(body, rid, created, model, _status(run), output, start))
        return StreamingResponse(
            _events(body, rid, created, model, start, output),
            media_type="text/event-stream",
            background=_abandon_all(engine, start.records),
        )

    return router


async def _events(body, rid, created, model, start: ChatStart, output: _Output):
    sequence = 0

    def event(payload: dict[str, Any]) -> bytes:
        nonlocal sequence
        payload = {"type": payload["type"], "sequence_number": sequence, **payload}
        sequence += 1
        return f"event: {payload['type']}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()

    yield event(
        {
            "type": "response.created",
            "response": _response(body, rid, created, model, "in_progress", None, start),
        }
    )
    yield event(
        {
            "type": "response.in_progress",
            "response": _response(body, rid, created, model, "in_progress", None, start),
        }
    )
    async for piece in run_choices(start.runs):
        output.feed(piece.delta)
        for ev in output.events:
            yield event(ev)
        output.events.clear()
    output.finish()
    for ev in output.events:
        yield event(ev)
    status = _status(start.runs[0])
    kind = "response.completed" if status == "completed" else "response.incomplete"
    yield event({"type": kind, "response": _response(body, rid, created, model, status, output, start)})
