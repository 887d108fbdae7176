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
    assert result["elapsed_ms"] > 0
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


def _post_with_retry(url: str, body: dict, log: list) -> dict:
    """What a well-behaved client does: retry a 503 after Retry-After, never give up on "now"
    (within the test's patience: 120 s)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        if r.status_code == 503:
            assert r.json()["error"]["kind"] == "rebuilding"
            assert r.json()["error"]["retry"] == "now"
            log.append(float(r.headers["Retry-After"]))
            time.sleep(0.05)
            continue
        assert r.status_code == 200, r.text
        return r.json()
    raise TimeoutError("waited 120 s for the re-split to let a retried request in")


def test_rebuild_under_load_waits_refuses_new_work_with_retry_after_and_changes_no_output(slow):
    """In-flight requests finish, arrivals get 503 + Retry-After, nothing fails, outputs are unchanged.

    Each request runs 40 held steps (at least 0.8 s), so both in-flight ones are listed
    together even when a loaded machine starts their threads far apart."""
    prompts = [f"load test prompt {i}" for i in range(4)]

    def body(p):
        return {"messages": [{"role": "user", "content": p}], "max_tokens": 40, "temperature": 0,
                "ignore_eos": True}

    def reply_text(p, retries):
        return _post_with_retry(slow.url, body(p), retries)["choices"][0]["message"]["content"]

    baseline = {p: reply_text(p, []) for p in prompts}
    results: dict[str, str] = {}
    retries: list[float] = []

    def worker(p):
        results[p] = reply_text(p, retries)

    inflight = [threading.Thread(target=worker, args=(p,)) for p in prompts[:2]]
    for t in inflight:
        t.start()
    wait_until(lambda: len(slow.status()["requests"]) >= 2, 60, "both in-flight requests to be admitted",
               poll_s=0.005)
    answer: dict = {}
    rb = threading.Thread(target=lambda: answer.setdefault("r", rebuild(slow, kv_tokens=1024)))
    rb.start()
    wait_until(lambda: httpx.get(f"{slow.url}/health").json()["state"] == "rebuilding", 60,
               "the engine to start the re-split", poll_s=0.002)
    late = [threading.Thread(target=worker, args=(p,)) for p in prompts[2:]]
    for t in late:
        t.start()
    for t in [*inflight, rb, *late]:
        join(t, 120, "the requests and the re-split under load")
    assert answer["r"].status_code == 200 and answer["r"].json()["outcome"] == "applied"
    assert retries and all(r >= 1 for r in retries)
    assert results == baseline
    assert sizes(slow)[1] == 64
    assert rebuild(slow, kv_tokens=2048).status_code == 200


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
    r = httpx.post(
        f"{slow.url}{REBUILD}", headers=ADMIN, json={"kv_tokens": 1024, "idle_timeout_s": 0.2}, timeout=30
    )
    assert r.status_code == 503
    assert r.json()["error"]["kind"] == "idle_timeout"
    assert r.headers["Retry-After"] == "1"
    assert sizes(slow) == before
    assert slow.status()["state"] == "serving"
    join(t, 120, "the long request")
    assert done["r"].status_code == 200
    assert done["r"].json()["choices"][0]["finish_reason"] == "length"
