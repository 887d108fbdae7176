"""Every refusal the engine raises, turned into one HTTP answer in OpenAI's error shape.

A refusal is an exception with a snake_case ``.kind``; ``policy.wire.refusal_for`` maps the
kind to the status and retry class, and ``policy.wire.error_body`` builds the body. A
``Retry.NOW`` refusal carries ``Retry-After``. An exception with no kind is a 500.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi.responses import JSONResponse

from moetray.policy.wire import RETRY_AFTER_S, Retry, error_body, refusal_for

log = logging.getLogger("moetray.engine.api.errors")


class ApiError(Exception):
    """A request-level refusal: ``kind`` (a ``wire.REFUSALS`` key), a message, optional fields."""

    def __init__(self, kind: str, message: str, **extra: Any) -> None:
        self.kind = kind
        self.extra = {k: v for k, v in extra.items() if v is not None}
        super().__init__(message)


def refusal_response(kind: str, message: str, **extra: Any) -> JSONResponse:
    """The JSON response for a refusal of ``kind`` (status, body and ``Retry-After`` from wire)."""
    refusal = refusal_for(kind)
    headers = {"Retry-After": str(RETRY_AFTER_S)} if refusal.retry is Retry.NOW else None
    return JSONResponse(error_body(kind, message, **extra), status_code=refusal.status, headers=headers)


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
    log.exception("internal error", exc_info=exc)
    return refusal_response("internal_error", f"internal error: {type(exc).__name__}: {exc}")
