"""The recurrent half of the radix cache: state snapshots beside the KV of a hybrid model.

A hybrid model (Gated DeltaNet linear-attention layers interleaved with a few
full-attention layers) needs two things to resume a prompt at position ``p``: the KV of
``[0, p)`` for its attention layers, and the recurrent state its linear layers reached
after exactly ``p`` tokens. The state is fixed-size per request and cannot be sliced: a
state taken after 48 tokens says nothing about position 32. So the second currency is a
*point*: a state-snapshot slot attached at a node's **end** boundary.

:class:`HybridRadixCache` is a :class:`~moetray.policy.radix.RadixCache` whose nodes may
carry such a snapshot, with its own lock count. The rules, stated once:

* **Reuse needs both currencies.** ``match_state`` walks like ``match_prefix`` and then
  truncates to the deepest node on the path that holds a live snapshot; a prefix of a
  snapshot node is not reusable (its state is unknown), and a path without a snapshot
  reuses nothing.
* **A snapshot stays at its boundary.** A split leaves it on the suffix (the node that keeps
  the end boundary); only whole pages ever hold one, so the root never does.
* **Dual lock.** ``lock_state`` takes a KV lock on the path (as ``lock``) *and* a state
  lock on the node itself; ``unlock_state`` releases both. So ``full_ref >= state_ref`` on
  every node, and a locked snapshot is never evicted.
* **Two evictions.** ``evict_full(n_tokens)`` frees KV, least recently used unlocked leaves
  first (leaves without a snapshot before any: their KV can never be resumed), each
  leaf's snapshot with it, and cascades through exposed KV-only leaves.
  ``evict_states(n)`` counts snapshots, not tokens: least recently used unlocked snapshots,
  internal nodes included. An internal or KV-locked node keeps its KV (a *tombstone*: its
  snapshot can be refilled by ``attach_state``); an unlocked leaf frees both and cascades.
* **Conservation.** State slots in the tree + state slots returned by evictions +
  snapshots refused by ``attach_state`` (the caller keeps and frees those) = every slot
  ever offered, each exactly once.

The plain ``evict`` is refused here: it would drop snapshots without returning their slots.
Refusals are :class:`~moetray.policy.radix.RadixError`, raised before any state changes.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import NamedTuple

from moetray.policy.radix import RadixCache, RadixError, RadixNode, SlotUnit

__all__ = ["HybridRadixCache", "StateEviction", "StateMatch"]


class StateMatch(NamedTuple):
    cached_len: int
    """Tokens whose KV and recurrent state are both cached (whole pages; 0 when none are)."""
    node: RadixNode
    """The snapshot-bearing node ending there (the root when ``cached_len`` is 0)."""
    state_slot: int | None
    """That node's snapshot slot, to copy into the request's live state (None when cold)."""


class StateEviction(NamedTuple):
    """What an eviction freed: KV slots and state-snapshot slots, for the caller to return."""

    kv_slots: tuple[int, ...]
    state_slots: tuple[int, ...]


class HybridRadixCache(RadixCache):
    """A radix cache whose nodes may hold a recurrent-state snapshot at their end boundary.

    ``page_size`` and ``slot_unit`` as for :class:`RadixCache` (KV slots). State slots are
    a separate namespace (the state pool's slot ids).
    """

    def __init__(self, page_size: int, *, slot_unit: SlotUnit = "token") -> None:
        super().__init__(page_size, slot_unit=slot_unit)
        self._evictable_states = 0
        self._protected_states = 0
        self._state_slots: set[int] = set()

    # ------------------------------------------------------------------ views

    @property
    def evictable_states(self) -> int:
        """Snapshots no state lock protects: what ``evict_states`` may free."""
        return self._evictable_states

    @property
    def protected_states(self) -> int:
        """Snapshots under at least one state lock."""
        return self._protected_states

    @property
    def state_count(self) -> int:
        """Every snapshot the tree holds."""
        return self._evictable_states + self._protected_states

    def snapshot_slots(self) -> tuple[int, ...]:
        """Every state slot the tree holds, ascending (what a caller reclaims when it drops the tree)."""
        return tuple(sorted(self._state_slots))

    def state_of(self, node: RadixNode) -> int | None:
        """The snapshot slot at ``node``'s end boundary, or None (none or a tombstone); refuses stale."""
        self._check_handle(node)
        return node._state

    def check_integrity(self) -> None:
        """``RadixCache.check_integrity`` plus the state rules; raises ``integrity``. Does not mutate.

        Checks: the root holds no snapshot; a node without a snapshot holds no state lock;
        every state lock is covered by the node's own KV locks (``full_ref >= state_ref``);
        no state slot is owned twice and the slot index equals the union of snapshots; the
        snapshot counters equal the sums over unlocked and locked snapshots.
        """
        super().check_integrity()
        if self._root._state is not None or self._root._state_ref:
            self._fail("the root holds a state snapshot")
        evictable = protected = 0
        seen: set[int] = set()
        for node in self._walk_nodes():
            if node._state is None:
                if node._state_ref:
                    self._fail(f"{node!r} holds {node._state_ref} state locks and no snapshot")
                continue
            if node._state_ref > node._own:
                self._fail(f"{node!r} state_ref {node._state_ref} exceeds its own KV locks {node._own}")
            if node._state in seen:
                self._fail(f"state slot {node._state} is owned twice")
            seen.add(node._state)
            if node._state_ref:
                protected += 1
            else:
                evictable += 1
        if seen != self._state_slots:
            self._fail(f"state slot index holds {len(self._state_slots)} slots, nodes hold {len(seen)}")
        if (evictable, protected) != (self._evictable_states, self._protected_states):
            self._fail(
                f"state counters evictable={self._evictable_states} protected={self._protected_states}, "
                f"recomputed evictable={evictable} protected={protected}"
            )

    # ------------------------------------------------------------------ verbs

    def match_state(self, ids: Sequence[int]) -> StateMatch:
        """Decides how much of ``ids`` can be resumed: KV and a state snapshot, in whole pages.

        Walks as ``match_prefix`` does (stamping the matched path, splitting where the
        query ends inside a node; the snapshot stays on the suffix), then truncates to the
        deepest node on the path holding a live snapshot. Mutates stamps and may split;
        refuses nothing.
        """
        walked, end = self._descend(tuple(ids))
        node, length = end, walked
        while node._parent is not None and node._state is None:
            length -= len(node._key)
            node = node._parent
        return StateMatch(length, node, node._state)

    def attach_state(self, node: RadixNode, slot: int) -> bool:
        """Decides whether the tree keeps ``slot`` as the snapshot at ``node``'s end boundary.

        Returns False, taking nothing, when ``node`` is the root (no page to resume at) or
        already holds a live snapshot (dedup): the caller still owns ``slot`` and frees it.
        A tombstone (a node whose snapshot was evicted) is refilled. The new snapshot is
        unlocked (evictable). Refuses ``stale_handle`` and ``slot_already_cached`` (the
        tree owns ``slot`` at another node), before any change.
        """
        self._check_handle(node)
        if slot in self._state_slots:
            raise RadixError("slot_already_cached", f"state slot {slot} is already a snapshot", slot=slot)
        if node is self._root or node._state is not None:
            return False
        node._state = slot
        self._state_slots.add(slot)
        self._evictable_states += 1
        return True

    def insert_state(self, ids: Sequence[int], slot: int) -> bool:
        """Attaches ``slot`` as the state after exactly ``ids`` (whole pages), if the tree holds that KV.

        Matches ``ids`` (stamping, splitting so a node ends exactly there) and calls
        ``attach_state`` on that node. Returns False, taking nothing, when the tree holds
        fewer tokens of ``ids`` than all of them (the KV to resume with is missing) or when
        ``attach_state`` declines. Refuses ``invalid_argument`` when ``len(ids)`` is not a
        whole number of pages, and what ``attach_state`` refuses.
        """
        ids = tuple(ids)
        if len(ids) % self._page:
            raise RadixError(
                "invalid_argument", f"a snapshot boundary must be whole pages of {self._page}, got {len(ids)}"
            )
        if slot in self._state_slots:
            raise RadixError("slot_already_cached", f"state slot {slot} is already a snapshot", slot=slot)
        cached_len, node = self._descend(ids)
        if cached_len != len(ids):
            return False
        return self.attach_state(node, slot)

    def lock_state(self, node: RadixNode) -> None:
        """Protects ``node``'s snapshot and the KV of its whole path (re-entrant).

        Mutates: a KV lock as ``lock(node)`` plus one state lock on ``node``; the snapshot
        moves from evictable to protected on its 0→1 edge. Refuses ``no_snapshot`` when
        ``node`` holds none (a tombstone included) and ``stale_handle``.
        """
        self._check_handle(node)
        if node._state is None:
            raise RadixError("no_snapshot", f"{node!r} holds no state snapshot to lock")
        self.lock(node)
        if node._state_ref == 0:
            self._evictable_states -= 1
            self._protected_states += 1
        node._state_ref += 1

    def unlock_state(self, node: RadixNode) -> None:
        """Releases one ``lock_state(node)``: its state lock and its KV lock.

        Refuses ``unlock_without_lock`` when ``node`` holds no state lock, and ``stale_handle``.
        """
        self._check_handle(node)
        if node._state_ref < 1:
            raise RadixError("unlock_without_lock", f"{node!r} holds no state lock")
        node._state_ref -= 1
        if node._state_ref == 0:
            self._protected_states -= 1
            self._evictable_states += 1
        super().unlock(node)

    def unlock(self, node: RadixNode) -> None:
        """``RadixCache.unlock``; refuses ``unlock_without_lock`` for a KV lock a state lock holds."""
        self._check_handle(node)
        if node._state_ref and node._own - 1 < node._state_ref:
            raise RadixError("unlock_without_lock", f"{node!r}'s remaining locks belong to its state locks")
        super().unlock(node)

    def evict(self, n_tokens: int) -> tuple[int, ...]:
        """Refused (``invalid_argument``): it would drop snapshots without returning their slots."""
        raise RadixError(
            "invalid_argument",
            "a hybrid cache evicts with evict_full or evict_states, which return both currencies",
        )

    def evict_full(self, n_tokens: int) -> StateEviction:
        """Decides what to free to make room for ``n_tokens`` of KV; returns both currencies freed.

        Frees whole unlocked leaves until at least ``ceil(n_tokens / page_size)`` pages are
        freed: leaves without a snapshot first (their KV can never be resumed), then least
        recently used. Each leaf's snapshot goes with it; a parent exposed as an unlocked
        leaf without a snapshot is freed at once (cascade), one with a snapshot joins the
        candidates. Locked paths and locked snapshots are never touched. ``evict_full(0)``
        is a no-op. Mutates: unlinks the victims (their handles go stale). Refuses, before
        anything is unlinked, ``evict_exceeds_evictable`` when ``n_tokens >
        evictable_size`` and ``invalid_argument`` when it is negative.
        """
        self._check_evict_count(n_tokens, self._evictable, "tokens")
        needed = -(-n_tokens // self._page) * self._page
        heap = [self._leaf_key(n) for n in self._walk_nodes() if n._ref == 0 and not n._children]
        heapq.heapify(heap)
        kv: list[int] = []
        states: list[int] = []
        freed = 0
        while freed < needed:
            victim = heapq.heappop(heap)[-1]
            freed += self._drop_leaf(victim, kv, states, heap)
        return StateEviction(tuple(kv), tuple(states))

    def evict_states(self, n: int) -> StateEviction:
        """Decides which ``n`` snapshots to free (counted in snapshots); returns both currencies freed.

        Least recently used unlocked snapshots first, internal nodes included; on a tie (one
        walk stamps a whole path alike) an internal node goes before a leaf, since the deeper
        snapshot resumes further along the same path. An internal
        or KV-locked node becomes a tombstone (its snapshot freed, its KV kept); an
        unlocked leaf frees its KV too and cascades through exposed KV-only leaves.
        ``evict_states(0)`` is a no-op. Refuses, before any change,
        ``evict_exceeds_evictable`` when ``n > evictable_states`` and ``invalid_argument``
        when it is negative.
        """
        self._check_evict_count(n, self._evictable_states, "snapshots")
        heap = [
            (node._stamp, not node._children, node._serial, node)
            for node in self._walk_nodes()
            if node._state is not None and node._state_ref == 0
        ]
        heapq.heapify(heap)
        kv: list[int] = []
        states: list[int] = []
        while len(states) < n:
            node = heapq.heappop(heap)[-1]
            if node._ref == 0 and not node._children:
                self._drop_leaf(node, kv, states, None)
            else:
                states.append(self._take_state(node))
        return StateEviction(tuple(kv), tuple(states))

    # ------------------------------------------------------------------ internals

    def _check_evict_count(self, n: int, available: int, unit: str) -> None:
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise RadixError("invalid_argument", f"the eviction count must be an int >= 0, got {n!r}")
        if n > available:
            raise RadixError(
                "evict_exceeds_evictable",
                f"asked to evict {n} {unit}, only {available} are evictable",
                requested=n,
                evictable=available,
            )

    @staticmethod
    def _leaf_key(node: RadixNode) -> tuple[bool, int, int, RadixNode]:
        return (node._state is not None, node._stamp, node._serial, node)

    def _take_state(self, node: RadixNode) -> int:
        """Frees ``node``'s unlocked snapshot (it becomes a tombstone); returns the slot."""
        slot = node._state
        assert slot is not None and node._state_ref == 0, node
        node._state = None
        self._state_slots.discard(slot)
        self._evictable_states -= 1
        return slot

    def _drop_leaf(
        self,
        victim: RadixNode,
        kv: list[int],
        states: list[int],
        heap: list[tuple[bool, int, int, RadixNode]] | None,
    ) -> int:
        """Unlinks an unlocked leaf with its snapshot, then the KV-only leaves that exposes.

        A parent left an unlocked leaf with a snapshot joins ``heap`` (when given). Returns
        the tokens freed; appends the freed slots to ``kv`` and ``states``.
        """
        freed = 0
        node: RadixNode | None = victim
        while node is not None:
            if node._state is not None:
                states.append(self._take_state(node))
            parent = self._unlink_leaf(node)
            kv.extend(node._value)
            freed += len(node._key)
            node = None
            if parent is not self._root and parent._ref == 0 and not parent._children:
                if parent._state is None:
                    node = parent  # a KV-only leaf can never be resumed: it goes too
                elif heap is not None:
                    heapq.heappush(heap, self._leaf_key(parent))
        return freed
