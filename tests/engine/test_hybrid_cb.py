"""Hybrid models (Gated DeltaNet + attention) through continuous batching: the state pool beside the KV pool.

Every test drives transformers' own continuous-batching manager through
``moetray.engine.cb.BatchRunner`` on a tiny generated checkpoint (three linear-attention
layers, one full-attention layer) and compares greedy tokens with transformers' own
``generate`` in fp32. Snapshot tests check *which* KV blocks a follow-up turn shares and how
many prompt tokens it skipped, not only that the text matches.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from test_cb_runner import PAGE, greedy_reference, make_runner, prompt_ids, run_all
from transformers import AutoModelForCausalLM, AutoTokenizer

from moetray.engine.cb import BatchRunner, Sampling
from moetray.engine.cb.hybrid import HybridPagedCache
from moetray.engine.cb.state import StateGeometry
from moetray.engine.experts import load_offloaded_model
from moetray.engine.models.checkpoint import CheckpointError, inspect_checkpoint

FAMILIES = ("qwen3_5_moe_text", "qwen3_5_moe", "qwen3_next")
LAYERS = 4  # three linear-attention layers, then one full-attention layer


def checkpoint(tiny_moe, family: str):
    return tiny_moe(family, "per_expert", num_layers=LAYERS)


@pytest.fixture(scope="module", params=FAMILIES)
def hybrid(request, tiny_moe):
    path = checkpoint(tiny_moe, request.param)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def qwen35(tiny_moe):
    path = checkpoint(tiny_moe, "qwen3_5_moe_text")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


def runner_for(model, *, state_slots=8, max_batch_tokens=64, **kw) -> BatchRunner:
    return make_runner(model, state_slots=state_slots, max_batch_tokens=max_batch_tokens, **kw)


async def run_greedy(runner: BatchRunner, jobs: dict[str, tuple[list[int], int]], timeout=120.0) -> dict:
    """Greedy ``jobs`` (id → prompt, new tokens), all at once; id → final output."""
    greedy = Sampling(temperature=0.0)
    return await run_all(runner, {rid: (ids, n, greedy) for rid, (ids, n) in jobs.items()}, timeout)


def hybrid_cache(runner: BatchRunner) -> HybridPagedCache:
    cache = runner.manager.batch_processor.cache
    assert isinstance(cache, HybridPagedCache)
    return cache


# ---------------------------------------------------------------- token identity


async def test_single_and_concurrent_requests_match_generate(hybrid):
    """Greedy through the state pool equals generate: a request alone, then four sharing each step
    (their decode steps batched over gathered states). Prevents: one request's recurrent state
    leaking into the next in the packed batch, a slot read after another request wrote it."""
    model, tok = hybrid
    prompts = [prompt_ids(tok, f"Hello number {i}, tell me about experts and caches") for i in range(4)]
    refs = [greedy_reference(model, p, 10) for p in prompts]
    runner = runner_for(model)
    try:
        alone = await run_greedy(runner, {"a": (prompts[0], 10)})
        together = await run_greedy(runner, {f"r{i}": (p, 10) for i, p in enumerate(prompts)})
        runner.check_integrity()
        assert runner.state_stats().live == 0  # every request gave its slot back
    finally:
        runner.stop()
    assert alone["a"].generated_tokens == refs[0]
    assert [together[f"r{i}"].generated_tokens for i in range(4)] == refs


async def test_chunked_prefill_carries_the_state_across_chunks(qwen35):
    """A prompt longer than the token budget is prefilled in chunks; each chunk must start from the
    state the previous one left (not from zero), and each chunk's page boundary is snapshotted."""
    model, tok = qwen35
    prompt = prompt_ids(
        tok, "A long question about mixture of experts, caches, pages, slots and layers. " * 2
    )
    assert len(prompt) > 3 * PAGE
    ref = greedy_reference(model, prompt, 8)
    runner = runner_for(model, max_batch_tokens=PAGE)  # one page per step: several chunks
    try:
        final = await run_greedy(runner, {"long": (prompt, 8)})
        cache = hybrid_cache(runner)
        committed = cache.states.counters["snapshots_committed"]
        runner.check_integrity()
    finally:
        runner.stop()
    assert final["long"].generated_tokens == ref
    assert committed >= (len(prompt) - 1) // PAGE  # every prompt page boundary was kept


async def test_a_state_pool_smaller_than_the_batch_queues_requests_without_changing_tokens(qwen35):
    """Requests hold one state slot while they run; with two slots, four requests take turns."""
    model, tok = qwen35
    prompts = [prompt_ids(tok, f"queue {i}") for i in range(4)]
    refs = [greedy_reference(model, p, 6) for p in prompts]
    runner = runner_for(model, state_slots=2)
    try:
        finals = await run_greedy(runner, {f"q{i}": (p, 6) for i, p in enumerate(prompts)})
        runner.check_integrity()
    finally:
        runner.stop()
    assert [finals[f"q{i}"].generated_tokens for i in range(4)] == refs


# ---------------------------------------------------------------- prefix reuse through snapshots


async def test_a_follow_up_turn_resumes_from_the_last_snapshot_and_equals_a_cold_run(qwen35):
    """The next turn resumes at the first turn's last page boundary: the tree holds the snapshot
    there (the state after exactly those tokens) over the first turn's own KV pages, the request
    skips that many prompt tokens (cached_tokens), restores the snapshot once, and its tokens equal
    a cold generate over the whole follow-up prompt."""
    model, tok = qwen35
    first = prompt_ids(tok, "Tell me about experts and caches, please.")
    runner = runner_for(model)
    try:
        reply = (await run_greedy(runner, {"t1": (first, 12)}))["t1"].generated_tokens
        follow = first + reply + prompt_ids(tok, "And then?")
        cache = hybrid_cache(runner)
        processed = len(first) + len(reply) - 1  # the last reply token is never fed back
        boundary = processed - processed % PAGE
        snapshot = cache.ledger.radix.match_state(follow[:boundary])
        first_turn_pages = cache.ledger.radix.slots_of(snapshot.node)
        resumed = await run_greedy(runner, {"t2": (follow, 8)})
        cached = runner.cached_tokens("t2")
        after = cache.ledger.radix.match_state(follow[:boundary])
        counters = dict(cache.states.counters)
        runner.check_integrity()
    finally:
        runner.stop()
    assert snapshot.cached_len == boundary > 0 and snapshot.state_slot is not None
    assert cached == boundary and counters["resumed"] == 1
    assert cache.ledger.radix.slots_of(after.node) == first_turn_pages  # the same pages, shared
    assert resumed["t2"].generated_tokens == greedy_reference(model, follow, 8)


async def test_a_snapshot_is_the_state_a_cold_forward_reaches_at_its_boundary(qwen35):
    """The tree's snapshots (a prompt boundary inside a prefill chunk, and the last generated one)
    hold exactly the conv window and recurrent state that transformers' own forward with a
    DynamicCache leaves after that many tokens. Prevents: a snapshot taken at the end of the chunk
    instead of at its page boundary, a decode step's state not written back, layers swapped."""
    model, tok = qwen35
    prompt = prompt_ids(tok, "Snapshots at page boundaries, please, with a long enough prompt here.")
    # chunks of 24 tokens end between page boundaries: each chunk's boundary falls inside it
    runner = runner_for(model, max_batch_tokens=24)
    try:
        reply = (await run_greedy(runner, {"s": (prompt, 2 * PAGE)}))["s"].generated_tokens
        cache = hybrid_cache(runner)
        sequence = prompt + reply
        boundaries = {}
        for end in range(PAGE, len(sequence), PAGE):
            match = cache.ledger.radix.match_state(sequence[:end])
            if match.cached_len == end:
                boundaries[end] = match.state_slot
        pool = cache.states.pool
        states = {
            end: {
                layer: (pool.conv[layer][slot].clone(), pool.recurrent[layer][slot].clone())
                for layer in pool.conv
            }
            for end, slot in boundaries.items()
        }
    finally:
        runner.stop()
    chunk_ends = [*range(24, len(prompt), 24), len(prompt)]
    deepest = {end - end % PAGE for end in chunk_ends} - {0}
    assert len(deepest) >= 3 and deepest <= set(states)  # each chunk's deepest boundary
    assert any(end % 24 for end in deepest)  # at least one fell inside its chunk (a split)
    assert max(states) > len(prompt)  # and the last generated one
    for end, layers in states.items():
        with torch.no_grad():
            ref = model(input_ids=torch.tensor([sequence[:end]]), use_cache=True).cache
        for layer, (conv, recurrent) in layers.items():
            torch.testing.assert_close(conv, ref.layers[layer].conv_states[0][0], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(
                recurrent, ref.layers[layer].recurrent_states[0][0], rtol=1e-4, atol=1e-5
            )


async def test_follow_up_tokens_equal_a_cold_run(hybrid):
    """Token identity of a resumed turn for every family: the snapshot is exactly the state a cold
    prefill reaches at that boundary (conv window and recurrent state both)."""
    model, tok = hybrid
    first = prompt_ids(tok, "Experts, caches and pages.")
    runner = runner_for(model)
    try:
        reply = (await run_greedy(runner, {"t1": (first, 10)}))["t1"].generated_tokens
        follow = first + reply + prompt_ids(tok, "More, please.")
        resumed = await run_greedy(runner, {"t2": (follow, 10)})
        cached = runner.cached_tokens("t2")
    finally:
        runner.stop()
    assert cached > 0
    assert resumed["t2"].generated_tokens == greedy_reference(model, follow, 10)


async def test_snapshot_pressure_evicts_the_least_recent_snapshot_and_stays_correct(qwen35):
    """With only three slots, new requests take slots from old snapshots (LRU); a prompt whose
    snapshot was evicted is recomputed from scratch, never resumed from a slot someone else reused."""
    model, tok = qwen35
    prompts = [prompt_ids(tok, f"conversation {i} about experts and slots") for i in range(4)]
    runner = runner_for(model, state_slots=3)
    try:
        for i, p in enumerate(prompts):
            await run_greedy(runner, {f"c{i}": (p, 4)})
        again = await run_greedy(runner, {"c0-again": (prompts[0], 6), "c3-again": (prompts[3], 6)})
        cached = {rid: runner.cached_tokens(rid) for rid in ("c0-again", "c3-again")}
        runner.check_integrity()
    finally:
        runner.stop()
    assert cached["c3-again"] > 0  # the newest conversation's snapshot survived
    for rid, prompt in (("c0-again", prompts[0]), ("c3-again", prompts[3])):
        assert again[rid].generated_tokens == greedy_reference(model, prompt, 6)


async def test_prefix_reuse_off_serves_a_hybrid_without_snapshots(qwen35):
    """--prefix-cache off: no match, no snapshot slot taken, the same tokens."""
    model, tok = qwen35
    prompt = prompt_ids(tok, "Nothing cached, please.")
    runner = runner_for(model, policy="off")
    try:
        first = await run_greedy(runner, {"o1": (prompt, 6)})
        second = await run_greedy(runner, {"o2": (prompt, 6)})
        stats = runner.state_stats()
        runner.check_integrity()
    finally:
        runner.stop()
    assert runner.cached_tokens("o2") == 0 and stats.snapshots == 0
    assert first["o1"].generated_tokens == second["o2"].generated_tokens == greedy_reference(model, prompt, 6)


# ---------------------------------------------------------------- experts offloaded, refusals


async def test_offloaded_experts_at_a_quarter_capacity_match_the_resident_model(tiny_moe):
    """The experts runtime serves a hybrid's MoE layers unchanged: with a quarter of the experts
    resident (the pool churning), continuous batching equals the resident model's generate."""
    path = checkpoint(tiny_moe, "qwen3_next")
    resident = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    experts = json.loads((path / "config.json").read_text())["num_experts"]
    offloaded = load_offloaded_model(path, capacity=LAYERS * experts // 4)
    prompts = [prompt_ids(tok, f"quarter {i}") for i in range(4)]
    runner = runner_for(offloaded.model)
    try:
        finals = await run_greedy(runner, {f"e{i}": (p, 8) for i, p in enumerate(prompts)})
    finally:
        runner.stop()
    assert offloaded.runtime.cache.stats().misses > offloaded.runtime.capacity
    assert [finals[f"e{i}"].generated_tokens for i in range(4)] == [
        greedy_reference(resident, p, 8) for p in prompts
    ]


def test_the_state_pool_is_priced_from_the_config(tiny_moe):
    """One slot holds a conv window and an fp32 recurrent state for every linear layer."""
    path = checkpoint(tiny_moe, "qwen3_5_moe")
    config = inspect_checkpoint(path).config
    geometry = StateGeometry.from_config(config, torch.float32)
    text = config.get_text_config()
    conv_dim = 2 * text.linear_num_key_heads * text.linear_key_head_dim + text.linear_num_value_heads * 16
    assert geometry.layers == (0, 1, 2)
    assert geometry.bytes_per_slot == 3 * (conv_dim * 4 * 4 + text.linear_num_value_heads * 16 * 16 * 4)
    assert "text only" in inspect_checkpoint(path).label


def test_another_familys_recurrent_layers_are_refused_before_any_weight_is_read(tmp_path):
    """GraniteMoeHybrid labels its Mamba blocks linear_attention; their state has another shape and
    cache interface. The folder holds no weights at all: the refusal comes from the config alone."""
    from transformers import GraniteMoeHybridConfig

    config = GraniteMoeHybridConfig(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2)
    config.save_pretrained(tmp_path)
    with pytest.raises(CheckpointError) as refusal:
        inspect_checkpoint(tmp_path)
    assert refusal.value.kind == "unsupported_layers"
    assert "granitemoehybrid" in str(refusal.value)


# ---------------------------------------------------------------- anchors, cancellation, KV pressure

ANCHOR = 100  # stands for a single-token tool-call opener


async def _tool_turn_then_follow_up(model, tok, anchor_token):
    runner = runner_for(model, anchor_token=anchor_token)
    try:
        first = prompt_ids(tok, "Plan a trip and call the weather tool for Paris.")
        forced = (*range(7, 27), ANCHOR, *range(30, 49))
        job = (first, len(forced), Sampling(forced_tokens=forced))
        t1 = (await run_all(runner, {"t1": job}, 120.0))["t1"].generated_tokens
        anchor_len = len(first) + forced.index(ANCHOR) + 1
        follow = (first + t1)[:anchor_len] + prompt_ids(tok, "tool result: sunny")
        ledger = hybrid_cache(runner).ledger
        holds = [(hold.state, len(hold.prefix)) for hold in ledger.retention.holds]
        resumed = await run_greedy(runner, {"t2": (follow, 6)})
        runner.check_integrity()
        return {
            "anchor_len": anchor_len,
            "holds": holds,
            "hit": runner.cached_tokens("t2"),
            "tokens": resumed["t2"].generated_tokens,
            "cold": greedy_reference(model, follow, 6),
            "released": dict(ledger.anchors_released),
        }
    finally:
        runner.stop()


async def test_the_snapshot_at_a_tool_call_opener_is_kept_for_the_next_turn(qwen35):
    """A turn that emits the tool-call opener pins the snapshot at the opener's page boundary (the
    rolling snapshot would move on past it) and the finished turn holds it with its KV, so the next
    turn, which rewrites everything after the opener, resumes there; without the anchor it resumes
    only from the prompt's last boundary."""
    model, tok = qwen35
    anchored = await _tool_turn_then_follow_up(model, tok, ANCHOR)
    plain = await _tool_turn_then_follow_up(model, tok, None)
    boundary = anchored["anchor_len"] - anchored["anchor_len"] % PAGE
    assert anchored["holds"] == [(True, boundary)]  # a state hold, at the opener's boundary
    assert anchored["hit"] == boundary and anchored["released"]["turn"] == 1
    assert plain["holds"] == [] and plain["hit"] < boundary
    assert anchored["tokens"] == anchored["cold"] and plain["tokens"] == plain["cold"]


async def test_a_request_cancelled_mid_prefill_gives_its_state_slots_back(qwen35):
    """Cancelled at any point, a request's live slot, its filling snapshot and its resume lock go."""
    model, tok = qwen35
    prompt = prompt_ids(tok, "A long prompt to cancel halfway through its prefill, please. " * 3)
    runner = runner_for(model, max_batch_tokens=PAGE, step_delay_s=0.02)
    try:
        finished = asyncio.Event()
        runner.submit(
            "c",
            prompt,
            max_new_tokens=8,
            sampling=Sampling(temperature=0.0),
            on_output=lambda out: out.is_finished() and finished.set(),
        )
        deadline = asyncio.get_running_loop().time() + 60
        while "c" not in hybrid_cache(runner).states.live:
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError("the request never took a state slot")
            await asyncio.sleep(0.005)
        runner.cancel("c")
        while runner.live_requests():
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError("the batch loop kept the cancelled request")
            await asyncio.sleep(0.01)
        states = hybrid_cache(runner).states
        assert not states.live and not states.filling
        runner.check_integrity()
    finally:
        runner.stop()


async def test_kv_pressure_evicts_leaves_with_their_snapshots_and_stays_exact(qwen35):
    """A KV pool too small for every conversation: radix frees least-recent leaves, each with its
    snapshot (both pools conserved), and a request that lost its prefix recomputes it exactly."""
    model, tok = qwen35
    prompts = [
        prompt_ids(tok, f"pressure conversation {i}, with enough words to fill pages.") for i in range(6)
    ]
    runner = runner_for(model, kv_pages=14, state_slots=12)
    try:
        for i, prompt in enumerate(prompts):
            await run_greedy(runner, {f"p{i}": (prompt, 8)})
            runner.check_integrity()
        ledger = hybrid_cache(runner).ledger
        again = await run_greedy(runner, {"p0-again": (prompts[0], 8)})
        runner.check_integrity()
    finally:
        runner.stop()
    assert ledger.evictions, "the pool was meant to overflow"
    assert again["p0-again"].generated_tokens == greedy_reference(model, prompts[0], 8)


async def test_concurrent_resumes_on_a_minimal_state_pool_neither_deadlock_nor_drift(qwen35):
    """Two slots, four follow-up turns matching snapshots at once: a resuming request takes its live
    slot at the match (or does not resume), so no request can wait on a slot a snapshot it locked
    holds; all four finish with the tokens of a cold run."""
    model, tok = qwen35
    firsts = [prompt_ids(tok, f"conversation {i} about pages and slots") for i in range(4)]
    runner = runner_for(model, state_slots=2)
    try:
        replies = {}
        for i, first in enumerate(firsts):
            replies[i] = (await run_greedy(runner, {f"f{i}": (first, 6)}))[f"f{i}"].generated_tokens
        follows = {f"g{i}": firsts[i] + replies[i] + prompt_ids(tok, "go on") for i in range(4)}
        finals = await run_greedy(runner, {rid: (prompt, 6) for rid, prompt in follows.items()})
        runner.check_integrity()
    finally:
        runner.stop()
    for rid, prompt in follows.items():
        assert finals[rid].generated_tokens == greedy_reference(model, prompt, 6)
