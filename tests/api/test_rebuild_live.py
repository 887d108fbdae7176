"""Live re-split on a real engine: applied, refused by arithmetic, the fault matrix, and under load.

The fault seam (the ``rebuild_faults`` fixture, ``tests/rebuild_faults.py``, wrapped around the
engine's pools for one test) makes the real destructive step fail before teardown, after
teardown, or in the restore; each outcome is checked through HTTP the way the tray sees it
(status, ``wire.RebuildResult`` fields, gate state, and whether serving still works).
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from bounded import join, wait_until
from engine_harness import ADMIN, LiveEngine

from moetray.policy import wire

REBUILD = wire.route_path("rebuild")


@pytest.fixture(scope="module")
def eng(tiny_qwen3, tmp_path_factory):
    engine = LiveEngine(tiny_qwen3, tmp_path_factory.mktemp("rebuild"))
    yield engine
    engine.close()


@pytest.fixture(autouse=True)
def _back_to_default(eng):
    """Each test starts from the same split and ends serving with consistent books."""
    yield
    assert eng.wait_idle()["state"] == "serving"
    eng.engine.pools.check_integrity()
    r = httpx.post(
        f"{eng.url}{REBUILD}", headers=ADMIN, json={"moe_slots": 16, "kv_tokens": 2048}, timeout=60
    )
    assert r.status_code == 200, r.text


def rebuild(engine: LiveEngine, **body) -> httpx.Response:
    return httpx.post(f"{engine.url}{REBUILD}", headers=ADMIN, json=body, timeout=120)


def sizes(engine: LiveEngine) -> tuple[int, int]:
    pools = engine.status()["pools"]
    return pools["moe_slots"], pools["kv_pages"]


def greedy(engine: LiveEngine, text: str, n: int = 8) -> str:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": n, "temperature": 0}
    r = httpx.post(f"{engine.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def chat(engine: LiveEngine, messages: list, n: int = 4) -> dict:
    body = {"messages": messages, "max_tokens": n, "temperature": 0}
    return httpx.post(f"{engine.url}/v1/chat/completions", json=body, timeout=60).json()


def test_kv_resplit_applies_without_reloading_and_invalidates_the_prefix_cache(eng):
    before_text = greedy(eng, "Resize me")
    model = eng.engine.served.loaded.model
    r = rebuild(eng, kv_tokens=1024)
    assert r.status_code == 200
    result = r.json()
    assert set(wire.RebuildResult.__annotations__) <= set(result)
    assert result["outcome"] == "applied"
    assert result["before"] == {"moe_slots": 16, "kv_pages": 128, "kv_tokens": 2048, "state_slots": 0}
    assert result["after"] == {"moe_slots": 16, "kv_pages": 64, "kv_tokens": 1024, "state_slots": 0}
    assert result["prefix_cache_invalidated"] is True
    assert result["elapsed_ms"] > 0 and result["applied_ms"] > 0 and result["waited_ms"] >= 0
    assert sizes(eng) == (16, 64)
    assert eng.engine.served.loaded.model is model  # no weight reload
    assert eng.status()["last_rebuild"] == result
    assert greedy(eng, "Resize me") == before_text  # same tokens from the new pool


def test_expert_only_resplit_keeps_the_prefix_cache(eng):
    """A MoE-only change resizes the slot pool in place: cached prefixes survive, the hottest experts stay."""
    history = [{"role": "user", "content": "Keep my prefix warm please " * 6}]
    first = chat(eng, history)
    r = rebuild(eng, moe_slots=10)
    assert r.status_code == 200
    assert r.json()["prefix_cache_invalidated"] is False
    assert sizes(eng) == (10, 128)
    experts = eng.status()["experts"]
    assert sum(slot is not None for row in experts["residency"] for slot in row) <= 10
    again = chat(eng, history)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]


REFUSED = [
    ({"moe_slots": 3}, 400, "below_floor"),
    ({"kv_tokens": 16}, 400, "below_floor"),
    ({"kv_tokens": 10**9}, 400, "too_large"),
    ({"moe_slots": 10**6}, 400, "too_large"),
]


@pytest.mark.parametrize(("body", "status", "kind"), REFUSED)
def test_arithmetic_refusals_change_nothing(eng, body, status, kind):
    before = sizes(eng)
    r = rebuild(eng, **body)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["kind"] == kind
    assert err["before"] == err["after"]
    assert sizes(eng) == before
    assert eng.status()["state"] == "serving"


@pytest.mark.parametrize("body", [{}, {"kv_tokens": "many"}, {"slots": 3}, {"moe_slots": -1}])
def test_malformed_rebuild_bodies_are_400(eng, body):
    r = rebuild(eng, **body)
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"


FAULTS = [
    ("before_teardown", {"kv_tokens": 1024}, "rejected_intact", False),
    ("before_teardown", {"moe_slots": 10}, "rejected_intact", False),
    ("after_teardown", {"kv_tokens": 1024}, "rolled_back", True),
    ("after_teardown", {"moe_slots": 10}, "rolled_back", False),
    ("after_teardown", {"moe_slots": 12, "kv_tokens": 512}, "rolled_back", True),
]


@pytest.mark.parametrize(("fault", "body", "outcome", "invalidated"), FAULTS)
def test_fault_matrix_recoverable_outcomes_keep_the_engine_serving(
    eng, rebuild_faults, fault, body, outcome, invalidated
):
    """Fails before teardown → rejected intact; after teardown → the touched pools are restored."""
    before = sizes(eng)
    reference = greedy(eng, "Still serving?")
    setattr(rebuild_faults(eng), fault, True)
    r = rebuild(eng, **body)
    assert r.status_code == 409
    err = r.json()["error"]
    assert err["kind"] == outcome and err["outcome"] == outcome
    assert err["before"] == err["after"]
    assert err["prefix_cache_invalidated"] is invalidated
    assert "injected" in err["message"]
    assert sizes(eng) == before
    assert eng.status()["state"] == "serving"
    assert greedy(eng, "Still serving?") == reference


def test_a_transaction_outliving_its_reply_keeps_the_gate_closed_until_it_ends(eng, rebuild_faults):
    """Timeouts fail closed: the reply gives up on a slow re-split (``rebuild_timed_out``, retry
    later), admission stays closed while the pools may be half built, and the transaction's own
    end reopens the gate with the new sizes. Reopening at the timeout would admit requests
    into pools being torn down."""
    hold = threading.Event()
    rebuild_faults(eng).hold = hold
    before = sizes(eng)
    r = rebuild(eng, kv_tokens=1024, txn_timeout_s=1.0)  # the documented minimum
    try:
        assert r.status_code == 503
        err = r.json()["error"]
        assert (err["kind"], err["retry"]) == ("rebuild_timed_out", "later")
        assert err["outcome"] is None and err["after"] is None  # the transaction decides them
        assert "Retry-After" not in r.headers
        assert eng.status()["state"] == "rebuilding"
        body = {"messages": [{"role": "user", "content": "x"}]}
        g = httpx.post(f"{eng.url}/v1/chat/completions", json=body)
        assert g.status_code == 503 and g.json()["error"]["kind"] == "rebuilding"
        assert rebuild(eng, kv_tokens=2048).json()["error"]["kind"] == "busy"
    finally:
        hold.set()
    wait_until(lambda: eng.status()["state"] == "serving", 60, "the transaction to end and reopen the gate")
    status = eng.status()
    assert status["state"] == "serving"
    assert sizes(eng) == (before[0], 1024 // 16)
    assert status["last_rebuild"]["outcome"] == "applied"
    assert greedy(eng, "Back again?")


def test_a_failed_restore_latches_the_engine(tiny_qwen3, start_engine, rebuild_faults):
    engine = start_engine(tiny_qwen3)
    faults = rebuild_faults(engine)
    faults.after_teardown = True
    faults.restore = True
    r = rebuild(engine, kv_tokens=1024)
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["kind"] == "rebuild_latched" and err["outcome"] == "latched"
    assert err["retry"] == "never"
    assert "rollback failed" in err["message"]
    assert httpx.get(f"{engine.url}/health").json()["state"] == "failed"
    g = httpx.post(f"{engine.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert g.status_code == 503 and g.json()["error"]["kind"] == "failed"
    again = rebuild(engine, kv_tokens=2048)
    assert again.status_code == 503 and again.json()["error"]["kind"] == "latched"


def test_rebuild_before_the_model_loaded_is_not_ready(tiny_qwen3, start_engine):
    engine = start_engine(tiny_qwen3, load=False)
    r = rebuild(engine, kv_tokens=1024)
    assert r.status_code == 503
    assert r.json()["error"]["kind"] == "not_ready"
    assert httpx.get(f"{engine.url}/health").json()["state"] == "loading"


def _post(url: str, body: dict, log: list) -> dict:
    """A client that never retries: during a re-split its request must be held, not refused."""
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    log.append(r.status_code)
    assert r.status_code == 200, r.text
    return r.json()


def _state(engine: LiveEngine) -> str:
    return httpx.get(f"{engine.url}/health").json()["state"]


def test_rebuild_under_load_holds_new_work_until_it_applies_and_changes_no_output(slow, rebuild_faults):
    """In-flight requests finish, arrivals wait at the gate (no 503) and go on once it reopens,
    nothing fails, outputs are unchanged, and the reply's durations are the wall time.

    Each request runs 40 held steps (at least 0.8 s), so both in-flight ones are listed
    together even when a loaded machine starts their threads far apart."""
    prompts = [f"load test prompt {i}" for i in range(4)]

    def body(p):
        return {"messages": [{"role": "user", "content": p}], "max_tokens": 40, "temperature": 0,
                "ignore_eos": True}

    def reply_text(p, statuses):
        return _post(slow.url, body(p), statuses)["choices"][0]["message"]["content"]

    baseline = {p: reply_text(p, []) for p in prompts}
    results: dict[str, str] = {}
    statuses: list[int] = []

    def worker(p):
        results[p] = reply_text(p, statuses)

    inflight = [threading.Thread(target=worker, args=(p,)) for p in prompts[:2]]
    for t in inflight:
        t.start()
    wait_until(lambda: len(slow.status()["requests"]) >= 2, 60, "both in-flight requests to be admitted",
               poll_s=0.005)
    answer: dict = {}

    def resplit():
        began = time.perf_counter()
        answer["r"] = rebuild(slow, kv_tokens=1024)
        answer["wall_ms"] = (time.perf_counter() - began) * 1000.0

    hold = threading.Event()  # the transaction waits here, so the late arrivals surely meet the gate
    rebuild_faults(slow).hold = hold
    rb = threading.Thread(target=resplit)
    rb.start()
    late: list[threading.Thread] = []
    try:
        wait_until(lambda: _state(slow) == "rebuilding", 60, "the engine to start the re-split", poll_s=0.002)
        late = [threading.Thread(target=worker, args=(p,)) for p in prompts[2:]]
        for t in late:
            t.start()
        wait_until(lambda: ((slow.status().get("rebuild_progress") or {}).get("held") or 0) >= 2, 60,
                   "the late requests to be held at the gate", poll_s=0.005)
    finally:
        hold.set()
    for t in [*inflight, rb, *late]:
        join(t, 120, "the requests and the re-split under load")
    result = answer["r"].json()
    assert answer["r"].status_code == 200 and result["outcome"] == "applied"
    assert statuses == [200, 200, 200, 200]  # nobody was refused
    assert results == baseline
    assert sizes(slow)[1] == 64
    # Durations are the true wall time: the wait for the two requests, then the change
    # (held by the test, so it cannot read as 0 ms).
    assert result["waited_ms"] > 0 and result["applied_ms"] > 0
    assert result["elapsed_ms"] >= result["waited_ms"] + result["applied_ms"] * 0.99
    assert result["elapsed_ms"] <= answer["wall_ms"]
    assert slow.status()["rebuild_progress"] is None
    assert rebuild(slow, kv_tokens=2048).status_code == 200


def _long_request(engine: LiveEngine, tokens: int = 60) -> tuple[threading.Thread, dict]:
    from test_openai_routes import noise_tokens

    done: dict = {}
    body = {
        "messages": [{"role": "user", "content": "long"}],
        "max_tokens": tokens,
        "temperature": 0,
        "moetray_test_forced_tokens": noise_tokens(tokens),
    }
    t = threading.Thread(
        target=lambda: done.setdefault(
            "r", httpx.post(f"{engine.url}/v1/chat/completions", json=body, timeout=120)
        )
    )
    t.start()
    while not engine.status()["requests"]:
        time.sleep(0.005)
    return t, done


WAIT_S = 3.0
"""How long the waiting re-splits below wait before the test acts: long enough that the HTTP
round trip is small beside it, so reported durations can be held to 25 % of the wall time."""


def _waited(engine: LiveEngine, seconds: float) -> dict:
    """Until the engine's own snapshot says the re-split has waited ``seconds``; returns it."""
    deadline = time.monotonic() + seconds + 60
    while True:
        progress = engine.status().get("rebuild_progress") or {}
        if progress.get("stage") == "waiting" and progress["waited_s"] >= seconds:
            return progress
        assert time.monotonic() < deadline, f"the re-split never waited {seconds} s: {progress}"
        time.sleep(0.05)


def _resplit_in_thread(engine: LiveEngine, **body) -> tuple[threading.Thread, dict]:
    answer: dict = {}

    def go():
        began = time.perf_counter()
        answer["r"] = httpx.post(f"{engine.url}{REBUILD}", headers=ADMIN, json=body, timeout=120)
        answer["wall_ms"] = (time.perf_counter() - began) * 1000.0

    t = threading.Thread(target=go)
    t.start()
    deadline = time.monotonic() + 30
    while not (engine.status().get("rebuild_progress") or {}).get("stage") == "waiting":
        assert time.monotonic() < deadline, "the re-split never started waiting"
        time.sleep(0.005)
    return t, answer


def test_a_waiting_resplit_shows_its_progress_and_stop_them_and_apply_applies_it(slow):
    before = sizes(slow)
    long, done = _long_request(slow, tokens=900)
    rb, answer = _resplit_in_thread(slow, kv_tokens=1024, idle_timeout_s=60)
    progress = _waited(slow, WAIT_S)
    assert progress["running"] == 1 and progress["timeout_s"] == 60
    r = httpx.post(f"{slow.url}{wire.route_path('rebuild_stop_running')}", headers=ADMIN, timeout=30)
    assert r.status_code == 200 and len(r.json()["stopped"]) == 1
    rb.join(timeout=120)
    long.join(timeout=120)
    result = answer["r"].json()
    assert answer["r"].status_code == 200 and result["outcome"] == "applied", result
    assert result["after"]["kv_pages"] == 64 != before[1]
    choice = done["r"].json()["choices"][0]
    assert (choice["finish_reason"], choice.get("stop_reason")) == ("stop", "cancelled")  # OpenAI's values
    history = httpx.get(f"{slow.url}{wire.route_path('request_history')}", headers=ADMIN).json()
    assert history["requests"][0]["stopped_by"] == "resplit"
    assert 0.75 * answer["wall_ms"] <= result["elapsed_ms"] <= answer["wall_ms"]
    assert result["waited_ms"] >= WAIT_S * 1000 and result["applied_ms"] is not None


def test_cancel_ends_a_waiting_resplit_and_nothing_changes(slow):
    before = sizes(slow)
    long, done = _long_request(slow, tokens=900)
    rb, answer = _resplit_in_thread(slow, kv_tokens=1024, idle_timeout_s=60)
    _waited(slow, WAIT_S)
    r = httpx.post(f"{slow.url}{wire.route_path('rebuild_cancel')}", headers=ADMIN, timeout=30)
    assert r.status_code == 200 and r.json() == {"cancelled": True}
    rb.join(timeout=120)
    err = answer["r"].json()["error"]
    assert answer["r"].status_code == 409 and err["kind"] == "rebuild_cancelled"
    assert err["outcome"] == "rejected_intact" and err["applied_ms"] is None
    assert "nothing changed" in err["message"]
    assert 0.75 * answer["wall_ms"] <= err["elapsed_ms"] <= answer["wall_ms"]
    assert sizes(slow) == before and slow.status()["state"] == "serving"
    long.join(timeout=120)
    assert done["r"].json()["choices"][0]["finish_reason"] == "length"  # the request went on
    again = httpx.post(f"{slow.url}{wire.route_path('rebuild_cancel')}", headers=ADMIN, timeout=30)
    assert again.status_code == 409 and again.json()["error"]["kind"] == "not_waiting"


def test_idle_wait_times_out_and_leaves_everything_as_it_was(slow):
    """A bounded wait that expires reopens the gate untouched; the running request is not harmed."""
    from test_openai_routes import noise_tokens

    done: dict = {}
    body = {
        "messages": [{"role": "user", "content": "long"}],
        "max_tokens": 60,
        "temperature": 0,
        "moetray_test_forced_tokens": noise_tokens(60),
    }
    t = threading.Thread(
        target=lambda: done.setdefault(
            "r", httpx.post(f"{slow.url}/v1/chat/completions", json=body, timeout=120)
        )
    )
    t.start()
    wait_until(lambda: slow.status()["requests"], 60, "the long request to be admitted", poll_s=0.005)
    before = sizes(slow)
    began = time.perf_counter()
    r = httpx.post(
        f"{slow.url}{REBUILD}", headers=ADMIN, json={"kv_tokens": 1024, "idle_timeout_s": 0.2}, timeout=30
    )
    wall_ms = (time.perf_counter() - began) * 1000.0
    assert r.status_code == 503
    err = r.json()["error"]
    assert err["kind"] == "idle_timeout"
    assert r.headers["Retry-After"] == "1"
    # In plain words, with the true wall time (not "in 0 ms").
    assert err["message"] == "1 request was still running after 0.2 s; nothing changed."
    assert err["waited_ms"] >= 200 and err["applied_ms"] is None
    assert 200 <= err["elapsed_ms"] <= wall_ms
    assert sizes(slow) == before
    assert slow.status()["state"] == "serving"
    join(t, 120, "the long request")
    assert done["r"].status_code == 200
    assert done["r"].json()["choices"][0]["finish_reason"] == "length"
