"""The FastAPI application: routes, the guarding middleware and the error handlers.

``build_app(engine, credentials, host_policy)`` assembles the OpenAI routes and the admin
routes over one ``Engine``. Pure ASGI middleware decides before any route, outermost first:

1. ``SecurityMiddleware``: an unknown ``Host`` header is a 403 (DNS rebinding); ``/v1/*``
   needs the API key and ``/admin/*`` the admin token (401);
2. ``BodyGuard`` (``bodies.py``): body size (413), media type (415) and strict JSON (400),
   before anything is parsed;
3. ``ReadinessGuard``: while the model loads (or after a failed load) ``/v1/*`` is a 503 with
   ``Retry-After`` and the load progress, ``/v1/models`` included, so a client probing it
   never mistakes a loading engine for a ready one.

A known route asked with the wrong method is a 405 with ``Allow``; an unknown path a JSON
404; any exception nobody named a JSON 500 with an id that is also in the log. No CORS
middleware is installed: browsers get no ``Access-Control-Allow-Origin``, never a wildcard.
The OpenAPI schema is completed by ``openapi.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi_offline import FastAPIOffline
from starlette.exceptions import HTTPException as StarletteHTTPException

from moetray.engine.api.bodies import BodyGuard
from moetray.engine.api.errors import (
    exception_response,
    internal_error_response,
    refusal_response,
    send_refusal,
)
from moetray.engine.api.security import Credentials, HostPolicy
from moetray.engine.core import Engine
from moetray.policy.wire import DEFAULT_MAX_BODY_BYTES, PROMPT_PARAMS


class SecurityMiddleware:
    """Host check on every request; API key on ``/v1/*``; admin token on ``/admin/*``."""

    def __init__(self, app, credentials: Credentials, hosts: HostPolicy) -> None:
        self.app = app
        self.credentials = credentials
        self.hosts = hosts

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        path = scope.get("path", "")
        refusal = None
        if not self.hosts.accepts(headers.get("host")):
            refusal = (
                "forbidden_host",
                f"Host header {headers.get('host')!r} is not a loopback or allowed host",
            )
        elif path.startswith("/admin") and not self.credentials.admin_ok(headers.get("authorization")):
            refusal = ("unauthorized", "admin routes need 'Authorization: Bearer <admin token>'")
        elif path.startswith("/v1") and not self.credentials.api_ok(headers.get("authorization")):
            refusal = ("unauthorized", "this engine needs 'Authorization: Bearer <api key>' on /v1/*")
        if refusal is None:
            return await self.app(scope, receive, send)
        kind, message = refusal
        challenge = {"WWW-Authenticate": "Bearer"} if kind == "unauthorized" else None
        await send_refusal(send, kind, message, headers=challenge)


def load_message(engine: Engine) -> str:
    """What a client asking ``/v1/*`` during the load is told: the stage and how far it got."""
    progress: Mapping[str, Any] = engine.loading.progress or {}
    stage = progress.get("stage") or "starting"
    done, total = progress.get("done"), progress.get("total")
    counted = f" ({done}/{total})" if total else ""
    return f"the model is still loading: {stage}{counted}; poll /health or retry after Retry-After"


class ReadinessGuard:
    """``/v1/*`` answers only once a model is loaded: 503 ``loading`` (``Retry-After``) or ``failed``."""

    def __init__(self, app, engine: Engine) -> None:
        self.app = app
        self.engine = engine

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope.get("path", "").startswith("/v1"):
            state = self.engine.gate.state.value
            if state == "loading":
                return await send_refusal(send, "loading", load_message(self.engine))
            if state == "failed" and self.engine.served is None:
                reason = self.engine.loading.error or "unknown reason"
                return await send_refusal(send, "failed", f"the model failed to load: {reason}")
        return await self.app(scope, receive, send)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "the request is malformed", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON: {first.get('msg')}", None
    where = ".".join(loc) or "body"
    return f"{where}: {first.get('msg')}", where


def refusal_classes() -> tuple[type[Exception], ...]:
    """Every exception type that carries a refusal ``.kind`` (mapped through ``wire.REFUSALS``)."""
    from moetray.engine.api.errors import ApiError
    from moetray.engine.budget import ContextTooLong
    from moetray.engine.cb import GrammarRefused
    from moetray.engine.core import EngineUnavailable
    from moetray.policy.effort import EffortRefused
    from moetray.policy.maintenance import AdmissionClosed, RebuildRefused, StopRefused
    from moetray.policy.outbox import StopFailure
    from moetray.policy.pool_sizes import RebuildRejected

    return (
        ApiError,
        AdmissionClosed,
        RebuildRefused,
        RebuildRejected,
        StopRefused,
        StopFailure,
        ContextTooLong,
        EngineUnavailable,
        EffortRefused,
        GrammarRefused,
    )


def build_app(
    engine: Engine,
    credentials: Credentials,
    hosts: HostPolicy,
    *,
    load_on_startup: bool = True,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """The engine's HTTP application (the model loads on startup unless told otherwise)."""
    from moetray.engine.api.admin_routes import build_router as admin_router
    from moetray.engine.api.openai_routes import build_router as openai_router
    from moetray.engine.api.openapi import document
    from moetray.engine.api.responses_routes import build_router as responses_router

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if load_on_startup:
            engine.start_loading()
        try:
            yield
        finally:
            engine.shutdown()

    # FastAPIOffline: /docs and /redoc serve their Swagger UI and Redoc assets from the
    # installed package (fastapi-offline), never from a CDN, so they work with no network.
    app = FastAPIOffline(
        title="moetray engine",
        version="0.1.0",
        lifespan=lifespan,
        description="OpenAI-compatible MoE serving with live pool re-split (admin routes need a token).",
    )

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return refusal_response("invalid_request_error", message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException):
        kind = {404: "not_found", 401: "unauthorized", 405: "method_not_allowed"}.get(
            exc.status_code, "invalid_request_error"
        )
        message = str(exc.detail)
        headers = dict(exc.headers) if exc.headers is not None else None
        if kind == "not_found":
            message = f"no route {request.url.path}"
        elif kind == "method_not_allowed":
            allow = (headers or {}).get("Allow")
            message = f"{request.method} is not allowed on {request.url.path} (Allow: {allow})"
        return refusal_response(kind, message, headers=headers)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception):
        return internal_error_response(exc)

    async def on_refusal(request: Request, exc: Exception):
        if getattr(exc, "kind", None) == "context_length_exceeded" and getattr(exc, "param", None) is None:
            setattr(exc, "param", PROMPT_PARAMS.get(request.url.path))  # OpenAI names the prompt's field  # noqa: B010
        return exception_response(exc)

    for cls in refusal_classes():
        app.add_exception_handler(cls, on_refusal)

    app.include_router(openai_router(engine))
    app.include_router(responses_router(engine))
    app.include_router(admin_router(engine))
    # add_middleware puts each one outside the ones before it: security runs first.
    app.add_middleware(ReadinessGuard, engine=engine)
    app.add_middleware(BodyGuard, max_body_bytes=max_body_bytes)
    app.add_middleware(SecurityMiddleware, credentials=credentials, hosts=hosts)
    document(app, credentials)
    return app
