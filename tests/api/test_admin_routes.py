"""Admin surface and security defaults on a live server: auth, Host checks, CORS, status, events, cancel."""

from __future__ import annotations

import json
import time

import httpx
from bounded import join
from engine_harness import ADMIN, ADMIN_TOKEN
from test_openai_routes import noise_tokens

from moetray.policy import wire
from moetray.policy.pool_budget import PoolBudget, PoolSizes


def test_health_needs_no_token_but_admin_routes_do(live):
    assert httpx.get(f"{live.url}/health").json()["state"] == "serving"
    for name in ("status", "requests"):
        path = wire.route_path(name)
        assert httpx.get(f"{live.url}{path}").status_code == 401
        r = httpx.get(f"{live.url}{path}", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        assert r.json()["error"]["kind"] == "unauthorized"
        assert httpx.get(f"{live.url}{path}", headers=ADMIN).status_code == 200
    r = httpx.post(f"{live.url}/admin/prepare-stop", json={})
    assert r.status_code == 401  # an unauthenticated stop changes nothing
    assert httpx.get(f"{live.url}/health").json()["state"] == "serving"


def test_unknown_host_header_is_refused_everywhere(live):
    """DNS rebinding: a page on evil.example resolving to 127.0.0.1 must not reach any route."""
    for path in ("/health", "/v1/models", "/admin/status"):
        r = httpx.get(f"{live.url}{path}", headers={"Host": "evil.example", **ADMIN})
        assert r.status_code == 403
        assert r.json()["error"]["kind"] == "forbidden_host"
    assert httpx.get(f"{live.url}/health", headers={"Host": "localhost:1234"}).status_code == 200
    assert httpx.get(f"{live.url}/health", headers={"Host": "[::1]:80"}).status_code == 200


def test_configured_host_is_accepted_and_api_key_guards_v1(tiny_qwen3, start_engine):
    engine = start_engine(tiny_qwen3, api_key="s3cret", allowed_hosts=("moetray.lan",))
    assert httpx.get(f"{engine.url}/health", headers={"Host": "moetray.lan"}).status_code == 200
    assert httpx.get(f"{engine.url}/v1/models").status_code == 401
    assert httpx.get(f"{engine.url}/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
    ok = httpx.get(f"{engine.url}/v1/models", headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200 and ok.json()["data"]
    # the admin token is a different secret from the API key
    assert (
        httpx.get(f"{engine.url}/admin/status", headers={"Authorization": "Bearer s3cret"}).status_code == 401
    )
    assert httpx.get(f"{engine.url}/admin/status", headers=ADMIN).status_code == 200


def test_no_cors_headers_are_ever_sent(live):
    """No wildcard (or any) CORS: a browser page cannot read engine responses cross-origin."""
    r = httpx.get(f"{live.url}/v1/models", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in {k.lower() for k in r.headers}
    pre = httpx.options(
        f"{live.url}/v1/chat/completions",
        headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
    )
    assert "access-control-allow-origin" not in {k.lower() for k in pre.headers}


def test_status_snapshot_has_the_wire_shape_and_honest_labels(live):
    """The tray reads StatusSnapshot's keys; on CPU the device tier is labelled host RAM, never 0 VRAM."""
    httpx.post(f"{live.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=30)
    snap = live.status()
    assert set(wire.StatusSnapshot.__annotations__) <= set(snap)
    assert snap["state"] == "serving"
    device = snap["device"]
    assert device["kind"] == "cpu"
    assert "host RAM" in device["label"]
    assert device["total_bytes"] > 0 and device["budget_bytes"] == 256 << 20
    assert snap["footprint"]["kind"] in ("pss", "rss") and snap["footprint"]["bytes"] > 0
    pools = snap["pools"]
    assert set(wire.PoolInfo.__annotations__) <= set(pools)
    assert pools["kv_tokens"] == pools["kv_pages"] * pools["page_size"]
    assert pools["limits"]["moe_slots"]["min"] == pools["floors"]["moe_slots"]
    experts = snap["experts"]
    assert set(wire.ExpertStats.__annotations__) <= set(experts)
    model = snap["model"]
    assert len(experts["residency"]) == model["num_layers"]
    assert all(len(row) == model["num_experts"] for row in experts["residency"])
    resident = sum(slot is not None for row in experts["residency"] for slot in row)
    assert resident <= pools["moe_slots"]
    tp = snap["throughput"]
    assert tp["requests_served"] >= 1 and tp["ttft_p50_ms"] is not None


def test_unknowns_are_null_before_any_traffic(tiny_qwen3, start_engine):
    """A fresh engine reports no tok/s and no TTFT (null), not a fake 0."""
    engine = start_engine(tiny_qwen3)
    tp = engine.status()["throughput"]
    assert tp["tok_s"] is None and tp["ttft_p50_ms"] is None and tp["ttft_p95_ms"] is None
    assert tp["requests_served"] == 0


def test_events_stream_status_snapshots_about_once_a_second(live):
    """Paced, not a flood: the second snapshot comes at least half a second after the first,
    by the engine's clock and by ours (how much later depends on the machine's load; the
    read timeout bounds the wait)."""
    with httpx.stream("GET", f"{live.url}{wire.route_path('events')}", headers=ADMIN, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events, data, started = [], [], time.monotonic()
        for line in r.iter_lines():
            if line.startswith("event: "):
                events.append(line[7:])
            elif line.startswith("data: "):
                data.append(json.loads(line[6:]))
            if len(data) == 2:
                break
        elapsed = time.monotonic() - started
    assert events[:2] == [wire.SNAPSHOT_EVENT] * 2
    assert data[0]["state"] == "serving"
    assert data[1]["uptime_s"] - data[0]["uptime_s"] >= 0.5 and elapsed >= 0.5


def _stream_in_background(url: str, body: dict, sink: list):
    import threading

    def run():
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    sink.append(json.loads(line[6:]))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _wait_for_request(engine, state: str | None = None, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = httpx.get(f"{engine.url}/admin/requests", headers=ADMIN).json()["requests"]
        if rows and (state is None or rows[0]["state"] == state):
            return rows[0]
        time.sleep(0.01)
    raise TimeoutError(f"waited {timeout:g} s for a request in state {state}")


def test_admin_cancel_ends_a_decoding_request_and_frees_its_pages(slow):
    chunks: list = []
    body = {
        "messages": [{"role": "user", "content": "go"}],
        "max_tokens": 600,
        "stream": True,
        "moetray_test_forced_tokens": noise_tokens(600),
    }
    thread = _stream_in_background(slow.url, body, chunks)
    row = _wait_for_request(slow, "decode")
    assert slow.status()["pools"]["kv_pages_used"] > 0
    r = httpx.post(f"{slow.url}{wire.route_path('cancel', request_id=row['id'])}", headers=ADMIN)
    assert r.status_code == 200 and r.json() == {"id": row["id"], "cancelled": True}
    join(thread, 30, "the cancelled stream to end")
    last = chunks[-1]["choices"][0]  # OpenAI's finish_reason, the admin Stop named beside it
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", "cancelled")
    snap = slow.wait_idle()
    assert snap["pools"]["kv_pages_used"] == 0


def test_admin_cancel_during_prefill(slow):
    """Cancel works before the first token: a long prompt still in chunked prefill is dropped."""
    chunks: list = []
    long_prompt = "The quick brown fox jumps over the lazy dog. " * 40
    body = {"messages": [{"role": "user", "content": long_prompt}], "max_tokens": 5, "stream": True}
    thread = _stream_in_background(slow.url, body, chunks)
    row = _wait_for_request(slow, "prefill")
    assert row["tokens"] == 0
    httpx.post(f"{slow.url}/admin/requests/{row['id']}/cancel", headers=ADMIN).raise_for_status()
    join(thread, 30, "the cancelled stream to end")
    ends = [c["choices"][0] for c in chunks if c["choices"]]
    finishes = [(c["finish_reason"], c.get("stop_reason")) for c in ends]
    assert finishes[-1] == ("stop", "cancelled")
    assert not any(c["choices"][0]["delta"].get("content") for c in chunks if c["choices"])
    assert slow.wait_idle()["pools"]["kv_pages_used"] == 0


def test_cancelling_an_unknown_request_is_404(live):
    r = httpx.post(f"{live.url}/admin/requests/req-nope/cancel", headers=ADMIN)
    assert r.status_code == 404
    assert r.json()["error"]["kind"] == "not_found"


def test_the_admin_token_is_compared_exactly(live):
    assert (
        httpx.get(f"{live.url}/admin/status", headers={"Authorization": f"Bearer {ADMIN_TOKEN}x"}).status_code
        == 401
    )
    assert httpx.get(f"{live.url}/admin/status", headers={"Authorization": ADMIN_TOKEN}).status_code == 401


def test_a_dead_batch_loop_latches_the_engine_failed(tiny_qwen3, start_engine):
    """If the generation thread dies, the engine says so for good (503 failed), never hangs a request."""
    engine = start_engine(tiny_qwen3)
    # the loop is gone behind the engine's back
    engine.engine.pools.runner.manager.stop(block=True, timeout=10)
    r = httpx.post(f"{engine.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 503
    assert r.json()["error"]["kind"] == "failed"
    health = httpx.get(f"{engine.url}/health").json()
    assert health["state"] == "failed" and "batch loop" in health["error"]


def test_the_pools_payload_is_the_budgets_wire_form(live):
    """``PoolBudget.to_wire`` writes the ``pools`` object, so the dashboard's ``from_wire`` gets the
    engine's own budget back: the slider offers exactly the limits the engine validates against."""
    pools = live.wait_idle()["pools"]
    budget = live.engine.pools.budget
    current = PoolSizes(pools["moe_slots"], pools["kv_pages"])
    used, evictable, live = pools["kv_pages_used"], pools["kv_pages_evictable"], pools["live_bytes"]
    assert pools == budget.to_wire(
        current,
        kv_pages_used=used,
        kv_pages_evictable=evictable,
        live_moe_bytes=live["moe_slots"],
        live_kv_bytes=live["kv_pages"],
    )
    dashboard = PoolBudget.from_wire(pools)
    assert (dashboard.limits(), dashboard.presets()) == (budget.limits(), budget.presets())
