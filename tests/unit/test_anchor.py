"""Rules of the anchor: detection, sliding-window release, and full-attention retention.

Sliding scenarios use window 512, page 64, gap 16, interval 128 (ferrox §6). Retention
runs against the real radix cache.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from moetray.policy.anchor import (
    RETAIN_GAP,
    AnchorError,
    AnchorRetention,
    AnchorState,
    HoldOutcome,
    SlideDecision,
    SlidingRequest,
    WindowPolicy,
    decode_slide,
    prefill_slide,
    resolve_anchor_token,
)
from moetray.policy.parser import ToolCallFormat
from moetray.policy.radix import RadixCache
from moetray.policy.radix_state import HybridRadixCache

POLICY = WindowPolicy(sliding_window=512, page_size=64, eviction_interval=128)
OPENER = 7  # the anchor token id in detection tests


def slide(position, anchor=None, *, released=0, locked=0, step=1, it=128):
    return decode_slide(SlidingRequest(position, released, locked, step), anchor, POLICY, it)


# ---------------------------------------------------------------- resolve_anchor_token


def byte_level_tokenizer(specials: list[str]) -> Tokenizer:
    """A real byte-level BPE; ``specials`` become single tokens, as in real checkpoints."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(["call a tool, read the result, answer the user"] * 4, trainer=trainer)
    tok.add_special_tokens(specials)
    return tok


def test_an_opener_counts_only_when_it_is_exactly_one_token():
    # Scenario 1: a multi-token opener cannot be detected by one integer compare, and
    # matching its first piece would anchor on any text that starts the same way.
    tok = byte_level_tokenizer(["<tool_call>"])
    encode = lambda text: tok.encode(text, add_special_tokens=False).ids  # noqa: E731
    assert resolve_anchor_token("<tool_call>", encode) == tok.token_to_id("<tool_call>")
    assert len(encode("[TOOL_CALLS]")) > 1
    assert resolve_anchor_token("[TOOL_CALLS]", encode) is None
    assert resolve_anchor_token(None, encode) is None
    assert resolve_anchor_token("", encode) is None


def test_every_tool_format_with_an_opener_resolves_and_gpt_oss_has_none():
    # Scenario 2: harmony's channel header opens ordinary messages too, so it must not anchor.
    openers = {fmt: fmt.opener() for fmt in ToolCallFormat}
    tok = byte_level_tokenizer(sorted({o for o in openers.values() if o}))
    encode = lambda text: tok.encode(text, add_special_tokens=False).ids  # noqa: E731
    for fmt, opener in openers.items():
        token = resolve_anchor_token(opener, encode)
        if fmt is ToolCallFormat.GPT_OSS:
            assert opener is None and token is None
        else:
            assert token == tok.token_to_id(opener), fmt


# ---------------------------------------------------------------- AnchorState.observe


def test_only_the_first_opener_of_a_turn_anchors():
    # Scenario 3: a second tool call's opener lies deeper than the point a rewrite of
    # the first call diverges at; anchoring there would keep a prefix nobody returns to.
    state = AnchorState()
    assert not state.observe(3, OPENER, 100, False) and state.anchor_len is None
    assert state.observe(OPENER, OPENER, 101, False) and state.anchor_len == 101
    assert not state.observe(OPENER, OPENER, 140, False)
    assert state.anchor_len == 101
    state.clear()
    assert state.anchor_len is None


def test_a_terminal_opener_never_anchors():
    # Scenario 4: a request that ended on the opener has no tool call to come back from.
    state = AnchorState()
    assert not state.observe(OPENER, OPENER, 101, True)
    assert state.anchor_len is None


def test_no_anchor_token_means_never_anchored():
    # Scenario 5: with no single-token opener, every id would otherwise compare against None.
    state = AnchorState()
    assert not any(state.observe(t, None, p, False) for p, t in enumerate([OPENER, 0, None], start=1))
    assert state.anchor_len is None


def test_observe_refuses_a_position_before_the_token():
    with pytest.raises(AnchorError) as err:
        AnchorState().observe(OPENER, OPENER, 0, False)
    assert err.value.kind == "invalid_argument" and err.value.field == "position"


# ---------------------------------------------------------------- decode_slide / prefill_slide


def test_the_slide_runs_on_its_cadence_and_never_on_the_first_decode_step():
    # Scenario 6: step 0's KV may still be in flight from prefill; freeing it corrupts decode.
    assert slide(4096, it=1) is None
    assert slide(4096, it=128) is not None
    assert slide(4096, step=0) is None
    assert POLICY.with_eviction_interval(0).eviction_interval == 1


def test_an_unanchored_slide_keeps_the_window_plus_a_page():
    # Scenario 7: (4096-1) - 512 - 64 = 3519, aligned down to 3456.
    assert slide(4096) == SlideDecision(0, 3456, False)


def test_short_sequences_free_nothing():
    # Scenario 8: the frontier is negative or below one page; releasing anything here
    # would free KV still inside the window.
    for position in (0, 1, 63, 100, 500):
        assert slide(position).frees_nothing(), position


def test_the_slide_never_releases_the_prefix_cache_s_locked_prefix():
    # Scenario 9: the radix tree owns those pages; the request freeing them is a double free.
    assert slide(4096, locked=3000) == SlideDecision(3000, 3456, False)


def test_released_tokens_are_not_released_twice():
    # Scenario 10.
    decision = slide(4096, released=3456)
    assert decision.frees_nothing() and decision.released() == 0


def test_an_anchor_caps_the_slide_below_its_window():
    # Scenario 11: keep the window ending at the opener so the next turn can resume there.
    plain, anchored = slide(3500), slide(3500, 3000)
    assert anchored.free_to < plain.free_to
    assert anchored.free_to <= 3000 - 512 - RETAIN_GAP
    assert not anchored.drop_anchor


def test_the_retained_window_reaches_a_gap_below_the_opener_s_window():
    # A re-rendered prompt may diverge up to RETAIN_GAP tokens before the opener (a
    # vanished "<think>\n"); the cap 3072 - 512 - 16 = 2544 aligns to 2496, where a
    # gapless cap (2560) would already release the page the resumed turn needs.
    assert slide(3500, 3072) == SlideDecision(0, 2496, False)


def test_an_anchor_never_makes_a_slide_more_aggressive_over_the_scenario_grid():
    # Scenario 12: an anchor that freed more than the plain slide would free the live window.
    for position in range(600, 6001, 97):
        plain = slide(position).free_to
        for anchor in range(100, position + 1, 211):
            assert slide(position, anchor).free_to <= plain, (position, anchor)


@settings(max_examples=200, deadline=None)
@given(
    position=st.integers(0, 200_000),
    data=st.data(),
    window=st.integers(1, 4096),
    page=st.sampled_from([1, 16, 64, 256]),
)
def test_an_anchor_never_makes_a_slide_more_aggressive(position, data, window, page):
    # Same rule for any geometry, release floor and locked prefix.
    policy = WindowPolicy(window, page, 1)
    released = data.draw(st.integers(0, position))
    locked = data.draw(st.integers(0, position))
    request = SlidingRequest(position, released, locked, 1)
    plain = decode_slide(request, None, policy, 0)
    assert plain is not None and not plain.drop_anchor
    if position >= 1:
        anchor = data.draw(st.integers(1, position))
        anchored = decode_slide(request, anchor, policy, 0)
        assert anchored is not None
        assert anchored.free_from == plain.free_from
        assert anchored.free_to <= plain.free_to
        if anchored.drop_anchor:
            assert anchored.free_to == plain.free_to


def test_an_anchor_is_dropped_once_the_cursor_drifts_more_than_a_window_past_it():
    # Scenario 13: 3576 still holds (frontier 2999, cap 2472: 527 <= 528); 3600 drops and
    # then frees exactly what the plain slide frees.
    assert not slide(3576, 3000).drop_anchor
    dropped = slide(3600, 3000)
    assert dropped.drop_anchor
    assert dropped.free_to == slide(3600).free_to


def test_held_tokens_stay_bounded_over_a_long_run():
    # Scenario 14: without the drop rule an anchor would pin the window forever and the
    # pool floor would be unbounded. Bound: 2*(512+16) + 128 + 2*64 = 1312.
    bound = 2 * (512 + RETAIN_GAP) + 128 + 2 * 64
    state, released, was_anchored = AnchorState(), 0, False
    for position in range(128, 100_001, 128):
        if not was_anchored and position >= 3000:
            was_anchored = state.observe(OPENER, OPENER, 3000, False)
        request = SlidingRequest(position, released, 0, decode_step=position)
        decision = decode_slide(request, state.anchor_len, POLICY, forward_iter=position)
        assert decision is not None
        if decision.drop_anchor:
            state.clear()
        released = max(released, decision.free_to)
        assert position - released <= bound, (position, released)
    assert was_anchored and state.anchor_len is None


def test_prefill_slides_every_batch_without_an_anchor():
    # Scenario 15: 4096 - 512 - 64 = 3520 (no -1: prefill's last token is not yet written).
    assert prefill_slide(SlidingRequest(4096), POLICY) == SlideDecision(0, 3520, False)
    assert prefill_slide(SlidingRequest(100), POLICY).frees_nothing()
    assert prefill_slide(SlidingRequest(4096, locked_prefix=3600), POLICY).frees_nothing()


def test_inconsistent_requests_and_policies_are_refused():
    with pytest.raises(AnchorError):
        SlidingRequest(10, already_released=11)
    with pytest.raises(AnchorError):
        SlidingRequest(-1)
    with pytest.raises(AnchorError):
        WindowPolicy(0, 64)
    with pytest.raises(AnchorError) as err:
        slide(3500, 3501)  # an anchor past the cursor cannot exist
    assert err.value.field == "anchor_len"


# ---------------------------------------------------------------- AnchorRetention (full attention)

P = 4


def turn(conversation: int, length: int) -> tuple[int, ...]:
    """A sequence of ``length`` tokens unique to one conversation."""
    return tuple(1000 * conversation + i for i in range(length))


SLOTS = itertools.count()


def cached(cache: RadixCache, ids) -> None:
    """Insert a finished sequence the way the engine does at finish (fresh slots)."""
    cache.insert_prefix(ids, [next(SLOTS) for _ in ids])


def test_a_hold_keeps_the_prefix_up_to_the_opener_through_pressure():
    # The point of retention: LRU pressure would otherwise drop the conversation the
    # agent is about to resume; the held prefix survives, the rest is reclaimed.
    cache = RadixCache(P)
    retention = AnchorRetention(cache, max_held_tokens=64)
    ids = turn(1, 40)
    cached(cache, ids)
    decision = retention.hold(ids, anchor_len=22)  # opener at index 21
    assert decision.outcome is HoldOutcome.HELD and decision.released == ()
    assert cache.protected_size == 20  # whole pages up to the opener
    for other in range(2, 6):  # newer traffic, then pressure takes everything evictable
        cached(cache, turn(other, 16))
    cache.evict(cache.evictable_size)
    follow_up = ids[:22] + (5, 5, 5, 5, 5, 5)
    assert cache.match_prefix(follow_up).cached_len == 20
    retention.check_integrity()
    cache.check_integrity()


def test_without_a_hold_the_same_pressure_loses_the_prefix():
    # Control for the test above: it is the lock, not luck, that kept the prefix.
    cache = RadixCache(P)
    ids = turn(1, 40)
    cached(cache, ids)
    cache.match_prefix(ids[:20])
    for other in range(2, 6):
        cached(cache, turn(other, 16))
    cache.evict(cache.evictable_size)
    assert cache.match_prefix(ids[:22]).cached_len == 0


def test_the_next_turn_releases_the_hold_after_locking_its_own_prefix():
    # Holding past the turn it waited for would pin pages nobody returns to.
    cache = RadixCache(P)
    retention = AnchorRetention(cache, max_held_tokens=64)
    ids = turn(1, 40)
    cached(cache, ids)
    retention.hold(ids, 22)
    follow_up = ids[:22] + (5,) * 10
    match = cache.match_prefix(follow_up)
    cache.lock(match.node)  # the new request's own lock comes first
    released = retention.on_turn(follow_up)
    assert [len(h.prefix) for h in released] == [20] and len(retention) == 0
    assert cache.protected_size == 20  # still protected: by the request now
    cache.unlock(match.node)
    assert cache.protected_size == 0
    cache.check_integrity()


def test_a_prompt_that_diverges_before_the_opener_does_not_release_the_hold():
    # Another conversation sharing only the system prompt is not the turn we wait for.
    cache = RadixCache(P)
    retention = AnchorRetention(cache, max_held_tokens=64)
    ids = turn(1, 40)
    cached(cache, ids)
    retention.hold(ids, 22)
    assert retention.on_turn(ids[:8] + (9,) * 20) == ()
    assert len(retention) == 1 and cache.protected_size == 20


def test_pressure_releases_the_oldest_holds_only_as_far_as_needed():
    # Retention is soft: pressure wins, but it should not drop more holds than it needs.
    cache = RadixCache(P)
    retention = AnchorRetention(cache, max_held_tokens=1000)
    convs = [turn(c, 24) for c in (1, 2, 3)]
    for ids in convs:
        cached(cache, ids)
        retention.hold(ids, 17)  # holds 16 tokens each, 8 evictable each
    assert cache.evictable_size == 24
    assert retention.make_room(24) == ()  # already enough: nothing released
    released = retention.make_room(40)
    assert [h.prefix for h in released] == [convs[0][:16]]
    assert cache.evictable_size == 40
    cache.evict(40)
    assert cache.match_prefix(convs[2]).cached_len == 16  # the newest hold survived
    with pytest.raises(AnchorError):
        retention.make_room(-1)
    retention.check_integrity()


def test_the_bound_on_held_tokens_releases_the_oldest_hold():
    # Agents that never come back must not accumulate locks until the pool is pinned.
    cache = RadixCache(P)
    retention = AnchorRetention(cache, max_held_tokens=40)
    convs = [turn(c, 24) for c in (1, 2, 3)]
    decisions = []
    for ids in convs:
        cached(cache, ids)
        decisions.append(retention.hold(ids, 17))
    assert [len(h.prefix) for h in decisions[2].released] == [16]
    assert decisions[2].released[0].prefix == convs[0][:16]
    assert retention.held_tokens == 32 and cache.protected_size == 32
    retention.check_integrity()


def test_holds_that_cannot_or_need_not_lock_take_no_lock():
    cache = RadixCache(P)
    retention = AnchorRetention(cache, max_held_tokens=16)
    ids = turn(1, 40)
    assert retention.hold(ids, 9).outcome is HoldOutcome.NOT_CACHED  # engine must insert first
    cached(cache, ids)
    assert retention.hold(ids, 3).outcome is HoldOutcome.BELOW_ONE_PAGE
    assert retention.hold(ids, 22).outcome is HoldOutcome.OVER_BOUND  # 20 > 16
    assert cache.protected_size == 0 and len(retention) == 0
    with pytest.raises(AnchorError):
        retention.hold(ids, 41)


def test_holding_the_same_prefix_twice_takes_one_lock():
    # A second lock with one recorded hold would leak: release_all unlocks only once.
    cache = RadixCache(P)
    retention = AnchorRetention(cache, max_held_tokens=64)
    ids = turn(1, 40)
    cached(cache, ids)
    first = retention.hold(ids, 22)
    again = retention.hold(ids + (1, 2), 23)  # same whole pages up to the opener
    assert again.outcome is HoldOutcome.REFRESHED and again.held == first.held
    retention.release_all()
    assert cache.protected_size == 0
    cache.check_integrity()


def test_a_hold_survives_later_splits_of_its_node():
    # Another prompt sharing a shorter prefix splits the held node; the handle must still
    # release exactly the held span.
    cache = RadixCache(P)
    retention = AnchorRetention(cache, max_held_tokens=64)
    ids = turn(1, 40)
    cached(cache, ids)
    retention.hold(ids, 22)
    cache.match_prefix(ids[:8] + (9, 9, 9, 9))
    assert cache.protected_size == 20
    retention.release_all()
    assert cache.protected_size == 0
    cache.check_integrity()


# ---------------------------------------------------------------- AnchorRetention (recurrent state)

STATE_SLOTS = itertools.count(10_000)


def hybrid_turn(cache: HybridRadixCache, ids, snapshots_at=()) -> None:
    """A finished hybrid turn as the engine inserts it: its KV, then its page-boundary snapshots."""
    cached(cache, ids)
    for boundary in snapshots_at:
        assert cache.insert_state(ids[:boundary], next(STATE_SLOTS))


def test_a_hybrid_hold_keeps_the_snapshot_at_the_opener_with_its_kv():
    # The state at the opener is what resumes a hybrid model: pressure on snapshots and on
    # KV must both spare it, exactly as a full-attention hold spares the KV prefix.
    cache = HybridRadixCache(P)
    retention = AnchorRetention(cache, max_held_tokens=64)
    ids = turn(1, 40)
    hybrid_turn(cache, ids, snapshots_at=(12, 20, 40))
    decision = retention.hold(ids, anchor_len=22)
    assert decision.outcome is HoldOutcome.HELD and decision.held.state
    assert decision.held.prefix == ids[:20]  # the deepest snapshot within the opener's pages
    assert (cache.protected_states, cache.protected_size) == (1, 20)
    cache.evict_states(cache.evictable_states)
    cache.evict_full(cache.evictable_size)
    follow_up = ids[:22] + (5, 5, 5, 5)
    assert cache.match_state(follow_up).cached_len == 20
    retention.check_integrity()
    cache.check_integrity()


def test_a_hybrid_hold_without_a_snapshot_takes_no_lock():
    # KV without a state cannot resume the turn: holding it would pin pages for nothing.
    cache = HybridRadixCache(P)
    retention = AnchorRetention(cache, max_held_tokens=64)
    ids = turn(1, 40)
    hybrid_turn(cache, ids, snapshots_at=(24,))  # only past the opener
    decision = retention.hold(ids, anchor_len=22)
    assert decision.outcome is HoldOutcome.NO_SNAPSHOT and decision.held is None
    assert cache.protected_size == 0 and cache.protected_states == 0


def test_snapshot_pressure_releases_the_oldest_state_holds_only_as_far_as_needed():
    # A request needing a state slot outranks retention, oldest hold first.
    cache = HybridRadixCache(P)
    retention = AnchorRetention(cache, max_held_tokens=1000)
    for conversation in (1, 2, 3):
        ids = turn(conversation, 16)
        hybrid_turn(cache, ids, snapshots_at=(8,))
        retention.hold(ids, anchor_len=9)
    assert cache.evictable_states == 0
    released = retention.make_room_states(2)
    assert [h.prefix[0] for h in released] == [1000, 2000]
    assert cache.evictable_states == 2 and len(retention) == 1
    assert retention.make_room_states(1) == ()  # already enough
    assert AnchorRetention(RadixCache(P), 10).make_room_states(1) == ()  # no snapshots at all
    retention.release_all()
    assert cache.protected_states == 0 and cache.protected_size == 0
    cache.check_integrity()


class RetentionMachine(RuleBasedStateMachine):
    """Random traces of finish / hold / next turn / pressure: locks never leak.

    Reference: the protected tokens are exactly the union of the held prefixes' pages.
    """

    def __init__(self) -> None:
        super().__init__()
        self.cache = RadixCache(P)
        self.retention = AnchorRetention(self.cache, max_held_tokens=48)
        self.fresh = itertools.count()
        self.finished: list[tuple[int, ...]] = []

    @rule(conv=st.integers(1, 4), length=st.integers(1, 40))
    def finish(self, conv, length):
        ids = turn(conv, length)
        self.cache.insert_prefix(ids, [next(self.fresh) for _ in ids])
        self.finished.append(ids)

    @precondition(lambda self: self.finished)
    @rule(data=st.data())
    def hold(self, data):
        ids = data.draw(st.sampled_from(self.finished))
        self.retention.hold(ids, data.draw(st.integers(1, len(ids))))

    @rule(conv=st.integers(1, 4), length=st.integers(0, 48))
    def next_turn(self, conv, length):
        self.retention.on_turn(turn(conv, length))

    @rule(n=st.integers(0, 200))
    def pressure(self, n):
        self.retention.make_room(n)
        self.cache.evict(min(n, self.cache.evictable_size))

    @invariant()
    def protected_is_exactly_the_held_pages(self):
        pages = {h.prefix[: k * P] for h in self.retention.holds for k in range(1, len(h.prefix) // P + 1)}
        assert self.cache.protected_size == P * len(pages)
        self.retention.check_integrity()
        self.cache.check_integrity()

    def teardown(self):
        self.retention.release_all()
        assert self.cache.protected_size == 0  # no lock outlives the retention


TestRetentionNeverLeaks = RetentionMachine.TestCase
TestRetentionNeverLeaks.settings = settings(
    max_examples=40, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
