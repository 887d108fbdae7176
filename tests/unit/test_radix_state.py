"""Rules of the recurrent half of the radix cache (state snapshots for hybrid models).

Page size 4 unless stated; KV slots are token slots 0.., state slots are 900.. so the two
currencies never look alike. A conservation property at the bottom drives random traces.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moetray.policy.radix import RadixError
from moetray.policy.radix_state import HybridRadixCache, StateEviction

A12 = list(range(100, 112))  # three pages
B8 = [100, 101, 102, 103, 200, 201, 202, 203]  # shares A's first page


def hybrid_with(ids=A12, page_size=4) -> HybridRadixCache:
    cache = HybridRadixCache(page_size)
    cache.insert_prefix(ids, range(len(ids)))
    return cache


# ---------------------------------------------------------------- match / attach


def test_a_snapshot_at_a_boundary_is_restored_by_match():
    """Resuming at 12 needs the state after exactly 12 tokens; match must hand back that slot."""
    cache = hybrid_with()
    assert cache.insert_state(A12, 900)
    match = cache.match_state(A12 + [7, 7])
    assert (match.cached_len, match.state_slot) == (12, 900)
    assert cache.slots_of(match.node) == tuple(range(12))
    cache.check_integrity()


def test_without_a_snapshot_nothing_is_resumable():
    """KV alone cannot resume a hybrid model: the linear layers would start from a zero state."""
    cache = hybrid_with()
    match = cache.match_state(A12)
    assert (match.cached_len, match.state_slot) == (0, None)
    assert cache.match_prefix(A12).cached_len == 12  # the KV is there all the same


def test_the_deepest_snapshot_on_the_path_wins():
    """Reusing a shallower snapshot would recompute pages the tree could have resumed past."""
    cache = hybrid_with()
    assert cache.insert_state(A12[:4], 900)
    assert cache.insert_state(A12[:8], 901)
    assert cache.match_state(A12).state_slot == 901
    assert cache.match_state(A12[:8]).cached_len == 8


def test_a_split_leaves_the_snapshot_on_the_suffix():
    """A snapshot marks its node's end boundary; moving it to a prefix would restore a state too far ahead."""
    cache = hybrid_with()
    assert cache.insert_state(A12, 900)
    cache.match_prefix(A12[:8])  # splits the 12-token node at 8
    cache.check_integrity()
    assert cache.match_state(A12).cached_len == 12
    assert cache.match_state(A12[:8]).cached_len == 0  # the prefix of a snapshot node is not resumable


def test_a_second_snapshot_at_the_same_boundary_is_declined_for_the_caller_to_free():
    """Dedup: the tree keeps one state per boundary; the caller still owns and frees its copy."""
    cache = hybrid_with()
    assert cache.insert_state(A12, 900)
    assert not cache.insert_state(A12, 901)
    assert cache.state_count == 1 and cache.match_state(A12).state_slot == 900
    with pytest.raises(RadixError) as refusal:
        cache.insert_state(A12[:8], 900)
    assert refusal.value.kind == "slot_already_cached"


def test_a_snapshot_needs_whole_pages_of_cached_kv():
    """A state at a ragged or uncached boundary could never be paired with its KV."""
    cache = hybrid_with(A12[:8])
    assert not cache.insert_state(A12, 900)  # the tree holds 8 of the 12 tokens
    assert not cache.insert_state([], 900)  # the root holds no page to resume at
    with pytest.raises(RadixError) as refusal:
        cache.insert_state(A12[:6], 900)
    assert refusal.value.kind == "invalid_argument"
    assert cache.state_count == 0


# ---------------------------------------------------------------- eviction


def test_evicting_an_internal_snapshot_keeps_its_kv_and_attach_refills_it():
    """A tombstone frees the state slot only; the KV under a longer snapshot must stay."""
    cache = hybrid_with()
    assert cache.insert_state(A12[:4], 900)
    assert cache.insert_state(A12, 901)
    cache.match_state(A12)  # one walk stamps both alike: the shallower one goes first
    freed = cache.evict_states(1)
    assert freed == StateEviction((), (900,))
    assert cache.total_size == 12 and cache.match_state(A12[:4]).cached_len == 0
    assert cache.insert_state(A12[:4], 902)  # the tombstone is refilled
    cache.check_integrity()


def test_evicting_a_leaf_snapshot_frees_its_kv_and_cascades():
    """A leaf's KV without its snapshot is unusable; so is every KV-only parent it exposes."""
    cache = hybrid_with()
    cache.match_prefix(A12[:4])  # a KV-only node [0, 4) above the leaf
    assert cache.insert_state(A12, 900)
    freed = cache.evict_states(1)
    assert sorted(freed.kv_slots) == list(range(12)) and freed.state_slots == (900,)
    assert cache.total_size == 0
    cache.check_integrity()


def test_evict_states_counts_snapshots_not_tokens():
    """A request needs one state slot, whatever the prompt length: eviction is counted in slots."""
    cache = hybrid_with()
    cache.insert_prefix(B8, range(20, 28))
    for ids, slot in ((A12[:4], 900), (A12[:8], 901), (A12, 902), (B8, 903)):
        assert cache.insert_state(ids, slot)
    freed = cache.evict_states(3)
    assert len(freed.state_slots) == 3 and cache.state_count == 1
    cache.check_integrity()


def test_evict_states_takes_the_least_recently_used_snapshot():
    """Recency follows reuse: the snapshot a conversation just resumed from is the last to go."""
    cache = hybrid_with()
    cache.insert_prefix(B8, range(20, 28))
    assert cache.insert_state(A12, 900)
    assert cache.insert_state(B8, 901)
    cache.match_state(A12)
    assert cache.evict_states(1).state_slots == (901,)


def test_evict_full_takes_the_leaf_snapshot_and_leaves_the_ancestor_resumable():
    """Freeing KV under pressure must not strand the shorter snapshot above it."""
    cache = hybrid_with()
    assert cache.insert_state(A12[:4], 900)
    assert cache.insert_state(A12, 901)
    freed = cache.evict_full(4)
    assert sorted(freed.kv_slots) == list(range(4, 12)) and freed.state_slots == (901,)
    assert cache.match_state(A12).cached_len == 4
    cache.check_integrity()


def test_evict_full_frees_kv_only_leaves_before_any_snapshot():
    """KV past the last snapshot can never be resumed: it goes before reusable prefixes do."""
    cache = hybrid_with()
    cache.insert_prefix(B8, range(20, 28))
    assert cache.insert_state(A12, 900)
    cache.match_prefix(B8)  # B is more recent but has no snapshot
    freed = cache.evict_full(4)
    assert sorted(freed.kv_slots) == list(range(24, 28)) and freed.state_slots == ()
    assert cache.match_state(A12).state_slot == 900


def test_the_plain_evict_is_refused():
    """It would drop snapshots without handing back their slots: a state-pool leak."""
    cache = hybrid_with()
    assert cache.insert_state(A12, 900)
    with pytest.raises(RadixError) as refusal:
        cache.evict(4)
    assert refusal.value.kind == "invalid_argument" and cache.total_size == 12


def test_evictions_beyond_what_is_evictable_are_refused_before_anything_moves():
    """A partial eviction followed by an error would leave the caller's pools out of step."""
    cache = hybrid_with()
    assert cache.insert_state(A12, 900)
    cache.lock_state(cache.match_state(A12).node)
    for evict, n in ((cache.evict_states, 1), (cache.evict_full, 4)):
        with pytest.raises(RadixError) as refusal:
            evict(n)
        assert refusal.value.kind == "evict_exceeds_evictable"
    assert cache.evict_states(0) == StateEviction((), ())
    assert cache.state_count == 1 and cache.total_size == 12


# ---------------------------------------------------------------- locks


def test_a_state_lock_pins_the_snapshot_and_its_whole_kv_path():
    """Between match and the copy into the live slot, neither currency may be evicted."""
    cache = hybrid_with()
    assert cache.insert_state(A12, 900)
    node = cache.match_state(A12).node
    cache.lock_state(node)
    assert (cache.protected_states, cache.evictable_states, cache.protected_size) == (1, 0, 12)
    cache.check_integrity()
    cache.unlock_state(node)
    assert (cache.protected_states, cache.evictable_states, cache.evictable_size) == (0, 1, 12)


def test_full_ref_never_drops_below_state_ref():
    """A KV unlock stealing the lock a state lock took would let the path under a pinned snapshot go."""
    cache = hybrid_with()
    assert cache.insert_state(A12, 900)
    node = cache.match_state(A12).node
    cache.lock_state(node)
    with pytest.raises(RadixError) as refusal:
        cache.unlock(node)
    assert refusal.value.kind == "unlock_without_lock"
    cache.lock(node)
    cache.unlock(node)  # a KV lock of its own may go
    with pytest.raises(RadixError):
        cache.unlock_state(cache._root)
    cache.check_integrity()


def test_a_state_lock_needs_a_snapshot():
    """Locking a tombstone would pin a state that is not there."""
    cache = hybrid_with()
    node = cache.match_prefix(A12).node
    with pytest.raises(RadixError) as refusal:
        cache.lock_state(node)
    assert refusal.value.kind == "no_snapshot"


def test_integrity_catches_a_drifting_snapshot_counter():
    """The counters feed admission (free state slots); a drift must be caught, not trusted."""
    cache = hybrid_with()
    assert cache.insert_state(A12, 900)
    cache._evictable_states += 1
    with pytest.raises(RadixError) as refusal:
        cache.check_integrity()
    assert refusal.value.kind == "integrity"


# ---------------------------------------------------------------- conservation


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_state_slots_are_conserved_across_random_traces(data):
    """Property: slots in the tree + slots evicted + slots the tree declined == slots offered, once each."""
    cache = HybridRadixCache(2)
    heads = [[1, 2], [1, 2, 3, 4], [5, 6], [1, 2, 7, 8]]
    offered: list[int] = []
    returned: list[int] = []
    locks: list = []
    next_slot = iter(range(1000, 2000))
    next_kv = iter(range(10_000))
    for _ in range(data.draw(st.integers(5, 40))):
        op = data.draw(st.sampled_from(["insert", "snap", "lock", "unlock", "evict_states", "evict_full"]))
        ids = data.draw(st.sampled_from(heads)) + data.draw(st.lists(st.integers(1, 3), max_size=4))
        if op == "insert":
            res = cache.insert_prefix(ids, [next(next_kv) for _ in ids])
            assert res.inserted_len <= len(ids)
        elif op == "snap":
            slot = next(next_slot)
            offered.append(slot)
            if not cache.insert_state(ids[: len(ids) - len(ids) % 2], slot):
                returned.append(slot)  # declined: the caller frees it
        elif op == "lock":
            node = cache.match_state(ids).node
            if cache.state_of(node) is not None:
                cache.lock_state(node)
                locks.append(node)
        elif op == "unlock" and locks:
            cache.unlock_state(locks.pop())
        elif op == "evict_states":
            returned += cache.evict_states(data.draw(st.integers(0, cache.evictable_states))).state_slots
        elif op == "evict_full":
            returned += cache.evict_full(data.draw(st.integers(0, cache.evictable_size))).state_slots
        cache.check_integrity()
        held = sorted(cache._state_slots)
        assert sorted(held + returned) == sorted(offered)
        assert all(node.alive for node in locks)
