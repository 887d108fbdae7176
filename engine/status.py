"""The engine's answers to "how are you?": ``GET /health`` and the ``/admin/status`` snapshot.

Assembled here from the parts that own each figure: the gate's state, the loading stage,
the served model, the pools (``Pools.to_wire``, i.e. ``PoolBudget.to_wire``), the experts
runtime's residency, the telemetry's counters and the requests in flight. Shapes follow
``policy.wire`` (``Health``, ``StatusSnapshot``); an unknown figure is ``None``, never 0.

May import ``moetray.engine.telemetry`` and ``moetray.policy``; the model and the pools are
handed in.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from moetray.engine.telemetry import Telemetry, device_memory
from moetray.policy import wire

if TYPE_CHECKING:
    from moetray.engine.cb import BatchRunner
    from moetray.engine.load import LoadState, ServedModel
    from moetray.engine.pools import Pools


def health(
    state: wire.GateStateName,
    load: LoadState,
    served: ServedModel | None,
    runner: BatchRunner | None,
    busy: Callable[[], bool],
) -> wire.Health:
    """``policy.wire.Health``: the state, the loading stage, the failure's reason, the model, and
    the batch loop's heartbeat once it runs (``busy()``: whether requests are in flight)."""
    body: wire.Health = {"state": state, "load_progress": load.progress}
    if load.error is not None:
        body["error"] = load.error
        body["error_kind"] = load.error_kind
    if served is not None:
        body["model"] = served.model_id
    if runner is not None:
        last = runner.last_step_at
        body["heartbeat"] = {
            "steps": runner.steps,
            "age_s": None if last is None else round(time.monotonic() - last, 3),
            "busy": busy(),
        }
    return body


def model_info(served: ServedModel | None, pools: Pools | None) -> dict[str, Any] | None:
    """``policy.wire.ModelInfo``; its context is the pools' ceiling once there is one."""
    if served is None:
        return None
    ceiling = pools.ceiling if pools is not None else None
    return served.info(ceiling.limit if ceiling is not None else None)


def snapshot(
    *,
    state: wire.GateStateName,
    load: LoadState,
    uptime_s: float,
    served: ServedModel | None,
    pools: Pools | None,
    telemetry: Telemetry,
    requests: list[dict[str, Any]],
) -> dict[str, Any]:
    """``policy.wire.StatusSnapshot``: everything the dashboard shows, unknowns as ``None``."""
    p50, p95 = telemetry.ttft()
    footprint = telemetry.footprint()
    live = pools if served is not None else None  # the pools' figures once the model serves
    return {
        "state": state,
        "load_progress": load.progress,
        "uptime_s": round(uptime_s, 3),
        "model": model_info(served, pools),
        "device": device_memory(live.runtime.device, live.device, footprint) if live is not None else None,
        "pools": live.to_wire() if live is not None else None,
        "experts": live.runtime.snapshot() if live is not None else None,
        "throughput": {
            "tok_s": telemetry.tok_s(),
            "ttft_p50_ms": p50,
            "ttft_p95_ms": p95,
            "queue": sum(1 for r in requests if r["state"] == "queued"),
            "requests_served": telemetry.requests_served,
            "prompt_tokens_total": telemetry.prompt_tokens_total,
            "completion_tokens_total": telemetry.completion_tokens_total,
        },
        "requests": requests,
        "footprint": footprint.to_wire() if footprint is not None else None,
        "last_rebuild": pools.last_rebuild if pools is not None else None,
    }
