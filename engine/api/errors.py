"""Every refusal the engine raises, turned into one HTTP answer in OpenAI's error shape.

A refusal is an exception with a snake_case ``.kind``; ``policy.wire.refusal_for`` maps the
kind to the status and retry class, ``policy.wire.error_body`` builds the body and
``policy.wire.retry_after_s`` says whether it carries ``Retry-After``. An exception with no
kind is a JSON 500 whose ``error.id`` is also in the log line with the traceback.
:func:`send_refusal` answers the same way from the raw ASGI layer (middleware that decides
before any route runs).
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

from fastapi.responses import JSONResponse

from moetray.policy.refused import Refused
from moetray.policy.wire import error_body, refusal_for, retry_after_s

log = logging.getLogger("moetray.engine.api.errors")


class ApiError(Refused):
    """A request-level refusal: ``kind`` (a ``wire.REFUSALS`` key), a message, optional fields.

    ``extra`` holds the fields given (``None`` ones dropped); the error body carries them.
    """

    def __init__(self, kind: str, message: str, **extra: Any) -> None:
        super().__init__(kind, message, **{k: v for k, v in extra.items() if v is not None})
        self.extra = self.fields


def refusal_headers(kind: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The headers a refusal of ``kind`` carries: ``Retry-After`` when wire says so, plus ``extra``."""
    headers = dict(extra or {})
    after = retry_after_s(kind)
    if after is not None:
        headers["Retry-After"] = str(after)
    return headers


def refusal_response(
    kind: str, message: str, *, headers: dict[str, str] | None = None, **extra: Any
) -> JSONResponse:
    """The JSON response for a refusal of ``kind`` (status, body and ``Retry-After`` from wire)."""
    return JSONResponse(
        error_body(kind, message, **extra),
        status_code=refusal_for(kind).status,
        headers=refusal_headers(kind, headers) or None,
    )


def internal_error_response(exc: BaseException) -> JSONResponse:
    """A JSON 500 for an exception nobody named; its ``error.id`` is logged with the traceback."""
    error_id = f"err-{uuid.uuid4().hex[:12]}"
    log.error("internal error %s: %s: %s", error_id, type(exc).__name__, exc, exc_info=exc)
    return refusal_response(
        "internal_error", f"internal error {error_id} ({type(exc).__name__}); see the engine log", id=error_id
    )


_REFUSAL_FIELDS = ("pool", "requested", "floor", "needed_bytes", "budget_bytes", "active", "state", "param")
"""Attributes of a refusal that travel in its error body."""


def exception_response(exc: BaseException) -> JSONResponse:
    """Map any exception with a ``.kind`` to its refusal; anything else is an internal error."""
    kind = getattr(exc, "kind", None)
    if isinstance(kind, str):
        extra = dict(getattr(exc, "extra", {}) or {})
        for name in _REFUSAL_FIELDS:
            value = getattr(exc, name, None)
            if value is not None and name not in extra:
                extra[name] = getattr(value, "value", value)
        return refusal_response(kind, str(exc), **extra)
    return internal_error_response(exc)


async def send_refusal(
    send, kind: str, message: str, *, headers: dict[str, str] | None = None, **extra: Any
) -> None:
    """Answer a refusal of ``kind`` through raw ASGI ``send`` (before any route has run)."""
    body = json.dumps(error_body(kind, message, **extra)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [
        (k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in refusal_headers(kind, headers).items()
    ]
    await send({"type": "http.response.start", "status": refusal_for(kind).status, "headers": raw})
    await send({"type": "http.response.body", "body": body})
