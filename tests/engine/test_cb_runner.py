"""The continuous-batching adapter on a real tiny MoE: token identity, sampling, cancel, prefix reuse.

Every test drives transformers' own ``ContinuousBatchingManager`` through
``moetray.engine.cb.BatchRunner`` (no mocks): the KV pool is the substrate's paged
cache, and the radix tests check *which blocks* are reused or evicted (page identity), not
just how many.
"""

from __future__ import annotations

import asyncio
import sys

import pytest
import torch

from moetray.engine.cb import BatchRunner, RadixLedger, RunnerConfig, Sampling, seeded_uniform

PAGE = 16
EOS = 2


def prompt_ids(tok, text: str) -> list[int]:
    return list(
        tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )["input_ids"]
    )


def make_runner(model, *, kv_pages=64, policy="radix", max_batch_tokens=256, **kw) -> BatchRunner:
    cfg = RunnerConfig(
        kv_pages=kv_pages,
        page_size=PAGE,
        max_batch_tokens=max_batch_tokens,
        prefix_policy=policy,
        eos_token_ids=(EOS,),
        **kw,
    )
    runner = BatchRunner(model, cfg)
    runner.start()
    return runner


async def run_all(runner: BatchRunner, jobs: dict[str, tuple[list[int], int, Sampling]], timeout=60.0):
    """Submit every job at once and wait until each finished; returns id → final output."""
    finals: dict[str, object] = {}
    done = asyncio.Event()

    def handler(rid):
        def on_output(out):
            if out.is_finished():
                finals[rid] = out
                if len(finals) == len(jobs):
                    done.set()

        return on_output

    for rid, (ids, max_new, sampling) in jobs.items():
        runner.submit(rid, ids, max_new_tokens=max_new, sampling=sampling, on_output=handler(rid))
    try:
        await asyncio.wait_for(done.wait(), timeout)
    except TimeoutError:
        raise TimeoutError(f"waited {timeout:g} s for every job to finish; "
                           f"finished: {sorted(finals)}") from None
    return finals


async def wait_until(predicate, what: str, timeout=30.0):
    """Poll ``predicate`` on the running loop; ``TimeoutError`` naming ``what`` at the deadline."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise TimeoutError(f"waited {timeout:g} s for {what}")
        await asyncio.sleep(0.01)


def greedy_reference(model, ids: list[int], n: int) -> list[int]:
    out = model.generate(
        torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=EOS, pad_token_id=0
    )
    return out[0, len(ids) :].tolist()


async def test_eight_interleaved_greedy_requests_match_generate_token_for_token(tiny):
    """Greedy decoding through the batcher equals `generate` (fp32): batching must not change tokens."""
    model, tok = tiny
    prompts = [prompt_ids(tok, f"Hello number {i}, tell me about experts and caches") for i in range(8)]
    refs = [greedy_reference(model, p, 10) for p in prompts]
    runner = make_runner(model, policy="stock")
    try:
        finals = await run_all(
            runner, {f"r{i}": (p, 10, Sampling(temperature=0.0)) for i, p in enumerate(prompts)}
        )
    finally:
        runner.stop()
    for i, ref in enumerate(refs):
        assert finals[f"r{i}"].generated_tokens == ref[: len(finals[f"r{i}"].generated_tokens)]
        assert len(finals[f"r{i}"].generated_tokens) == len(ref)


def resident_share(tensor: torch.Tensor) -> float:
    """The share of ``tensor``'s pages that are resident (Linux ``mincore``)."""
    import ctypes
    import mmap

    page = mmap.PAGESIZE
    start = tensor.data_ptr() - tensor.data_ptr() % page
    pages = -(-(tensor.data_ptr() + tensor.numel() * tensor.element_size() - start) // page)
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * page), vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec) / pages


@pytest.mark.skipif(sys.platform != "linux", reason="mincore reads Linux's page residency")
async def test_the_attention_mask_holds_only_the_pages_steps_read(tiny):
    """The substrate's mask spans every batch token against the whole cache (here 256 × 8,448
    float32: 8.3 MiB) and its full resets filled all of it; the runner maps it lazily
    (``kv.map_attention_mask_lazily``), so after a generation loop started (a full reset) and
    served batched greedy requests, only the rows those steps read are resident, and the tokens
    still equal ``generate``'s."""
    model, tok = tiny
    prompts = [prompt_ids(tok, f"Tell me {i} things about experts") for i in range(3)]
    refs = [greedy_reference(model, p, 8) for p in prompts]
    runner = make_runner(model, kv_pages=512, policy="stock")
    try:
        jobs = {f"r{i}": (p, 8, Sampling(temperature=0.0)) for i, p in enumerate(prompts)}
        finals = await run_all(runner, jobs)
        masks = runner.manager.batch_processor.inputs_and_outputs.attention_mask
    finally:
        runner.stop()
    assert [finals[f"r{i}"].generated_tokens for i in range(3)] == refs
    (mask,) = masks.values()
    assert mask.numel() * mask.element_size() >= 8 << 20
    assert resident_share(mask) < 0.25


async def test_a_seed_fixes_the_sample_whatever_else_shares_the_batch(tiny):
    """A seeded request draws the same tokens alone or next to others (no shared RNG stream)."""
    model, tok = tiny
    target = prompt_ids(tok, "Sample me, please")
    runner = make_runner(model, policy="off")
    try:
        alone = await run_all(runner, {"a": (target, 12, Sampling(temperature=1.0, seed=7))})
        crowd = {f"n{i}": (prompt_ids(tok, f"noise {i}"), 12, Sampling(temperature=1.0)) for i in range(5)}
        crowd["a2"] = (target, 12, Sampling(temperature=1.0, seed=7))
        crowded = await run_all(runner, crowd)
        other_seed = await run_all(runner, {"b": (target, 12, Sampling(temperature=1.0, seed=8))})
    finally:
        runner.stop()
    assert alone["a"].generated_tokens == crowded["a2"].generated_tokens
    assert other_seed["b"].generated_tokens != alone["a"].generated_tokens
    assert seeded_uniform(7, 3) == seeded_uniform(7, 3) != seeded_uniform(7, 4)


async def test_forced_token_hook_makes_the_real_engine_emit_the_chosen_ids_then_eos(tiny):
    """The documented test hook: the model runs for real, the draw processor picks these ids."""
    model, tok = tiny
    forced = tuple(tok.encode("Hello! caches"))
    runner = make_runner(model, policy="off")
    try:
        finals = await run_all(
            runner, {"f": (prompt_ids(tok, "anything"), 50, Sampling(forced_tokens=forced))}
        )
    finally:
        runner.stop()
    assert finals["f"].generated_tokens == [*forced, EOS]


async def test_cancel_during_prefill_frees_every_page(tiny):
    """Cancelling a request still in (chunked) prefill frees its pages; it produces no more output."""
    model, tok = tiny
    long_prompt = prompt_ids(tok, "The quick brown fox jumps over the lazy dog. " * 60)
    runner = make_runner(model, kv_pages=128, policy="off", max_batch_tokens=16)
    outputs = []
    try:
        runner.submit(
            "long",
            long_prompt,
            max_new_tokens=4,
            sampling=Sampling(temperature=0.0),
            on_output=outputs.append,
        )
        await wait_until(
            lambda: any(r.state == "prefill" and r.request_id == "long" for r in runner.live_requests()),
            "the long request to be in prefill",
        )
        assert runner.kv_stats().used > 0
        runner.cancel("long")
        await wait_until(lambda: not runner.live_requests() and runner.kv_stats().used == 0,
                         "the cancelled request to leave and free its pages")
        runner.check_integrity()
        assert runner.kv_stats().free == runner.kv_stats().total
    finally:
        runner.stop()
    assert not any(o.is_finished() for o in outputs)


async def test_follow_up_turn_reuses_the_first_turns_very_blocks(tiny):
    """Page identity: a follow-up's shared prefix is served by the blocks turn one wrote, per radix."""
    model, tok = tiny
    runner = make_runner(model, policy="radix")
    try:
        first = prompt_ids(tok, "Explain mixture of experts routing in detail, please. " * 3)
        t1 = await run_all(runner, {"t1": (first, 8, Sampling(temperature=0.0))})
        ledger = runner.ledger
        assert isinstance(ledger, RadixLedger)
        history = first + t1["t1"].generated_tokens
        match = ledger.radix.match_prefix(history)
        turn_one_blocks = list(ledger.radix.slots_of(match.node))
        assert match.cached_len == len(turn_one_blocks) * PAGE > 0
        follow = history + prompt_ids(tok, "And what about caches?")
        seen = {}

        def capture(out):
            if "blocks" not in seen:
                table = runner.manager.batch_processor.cache.cache_allocators["full_attention"].block_table
                seen["blocks"] = list(table.get("t2", []))

        runner.submit("t2", follow, max_new_tokens=4, sampling=Sampling(temperature=0.0), on_output=capture)
        await wait_until(
            lambda: "t2" not in {r.request_id for r in runner.live_requests()} and "blocks" in seen,
            "the follow-up turn to finish",
        )
        assert seen["blocks"][: len(turn_one_blocks)] == turn_one_blocks
        assert runner.cached_tokens("t2") == len(turn_one_blocks) * PAGE
        runner.check_integrity()
    finally:
        runner.stop()


async def test_a_repeated_prompt_copies_its_ragged_end_and_computes_one_token(tiny):
    """The same prompt again: its whole pages are shared, the rows of its last, partial page are
    copied from the page turn one completed into a page of its own, so only the last prompt token
    is computed; the answer is still generate's, token for token (fp32). Prevents: the copy never
    wired, a shared page written over, or copied rows misplaced (the answer would change)."""
    model, tok = tiny
    runner = make_runner(model, policy="radix")
    try:
        prompt = prompt_ids(tok, "Explain mixture of experts routing in detail, please.")
        assert len(prompt) % PAGE not in (0, 1)  # a ragged end of two or more tokens to copy from
        want = greedy_reference(model, prompt, PAGE)
        first = await run_all(runner, {"a": (prompt, PAGE, Sampling(temperature=0.0))})
        assert first["a"].generated_tokens == want
        ledger = runner.ledger
        assert isinstance(ledger, RadixLedger) and ledger.partial_pages_copied == 0
        whole = len(prompt) // PAGE
        source = list(ledger.radix.slots_of(ledger.radix.match_prefix(prompt + want).node))[whole]
        seen = {}

        def capture(out):
            seen.setdefault("blocks", list(
                runner.manager.batch_processor.cache.cache_allocators["full_attention"].block_table["c"]))

        again = await run_all(runner, {"b": (prompt, PAGE, Sampling(temperature=0.0))})
        assert again["b"].generated_tokens == want
        assert ledger.partial_pages_copied == 1 and runner.cached_tokens("b") == len(prompt) - 1
        runner.submit("c", prompt, max_new_tokens=2, sampling=Sampling(temperature=0.0), on_output=capture)
        await wait_until(lambda: "blocks" in seen and all(r.request_id != "c"
                                                          for r in runner.live_requests()),
                         "the third request to finish")
        assert seen["blocks"][whole] != source  # a copy of its own, the cached page untouched
        runner.check_integrity()
    finally:
        runner.stop()


async def test_a_one_token_answer_leaves_its_prompt_pages_cached(tiny):
    """A request that finishes on its first token (``max_tokens: 1``) keeps its prompt's whole pages
    cached: the next identical prompt matches them. Prevents: the last step's pages left unhashed
    and freed with the request (the substrate hashes only an unfinished request's pages)."""
    model, tok = tiny
    runner = make_runner(model, policy="radix")
    try:
        prompt = prompt_ids(tok, "Explain mixture of experts routing in detail, please.")
        await run_all(runner, {"a": (prompt, 1, Sampling(temperature=0.0))})
        again = await run_all(runner, {"b": (prompt, 4, Sampling(temperature=0.0))})
        assert runner.cached_tokens("b") == (len(prompt) - 1) // PAGE * PAGE > 0
        assert again["b"].generated_tokens == greedy_reference(model, prompt, 4)
        runner.check_integrity()
    finally:
        runner.stop()


async def _pressure_then_follow_up(model, tok, policy: str) -> tuple[int, list[list[int]], list[int]]:
    """Older cached junk, then turn one, then a request that needs a few more pages than are free.

    Returns the follow-up turn's prefix-cache hit (tokens), the radix evictions, and the
    blocks turn one's history occupied.
    """
    runner = make_runner(model, kv_pages=24, policy=policy)
    try:
        junk = {
            f"junk{i}": (prompt_ids(tok, f"old junk {i} " * 10), 2, Sampling(temperature=0.0))
            for i in range(2)
        }
        await run_all(runner, junk)
        junk_blocks = set(runner.ledger.tree_blocks) if isinstance(runner.ledger, RadixLedger) else set()
        first = prompt_ids(tok, "Keep this conversation warm: experts, slots and pages.")
        t1 = await run_all(runner, {"t1": (first, 8, Sampling(temperature=0.0))})
        history = first + t1["t1"].generated_tokens
        t1_blocks: list[int] = []
        if isinstance(runner.ledger, RadixLedger):
            # Read the tree without touching its recency: the blocks turn one added.
            t1_blocks = sorted(runner.ledger.tree_blocks - junk_blocks)
        stats = runner.kv_stats()
        # A prompt needing a few pages more than are free: pressure, but far less than all that is cached.
        pressure_tokens = (stats.free + 2) * PAGE
        filler = prompt_ids(tok, "pressure " * 200)[:pressure_tokens]
        await run_all(runner, {"pressure": (filler, 1, Sampling(temperature=0.0))})
        follow = history + prompt_ids(tok, "next question")
        await run_all(runner, {"t2": (follow, 2, Sampling(temperature=0.0))})
        evictions = list(runner.ledger.evictions) if isinstance(runner.ledger, RadixLedger) else []
        runner.check_integrity()
        return runner.cached_tokens("t2"), evictions, t1_blocks
    finally:
        runner.stop()


async def test_radix_evicts_only_the_deficit_so_the_follow_up_still_hits_where_stock_drops_everything(tiny):
    """Under pressure the stock ledger flushes all cached blocks; radix frees only what is needed."""
    model, tok = tiny
    radix_hit, evictions, t1_blocks = await _pressure_then_follow_up(model, tok, "radix")
    stock_hit, _, _ = await _pressure_then_follow_up(model, tok, "stock")
    evicted = {b for batch in evictions for b in batch}
    assert evicted, "the pool was meant to come under pressure"
    assert not evicted & set(t1_blocks), "radix evicted the most recent conversation before older junk"
    assert radix_hit >= len(t1_blocks) * PAGE > 0
    assert stock_hit == 0


async def test_many_distinct_prompts_through_a_small_pool_all_complete_and_pages_return(tiny):
    """The pool must not shrink monotonically: cached prefixes are evicted under pressure, never leaked."""
    model, tok = tiny
    runner = make_runner(model, kv_pages=20, policy="radix")
    try:
        for wave in range(4):
            jobs = {
                f"d{wave}-{i}": (prompt_ids(tok, f"prompt {wave} {i} " * 8), 6, Sampling(temperature=0.0))
                for i in range(4)
            }
            finals = await run_all(runner, jobs)
            assert all(not f.error for f in finals.values())
        await wait_until(lambda: not runner.live_requests(), "the batch to drain")
        stats = runner.kv_stats()
        assert stats.used == 0
        assert stats.free + stats.evictable == stats.total
        assert runner.ledger.evictions, "this workload only completes if radix evicts"
        scheduler = runner.manager.batch_processor.scheduler
        assert runner.ledger.demand.__self__ is scheduler  # the substrate's flush asks the scheduler's demand
        runner.check_integrity()
    finally:
        runner.stop()


ANCHOR = 100  # stands for a single-token tool-call opener in these tests


async def _anchored_turn_under_pressure(model, tok, anchor_token, pressure_extra_pages: int | None):
    """Turn one ends with a tool call (the opener at a known position), newer junk follows, then pressure."""
    runner = make_runner(model, kv_pages=24, policy="radix", anchor_token=anchor_token)
    try:
        first = prompt_ids(tok, "Plan a trip and call the weather tool for Paris, please.")
        forced = (7, 8, 9, 10, 11, 12, 13, 14, ANCHOR, 15, 16, 17)
        t1 = await run_all(runner, {"t1": (first, 40, Sampling(forced_tokens=forced))})
        history = first + t1["t1"].generated_tokens
        anchor_len = len(first) + forced.index(ANCHOR) + 1
        anchored = {b for b in runner.ledger.tree_blocks}
        anchored_blocks = sorted(anchored)[: anchor_len // PAGE] if anchor_len >= PAGE else []
        junk = {
            f"junk{i}": (prompt_ids(tok, f"newer junk {i} " * 10), 2, Sampling(temperature=0.0))
            for i in range(2)
        }
        await run_all(runner, junk)
        held_before = len(runner.ledger.retention)
        stats = runner.kv_stats()
        pages = stats.total - 1 if pressure_extra_pages is None else stats.free + pressure_extra_pages
        filler = prompt_ids(tok, "pressure " * 300)[: pages * PAGE]
        await run_all(runner, {"pressure": (filler, 1, Sampling(temperature=0.0))})
        evicted = {b for batch in runner.ledger.evictions for b in batch}
        follow = history[:anchor_len] + prompt_ids(tok, "tool result: sunny")
        await run_all(runner, {"t2": (follow, 2, Sampling(temperature=0.0))})
        runner.check_integrity()
        return {
            "held_before": held_before,
            "hit": runner.cached_tokens("t2"),
            "anchor_pages": anchor_len // PAGE,
            "evicted_anchor": bool(evicted & set(anchored_blocks)),
            "released": dict(runner.ledger.anchors_released),
            "outcomes": dict(runner.ledger.anchor_outcomes),
            "held_after": len(runner.ledger.retention),
        }
    finally:
        runner.stop()


async def test_anchor_keeps_the_turn_prefix_up_to_the_opener_through_pressure_until_the_next_turn(tiny):
    """An older anchored prefix survives LRU pressure that takes it without an anchor; next turn frees it."""
    model, tok = tiny
    anchored = await _anchored_turn_under_pressure(model, tok, ANCHOR, pressure_extra_pages=3)
    plain = await _anchored_turn_under_pressure(model, tok, None, pressure_extra_pages=3)
    assert anchored["outcomes"] == {"held": 1} and anchored["held_before"] == 1
    assert anchored["anchor_pages"] >= 2
    assert not anchored["evicted_anchor"]
    assert anchored["hit"] >= anchored["anchor_pages"] * PAGE
    assert anchored["released"]["turn"] == 1 and anchored["held_after"] == 0
    assert plain["evicted_anchor"], "without the anchor, LRU takes the oldest turn first"
    assert plain["hit"] < anchored["hit"]


async def test_memory_pressure_reclaims_an_anchor_rather_than_starving_a_request(tiny):
    """Anchors are soft: when nothing else can give, the hold is released and the request runs."""
    model, tok = tiny
    result = await _anchored_turn_under_pressure(model, tok, ANCHOR, pressure_extra_pages=None)
    assert result["released"]["pressure"] == 1
    assert result["held_after"] == 0


def test_the_substrates_own_flush_is_bounded_by_the_pressure_at_hand():
    """Before offloading, the substrate flushes every cached block; radix frees only the demand, LRU first."""
    ledger = RadixLedger(4)
    for turn, base in enumerate((10, 20, 30)):  # three cached turns, oldest first
        blocks = [base, base + 1]
        for block in blocks:
            ledger.cached_blocks[block] = None
            ledger.hash_to_block[hash((turn, block))] = block
            ledger.block_to_hash[block] = hash((turn, block))
        ledger.insert([100 * turn + k for k in range(8)], blocks)
    ledger.demand = lambda: 2
    assert sorted(ledger.evict_cached_blocks()) == [10, 11]
    assert set(ledger.cached_blocks) == {20, 21, 30, 31}
    ledger.demand = None  # no scheduler has said what it needs: the stock full flush
    assert sorted(ledger.evict_cached_blocks()) == [20, 21, 30, 31]
    assert not ledger.hash_to_block and not ledger.tree_blocks


async def test_overcommitted_pool_soft_resets_requests_and_still_matches_generate(tiny):
    """More live KV than the pool holds: the substrate offloads (soft-resets) requests, radix keeps
    their finished pages cached for the re-run, every output still equals `generate`, books balance."""
    model, tok = tiny
    prompts = [prompt_ids(tok, f"overcommit {i}: experts and caches, pages and slots") for i in range(4)]
    refs = [greedy_reference(model, p, 60) for p in prompts]
    runner = make_runner(model, kv_pages=12, policy="radix", max_batch_tokens=64)
    try:
        finals = await run_all(
            runner, {f"o{i}": (p, 60, Sampling(temperature=0.0)) for i, p in enumerate(prompts)}
        )
        for i, ref in enumerate(refs):
            assert finals[f"o{i}"].generated_tokens == ref
        await wait_until(lambda: not runner.live_requests(), "the batch to drain")
        runner.check_integrity()
        assert runner.kv_stats().used == 0
    finally:
        runner.stop()
