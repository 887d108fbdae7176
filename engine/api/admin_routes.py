"""The admin routes: health, status, events, requests, cancel, rebuild and prepare-stop.

``/health`` needs no token (the tray polls it while the model loads); every ``/admin/*``
route needs the admin bearer token (checked by the server's middleware). Shapes follow
``policy.wire``: the status snapshot is ``StatusSnapshot``, a rebuild reply
``RebuildResult``, refusals ``error_body``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt

from moetray.engine.api.errors import ApiError, refusal_headers
from moetray.engine.core import Engine
from moetray.engine.rebuild import TXN_TIMEOUT_S, run_rebuild
from moetray.engine.stop import prepare_stop
from moetray.policy.outbox import FileOutbox
from moetray.policy.wire import EVENTS_INTERVAL_S, SNAPSHOT_EVENT, TIMEOUT_LIMITS_S


def timeout_field(name: str, default: float | None, what: str):
    """A client-supplied timeout bounded by ``wire.TIMEOUT_LIMITS_S`` (outside them: 400)."""
    low, high = TIMEOUT_LIMITS_S[name]
    return Field(default=default, ge=low, le=high, description=f"{what}; {low:g} to {high:g} seconds")


class RebuildBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    moe_slots: StrictInt | None = Field(default=None, ge=0)
    kv_tokens: StrictInt | None = Field(default=None, ge=0)
    state_slots: StrictInt | None = Field(
        default=None, ge=0, description="recurrent-state slots (hybrid models; other models: no_such_pool)"
    )
    idle_timeout_s: StrictFloat | None = timeout_field(
        "idle_timeout_s", None, "how long to wait for running requests (default: the engine's)"
    )
    txn_timeout_s: StrictFloat = timeout_field(
        "txn_timeout_s", TXN_TIMEOUT_S, "how long the reply waits for the re-split itself"
    )


class StopBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    drain_timeout_s: StrictFloat | None = timeout_field(
        "drain_timeout_s", None, "how long running requests may finish before they are aborted"
    )
    abort_timeout_s: StrictFloat | None = timeout_field(
        "abort_timeout_s", None, "how long aborted requests have to let go of the batch loop"
    )


def build_router(
    engine: Engine, *, outbox: FileOutbox | None = None, events_interval_s: float = EVENTS_INTERVAL_S
) -> APIRouter:
    router = APIRouter()
    from moetray.engine.stop import default_outbox_dir

    box = outbox or FileOutbox(engine.options.outbox_dir or default_outbox_dir())

    @router.get("/health")
    async def health() -> dict[str, Any]:
        return dict(engine.health())

    @router.get("/admin/status")
    async def status() -> dict[str, Any]:
        return engine.snapshot()

    @router.get("/admin/events")
    async def events(request: Request):
        async def stream():
            while True:
                payload = json.dumps(engine.snapshot(), separators=(",", ":"))
                yield f"event: {SNAPSHOT_EVENT}\ndata: {payload}\n\n".encode()
                if await request.is_disconnected():
                    return
                await asyncio.sleep(events_interval_s)

        return StreamingResponse(
            stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    @router.get("/admin/requests")
    async def requests() -> dict[str, Any]:
        return {"requests": engine.active_requests()}

    @router.post("/admin/requests/{request_id}/cancel")
    async def cancel(request_id: str) -> dict[str, Any]:
        if not engine.cancel(request_id):
            raise ApiError("not_found", f"no request {request_id!r} is in flight")
        return {"id": request_id, "cancelled": True}

    @router.post("/admin/cache/rebuild")
    async def rebuild(body: RebuildBody):
        idle_timeout_s = body.idle_timeout_s
        if idle_timeout_s is None:
            idle_timeout_s = engine.options.rebuild_idle_timeout_s
        status_code, payload = await run_rebuild(
            body.model_dump(exclude_none=True),
            gate=engine.gate,
            pools=engine.pools,
            requests=engine.requests,
            idle_timeout_s=idle_timeout_s,
            txn_timeout_s=body.txn_timeout_s,
        )
        kind = payload.get("error", {}).get("kind") if status_code >= 400 else None
        headers = refusal_headers(kind) if kind else None
        return JSONResponse(payload, status_code=status_code, headers=headers or None)

    @router.post("/admin/prepare-stop")
    async def stop(body: StopBody | None = None) -> dict[str, Any]:
        body = body or StopBody()
        return await prepare_stop(
            engine.gate,
            engine.requests,
            identity=engine.identity,
            accounting=engine.sealed_accounting,
            drain_timeout_s=body.drain_timeout_s,
            abort_timeout_s=body.abort_timeout_s,
            outbox=box,
        )

    return router
