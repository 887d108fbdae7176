"""Issue 11's load, CI-sized: streams hanging up mid-stream and a re-split leave nothing behind.

24 clients send streaming chat completions back to back; 30 % of the requests hang up after a
few chunks. Once half the requests have been sent the KV pool is re-split under that load
(requests arriving while it runs get the documented 503 ``rebuilding``, ``retry: now``, and are
sent again, as OpenAI's client does). The verdict is counters: every request ended as its client
chose, no other 5xx, and the idle engine holds 0 KV pages and 0 requests. ``moetray bench soak``
runs the same load (:mod:`moetray.engine.bench.soak`) with 64 streams for minutes.
"""

from __future__ import annotations

import asyncio
import time

from engine_harness import ADMIN_TOKEN

from moetray.engine.bench.soak import LoadPlan, LoadTally, resplit, run_load


async def _until(condition, what: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:.0f} s for {what}")
        await asyncio.sleep(0.02)


def test_streams_with_hangups_and_a_resplit_leave_no_page_no_request_and_no_5xx(tiny_qwen3, start_engine):
    engine = start_engine(tiny_qwen3, kv_tokens=2048)
    telemetry = engine.engine.telemetry
    served0 = telemetry.requests_served
    plan = LoadPlan(streams=24, requests_per_stream=3, disconnect_fraction=0.3, max_tokens=(8, 32), seed=11)
    tally = LoadTally()
    ended_at: dict[str, int] = {}

    async def scenario() -> dict:
        load = asyncio.ensure_future(run_load(engine.url, plan, tally))
        await _until(lambda: tally.started >= plan.total // 2 or load.done(), "half the requests to be sent")
        assert not load.done(), tally.to_json()
        ended_at["resplit_start"] = tally.completed + tally.disconnected
        outcome = await resplit(engine.url, ADMIN_TOKEN, 1024, idle_timeout_s=120.0)
        ended_at["resplit_end"] = tally.completed + tally.disconnected
        await load
        return outcome

    outcome = asyncio.run(scenario())
    assert outcome["outcome"] == "applied" and outcome["after"]["kv_pages"] == 1024 // 16, outcome
    assert tally.unexpected == [] and tally.server_errors == 0, tally.to_json()
    assert set(tally.retried) <= {"rebuilding"}, tally.to_json()
    # Every request ended as its client chose: read to the end, or hung up on mid-stream.
    assert tally.completed + tally.disconnected == tally.started == plan.total, tally.to_json()
    assert tally.disconnected >= plan.total // 10 and tally.completed >= plan.total // 2, tally.to_json()
    # The re-split really ran in the middle: requests were still to come when it was asked and when it ended.
    assert ended_at["resplit_end"] < plan.total, (ended_at, tally.to_json())
    snap = engine.wait_idle(timeout=120.0)
    assert snap["requests"] == [] and snap["throughput"]["queue"] == 0
    assert snap["pools"]["kv_pages_used"] == 0, snap["pools"]
    assert snap["pools"]["kv_tokens"] == 1024
    assert telemetry.requests_served - served0 == plan.total  # each left the engine once
    engine.engine.pools.runner.check_integrity()
