"""The OpenAPI schema as the truth: every status each route can return, with its body.

FastAPI documents a route's 200 and a 422 this server never sends. :func:`document` replaces
``app.openapi`` with a schema that, for every operation:

- lists every status it can answer, each error with the one error shape (``ErrorResponse``:
  OpenAI's ``message``/``type``/``param``/``code`` plus moetray's ``kind`` and ``retry``).
  Statuses come from the refusal kinds the route can raise (``ROUTE_REFUSALS``) and the ones
  the middleware decides for every route of its kind (host, auth, body, readiness), each
  mapped through ``policy.wire.REFUSALS``, so the table and the wire agree by construction;
- documents ``text/event-stream`` beside JSON where the route streams;
- names the bearer scheme the route needs (admin token; API key when this engine has one);
- hides the test-only request fields (``moetray_test_*``: honoured only under
  ``--test-hooks``, never part of the public API).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from moetray.engine.api.security import Credentials
from moetray.policy.wire import REFUSALS, Retry, refusal_for

TEST_FIELD_PREFIX = "moetray_test_"
"""Request fields with this prefix are test hooks (``--test-hooks``): accepted, never documented."""

GENERATION = (
    "invalid_request_error",
    "context_length_exceeded",
    "not_found",
    "engine_stopping",
    "loading",
    "rebuilding",
    "failed",
)
CHAT = (
    *GENERATION,
    "model_not_found",
    "unsupported_content",
    "invalid_schema",
    "tools_unsupported",
    "constrained_decoding_unavailable",
)
ROUTE_REFUSALS: dict[tuple[str, str], tuple[str, ...]] = {
    ("GET", "/health"): (),
    ("GET", "/v1/models"): ("loading", "failed"),
    ("GET", "/v1/models/{model}"): ("model_not_found", "loading", "failed"),
    ("POST", "/v1/chat/completions"): CHAT,
    ("POST", "/v1/completions"): (*GENERATION, "model_not_found"),
    ("POST", "/v1/responses"): (*CHAT, "unsupported_parameter"),
    ("GET", "/admin/status"): (),
    ("GET", "/admin/events"): (),
    ("GET", "/admin/requests"): (),
    ("POST", "/admin/requests/{request_id}/cancel"): ("not_found",),
    ("POST", "/admin/cache/rebuild"): (
        "invalid_request_error",
        "below_floor",
        "too_large",
        "busy",
        "engine_stopping",
        "rejected_intact",
        "rolled_back",
        "rebuild_latched",
        "not_ready",
        "latched",
        "idle_timeout",
        "rebuild_timed_out",
    ),
    ("POST", "/admin/prepare-stop"): (
        "invalid_request_error",
        "rebuild_in_progress",
        "abort_barrier_timed_out",
        "unidentified_inflight",
        "not_persisted",
        "not_signalled",
    ),
}
"""The refusal kinds each route raises itself (``wire.REFUSALS`` keys); the middleware's are added by rule."""

STREAMING_ROUTES = {("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/v1/responses")}
"""JSON, or ``text/event-stream`` when the body asks ``"stream": true``."""
EVENT_STREAM_ONLY = {("GET", "/admin/events")}

SSE_EVENT_SCHEMA: dict[str, Any] = {
    "title": "ServerSentEvent",
    "description": "one event of the stream (OpenAPI before 3.2: the schema of each event)",
    "type": "object",
    "required": ["data"],
    "properties": {
        "event": {"type": "string"},
        "data": {"type": "string", "description": "a JSON chunk, or [DONE] at the end"},
        "id": {"type": "string"},
        "retry": {"type": "integer"},
    },
}
ERROR_SCHEMA: dict[str, Any] = {
    "title": "ErrorResponse",
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code", "kind", "retry"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string", "description": "OpenAI's error class for the status"},
                "param": {"type": ["string", "null"], "description": "the offending field, if one"},
                "code": {"type": ["string", "null"], "description": "the kind, null for a plain bad request"},
                "kind": {"type": "string", "enum": sorted([*REFUSALS, "internal_error"])},
                "retry": {"type": "string", "enum": [r.value for r in Retry]},
            },
            "additionalProperties": True,
        }
    },
}


def middleware_kinds(method: str, path: str, *, api_key: bool) -> set[str]:
    """The refusals the middleware may answer on this operation before its route runs."""
    kinds = {"forbidden_host", "internal_error"}
    if path.startswith("/admin") or (path.startswith("/v1") and api_key):
        kinds.add("unauthorized")
    if method in ("POST", "PUT", "PATCH", "DELETE"):
        kinds |= {"invalid_request_error", "request_too_large", "unsupported_media_type"}
    if path.startswith("/v1"):
        kinds |= {"loading", "failed"}
    return kinds


def operation_statuses(method: str, path: str, *, api_key: bool) -> dict[int, list[str]]:
    """Status → the refusal kinds behind it, for one operation (unknown routes: the generation set)."""
    kinds = set(ROUTE_REFUSALS.get((method, path), GENERATION)) | middleware_kinds(
        method, path, api_key=api_key
    )
    statuses: dict[int, list[str]] = {}
    for kind in sorted(kinds):
        statuses.setdefault(refusal_for(kind).status, []).append(kind)
    return statuses


def _strip_test_fields(schema: dict[str, Any]) -> None:
    for component in schema.get("components", {}).get("schemas", {}).values():
        props = component.get("properties") or {}
        for name in [n for n in props if n.startswith(TEST_FIELD_PREFIX)]:
            del props[name]
        if "required" in component:
            component["required"] = [n for n in component["required"] if not n.startswith(TEST_FIELD_PREFIX)]


def _error_response(kinds: list[str]) -> dict[str, Any]:
    described = "; ".join(f"`{k}`: {REFUSALS[k].summary}" if k in REFUSALS else f"`{k}`" for k in kinds)
    return {
        "description": described,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
    }


def build_schema(app: FastAPI, credentials: Credentials) -> dict[str, Any]:
    """The completed OpenAPI document for ``app`` (see the module docstring)."""
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    components = schema.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    schemas["ErrorResponse"] = ERROR_SCHEMA
    _strip_test_fields(schema)
    api_key = credentials.api_key is not None
    components["securitySchemes"] = {"adminToken": {"type": "http", "scheme": "bearer"}}
    if api_key:
        components["securitySchemes"]["apiKey"] = {"type": "http", "scheme": "bearer"}
    for path, operations in schema["paths"].items():
        for lower, operation in operations.items():
            method = lower.upper()
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            ok = responses.setdefault("200", {"description": "Successful Response"})
            key = (method, path)
            if key in EVENT_STREAM_ONLY:
                ok["content"] = {"text/event-stream": {"schema": SSE_EVENT_SCHEMA}}
            elif key in STREAMING_ROUTES:
                ok.setdefault("content", {"application/json": {"schema": {}}})
                ok["content"]["text/event-stream"] = {"schema": SSE_EVENT_SCHEMA}
            for status, kinds in operation_statuses(method, path, api_key=api_key).items():
                responses[str(status)] = _error_response(kinds)
            if path.startswith("/admin"):
                operation["security"] = [{"adminToken": []}]
            elif path.startswith("/v1") and api_key:
                operation["security"] = [{"apiKey": []}]
    return schema


def document(app: FastAPI, credentials: Credentials) -> None:
    """Serve :func:`build_schema`'s document at ``/openapi.json`` (built once, on first request)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_schema(app, credentials)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to replace the schema
