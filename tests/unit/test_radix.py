"""Rules of the radix prefix cache, then a model-based harness against a reference model.

Scenario tests use page size 4 unless stated. The harness at the bottom drives random
traces of match / insert / lock / unlock / evict through both the real tree and an
independent, obviously-correct model keyed by page path, and checks after every step:
the tree's own ``check_integrity``, node-for-node agreement with the model, counters,
handle validity, LRU eviction order, and slot conservation.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from moetray.policy.radix import InsertResult, MatchResult, RadixCache, RadixError, RadixNode

A8 = list(range(100, 108))


def cache_with(ids, slots, page_size=4, **kw) -> tuple[RadixCache, InsertResult]:
    cache = RadixCache(page_size, **kw)
    result = cache.insert_prefix(ids, slots)
    cache.check_integrity()
    return cache, result


# ---------------------------------------------------------------- match / insert


def test_insert_then_match_returns_the_same_slots():
    # Scenario 1: a lookup that returned other slots would read another prompt's KV.
    cache, res = cache_with(A8, range(8))
    assert (res.cached_len, res.inserted_len) == (0, 8)
    assert cache.evictable_size == 8 and cache.protected_size == 0
    match = cache.match_prefix(A8)
    assert match.cached_len == 8
    assert cache.slots_of(match.node) == tuple(range(8))


def test_match_stops_at_the_last_whole_page_before_a_divergence():
    # Scenario 2: reusing the 2 matching tokens of page 2 would splice KV of a different page.
    cache, _ = cache_with(A8, range(8))
    match = cache.match_prefix([100, 101, 102, 103, 104, 105, 999, 999])
    assert match.cached_len == 4
    assert cache.slots_of(match.node) == (0, 1, 2, 3)
    cache.check_integrity()


def test_insert_drops_the_trailing_partial_page():
    # Scenario 3: a partial page is still being written; caching it would serve stale KV.
    cache, res = cache_with(A8[:6], range(6))
    assert (res.cached_len, res.inserted_len) == (0, 4)
    assert cache.total_size == 4
    assert cache.match_prefix(A8[:6]).cached_len == 4


def test_a_sub_page_query_matches_nothing_and_returns_the_root():
    # Scenario 4: a short key must not match a child by its first tokens only.
    cache, _ = cache_with(A8, range(8))
    match = cache.match_prefix(A8[:3])
    assert match.cached_len == 0
    assert cache.slots_of(match.node) == ()


def test_reinsert_reports_the_whole_span_as_cached_and_keeps_the_original_slots():
    # Scenario 5: the classic leak. cached_len says the caller's slots 50..57 were not
    # taken, so the caller must free them; the tree keeps its own 0..7.
    cache, _ = cache_with(A8, range(8))
    res = cache.insert_prefix(A8, range(50, 58))
    assert res.cached_len == 8 and res.inserted_len == 8
    assert cache.total_size == 8
    assert cache.slots_of(cache.match_prefix(A8).node) == tuple(range(8))
    assert cache.duplicates_to_free(range(50, 58), res) == tuple(range(50, 58))


def test_slots_identical_to_the_trees_own_are_not_duplicates():
    # A request admitted on a cached prefix already points at the tree's slots; freeing
    # them on commit would free pages the tree still serves.
    cache, _ = cache_with(A8[:4], range(4))
    mine = [0, 1, 2, 3, 20, 21, 22, 23]
    res = cache.insert_prefix(A8, mine)
    assert res.cached_len == 4
    assert cache.duplicates_to_free(mine, res) == ()
    assert cache.slots_of(res.node) == (0, 1, 2, 3, 20, 21, 22, 23)
    cache.check_integrity()


def test_the_tree_keeps_its_own_copy_of_the_slots():
    # Scenario 6: a caller reusing its buffer after insert must not rewrite the tree.
    slots = list(range(8))
    cache, _ = cache_with(A8, slots)
    slots[:] = [99] * 8
    assert cache.slots_of(cache.match_prefix(A8).node) == tuple(range(8))


def test_page_size_one_is_a_token_trie():
    # Scenario 12: P=1 must match token by token.
    cache, _ = cache_with([1, 2, 3, 4, 5], range(5), page_size=1)
    assert cache.match_prefix([1, 2, 3, 9, 9]).cached_len == 3
    assert cache.match_prefix([1, 2, 3, 4, 5]).cached_len == 5


def test_pages_sharing_leading_tokens_do_not_share_an_edge():
    # Two pages that agree on 3 of 4 tokens are different pages: matching one for the
    # other would reuse KV computed for a different token.
    cache = RadixCache(4)
    cache.insert_prefix([1, 1, 1, 1, 5, 5, 5, 5], range(8))
    cache.insert_prefix([1, 1, 1, 2, 6, 6, 6, 6], range(8, 16))
    assert cache.match_prefix([1, 1, 1, 2, 6, 6, 6, 6]).cached_len == 8
    assert cache.match_prefix([1, 1, 1, 3]).cached_len == 0
    cache.check_integrity()


# ---------------------------------------------------------------- refusals before mutation


def snapshot(cache: RadixCache):
    return (cache.evictable_size, cache.protected_size, real_pages(cache))


def test_wrong_slot_count_is_refused_without_change():
    # One slot per token: a short list would shift every index by the missing count.
    cache, _ = cache_with(A8[:4], range(4))
    before = snapshot(cache)
    with pytest.raises(RadixError) as err:
        cache.insert_prefix(A8, range(7))
    assert err.value.kind == "slot_count_mismatch" and err.value.got == 7
    assert snapshot(cache) == before


def test_a_slot_the_tree_already_owns_is_refused_without_change():
    # Storing slot 2 twice would hand the same KV page to two prefixes: a double free later.
    cache, _ = cache_with(A8[:4], range(4))
    before = snapshot(cache)
    with pytest.raises(RadixError) as err:
        cache.insert_prefix([7, 7, 7, 7, 8, 8, 8, 8], [10, 11, 12, 13, 14, 2, 15, 16])
    assert err.value.kind == "slot_already_cached" and err.value.slot == 2
    assert snapshot(cache) == before


def test_a_caller_slot_aliasing_another_cached_page_is_refused():
    # In the already-cached span a slot may equal the tree's own at that position; one
    # owned by a DIFFERENT page would be freed by the caller while the tree serves it.
    cache, _ = cache_with([5, 5, 5, 5], range(4))
    cache.insert_prefix(A8[:4], range(10, 14))
    before = snapshot(cache)
    with pytest.raises(RadixError) as err:
        cache.insert_prefix(A8, [10, 11, 2, 13, 20, 21, 22, 23])
    assert err.value.kind == "slot_already_cached"
    assert snapshot(cache) == before


def test_the_same_slot_twice_in_one_call_is_refused():
    cache = RadixCache(4)
    with pytest.raises(RadixError) as err:
        cache.insert_prefix(A8, [0, 1, 2, 3, 4, 5, 6, 3])
    assert err.value.kind == "duplicate_slot"
    assert cache.total_size == 0


def test_bad_geometry_is_refused():
    for bad in (0, -4, 2.0, True):
        with pytest.raises(RadixError):
            RadixCache(bad)
    with pytest.raises(RadixError):
        RadixCache(4, slot_unit="byte")


# ---------------------------------------------------------------- locks


def test_lock_accounting_moves_tokens_only_on_the_zero_one_edge():
    # Scenario 7: counting every lock would make protected exceed the cache and eviction
    # would refuse memory that is actually free.
    cache, _ = cache_with(A8, range(8))
    head = cache.match_prefix(A8[:4]).node  # splits 4 + 4
    tail = cache.match_prefix(A8).node
    cache.lock(tail)
    assert (cache.protected_size, cache.evictable_size) == (8, 0)
    cache.lock(tail)
    assert (cache.protected_size, cache.evictable_size) == (8, 0)
    cache.unlock(tail)
    assert (cache.protected_size, cache.evictable_size) == (8, 0)
    cache.unlock(tail)
    assert (cache.protected_size, cache.evictable_size) == (0, 8)
    cache.lock(head)
    assert (cache.protected_size, cache.evictable_size) == (4, 4)
    cache.check_integrity()


def test_unlock_without_lock_is_refused():
    # A stray unlock would drive a lock depth negative and expose a live request's KV.
    cache, res = cache_with(A8, range(8))
    with pytest.raises(RadixError) as err:
        cache.unlock(res.node)
    assert err.value.kind == "unlock_without_lock"
    cache.check_integrity()


def test_a_descendants_lock_does_not_license_unlocking_the_parent():
    # Unlocking the head while only the tail is locked would leave the tail's path
    # unprotected above it: the parent could be evicted under a locked child.
    cache, _ = cache_with(A8, range(8))
    head = cache.match_prefix(A8[:4]).node
    tail = cache.match_prefix(A8).node
    cache.lock(tail)
    with pytest.raises(RadixError) as err:
        cache.unlock(head)
    assert err.value.kind == "unlock_without_lock"
    assert cache.protected_size == 8
    cache.check_integrity()


def test_the_root_can_be_locked_and_unlocked_symmetrically():
    # A cold match returns the root; callers lock whatever match returned.
    cache = RadixCache(4)
    root = cache.match_prefix([1, 2]).node
    cache.lock(root)
    cache.unlock(root)
    with pytest.raises(RadixError):
        cache.unlock(root)  # its permanent lock is not the caller's to release
    cache.check_integrity()


def test_a_split_keeps_the_original_node_as_the_suffix():
    # Scenario 14: a handle taken before a split must still name the same end boundary,
    # or a later unlock would release the wrong span.
    cache, res = cache_with(A8, range(8))
    cache.lock(res.node)
    head = cache.match_prefix(A8[:4]).node
    assert head is not res.node
    assert cache.slots_of(res.node) == tuple(range(8))
    assert cache.slots_of(head) == (0, 1, 2, 3)
    assert head.locked and res.node.locked  # the split copied the lock depth
    cache.unlock(res.node)
    assert (cache.protected_size, cache.evictable_size) == (0, 8)
    cache.check_integrity()


# ---------------------------------------------------------------- eviction


def two_branches() -> tuple[RadixCache, RadixNode, RadixNode]:
    cache = RadixCache(4)
    a = cache.insert_prefix([0, 1, 2, 3], range(4)).node
    b = cache.insert_prefix([100, 101, 102, 103], range(100, 104)).node
    return cache, a, b


def test_eviction_takes_the_least_recently_used_leaf():
    # Scenario 8: evicting the just-used branch turns every follow-up turn into a cold prefill.
    cache, a, b = two_branches()
    cache.match_prefix([0, 1, 2, 3])
    assert cache.evict(1) == (100, 101, 102, 103)
    assert not b.alive and a.alive
    cache.check_integrity()


def test_a_locked_leaf_is_never_evicted():
    # Scenario 9: evicting a locked prefix frees KV that a running request still reads.
    cache, a, b = two_branches()
    cache.match_prefix([100, 101, 102, 103])  # B is now the most recent
    cache.lock(a)
    assert cache.evict(4) == (100, 101, 102, 103)
    assert cache.match_prefix([0, 1, 2, 3]).cached_len == 4
    cache.check_integrity()


def test_eviction_cascades_to_a_parent_that_becomes_a_leaf():
    # Scenario 10: without the cascade, evict(8) on a split 4+4 path would stop at 4
    # and the caller would believe 8 tokens were freed.
    cache, _ = cache_with(A8, range(8))
    cache.match_prefix(A8[:4])
    freed = cache.evict(8)
    assert sorted(freed) == list(range(8))
    assert cache.total_size == 0
    cache.check_integrity()


def test_evicting_more_than_evictable_is_refused_with_the_tree_untouched():
    # Scenario 11: a partial eviction followed by an error would leak the freed pages.
    cache, _ = cache_with(A8[:4], range(4))
    before = snapshot(cache)
    with pytest.raises(RadixError) as err:
        cache.evict(8)
    assert err.value.kind == "evict_exceeds_evictable"
    assert (err.value.requested, err.value.evictable) == (8, 4)
    assert snapshot(cache) == before
    assert cache.evict(0) == ()
    with pytest.raises(RadixError):
        cache.evict(-1)


def test_eviction_frees_only_the_pages_asked_for_trimming_a_long_leaf_from_its_tail():
    # Issue 5's gap: the stock ledger drops every cached block at once under pressure.
    # Needing one page must cost one page: the head of the prefix stays reusable.
    cache, res = cache_with(list(range(16)), range(16))
    freed = cache.evict(3)
    assert freed == (12, 13, 14, 15)
    assert not res.node.alive  # its end page is gone: the old handle is stale
    assert cache.match_prefix(list(range(16))).cached_len == 12
    assert cache.evict(5) == (4, 5, 6, 7, 8, 9, 10, 11)
    assert cache.match_prefix(list(range(16))).cached_len == 4
    cache.check_integrity()


def test_evicting_everything_keeps_the_root():
    cache, _ = cache_with(A8, range(8))
    cache.evict(cache.evictable_size)
    assert cache.total_size == 0
    res = cache.insert_prefix(A8, range(8))
    assert res.cached_len == 0 and cache.total_size == 8
    cache.check_integrity()


def test_a_stale_handle_is_refused():
    # Locking an evicted node would count tokens that are no longer in the tree.
    cache, res = cache_with(A8, range(8))
    cache.evict(8)
    for verb in (cache.lock, cache.unlock, cache.slots_of):
        with pytest.raises(RadixError) as err:
            verb(res.node)
        assert err.value.kind == "stale_handle"
    other = RadixCache(4)
    with pytest.raises(RadixError):
        other.lock(cache.match_prefix([]).node)


def test_check_integrity_catches_a_drifted_counter():
    # The integrity check is only worth its calls if it can fail.
    cache, _ = cache_with(A8, range(8))
    cache._evictable += 4
    with pytest.raises(RadixError) as err:
        cache.check_integrity()
    assert err.value.kind == "integrity"


# ---------------------------------------------------------------- page-id mode (KV block ids)


def test_page_mode_takes_one_block_id_per_page():
    # transformers' block ledger deals in block ids of block_size tokens: one id per page.
    cache = RadixCache(4, slot_unit="page")
    res = cache.insert_prefix(list(range(10)), [7, 3, 9])  # 2 whole pages + a partial one
    assert (res.cached_len, res.inserted_len) == (0, 8)
    assert cache.slots_of(res.node) == (7, 3)  # the partial block stays with the caller
    assert cache.total_size == 8
    res2 = cache.insert_prefix(list(range(12)), [7, 3, 11])
    assert res2.cached_len == 8 and cache.duplicates_to_free([7, 3, 11], res2) == ()
    assert cache.evict(1) == (11,)
    cache.check_integrity()


def test_page_mode_refuses_a_token_granular_slot_list():
    cache = RadixCache(4, slot_unit="page")
    with pytest.raises(RadixError) as err:
        cache.insert_prefix(list(range(8)), range(8))
    assert err.value.kind == "slot_count_mismatch" and err.value.expected == (2, 2)


def test_a_ragged_prompt_end_copies_the_longest_run_a_next_page_begins_with():
    # The prompt's last page, short of a page, copies the matched rows of a cached next page:
    # the longest run wins, at most a page less one token (one is always left to compute).
    cache = RadixCache(4, slot_unit="page")
    cache.insert_prefix([1, 2, 3, 4, 5, 6, 7, 8], [10, 11])
    cache.insert_prefix([1, 2, 3, 4, 5, 6, 9, 9], [10, 12])
    matched = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert matched.cached_len == 4
    assert cache.partial_page(matched.node, [5, 6, 7]) == (3, 11)
    assert cache.partial_page(matched.node, [5, 6, 9, 9, 1]) == (3, 12)  # never the whole page
    assert cache.partial_page(matched.node, [5, 7]) == (1, 11)  # ties keep the first page seen
    assert cache.partial_page(matched.node, [8]) is None
    assert cache.partial_page(matched.node, []) is None
    cache.check_integrity()


def test_partial_page_needs_page_slots():
    cache, res = cache_with(A8, range(8))
    with pytest.raises(RadixError) as err:
        cache.partial_page(res.node, [1])
    assert err.value.kind == "invalid_argument"


# ---------------------------------------------------------------- conservation scenario


def test_slots_are_conserved_over_rounds_of_shared_heads_and_varying_tails():
    # Scenario 13: a request lifecycle repeated; every slot handed in ends up in exactly
    # one place (tree, evicted, or returned to the caller as a duplicate / partial tail).
    cache = RadixCache(4)
    fresh = itertools.count()
    handed, returned = Counter(), Counter()
    heads = [[1, 1, 1, 1], [2, 2, 2, 2]]
    for round_ in range(6):
        prompt = heads[round_ % 2] + [10 + round_] * 4 + [9] * (round_ % 3)
        match = cache.match_prefix(prompt)
        cache.lock(match.node)
        mine = list(cache.slots_of(match.node))
        new = [next(fresh) for _ in range(len(prompt) - len(mine))]
        handed.update(new)
        res = cache.insert_prefix(prompt, mine + new)
        returned.update(cache.duplicates_to_free(mine + new, res))
        returned.update((mine + new)[res.inserted_len :])
        cache.lock(res.node)
        cache.unlock(match.node)
        cache.unlock(res.node)
        if round_ % 2:
            returned.update(cache.evict(4))
        cache.check_integrity()
    in_tree = Counter(slot for _, slots in real_pages(cache) for slot in slots)
    assert in_tree + returned == handed
    assert set((in_tree + returned).values()) == {1}


# ================================================================= model-based harness


def real_pages(cache: RadixCache) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The tree as (page path, slots of that page) pairs, read from the nodes."""
    out = []
    per_page = cache.page_size if cache.slot_unit == "token" else 1
    stack = [((), cache._root)]
    while stack:
        prefix, node = stack.pop()
        path = prefix + node._key
        for j in range(len(node._key) // cache.page_size):
            end = len(prefix) + (j + 1) * cache.page_size
            out.append((path[:end], node._value[j * per_page : (j + 1) * per_page]))
        stack.extend((path, child) for child in node._children.values())
    return sorted(out)


class RadixModel:
    """Reference: a dict of page paths (the page-aligned prefixes ``ids[:k*P]``).

    Obviously correct by construction: no nodes, no splits, no counters. A page is
    protected iff some held lock's path extends it; eviction may take any unprotected
    childless page whose stamp is minimal.
    """

    def __init__(self, page_size: int, per_page: int) -> None:
        self.P = page_size
        self.per_page = per_page
        self.pages: dict[tuple[int, ...], tuple[int, ...]] = {}
        self.stamp: dict[tuple[int, ...], int] = {}
        self.children: Counter[tuple[int, ...]] = Counter()
        self.locks: Counter[tuple[int, ...]] = Counter()
        self.clock = 0

    def match_len(self, ids) -> int:
        k = 0
        while (k + 1) * self.P <= len(ids) and tuple(ids[: (k + 1) * self.P]) in self.pages:
            k += 1
        return k * self.P

    def path_slots(self, path) -> tuple[int, ...]:
        pages = (self.pages[tuple(path[: k * self.P])] for k in range(1, len(path) // self.P + 1))
        return tuple(s for page in pages for s in page)

    def touch(self, ids, n: int) -> None:
        self.clock += 1
        for k in range(1, n // self.P + 1):
            self.stamp[tuple(ids[: k * self.P])] = self.clock

    def add(self, path, slots) -> None:
        self.pages[path] = slots
        self.stamp[path] = self.clock
        self.children[path[: -self.P]] += 1

    def remove(self, path) -> None:
        del self.pages[path], self.stamp[path]
        self.children[path[: -self.P]] -= 1

    def protected(self, page) -> bool:
        return any(n and len(lk) >= len(page) and lk[: len(page)] == page for lk, n in self.locks.items())

    def sizes(self) -> tuple[int, int]:
        prot = sum(self.P for p in self.pages if self.protected(p))
        return len(self.pages) * self.P - prot, prot

    def eligible(self) -> list[tuple[int, ...]]:
        return [p for p in self.pages if not self.children[p] and not self.protected(p)]


@dataclass
class Handle:
    node: RadixNode
    path: tuple[int, ...]
    dead: bool = False


def make_machine(page_size: int, slot_unit: str, page_alphabet: list[tuple[int, ...]]):
    per_page = page_size if slot_unit == "token" else 1
    prompts = st.builds(
        lambda pages, tail: tuple(t for p in pages for t in p) + tuple(tail),
        st.lists(st.sampled_from(page_alphabet), max_size=5),
        st.lists(st.sampled_from([1, 2]), max_size=page_size - 1),
    )

    class RadixMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.cache = RadixCache(page_size, slot_unit=slot_unit)
            self.model = RadixModel(page_size, per_page)
            self.fresh = itertools.count()
            self.handed: Counter[int] = Counter()
            self.returned: Counter[int] = Counter()
            self.slot_page: dict[int, tuple[int, ...]] = {}
            self.handles: list[Handle] = [Handle(self.cache.match_prefix(()).node, ())]
            self.held: list[Handle] = []

        def remember(self, node: RadixNode, path) -> None:
            self.handles.append(Handle(node, tuple(path)))
            self.handles = self.handles[:1] + [h for h in self.handles[1:] if not h.dead][-12:]

        def n_slots(self, n_ids: int, ceil: bool) -> int:
            if slot_unit == "token":
                return n_ids
            return -(-n_ids // page_size) if ceil else n_ids // page_size

        @rule(ids=prompts)
        def match(self, ids):
            expected = self.model.match_len(ids)
            res = self.cache.match_prefix(ids)
            assert isinstance(res, MatchResult)
            assert res.cached_len == expected, ("match.cached_len", res.cached_len, expected)
            assert self.cache.slots_of(res.node) == self.model.path_slots(ids[:expected])
            self.model.touch(ids, expected)
            self.remember(res.node, ids[:expected])

        @rule(ids=prompts, reuse_tree_slots=st.booleans(), ceil=st.booleans())
        def insert(self, ids, reuse_tree_slots, ceil):
            whole = len(ids) - len(ids) % page_size
            cached = self.model.match_len(ids[:whole])
            count = self.n_slots(len(ids), ceil)
            mine = list(self.model.path_slots(ids[:cached])) if reuse_tree_slots else []
            new = [next(self.fresh) for _ in range(count - len(mine))]
            self.handed.update(new)
            slots = mine + new
            res = self.cache.insert_prefix(ids, slots)
            assert (res.cached_len, res.inserted_len) == (cached, whole), ("insert", res, cached, whole)
            dups = self.cache.duplicates_to_free(slots, res)
            assert dups == (() if reuse_tree_slots else tuple(slots[: cached // page_size * per_page]))
            self.returned.update(dups)
            self.returned.update(slots[whole // page_size * per_page :])
            self.model.touch(ids, cached)
            kept = slots[: whole // page_size * per_page]
            for k in range(cached // page_size, whole // page_size):
                path = tuple(ids[: (k + 1) * page_size])
                page_slots = tuple(kept[k * per_page : (k + 1) * per_page])
                self.model.add(path, page_slots)
                self.slot_page.update(dict.fromkeys(page_slots, path))
            self.remember(res.node, ids[:whole])

        @precondition(lambda self: len(self.model.pages) > 0)
        @rule(data=st.data())
        def insert_aliasing_a_cached_slot(self, data):
            # Refused before any change: the invariants then check nothing moved.
            victim = data.draw(st.sampled_from(sorted(self.slot_page)))
            ids = (9,) * page_size
            count = self.n_slots(len(ids), False)
            with pytest.raises(RadixError) as err:
                self.cache.insert_prefix(ids, [victim] + [-1 - i for i in range(count - 1)])
            assert err.value.kind == "slot_already_cached"

        @rule(data=st.data())
        def lock(self, data):
            handle = data.draw(st.sampled_from(self.handles))
            if handle.dead:
                with pytest.raises(RadixError) as err:
                    self.cache.lock(handle.node)
                assert err.value.kind == "stale_handle"
                return
            self.cache.lock(handle.node)
            self.model.locks[handle.path] += 1
            self.held.append(handle)

        @precondition(lambda self: self.held)
        @rule(data=st.data())
        def unlock(self, data):
            handle = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
            self.cache.unlock(handle.node)
            self.model.locks[handle.path] -= 1

        @rule(data=st.data())
        def unlock_without_lock(self, data):
            free = [h for h in self.handles if not h.dead and self.model.locks[h.path] == 0]
            if free:
                handle = data.draw(st.sampled_from(free))
                with pytest.raises(RadixError) as err:
                    self.cache.unlock(handle.node)
                assert err.value.kind == "unlock_without_lock"

        @rule(data=st.data())
        def evict(self, data):
            evictable, _ = self.model.sizes()
            n = data.draw(st.integers(0, evictable))
            freed = self.cache.evict(n)
            pages = {self.slot_page[s] for s in freed}
            assert len(pages) == -(-n // page_size), ("evict.count", n, len(pages))
            assert sorted(freed) == sorted(s for p in pages for s in self.model.pages[p]), "evict.whole_pages"
            while pages:
                eligible = self.model.eligible()
                oldest = min(self.model.stamp[p] for p in eligible)
                pick = [p for p in pages if p in eligible and self.model.stamp[p] == oldest]
                assert pick, ("model.evict: victims are not the least recently used leaves", pages)
                pages.discard(pick[0])
                self.model.remove(pick[0])
                for h in self.handles:
                    h.dead = h.dead or h.path == pick[0]
            for s in freed:
                del self.slot_page[s]
            self.returned.update(freed)

        @rule(extra=st.integers(1, 2 * page_size))
        def evict_too_much(self, extra):
            evictable, _ = self.model.sizes()
            with pytest.raises(RadixError) as err:
                self.cache.evict(evictable + extra)
            assert err.value.kind == "evict_exceeds_evictable"

        @invariant()
        def integrity(self):
            self.cache.check_integrity()

        @invariant()
        def agrees_with_model(self):
            assert real_pages(self.cache) == sorted(self.model.pages.items()), "model.nodes"
            evictable, protected = self.model.sizes()
            sizes = (self.cache.evictable_size, self.cache.protected_size)
            assert sizes == (evictable, protected), "counters"

        @invariant()
        def handles_name_their_span(self):
            for h in self.handles:
                assert h.node.alive is not h.dead, ("handle.alive", h)
                if not h.dead:
                    assert self.cache.slots_of(h.node) == self.model.path_slots(h.path), ("handle.slots", h)

        @invariant()
        def slots_are_conserved(self):
            in_tree = Counter(s for slots in self.model.pages.values() for s in slots)
            assert in_tree + self.returned == self.handed, "conservation"
            assert all(n == 1 for n in (in_tree + self.returned).values()), "conservation.once"

    return RadixMachine


ALPHABETS = {
    1: [(1,), (2,), (3,)],
    2: [(1, 1), (1, 2), (2, 1)],
    4: [(1, 1, 1, 1), (1, 1, 1, 2), (1, 2, 1, 2), (2, 2, 2, 2)],
}
HARNESS = settings(
    max_examples=40,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

TestRadixToken1 = make_machine(1, "token", ALPHABETS[1]).TestCase
TestRadixToken1.settings = HARNESS
TestRadixToken4 = make_machine(4, "token", ALPHABETS[4]).TestCase
TestRadixToken4.settings = HARNESS
TestRadixPage2 = make_machine(2, "page", ALPHABETS[2]).TestCase
TestRadixPage2.settings = HARNESS
TestRadixPage4 = make_machine(4, "page", ALPHABETS[4]).TestCase
TestRadixPage4.settings = HARNESS
