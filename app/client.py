"""The tray's HTTP client of the engine: every URL and key comes from :mod:`moetray.policy.wire`.

Async (httpx) so it runs on the Qt loop through qasync without blocking the UI thread.
The dashboard has no back door: each method here is one public route that ``curl`` could
call with the same token.

Refusals come back as :class:`EngineError` with the engine's ``kind`` and its sentence;
the two kinds that only a client can see are ``unreachable`` (no connection, or the
engine closed it) and ``timeout``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from moetray.policy import wire
from moetray.policy.refused import Refused

CLIENT_KINDS = ("unreachable", "timeout", "bad_reply")
"""Refusal kinds the client itself raises (the engine never sends them)."""


class EngineError(Refused):
    """A route refused or could not be reached; ``kind`` says which kind of no."""

    message: str
    status: int | None  # the HTTP status; None when no reply came
    body: dict[str, Any] | None  # the error body as sent, when there was one

    def __init__(self, kind: str, message: str, *, status: int | None = None,
                 body: Mapping[str, Any] | None = None) -> None:
        super().__init__(kind, f"{kind}: {message}", status=status,
                         body=dict(body) if body is not None else None)
        self.message = message  # without the kind (``str(self)`` carries both)

    @property
    def retry(self) -> str:
        """``now`` / ``later`` / ``never`` per wire's table; client-side kinds retry later."""
        if self.kind in CLIENT_KINDS:
            return wire.Retry.LATER.value
        return wire.refusal_for(self.kind).retry.value


@dataclass
class SseDecoder:
    """Server-sent events, one line at a time (the WHATWG field rules we need).

    ``feed(line)`` returns ``(event, data)`` when a blank line ends an event, else ``None``.
    Comment lines (``:``) and ``id``/``retry`` fields are ignored; several ``data`` lines
    join with newlines; an event with no data is dropped.
    """

    _event: str = ""
    _data: list[str] = field(default_factory=list)

    def feed(self, line: str) -> tuple[str, str] | None:
        line = line.rstrip("\r\n")
        if not line:
            event, data = self._event or "message", self._data
            self._event, self._data = "", []
            return (event, "\n".join(data)) if data else None
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)
        return None


def error_from_reply(status: int, body: Any) -> EngineError:
    """An :class:`EngineError` from a non-2xx reply in OpenAI's error shape (or not)."""
    if isinstance(body, Mapping) and isinstance(body.get("error"), Mapping):
        err = body["error"]
        kind = str(err.get("kind") or err.get("type") or "internal")
        message = str(err.get("message") or wire.refusal_for(kind).summary)
        return EngineError(kind, message, status=status, body=body)
    if isinstance(body, Mapping) and "detail" in body:  # a framework-level reply
        return EngineError("invalid_request_error" if status < 500 else "internal",
                           str(body["detail"]), status=status, body=body)
    return EngineError("bad_reply", f"HTTP {status}", status=status)


class EngineClient:
    """One engine at ``base_url``; admin routes carry ``Authorization: Bearer <token>``.

    ``timeout_s`` bounds every plain call; the event stream uses ``stream_timeout_s`` as its
    read timeout, so a silent engine ends the stream instead of hanging it.
    """

    def __init__(self, base_url: str, admin_token: str | None, *, timeout_s: float = 5.0,
                 stream_timeout_s: float = 5 * wire.EVENTS_INTERVAL_S) -> None:
        self.base_url = base_url.rstrip("/")
        self._token = admin_token
        self._timeout = httpx.Timeout(timeout_s)
        self._stream_timeout = httpx.Timeout(timeout_s, read=stream_timeout_s)
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=self._timeout,
                                       trust_env=False)

    @property
    def api_url(self) -> str:
        """The OpenAI-compatible base URL users paste into their clients."""
        return self.base_url + "/v1"

    def _headers(self, route: str) -> dict[str, str]:
        if wire.ROUTES[route].auth == "admin" and self._token:
            return {"Authorization": f"Bearer {self._token}"}
        return {}

    async def _call(self, route: str, *, json_body: Any = None, timeout_s: float | None = None,
                    accept_error: bool = False, **params: str) -> tuple[int, Any]:
        r = wire.ROUTES[route]
        timeout = httpx.Timeout(timeout_s) if timeout_s is not None else self._timeout
        try:
            reply = await self._http.request(r.method, wire.route_path(route, **params),
                                             headers=self._headers(route), json=json_body,
                                             timeout=timeout)
        except httpx.TimeoutException as exc:
            raise EngineError("timeout", f"{r.method} {r.path} timed out") from exc
        except httpx.TransportError as exc:
            raise EngineError("unreachable", f"{self.base_url}: {exc}") from exc
        try:
            body = reply.json() if reply.content else None
        except ValueError:
            body = {"detail": reply.text[:200]}
        if reply.status_code >= 400 and not accept_error:
            raise error_from_reply(reply.status_code, body)
        return reply.status_code, body

    async def health(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        """``GET /health`` (no auth): the gate state and load progress."""
        return (await self._call("health", timeout_s=timeout_s))[1] or {}

    async def status(self) -> wire.StatusSnapshot:
        """``GET /admin/status``: one telemetry snapshot."""
        return (await self._call("status"))[1]

    async def events(self) -> AsyncIterator[wire.StatusSnapshot]:
        """``GET /admin/events``: yields each status snapshot until the stream ends.

        Raises :class:`EngineError` on a refusal, a lost connection or a silent stream.
        """
        route = wire.ROUTES["events"]
        decoder = SseDecoder()
        try:
            async with self._http.stream(route.method, route.path, headers=self._headers("events"),
                                         timeout=self._stream_timeout) as reply:
                if reply.status_code >= 400:
                    await reply.aread()
                    try:
                        body = reply.json()
                    except ValueError:
                        body = None
                    raise error_from_reply(reply.status_code, body)
                async for line in reply.aiter_lines():
                    event = decoder.feed(line)
                    if event is None or event[0] != wire.SNAPSHOT_EVENT:
                        continue
                    try:
                        yield json.loads(event[1])
                    except ValueError as exc:
                        raise EngineError("bad_reply", f"undecodable snapshot: {exc}") from exc
        except httpx.TimeoutException as exc:
            raise EngineError("timeout", "the event stream went silent") from exc
        except httpx.TransportError as exc:
            raise EngineError("unreachable", f"{self.base_url}: {exc}") from exc
        raise EngineError("unreachable", "the engine closed the event stream")

    async def rebuild(self, *, moe_slots: int | None = None, kv_tokens: int | None = None,
                      state_slots: int | None = None, timeout_s: float = 120.0) -> tuple[int, Any]:
        """``POST /admin/cache/rebuild``; returns ``(status, body)`` whatever the outcome.

        A rebuild's refusals are outcomes the dashboard shows verbatim, so a 4xx/5xx reply
        is returned, not raised; only a missing reply raises :class:`EngineError`.
        """
        named = (("moe_slots", moe_slots), ("kv_tokens", kv_tokens), ("state_slots", state_slots))
        payload = {k: v for k, v in named if v is not None}
        return await self._call("rebuild", json_body=payload, timeout_s=timeout_s, accept_error=True)

    async def requests(self) -> list[wire.ActiveRequest]:
        """``GET /admin/requests``: the active requests."""
        body = (await self._call("requests"))[1]
        if isinstance(body, Mapping):
            body = body.get("requests", body.get("data", []))
        return list(body or [])

    async def cancel(self, request_id: str) -> Any:
        """``POST /admin/requests/{id}/cancel``: end one request (prefill included)."""
        return (await self._call("cancel", request_id=request_id))[1]

    async def prepare_stop(self, *, drain_timeout_s: float | None = None,
                           timeout_s: float = 60.0) -> dict[str, Any]:
        """``POST /admin/prepare-stop``: drain, seal and return the stop receipt."""
        payload = {} if drain_timeout_s is None else {"drain_timeout_s": drain_timeout_s}
        return (await self._call("prepare_stop", json_body=payload, timeout_s=timeout_s))[1] or {}

    async def aclose(self) -> None:
        await self._http.aclose()
