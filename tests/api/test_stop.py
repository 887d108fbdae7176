"""prepare-stop on a live engine: drain, abort, seal, durable receipt, idempotent retries."""

from __future__ import annotations

import json
import threading

import httpx
from bounded import join, wait_until
from engine_harness import ADMIN
from test_openai_routes import noise_tokens

from moetray.policy import wire
from moetray.policy.outbox import receipt_id

STOP = wire.route_path("prepare_stop")


def stop(engine, **body) -> httpx.Response:
    return httpx.post(f"{engine.url}{STOP}", headers=ADMIN, json=body, timeout=60)


def test_stop_retried_three_times_returns_one_receipt_and_one_file(tiny_qwen3, start_engine):
    engine = start_engine(tiny_qwen3, instance_id="stop-test-1")
    out = httpx.post(
        f"{engine.url}/v1/completions", json={"prompt": "Hi there", "max_tokens": 5}, timeout=30
    ).json()
    replies = [stop(engine) for _ in range(3)]
    assert [r.status_code for r in replies] == [200, 200, 200]
    bodies = [r.json() for r in replies]
    assert bodies[0] == bodies[1] == bodies[2]
    body = bodies[0]
    assert body["receipt_id"] == receipt_id("stop-test-1")
    assert body["receipt"]["status"] == "complete" and body["drain_complete"] is True
    assert body["prompt_tokens_total"] == out["usage"]["prompt_tokens"]
    assert body["completion_tokens_total"] == out["usage"]["completion_tokens"]
    outbox = engine.engine.options.outbox_dir
    files = sorted(p.name for p in outbox.iterdir())
    assert files == [f"{body['receipt_id']}.json"]  # no temp file left, no second file
    assert json.loads((outbox / files[0]).read_text()) == body["receipt"]
    assert (body["drained"], body["aborted"]) == (0, 0)  # nothing was in flight
    # Issue 11, defect 4: admission is closed for good and a re-split is refused, both by a kind
    # that says never retry (a re-split used to be 409 "busy", retry "now": it never succeeds).
    g = httpx.post(f"{engine.url}/v1/completions", json={"prompt": "x"}, timeout=10)
    rb = httpx.post(f"{engine.url}/admin/cache/rebuild", headers=ADMIN, json={"kv_tokens": 1024})
    for refused in (g, rb):
        assert refused.status_code == 409, refused.text
        err = refused.json()["error"]
        assert (err["kind"], err["retry"]) == ("engine_stopping", "never")
        assert "Retry-After" not in refused.headers


def test_stop_drains_running_requests_before_sealing(tiny_qwen3, start_engine):
    engine = start_engine(tiny_qwen3, test_step_delay_s=0.02)
    result: dict = {}
    body = {
        "messages": [{"role": "user", "content": "finish me"}],
        "max_tokens": 80,  # >= 1.6 s of held steps: the Stop lands while it runs, even when loaded
        "temperature": 0,
        "moetray_test_forced_tokens": noise_tokens(80),
    }
    t = threading.Thread(
        target=lambda: result.setdefault(
            "r", httpx.post(f"{engine.url}/v1/chat/completions", json=body, timeout=60)
        )
    )
    t.start()
    wait_until(lambda: engine.status()["requests"], 60, "the request to be admitted", poll_s=0.005)
    r = stop(engine, drain_timeout_s=30)
    join(t, 60, "the drained chat request")
    assert r.status_code == 200
    reply = result["r"].json()
    assert reply["choices"][0]["finish_reason"] == "length"  # it ran to completion: drained, not aborted
    assert r.json()["completion_tokens_total"] == reply["usage"]["completion_tokens"] == 80
    assert (r.json()["drained"], r.json()["aborted"]) == (1, 0)


def test_stop_aborts_what_does_not_drain_in_time(tiny_qwen3, start_engine):
    engine = start_engine(tiny_qwen3, test_step_delay_s=0.02)
    chunks: list = []
    body = {
        "messages": [{"role": "user", "content": "never ends"}],
        "max_tokens": 800,
        "stream": True,
        "moetray_test_forced_tokens": noise_tokens(800),
    }

    def run():
        with httpx.stream("POST", f"{engine.url}/v1/chat/completions", json=body, timeout=120) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))

    t = threading.Thread(target=run)
    t.start()
    wait_until(lambda: engine.status()["requests"], 60, "the request to be admitted", poll_s=0.005)
    r = stop(engine, drain_timeout_s=0.2)
    join(t, 60, "the aborted stream")
    assert r.status_code == 200
    last = chunks[-1]["choices"][0]  # OpenAI's finish_reason, the admin Stop named beside it
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", "cancelled")
    assert r.json()["completion_tokens_total"] < 800
    assert (r.json()["drained"], r.json()["aborted"]) == (0, 1)
    assert engine.engine.pools.runner.kv_stats().used == 0


def test_stop_during_a_rebuild_is_refused_and_changes_nothing(tiny_qwen3, start_engine):
    engine = start_engine(tiny_qwen3, test_step_delay_s=0.02)
    body = {
        "messages": [{"role": "user", "content": "hold"}],
        "max_tokens": 120,  # >= 2.4 s of held steps: the re-split still waits when Stop comes
        "temperature": 0,
        "moetray_test_forced_tokens": noise_tokens(120),
    }
    t = threading.Thread(
        target=lambda: httpx.post(f"{engine.url}/v1/chat/completions", json=body, timeout=60)
    )
    t.start()
    wait_until(lambda: engine.status()["requests"], 60, "the request to be admitted", poll_s=0.005)
    answer: dict = {}
    rb = threading.Thread(
        target=lambda: answer.setdefault(
            "r",
            httpx.post(
                f"{engine.url}/admin/cache/rebuild", headers=ADMIN, json={"kv_tokens": 1024}, timeout=60
            ),
        )
    )
    rb.start()
    wait_until(lambda: httpx.get(f"{engine.url}/health").json()["state"] == "rebuilding", 60,
               "the engine to start the re-split", poll_s=0.002)
    r = stop(engine)
    assert r.status_code == 503
    assert r.json()["error"]["kind"] == "rebuild_in_progress"
    assert r.headers["Retry-After"] == "1"
    join(t, 60, "the chat request")
    join(rb, 60, "the re-split")
    assert answer["r"].status_code == 200
    assert httpx.get(f"{engine.url}/health").json()["state"] == "serving"
    assert not list(engine.engine.options.outbox_dir.glob("*.json"))


def test_an_unwritable_outbox_is_a_retryable_500_and_a_retry_persists(tiny_qwen3, start_engine, tmp_path):
    """Persist before signal: no receipt reaches the caller before it is on disk."""
    blocked = tmp_path / "outbox-is-a-file"
    blocked.write_text("not a directory")
    engine = start_engine(tiny_qwen3, outbox_dir=blocked)
    r = stop(engine)
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["kind"] == "not_persisted" and err["retry"] == "now"
    blocked.unlink()
    again = stop(engine)
    assert again.status_code == 200
    assert (blocked / f"{again.json()['receipt_id']}.json").is_file()
