"""Request bodies, judged before any route parses them: size, media type and the bytes themselves.

:class:`BodyGuard` is a pure ASGI middleware. For a request with a body it decides, in this
order and before FastAPI sees a byte:

1. size: a ``Content-Length`` over the limit is a 413 (``request_too_large``) without reading
   anything; a body sent without one (chunked) is counted while it is read and refused the
   moment it passes the limit, so nothing larger than the limit is ever held;
2. media type: a non-empty body that is not JSON (``application/json`` or ``…+json``) is a 415;
3. bytes: invalid UTF-8, malformed JSON, ``NaN`` / ``Infinity`` (and numbers that overflow to
   them), lone UTF-16 surrogates (``"\\ud800"``, which no tokenizer can encode) and nesting
   deeper than the parser can walk are a 400 in OpenAI's error shape.

The body it read is then replayed to the application unchanged, and later ``receive`` calls
(a streaming route watching for the client to disconnect) reach the server as before.
Parsing a large body runs in a worker thread, so the event loop keeps answering ``/health``.
"""

from __future__ import annotations

import asyncio
import json
import math
import re

from moetray.engine.api.errors import send_refusal

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")
_PARSE_IN_WORKER_BYTES = 256 << 10
"""Bodies at least this large are parsed off the event loop (8 MiB of JSON takes ~50 ms)."""


class BadBody(ValueError):
    """The body's bytes are not one JSON document moetray can take; the message says why."""


def _reject_constant(name: str):
    raise BadBody(f"the body is not valid JSON: {name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BadBody(f"the body is not valid JSON: the number {text[:40]} does not fit a double")
    return value


def _first_lone_surrogate(value) -> str | None:
    """The JSON path of the first string holding a lone UTF-16 surrogate, or None."""
    stack = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return path or "body"
        elif isinstance(item, dict):
            for key, sub in item.items():
                stack.append((f"{path}.{key}" if path else str(key), key))
                stack.append((f"{path}.{key}" if path else str(key), sub))
        elif isinstance(item, list):
            stack.extend((f"{path}[{i}]", sub) for i, sub in enumerate(item))
    return None


def check_json(body: bytes) -> None:
    """Refuses (``BadBody``) bytes that are not one strict JSON document; mutates nothing.

    Strict means: UTF-8 (no BOM tricks, no invalid sequences), no ``NaN``/``Infinity``, no
    number that overflows a double, no lone surrogate escapes, no nesting beyond the parser.
    """
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadBody(f"the body is not valid UTF-8 (byte {exc.start})") from exc
    try:
        value = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except BadBody:
        raise
    except RecursionError as exc:
        raise BadBody("the body is not valid JSON: nested too deeply") from exc
    except ValueError as exc:
        raise BadBody(f"the body is not valid JSON: {exc}") from exc
    if _ESCAPED_SURROGATE.search(body):
        where = _first_lone_surrogate(value)
        if where is not None:
            raise BadBody(f"{where}: a lone UTF-16 surrogate is not text (no tokenizer can encode it)")


def _is_json(content_type: str | None) -> bool:
    if not content_type:
        return False
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


class BodyGuard:
    """Size, media type and strict JSON for every request body (see the module docstring)."""

    def __init__(self, app, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = int(max_body_bytes)

    def _too_large(self, send, size: str):
        return send_refusal(
            send,
            "request_too_large",
            f"the request body is {size} bytes; this engine accepts at most {self.max_body_bytes} "
            "(moetray serve --max-body-bytes)",
            max_body_bytes=self.max_body_bytes,
        )

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in _BODY_METHODS:
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        declared = headers.get("content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                return await send_refusal(send, "invalid_request_error", "Content-Length is not a number")
            if int(declared) > self.max_body_bytes:
                return await self._too_large(send, declared.strip())
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before its body arrived: nothing to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return await self._too_large(send, f"more than {self.max_body_bytes}")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if body:
            if not _is_json(headers.get("content-type")):
                return await send_refusal(
                    send,
                    "unsupported_media_type",
                    "request bodies must be application/json, not "
                    + (headers.get("content-type") or "unlabelled"),
                )
            try:
                if len(body) >= _PARSE_IN_WORKER_BYTES:
                    await asyncio.to_thread(check_json, body)
                else:
                    check_json(body)
            except BadBody as exc:
                return await send_refusal(send, "invalid_request_error", str(exc))
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)
