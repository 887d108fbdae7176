"""Non-streaming replies without a stop string take the quiet path (``Engine.stream(every_step=False)``).

Such a reply needs the engine's steps only as accounting, so they stay on the generation
thread and the event loop is woken once per request instead of once per token. These
tests pin when the quiet path is taken (the runner's routing counters) and that the reply
and the telemetry are what the every-step path gives.
"""

from __future__ import annotations

import json

import httpx


def _counts(live) -> tuple[int, int]:
    return live.engine.pools.runner.routing_counts()


def _chat(live, **extra) -> dict:
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": "Tell me about pages and experts"}],
        "max_tokens": 10,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }
    r = httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=60)
    r.raise_for_status()
    return r.json()


def _streamed_chat(live, **extra) -> tuple[str, dict]:
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": "Tell me about pages and experts"}],
        "max_tokens": 10,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    text, usage = [], None
    with httpx.stream("POST", f"{live.url}/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                text.append((choice.get("delta") or {}).get("content") or "")
    return "".join(text), usage


def test_a_whole_reply_wakes_the_loop_once_and_equals_the_streamed_reply(live):
    """Non-streaming, no stop: one loop hand-off for ten tokens; same text and usage as streamed."""
    loop0, tapped0 = _counts(live)
    whole = _chat(live)
    loop1, tapped1 = _counts(live)
    text, usage = _streamed_chat(live)
    loop2, tapped2 = _counts(live)
    assert (loop1 - loop0, tapped1 - tapped0) == (1, 9)
    assert (loop2 - loop1, tapped2 - tapped1) == (10, 0)  # the streamed reply needs every step
    assert whole["choices"][0]["message"]["content"] == text
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):  # cached tokens differ: a prefix hit
        assert whole["usage"][key] == usage[key]


def test_a_quiet_reply_is_accounted_step_by_step(live, monkeypatch):
    """Its tokens enter the tok/s window as they are generated (one event per step, not one
    lump at the end), its first token is timed once, and the totals count every token.

    Counted at the telemetry's inputs (the window itself drops events by wall-clock age)."""
    telemetry = live.engine.telemetry
    token_events: list[int] = []
    first_tokens: list[float] = []
    tokens, first_token = telemetry.tokens, telemetry.first_token
    monkeypatch.setattr(telemetry, "tokens", lambda n: (token_events.append(n), tokens(n)))
    monkeypatch.setattr(telemetry, "first_token", lambda s: (first_tokens.append(s), first_token(s)))
    served0, total0 = telemetry.requests_served, telemetry.completion_tokens_total
    whole = _chat(live)
    assert whole["usage"]["completion_tokens"] == 10
    assert token_events == [1] * 10
    assert len(first_tokens) == 1
    assert (telemetry.requests_served - served0, telemetry.completion_tokens_total - total0) == (1, 10)


def test_a_stop_string_keeps_the_every_step_path(live):
    """A stop string must be watched at every step (a match ends generation there): no quiet path.

    Every counted token came through a loop hand-off, none through a tap. (The batch loop may
    still hand over a step or two between the match and the cancellation landing: how many
    depends on the machine's load, so the count is a lower bound.)"""
    forced = "Hello there STOP and a long tail that must never be generated"
    loop0, tapped0 = _counts(live)
    whole = _chat(live, stop=["STOP"], max_tokens=200, ignore_eos=False, moetray_test_forced_text=forced)
    loop1, tapped1 = _counts(live)
    assert whole["choices"][0]["message"]["content"] == "Hello there "
    assert tapped1 - tapped0 == 0
    assert loop1 - loop0 >= whole["usage"]["completion_tokens"] > 1
    assert whole["usage"]["completion_tokens"] < len(live.engine.served.chat.encode(forced)) // 2


def test_a_whole_text_completion_takes_the_quiet_path_too(live):
    """/v1/completions without stream or stop: one loop hand-off, same text as streamed."""
    body = {"prompt": "Hello experts", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    loop0, tapped0 = _counts(live)
    whole = httpx.post(f"{live.url}/v1/completions", json=body, timeout=60).json()
    loop1, tapped1 = _counts(live)
    pieces = []
    with httpx.stream("POST", f"{live.url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                pieces.extend(c["text"] for c in json.loads(line[6:])["choices"])
    assert (loop1 - loop0, tapped1 - tapped0) == (1, 7)
    assert whole["choices"][0]["text"] == "".join(pieces)
    assert whole["usage"]["completion_tokens"] == 8
