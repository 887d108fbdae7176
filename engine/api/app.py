"""The FastAPI application: routes, the security middleware and the error handlers.

``build_app(engine, credentials, host_policy)`` assembles the OpenAI routes and the admin
routes over one ``Engine``. A pure ASGI middleware runs before any route: it rejects an
unknown ``Host`` header (DNS rebinding, 403), then checks the API key on ``/v1/*`` and the
admin token on ``/admin/*`` (401). No CORS middleware is installed: browsers get no
``Access-Control-Allow-Origin`` at all, never a wildcard.
"""

from __future__ import annotations

import json
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi_offline import FastAPIOffline
from starlette.exceptions import HTTPException as StarletteHTTPException

from moetray.engine.api.errors import exception_response, refusal_response
from moetray.engine.api.security import Credentials, HostPolicy
from moetray.engine.core import Engine
from moetray.policy.wire import error_body, refusal_for


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
        body = json.dumps(error_body(kind, message)).encode()
        await send(
            {
                "type": "http.response.start",
                "status": refusal_for(kind).status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


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
    from moetray.policy.pool_budget import RebuildRejected

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
    engine: Engine, credentials: Credentials, hosts: HostPolicy, *, load_on_startup: bool = True
) -> FastAPI:
    """The engine's HTTP application (the model loads on startup unless told otherwise)."""
    from moetray.engine.api.admin_routes import build_router as admin_router
    from moetray.engine.api.openai_routes import build_router as openai_router
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
        kind = {404: "not_found", 401: "unauthorized"}.get(exc.status_code, "invalid_request_error")
        return refusal_response(kind, str(exc.detail))

    async def on_refusal(request: Request, exc: Exception):
        return exception_response(exc)

    for cls in refusal_classes():
        app.add_exception_handler(cls, on_refusal)

    app.include_router(openai_router(engine))
    app.include_router(responses_router(engine))
    app.include_router(admin_router(engine))
    app.add_middleware(SecurityMiddleware, credentials=credentials, hosts=hosts)
    return app
