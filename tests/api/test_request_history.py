"""The engine's feed of finished requests (``GET /admin/requests/history``): what the tray's
history table shows, from the engine's own account rather than what a dashboard happened to see."""

from __future__ import annotations

import threading
import time

import httpx
from engine_harness import ADMIN
from test_openai_routes import noise_tokens

from moetray.policy import wire

HISTORY = wire.route_path("request_history")


def history(engine) -> dict:
    r = httpx.get(f"{engine.url}{HISTORY}", headers=ADMIN, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_finished_request_is_recorded_with_its_figures(live):
    body = {"messages": [{"role": "user", "content": "history please"}], "max_tokens": 6,
            "temperature": 0, "ignore_eos": True}
    before = time.time()
    reply = httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=60).json()
    feed = history(live)
    row = feed["requests"][0]
    assert feed["capacity"] == wire.REQUEST_HISTORY == 200
    assert set(row) == set(wire.FinishedRequest.__annotations__)
    assert row["id"] in reply["id"] and row["finish_reason"] == "length" and row["stopped_by"] is None
    assert row["prompt_tokens"] == reply["usage"]["prompt_tokens"]
    assert row["completion_tokens"] == reply["usage"]["completion_tokens"] == 6
    assert row["model"] == live.status()["model"]["id"]
    assert before <= row["finished_at"] <= time.time()
    assert row["ttft_ms"] > 0 and row["tok_s"] > 0


def test_who_stopped_a_request_is_recorded(slow):
    body = {"messages": [{"role": "user", "content": "long"}], "max_tokens": 400, "temperature": 0,
            "moetray_test_forced_tokens": noise_tokens(400)}
    done: dict = {}
    t = threading.Thread(target=lambda: done.setdefault(
        "r", httpx.post(f"{slow.url}/v1/chat/completions", json=body, timeout=120)))
    t.start()
    deadline = time.monotonic() + 30
    while not slow.status()["requests"]:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    rid = slow.status()["requests"][0]["id"]
    cancel = httpx.post(f"{slow.url}{wire.route_path('cancel', request_id=rid)}", headers=ADMIN)
    assert cancel.status_code == 200
    t.join(timeout=120)
    row = next(r for r in history(slow)["requests"] if r["id"] == rid)
    assert (row["finish_reason"], row["stopped_by"]) == ("cancelled", "admin")
    assert row["completion_tokens"] < 400


def test_a_client_that_goes_away_is_recorded_as_such(slow):
    body = {"messages": [{"role": "user", "content": "leave"}], "max_tokens": 400, "stream": True,
            "temperature": 0, "moetray_test_forced_tokens": noise_tokens(400)}
    with httpx.stream("POST", f"{slow.url}/v1/chat/completions", json=body, timeout=60) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                break  # a token arrived: hang up mid-stream
    deadline = time.monotonic() + 30
    while not any(r["stopped_by"] == "client" for r in history(slow)["requests"]):
        assert time.monotonic() < deadline, history(slow)["requests"][:3]
        time.sleep(0.05)
    row = next(r for r in history(slow)["requests"] if r["stopped_by"] == "client")
    assert row["finish_reason"] == "cancelled"
