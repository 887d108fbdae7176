"""Issue 11's defects on a live server: one bad request never takes the engine down.

Each test here failed on the engine before the fix: a huge prompt froze the event loop, a
lone surrogate was a text/plain 500, TRACE/PUT/DELETE were 400s, a 64 MiB body was read whole,
a denormal timeout was accepted, and ``/v1/models`` said 200 while the model loaded.
"""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest
from engine_harness import ADMIN
from health_poll import HealthPoller

FOUR_MB = 4 << 20


def test_a_4mb_prompt_never_stalls_the_event_loop(live):
    """Defect 1: rendering and tokenizing 4 MB ran on the event loop, so /health went silent for
    seconds and the supervisor killed the engine. A 4 MB system message cannot be refused by
    arithmetic (templates may drop system text), so it really is rendered and tokenized, in a
    worker; a 4 MB user message is refused before tokenizing. ``/admin/status`` is polled beside
    ``/health``: the tray's dashboard reads it."""
    system = {"role": "system", "content": "word " * (FOUR_MB // 5)}
    body = {"messages": [system, {"role": "user", "content": "hi"}], "max_tokens": 2}
    with HealthPoller(live.url, paths=("/health", "/admin/status"), headers=ADMIN) as polls:
        r = httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=600)
        user = {"messages": [{"role": "user", "content": "x" * FOUR_MB}], "max_tokens": 2}
        fast = httpx.post(f"{live.url}/v1/chat/completions", json=user, timeout=600)
    assert r.status_code == 400 and r.json()["error"]["kind"] == "context_length_exceeded"
    assert "at least" not in r.json()["error"]["message"]  # counted by the tokenizer itself
    assert fast.status_code == 400 and fast.json()["error"]["kind"] == "context_length_exceeded"
    assert "at least" in fast.json()["error"]["message"]  # refused by arithmetic, never tokenized
    assert polls.errors == []
    assert len(polls.latencies) >= 6, polls.latencies  # the request lasted long enough to be watched
    assert max(polls.latencies) < 2.0, polls.latencies


def test_a_lone_surrogate_is_a_json_400_not_a_500(live):
    """Defect 3: "\\ud800" decoded to a str no tokenizer can encode: 500 text/plain and a reset."""
    raw = b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}'
    r = httpx.post(f"{live.url}/v1/chat/completions", content=raw,
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and r.headers["content-type"] == "application/json"
    assert "surrogate" in r.json()["error"]["message"]
    assert live.status()["state"] == "serving"


@pytest.mark.parametrize(("raw", "content_type", "status", "mentions"), [
    (b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', "application/json", 400, "UTF-8"),
    (b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', "application/json", 400, "NaN"),
    (b'{"messages": [{"role": "user", "content": "x"}], "top_p": 1e999}', "application/json", 400, "double"),
    (b'{"messages": [{"role": "user", "content": "x"}]', "application/json", 400, "not valid JSON"),
    (b"[" * 100000 + b"]" * 100000, "application/json", 400, "not valid JSON"),
    (b'{"messages": [{"role": "user", "content": "x"}]}', "text/plain", 415, "application/json"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": true}', "application/json", 400,
     "max_tokens"),
])
def test_bad_bytes_get_a_json_4xx_in_openai_shape(live, raw, content_type, status, mentions):
    r = httpx.post(f"{live.url}/v1/chat/completions", content=raw, headers={"content-type": content_type},
                   timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert mentions in err["message"] and err["retry"] == "never"


def test_max_tokens_8_0_is_8_as_openai_takes_it(live):
    body = {"prompt": "Hello", "max_tokens": 3.0, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{live.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("method", ["TRACE", "PUT", "DELETE", "PATCH"])
def test_a_wrong_method_on_a_known_route_is_405_with_allow(live, method):
    """Defect 5: these were 400s."""
    r = httpx.request(method, f"{live.url}/v1/chat/completions", timeout=10)
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["error"]["kind"] == "method_not_allowed"
    unknown = httpx.get(f"{live.url}/v1/no-such-route", timeout=10)
    assert unknown.status_code == 404 and unknown.json()["error"]["kind"] == "not_found"


def _raw_request(port: int, head: bytes, body_chunks, timeout: float = 30.0) -> bytes:
    """Send a request by hand (to control Content-Length and chunking); return what came back."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(head)
        try:
            for chunk in body_chunks:
                sock.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed without reading the rest: what we want
        reply = b""
        while True:
            try:
                data = sock.recv(65536)
            except (ConnectionResetError, TimeoutError):
                break
            if not data:
                break
            reply += data
            if b"\r\n\r\n" in reply and reply.split(b"\r\n\r\n", 1)[1].endswith(b"}"):
                break
        return reply


def test_a_64mib_body_is_refused_from_its_content_length_without_reading_it(live):
    """Defect 7: a 64 MiB body was read whole and tied the engine up for over 30 s."""
    size = 64 << 20
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {size}\r\n\r\n").encode()
    reply = _raw_request(live.port, head, [])  # not one byte of the body is sent
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b'"request_too_large"' in reply
    assert httpx.get(f"{live.url}/health", timeout=5).json()["state"] == "serving"


def test_a_chunked_body_is_refused_once_it_passes_the_limit(live):
    """No Content-Length: the body is counted while it is read and refused past the limit."""
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    piece = b"x" * (1 << 20)
    chunk = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
    reply = _raw_request(live.port, head, [chunk] * 16)  # 16 MiB offered, 8 MiB allowed
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]


def test_the_body_limit_is_the_engines_setting(tiny_qwen3, start_engine):
    engine = start_engine(tiny_qwen3, max_body_bytes=1024)
    big = {"prompt": "x" * 2000, "max_tokens": 1}
    r = httpx.post(f"{engine.url}/v1/completions", json=big, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["max_body_bytes"] == 1024


@pytest.mark.parametrize("field", ["txn_timeout_s", "idle_timeout_s"])
@pytest.mark.parametrize("value", [5e-324, -1.0, 1e9])
def test_client_timeouts_outside_their_documented_bounds_are_400(live, field, value):
    """Defect 7: txn_timeout_s 5e-324 was accepted and became a 503 rebuild_timed_out."""
    if field == "idle_timeout_s" and value == 5e-324:
        pytest.skip("0 is a valid idle wait (do not wait), so a denormal is as good as 0")
    r = httpx.post(f"{live.url}/admin/cache/rebuild", headers=ADMIN, json={"kv_tokens": 1024, field: value},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == field
    assert live.status()["state"] == "serving"


def test_while_loading_every_v1_route_is_503_with_retry_after_and_progress(tiny_qwen3, start_engine):
    """Defect 8: /v1/models said 200 with an empty list while the model loaded."""
    engine = start_engine(tiny_qwen3, load=False)
    routes = (("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"))
    for method, path in routes:
        r = httpx.request(method, f"{engine.url}{path}", json={"prompt": "x"}, timeout=10)
        assert r.status_code == 503, (path, r.text)
        assert r.headers["retry-after"] == "2"
        err = r.json()["error"]
        assert (err["kind"], err["retry"]) == ("loading", "later")
        assert "still loading: starting" in err["message"]
    engine.engine.start_loading()
    engine.wait_state({"serving"})
    assert httpx.get(f"{engine.url}/v1/models").json()["data"][0]["id"] == engine.engine.model_id()


def test_an_unexpected_exception_is_a_json_500_with_an_id_in_the_log(live, caplog, monkeypatch):
    def boom():
        raise RuntimeError("kaboom")

    monkeypatch.setattr(live.engine, "active_requests", boom)
    with caplog.at_level("ERROR", logger="moetray.engine.api.errors"):
        r = httpx.get(f"{live.url}/admin/requests", headers=ADMIN, timeout=10)
    assert r.status_code == 500 and r.headers["content-type"] == "application/json"
    error_id = r.json()["error"]["id"]
    assert error_id in caplog.text and "kaboom" in caplog.text


def test_health_carries_the_batch_loops_heartbeat(slow):
    """The supervisor tells busy from hung by it: steps advance while a request runs."""
    before = httpx.get(f"{slow.url}/health").json()["heartbeat"]
    assert before["busy"] is False
    done = threading.Event()
    body = {"prompt": "beat", "max_tokens": 30, "ignore_eos": True}

    def run() -> None:
        httpx.post(f"{slow.url}/v1/completions", json=body, timeout=120)
        done.set()

    t = threading.Thread(target=run)
    t.start()
    seen_busy = []
    while not done.is_set():
        seen_busy.append(httpx.get(f"{slow.url}/health").json()["heartbeat"]["busy"])
        time.sleep(0.05)
    t.join(timeout=60)
    after = httpx.get(f"{slow.url}/health").json()["heartbeat"]
    assert True in seen_busy
    assert after["steps"] >= before["steps"] + 30 and after["age_s"] is not None


# --- a client that leaves while its huge prompt is worked on leaves nothing behind ---------------


def _send_then_hang_up(port: int, path: str, body: dict, *, when) -> None:
    """POST ``body`` by hand, wait until ``when()`` is true (deadline 120 s), then close the socket."""
    import json

    payload = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head + payload)
        _wait(when, "the moment to hang up")


def _wait(condition, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:.0f} s for {what}")
        time.sleep(0.01)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_leaving_during_the_worker_hop_leaves_no_request_and_no_page(live, monkeypatch, stream):
    """The prompt is being rendered and tokenized in a worker when its client hangs up: when the
    worker is done the request may be admitted, but it is cancelled at once and leaves nothing."""
    from moetray.engine.api import prompts

    monkeypatch.setattr(prompts, "INLINE_CHARS", 64)  # this modest prompt takes the worker hop
    chat, entered, release = live.engine.chat_support(), threading.Event(), threading.Event()
    encode = chat.encode

    def held_encode(text: str) -> list[int]:
        entered.set()
        assert release.wait(120), "the test never released the worker"
        return encode(text)

    monkeypatch.setattr(chat, "encode", held_encode)
    connections = live.server.server_state.connections
    before, served0 = set(connections), live.engine.telemetry.requests_served
    system = {"role": "system", "content": "a long system message " * 20}
    body = {"messages": [system, {"role": "user", "content": "hi"}], "max_tokens": 40, "ignore_eos": True,
            "stream": stream}
    try:
        _send_then_hang_up(live.port, "/v1/chat/completions", body, when=entered.is_set)
        _wait(lambda: not (set(connections) - before), "the server to see the client go")
    finally:
        release.set()
    snap = live.wait_idle(timeout=60)
    assert snap["requests"] == [] and snap["pools"]["kv_pages_used"] == 0, snap["pools"]
    assert live.engine.telemetry.requests_served - served0 <= 1  # admitted at most once, then gone
    live.engine.pools.runner.check_integrity()


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_leaving_during_a_long_prefill_cancels_it_there(tiny_qwen3, start_engine, stream):
    """A near-context prompt prefilled in many small steps; the client hangs up mid-prefill: the
    request is cancelled before its first token and gives back every page."""
    engine = start_engine(tiny_qwen3, max_batch_tokens=16, test_step_delay_s=0.05)
    limit = engine.engine.pools.ceiling.limit
    prompt = [3 + (i * 7) % 300 for i in range(limit - 64)]  # ~60 prefill steps of 16 tokens
    body = {"prompt": prompt, "max_tokens": 32, "ignore_eos": True, "stream": stream}
    tokens0, steps0 = engine.engine.telemetry.completion_tokens_total, engine.engine.pools.runner.steps

    def prefilling() -> bool:
        return any(r["state"] == "prefill" for r in engine.engine.active_requests())

    _send_then_hang_up(engine.port, "/v1/completions", body, when=prefilling)
    snap = engine.wait_idle(timeout=60)
    assert snap["requests"] == [] and snap["pools"]["kv_pages_used"] == 0, snap["pools"]
    assert engine.engine.telemetry.completion_tokens_total == tokens0  # cancelled before its first token
    assert engine.engine.pools.runner.steps - steps0 < len(prompt) // 16  # the prefill was never finished
    assert engine.engine.telemetry.requests_served == 1
    engine.engine.pools.runner.check_integrity()
