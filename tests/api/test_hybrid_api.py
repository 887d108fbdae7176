"""Hybrid models served end to end: HTTP → continuous batching with a state pool → offloaded experts.

A real engine (``moetray serve``'s code path, on a loopback port) over a tiny generated
Qwen3.5-MoE checkpoint in the layout real ones ship (``Qwen3_5MoeForConditionalGeneration``,
served text-only) and a Qwen3-Next one: greedy completions equal transformers' own
``generate`` (fp32) alone, four at once, on a follow-up turn resumed from a state snapshot
(``usage.prompt_tokens_details.cached_tokens``), after a live re-split of all three pools and
with a quarter of the experts resident. ``/admin/status`` reports the third pool; a re-split
names it; a model without it, or an architecture moetray cannot serve, is refused by name.
"""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest
import torch
from engine_harness import ADMIN

NEW = 10
LAYERS = 4  # three Gated DeltaNet layers, one attention layer


@pytest.fixture(scope="module")
def qwen35(tiny_moe):
    return tiny_moe("qwen3_5_moe", "per_expert", num_layers=LAYERS)


@pytest.fixture(scope="module")
def hybrid_engine(qwen35, tmp_path_factory):
    from engine_harness import LiveEngine

    engine = LiveEngine(qwen35, tmp_path_factory.mktemp("hybrid"))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def stock(qwen35):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(qwen35, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(qwen35)


def greedy(model, prompt: list[int], n: int = NEW) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


def complete(url: str, prompt: list[int], n: int = NEW) -> dict:
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    r.raise_for_status()
    return r.json()


def ids(tok, text: str) -> list[int]:
    return tok.encode(text)


def test_single_and_concurrent_completions_equal_generate(hybrid_engine, stock):
    """Prevents: a hybrid that loads but decodes wrong through the state pool, alone or batched."""
    model, tok = stock
    prompts = [ids(tok, f"Mixture of experts number {i} routes tokens to experts.") for i in range(4)]
    want = [tok.decode(greedy(model, p)) for p in prompts]
    assert complete(hybrid_engine.url, prompts[0])["choices"][0]["text"] == want[0]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda p: complete(hybrid_engine.url, p)["choices"][0]["text"], prompts))
    assert got == want
    hybrid_engine.wait_idle()
    hybrid_engine.engine.pools.runner.check_integrity()


def test_a_follow_up_turn_is_served_from_a_snapshot_and_equals_a_cold_run(hybrid_engine, stock):
    """The next turn of a conversation skips the prompt it shares with the last turn, up to the last
    page boundary, and says so in usage; its tokens equal a cold generate over the whole prompt."""
    model, tok = stock
    first = ids(tok, "The quick brown fox jumps over the lazy dog while the tray shows tokens.")
    reply = greedy(model, first, 12)  # the ids the engine generated (text would re-tokenize differently)
    assert complete(hybrid_engine.url, first, 12)["choices"][0]["text"] == tok.decode(reply)
    follow = first + reply + ids(tok, " And then? Tell me more.")
    second = complete(hybrid_engine.url, follow)
    page = hybrid_engine.status()["pools"]["page_size"]
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    processed = len(first) + 12 - 1
    assert cached == processed - processed % page > 0
    assert second["choices"][0]["text"] == tok.decode(greedy(model, follow))


def test_status_reports_the_state_pool(hybrid_engine):
    """The dashboard's third pool: size, use, unit cost, floor and range, from the engine's pricing."""
    pools = hybrid_engine.wait_idle()["pools"]
    runner = hybrid_engine.engine.pools.runner
    assert pools["state_slots"] == runner.state_slots > 0
    assert pools["state_slots_used"] == 0  # idle: no live slot, every snapshot evictable
    assert pools["bytes_per_state_slot"] > 0 and pools["floors"]["state_slots"] == 2
    limits = pools["limits"]["state_slots"]
    assert limits["min"] == 2 <= pools["state_slots"] <= limits["max"]
    assert pools["live_bytes"]["state_slots"] == pools["state_slots"] * pools["bytes_per_state_slot"]


def test_a_three_pool_resplit_applies_and_tokens_stay_identical(hybrid_engine, stock):
    """A live re-split of experts, KV and state at once lands on the named sizes and the engine
    keeps decoding exactly (the prefix cache went with the old pools)."""
    model, tok = stock
    prompt = ids(tok, "Pages, slots and layers after a re-split.")
    want = tok.decode(greedy(model, prompt))
    pools = hybrid_engine.wait_idle()["pools"]
    target = {
        "moe_slots": pools["floors"]["moe_slots"] + 1,
        "kv_tokens": (pools["kv_pages"] - 8) * pools["page_size"],
        "state_slots": pools["state_slots"] + 3,
    }
    r = httpx.post(f"{hybrid_engine.url}/admin/cache/rebuild", headers=ADMIN, json=target, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["outcome"] == "applied" and body["prefix_cache_invalidated"]
    assert body["after"]["state_slots"] == target["state_slots"] == body["before"]["state_slots"] + 3
    assert body["after"]["moe_slots"] == target["moe_slots"]
    after = hybrid_engine.status()["pools"]
    assert (after["state_slots"], after["moe_slots"]) == (target["state_slots"], target["moe_slots"])
    assert complete(hybrid_engine.url, prompt)["choices"][0]["text"] == want
    hybrid_engine.wait_idle()
    hybrid_engine.engine.pools.runner.check_integrity()


def test_a_state_pool_below_its_floor_is_refused_by_name(hybrid_engine):
    """Fewer than two slots could not keep a snapshot beside a running request."""
    r = httpx.post(
        f"{hybrid_engine.url}/admin/cache/rebuild", headers=ADMIN, json={"state_slots": 1}, timeout=60
    )
    error = r.json()["error"]
    assert (r.status_code, error["kind"], error["pool"], error["floor"]) == (400, "below_floor", "state", 2)
    assert hybrid_engine.status()["state"] == "serving"


def test_a_model_without_a_state_pool_refuses_a_state_resplit(live):
    """A full-attention model reports state_slots 0 (the pool's absence, not an unknown) and
    answers a request for it no_such_pool, naming the pool, with nothing changed."""
    pools = live.wait_idle()["pools"]
    assert (pools["state_slots"], pools["state_slots_used"], pools["bytes_per_state_slot"]) == (0, 0, 0)
    assert pools["floors"]["state_slots"] == 0 and pools["limits"]["state_slots"] == {"min": 0, "max": 0}
    r = httpx.post(f"{live.url}/admin/cache/rebuild", headers=ADMIN, json={"state_slots": 8}, timeout=60)
    error = r.json()["error"]
    assert (r.status_code, error["kind"], error["pool"]) == (400, "no_such_pool", "state")
    assert error["after"] == error["before"] and error["after"]["state_slots"] == 0


def test_qwen3_next_with_a_quarter_of_the_experts_resident(tiny_moe, start_engine):
    """The experts runtime serves a hybrid's MoE layers unchanged while the state pool serves its
    linear layers: at 25 % capacity the pool churns and the tokens stay the stock model's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    checkpoint = tiny_moe("qwen3_next", "per_expert", num_layers=LAYERS)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(checkpoint)
    engine = start_engine(checkpoint, moe_capacity=LAYERS * 8 // 4)
    prompts = [ids(tok, f"Quarter capacity {i}: experts stream over the link.") for i in range(2)]
    for prompt in prompts:
        assert complete(engine.url, prompt)["choices"][0]["text"] == tok.decode(greedy(model, prompt))
    runtime = engine.engine.pools.runtime
    assert runtime.capacity == LAYERS * 8 // 4 and runtime.cache.stats().misses > runtime.capacity


def test_an_unservable_recurrent_architecture_fails_the_load_by_name(tmp_path, start_engine):
    """GraniteMoeHybrid's Mamba blocks are labelled linear_attention but keep another state: the
    engine must end failed, naming it, from the config alone (the folder has no weights)."""
    from transformers import GraniteMoeHybridConfig

    folder = tmp_path / "granite-hybrid"
    GraniteMoeHybridConfig(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2).save_pretrained(
        folder
    )
    engine = start_engine(folder, wait=False)
    health = engine.wait_state({"failed", "serving"})
    assert health["state"] == "failed" and health["error_kind"] == "unsupported_layers"
    assert "granitemoehybrid" in health["error"]
