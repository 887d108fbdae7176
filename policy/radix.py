"""Radix prefix cache: which prefix of a new prompt is already computed, and what may be evicted.

A page-granular radix tree over token ids (SGLang-style). Prompts that share a prefix
share nodes, and so share the KV storage those nodes name. The tree only ever reuses
whole pages of ``page_size`` tokens: a trailing partial page is still being written and
has no stable identity.

Units, stated once:

* **Lengths and sizes are always tokens**: ``cached_len``, ``inserted_len``,
  ``evictable_size``, ``protected_size`` and ``evict(n_tokens)``. They are multiples of
  ``page_size`` except the ``n_tokens`` a caller asks for, which is rounded up to pages.
* **Slots** are the opaque integers the caller's KV pool hands out. With
  ``slot_unit="token"`` there is one slot per token (a token-granular pool, SGLang's
  ``page_size`` token slots per page). With ``slot_unit="page"`` there is one slot per
  page: a KV *block id*, which is what transformers' continuous-batching block ledger
  deals in (a block holds ``block_size`` tokens). Every method that takes or returns
  slots uses the cache's unit.

Ownership: the tree keeps an owned copy of the slots it stores. ``insert_prefix``
reports ``cached_len``, *how much of the caller's span the tree already had*; the
caller's slots for that span are duplicates the caller must free (except those identical
to the tree's own, see ``duplicates_to_free``). Forgetting that is the classic leak.
Conservation: slots in the tree + slots returned by ``evict`` + duplicates returned to
the caller = every slot ever handed in, each exactly once.

Accounting: every cached token is in exactly one of ``evictable_size`` (no lock on its
node) or ``protected_size`` (locked). Locks walk from a node to the root and move tokens
between the two only on a node's 0↔1 edge. Recency is a logical clock, one tick per
``match_prefix`` / ``insert_prefix`` walk, stamped on the whole walked path: no wall time,
so eviction order is deterministic.

Handles: ``match_prefix`` and ``insert_prefix`` return a node naming the *end* of the
matched span. Splitting a node keeps the original object as the suffix, so a handle keeps
naming the same end boundary however the tree is later split. A handle whose end page
was evicted is stale: ``lock``, ``unlock`` and ``slots_of`` refuse it.

Refusals are ``RadixError`` (a ``ValueError``) with a snake_case ``.kind`` and named
fields, raised before any state changes.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from typing import Literal, NamedTuple

from moetray.policy.refused import Refused

__all__ = [
    "InsertResult",
    "MatchResult",
    "RadixCache",
    "RadixError",
    "RadixNode",
    "SlotUnit",
]

SlotUnit = Literal["token", "page"]
"""What one slot stands for: one token of KV, or one page (a KV block id)."""


class RadixError(Refused, ValueError):
    """A radix cache refusal; ``.kind`` says which rule, extra attributes carry the numbers.

    Kinds: ``invalid_argument``, ``slot_count_mismatch`` (``.expected``, ``.got``),
    ``duplicate_slot`` (``.slot``: the caller handed the same slot twice),
    ``slot_already_cached`` (``.slot``: the tree already owns it elsewhere),
    ``stale_handle`` (the node was evicted or belongs to another cache),
    ``unlock_without_lock``, ``evict_exceeds_evictable`` (``.requested``, ``.evictable``),
    ``no_snapshot`` (a state lock asked of a node holding no state snapshot),
    ``integrity`` (``check_integrity`` found counters or structure out of line).
    """

    KINDS = (
        "invalid_argument",
        "slot_count_mismatch",
        "duplicate_slot",
        "slot_already_cached",
        "stale_handle",
        "unlock_without_lock",
        "evict_exceeds_evictable",
        "no_snapshot",
        "integrity",
    )

    def __init__(self, kind: str, message: str, **fields: object) -> None:
        super().__init__(kind, f"{kind}: {message}", **fields)


class RadixNode:
    """One edge of the tree: a run of whole pages, and the slots that hold their KV.

    Opaque to callers: keep it as a handle for ``lock``/``unlock``/``slots_of``. Its end
    boundary never moves (splits keep this object as the suffix).
    """

    __slots__ = (
        "_alive", "_cache", "_children", "_key", "_own", "_parent", "_ref", "_serial", "_stamp", "_state",
        "_state_ref", "_value",
    )

    def __init__(
        self,
        cache: RadixCache,
        key: tuple[int, ...],
        value: tuple[int, ...],
        parent: RadixNode | None,
        ref: int,
        stamp: int,
        serial: int,
    ) -> None:
        self._cache = cache
        self._key = key
        self._value = value
        self._parent = parent
        self._children: dict[tuple[int, ...], RadixNode] = {}
        self._ref = ref  # lock depth: own locks plus every lock taken on a descendant
        self._own = ref  # locks taken on this very node (a split's new prefix has none)
        self._stamp = stamp
        self._serial = serial
        self._alive = True
        # The recurrent half (policy.radix_state): a state snapshot slot at this node's END
        # boundary and its own lock count. Inert in a plain cache; a split leaves both on the
        # suffix, which keeps the end boundary.
        self._state: int | None = None
        self._state_ref = 0

    @property
    def alive(self) -> bool:
        """False once eviction removed this node's end page (the handle is stale)."""
        return self._alive

    @property
    def locked(self) -> bool:
        """True while some lock protects this node (its own, or one on a descendant)."""
        return self._ref > 0

    def __repr__(self) -> str:
        state = "root" if self._parent is None else ("alive" if self._alive else "stale")
        return f"RadixNode(#{self._serial}, {state}, tokens={len(self._key)}, ref={self._ref})"


class MatchResult(NamedTuple):
    cached_len: int
    """Tokens of the query the tree holds, whole pages only."""
    node: RadixNode
    """Handle naming the end of the matched span (the root when ``cached_len`` is 0)."""


class InsertResult(NamedTuple):
    cached_len: int
    """Tokens of the span the tree already had: the caller's slots there are duplicates."""
    node: RadixNode
    """Handle naming the end of the whole inserted span."""
    inserted_len: int
    """The span now covered by the tree: the ids rounded down to whole pages."""


class RadixCache:
    """Page-granular radix tree over token ids; decides prefix reuse and eviction order.

    ``page_size``: tokens per page (>= 1; 1 makes it a token trie). ``slot_unit``:
    ``"token"`` (one slot per token) or ``"page"`` (one slot per page, e.g. a KV block id).
    """

    def __init__(self, page_size: int, *, slot_unit: SlotUnit = "token") -> None:
        if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
            raise RadixError("invalid_argument", f"page_size must be an int >= 1, got {page_size!r}")
        if slot_unit not in ("token", "page"):
            raise RadixError("invalid_argument", f"slot_unit must be 'token' or 'page', got {slot_unit!r}")
        self._page = page_size
        self._unit: SlotUnit = slot_unit
        self._clock = 0
        self._serials = 0
        self._evictable = 0
        self._protected = 0
        self._slots: set[int] = set()
        # The root holds a permanent lock so it is never evicted; callers may still lock it
        # (a cold match returns it) and unlock it symmetrically.
        self._root = self._new_node((), (), None, ref=1)

    # ------------------------------------------------------------------ views

    @property
    def page_size(self) -> int:
        return self._page

    @property
    def slot_unit(self) -> SlotUnit:
        return self._unit

    @property
    def evictable_size(self) -> int:
        """Cached tokens no lock protects: what ``evict`` may free."""
        return self._evictable

    @property
    def protected_size(self) -> int:
        """Cached tokens under at least one lock."""
        return self._protected

    @property
    def total_size(self) -> int:
        """All cached tokens (evictable + protected)."""
        return self._evictable + self._protected

    def slots_of(self, node: RadixNode) -> tuple[int, ...]:
        """The slots of the whole path from the root to ``node``, in token order.

        Empty for the root. Does not mutate (no recency stamp). Refuses a stale handle
        (``stale_handle``).
        """
        self._check_handle(node)
        parts: list[tuple[int, ...]] = []
        while node._parent is not None:
            parts.append(node._value)
            node = node._parent
        return tuple(slot for part in reversed(parts) for slot in part)

    def duplicates_to_free(self, slots: Sequence[int], result: InsertResult) -> tuple[int, ...]:
        """The caller's slots that ``insert_prefix`` did not take and the caller must free.

        Decides, for the span ``[0, result.cached_len)`` the tree already had, which of
        the caller's ``slots`` (the same sequence passed to that insert) are copies: all
        of them except those identical to the tree's own slot at the same position (a
        request whose page table already points at the tree's pages frees nothing
        there). The trailing partial page past ``inserted_len`` is not included: the
        caller keeps it. Call it right after the insert. Does not mutate; refuses a
        stale ``result.node``.
        """
        span = self._entries(result.cached_len)
        tree = self.slots_of(result.node)[:span]
        mine_span = tuple(slots)[:span]
        return tuple(mine for mine, canonical in zip(mine_span, tree, strict=True) if mine != canonical)

    def check_integrity(self) -> None:
        """Recomputes every counter and structural rule from the nodes; raises ``integrity``.

        Checks: each node is registered under its own first page and points back at its
        parent; keys are non-empty whole pages with one slot per unit; no slot is owned
        twice and the slot index equals the union of node values; a parent's lock depth
        covers its children's and its stamp is at least as recent; ``evictable_size`` and
        ``protected_size`` equal the sums over unlocked and locked nodes. Does not mutate.
        """
        evictable = protected = 0
        seen: set[int] = set()
        if self._root._ref < 1 or self._root._key or self._root._value:
            self._fail(f"root must hold its permanent lock and no tokens (ref={self._root._ref})")
        for node in self._walk_nodes():
            parent = node._parent
            assert parent is not None
            if not node._alive:
                self._fail(f"{node!r} is reachable but marked stale")
            if not node._key or len(node._key) % self._page:
                self._fail(f"{node!r} key length {len(node._key)} is not whole pages of {self._page}")
            if len(node._value) != self._entries(len(node._key)):
                self._fail(f"{node!r} holds {len(node._value)} slots for {len(node._key)} tokens")
            if parent._children.get(node._key[: self._page]) is not node:
                self._fail(f"{node!r} is not registered under its first page in its parent")
            if node._stamp > parent._stamp and parent is not self._root:
                self._fail(f"{node!r} stamp {node._stamp} is newer than its parent's {parent._stamp}")
            for slot in node._value:
                if slot in seen:
                    self._fail(f"slot {slot} is owned twice")
                seen.add(slot)
            if node._ref == 0:
                evictable += len(node._key)
            else:
                protected += len(node._key)
        for node in self._walk_nodes(include_root=True):
            below = sum(child._ref for child in node._children.values())
            if node._own < (1 if node is self._root else 0) or node._ref != node._own + below:
                self._fail(f"{node!r} lock depth {node._ref} != own {node._own} + children's {below}")
        if seen != self._slots:
            self._fail(f"slot index holds {len(self._slots)} slots, nodes hold {len(seen)}")
        if (evictable, protected) != (self._evictable, self._protected):
            self._fail(
                f"counters evictable={self._evictable} protected={self._protected}, "
                f"recomputed evictable={evictable} protected={protected}"
            )

    # ------------------------------------------------------------------ verbs

    def match_prefix(self, ids: Sequence[int]) -> MatchResult:
        """Decides how much of ``ids`` is already computed, in whole pages.

        Mutates: stamps the whole matched path with one tick of the logical clock (so a
        long shared prefix does not age out under its short suffixes), and splits a node
        when the query diverges or ends inside it (the original node keeps the suffix, so
        earlier handles stay valid). A ragged length is fine; a query shorter than a page
        matches nothing and returns the root. Refuses nothing.
        """
        cached_len, node = self._descend(tuple(ids))
        return MatchResult(cached_len, node)

    def partial_page(self, node: RadixNode, ids: Sequence[int]) -> tuple[int, int] | None:
        """Decides how much of a page past ``node`` a prompt can copy: ``(tokens, slot)``, the longest
        start of ``ids`` (at most a page less one token) that one of ``node``'s next pages begins
        with, and the slot holding that page; None where none begins with ``ids[0]``.

        A whole-page match shares pages; the prompt's ragged end cannot share one (the request
        writes the rest of its last page), but may copy the matched rows of a cached page into a
        page of its own and compute only the tokens after them. Slots are pages
        (``slot_unit="page"``, else ``invalid_argument``). Does not mutate (no recency stamp: the
        page is copied, not shared); refuses a stale handle (``stale_handle``).
        """
        if self._unit != "page":
            raise RadixError("invalid_argument", "partial_page needs slot_unit='page'")
        self._check_handle(node)
        want = tuple(ids[: self._page - 1])
        best: tuple[int, int] | None = None
        for key, child in node._children.items():
            same = _common_tokens(key, want, 0)
            if same and (best is None or same > best[0]):
                best = (same, child._value[0])
        return best

    def insert_prefix(self, ids: Sequence[int], slots: Sequence[int]) -> InsertResult:
        """Records that ``slots`` hold the KV of ``ids``; decides which part the tree keeps.

        ``slots`` has one entry per token (``slot_unit="token"``: ``len(slots) ==
        len(ids)``) or one per page (``"page"``: one per whole page, optionally plus one
        for a trailing partial page). The trailing partial page is dropped (the caller
        keeps its slot). The tree stores an owned copy of the slots of the span it did
        not have yet, as one new unlocked (evictable) leaf.

        Returns ``cached_len``: how much of the span the tree already had. The caller's
        slots there were NOT taken and must be freed by the caller (``duplicates_to_free``
        names them). Mutates: the walked path and the new leaf are stamped; a node may be
        split. Refuses, before any change: ``slot_count_mismatch``, ``duplicate_slot``
        (the same slot twice in ``slots``), ``slot_already_cached`` (a slot the tree owns
        at another position).
        """
        ids = tuple(ids)
        slots = tuple(slots)
        whole = len(ids) - len(ids) % self._page
        full_pages = self._entries(whole)
        allowed: tuple[int, ...]
        if self._unit == "token":
            allowed = (len(ids),)
        else:
            allowed = (full_pages, -(-len(ids) // self._page))
        if len(slots) not in allowed:
            raise RadixError(
                "slot_count_mismatch",
                f"{len(ids)} ids with page_size {self._page} need {' or '.join(map(str, allowed))} "
                f"{self._unit} slots, got {len(slots)}",
                expected=allowed,
                got=len(slots),
            )
        if len(set(slots)) != len(slots):
            repeated = next(s for i, s in enumerate(slots) if s in slots[:i])
            raise RadixError("duplicate_slot", f"slot {repeated} appears twice", slot=repeated)
        kept = slots[:full_pages]
        cached_len, tree_slots = self._probe(ids[:whole])
        cached_entries = self._entries(cached_len)
        for mine, canonical in zip(kept[:cached_entries], tree_slots, strict=True):
            if mine != canonical and mine in self._slots:
                raise RadixError(
                    "slot_already_cached", f"slot {mine} is owned by another cached page", slot=mine
                )
        new_slots = kept[cached_entries:]
        for slot in new_slots:
            if slot in self._slots:
                raise RadixError("slot_already_cached", f"slot {slot} is already cached", slot=slot)

        walked, node = self._descend(ids[:whole])
        assert walked == cached_len, (walked, cached_len)
        if cached_len < whole:
            leaf = self._new_node(ids[cached_len:whole], new_slots, node, ref=0)
            node._children[leaf._key[: self._page]] = leaf
            self._evictable += whole - cached_len
            self._slots.update(new_slots)
            node = leaf
        return InsertResult(cached_len, node, whole)

    def lock(self, node: RadixNode) -> None:
        """Protects the path from the root to ``node`` from eviction (re-entrant).

        Mutates: lock depths along the path; tokens move from evictable to protected only
        for nodes going 0→1. Locking the root is allowed and changes no counter. Refuses
        a stale handle (``stale_handle``).
        """
        self._check_handle(node)
        node._own += 1
        walk: RadixNode | None = node
        while walk is not None:
            if walk._ref == 0:
                self._evictable -= len(walk._key)
                self._protected += len(walk._key)
            walk._ref += 1
            walk = walk._parent

    def unlock(self, node: RadixNode) -> None:
        """Releases one ``lock(node)``.

        Mutates: lock depths along the path; tokens return to evictable only for nodes
        going 1→0. Refuses ``unlock_without_lock`` when ``node`` holds no lock of its own
        (a lock on a descendant does not count), and ``stale_handle``.
        """
        self._check_handle(node)
        if node._own < (2 if node is self._root else 1):
            raise RadixError("unlock_without_lock", f"{node!r} holds no lock of its own")
        node._own -= 1
        walk: RadixNode | None = node
        while walk is not None:
            walk._ref -= 1
            if walk._ref == 0:
                self._protected -= len(walk._key)
                self._evictable += len(walk._key)
            walk = walk._parent

    def evict(self, n_tokens: int) -> tuple[int, ...]:
        """Decides what to free to make room for ``n_tokens``; returns the freed slots.

        Frees exactly ``ceil(n_tokens / page_size)`` pages, least-recently-used first:
        it pops unlocked leaves by stamp; a leaf with more pages than still needed loses
        only its tail pages (the node is split, the remaining head keeps its stamp); a
        parent that becomes an unlocked leaf joins the same pass (cascade). Locked paths
        are never touched. ``evict(0)`` is a no-op. Mutates: unlinks the victims; handles
        whose end page was freed go stale. Refuses, before anything is unlinked,
        ``evict_exceeds_evictable`` when ``n_tokens > evictable_size`` and
        ``invalid_argument`` when it is negative.
        """
        if not isinstance(n_tokens, int) or isinstance(n_tokens, bool) or n_tokens < 0:
            raise RadixError("invalid_argument", f"n_tokens must be an int >= 0, got {n_tokens!r}")
        if n_tokens > self._evictable:
            raise RadixError(
                "evict_exceeds_evictable",
                f"asked to evict {n_tokens} tokens, only {self._evictable} are evictable",
                requested=n_tokens,
                evictable=self._evictable,
            )
        pages_needed = -(-n_tokens // self._page)
        heap = [(n._stamp, n._serial, n) for n in self._walk_nodes() if n._ref == 0 and not n._children]
        heapq.heapify(heap)
        freed: list[int] = []
        while pages_needed:
            _, _, victim = heapq.heappop(heap)
            pages = len(victim._key) // self._page
            if pages > pages_needed:
                self._split(victim, (pages - pages_needed) * self._page)
                pages = pages_needed
            parent = self._unlink_leaf(victim)
            freed.extend(victim._value)
            pages_needed -= pages
            if parent is not self._root and parent._ref == 0 and not parent._children:
                heapq.heappush(heap, (parent._stamp, parent._serial, parent))
        return tuple(freed)

    # ------------------------------------------------------------------ internals

    def _entries(self, n_tokens: int) -> int:
        """How many slots cover ``n_tokens`` (whole pages) in this cache's unit."""
        return n_tokens if self._unit == "token" else n_tokens // self._page

    def _new_node(
        self, key: tuple[int, ...], value: tuple[int, ...], parent: RadixNode | None, ref: int
    ) -> RadixNode:
        self._serials += 1
        return RadixNode(self, key, value, parent, ref, self._clock, self._serials)

    def _check_handle(self, node: RadixNode) -> None:
        if not isinstance(node, RadixNode) or node._cache is not self:
            raise RadixError("stale_handle", f"{node!r} is not a node of this cache")
        if not node._alive:
            raise RadixError("stale_handle", f"{node!r} was evicted")

    def _fail(self, message: str) -> None:
        raise RadixError("integrity", message)

    def _unlink_leaf(self, victim: RadixNode) -> RadixNode:
        """Removes an unlocked leaf and its slots from the tree; returns its parent. Its handle goes stale."""
        assert victim._ref == 0 and not victim._children, victim
        parent = victim._parent
        assert parent is not None
        del parent._children[victim._key[: self._page]]
        victim._alive = False
        self._evictable -= len(victim._key)
        self._slots.difference_update(victim._value)
        return parent

    def _walk_nodes(self, include_root: bool = False) -> Iterator[RadixNode]:
        stack = list(self._root._children.values())
        if include_root:
            yield self._root
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node._children.values())

    def _common_pages(self, key: tuple[int, ...], ids: tuple[int, ...], pos: int) -> int:
        """Tokens of ``key`` that equal ``ids[pos:]``, rounded down to whole pages."""
        same = _common_tokens(key, ids, pos)
        return same - same % self._page

    def _probe(self, ids: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
        """Read-only walk: the whole-page match length of ``ids`` and the tree's slots for it."""
        node, pos = self._root, 0
        found: list[int] = []
        while pos + self._page <= len(ids):
            child = node._children.get(ids[pos : pos + self._page])
            if child is None:
                break
            same = self._common_pages(child._key, ids, pos)
            found.extend(child._value[: self._entries(same)])
            pos += same
            if same < len(child._key):
                break
            node = child
        return pos, tuple(found)

    def _descend(self, ids: tuple[int, ...]) -> tuple[int, RadixNode]:
        """Mutating walk: stamps the matched path, splits at a mid-node end; returns the end node."""
        self._clock += 1
        tick = self._clock
        node, pos = self._root, 0
        node._stamp = tick
        while pos + self._page <= len(ids):
            child = node._children.get(ids[pos : pos + self._page])
            if child is None:
                break
            same = self._common_pages(child._key, ids, pos)
            if same < len(child._key):
                child = self._split(child, same)
            child._stamp = tick
            node = child
            pos += same
        return pos, node

    def _split(self, node: RadixNode, at: int) -> RadixNode:
        """Cuts ``node`` after ``at`` tokens; returns the NEW prefix node, ``node`` keeps the suffix.

        Lock depth and stamp are copied to the prefix, so no counter changes.
        """
        assert 0 < at < len(node._key) and at % self._page == 0, (at, len(node._key))
        parent = node._parent
        assert parent is not None
        cut = self._entries(at)
        prefix = self._new_node(node._key[:at], node._value[:cut], parent, ref=node._ref)
        prefix._own = 0  # every lock counted in its depth was taken on the suffix or below
        prefix._stamp = node._stamp
        parent._children[node._key[: self._page]] = prefix
        node._key = node._key[at:]
        node._value = node._value[cut:]
        node._parent = prefix
        prefix._children[node._key[: self._page]] = node
        return prefix


def _common_tokens(key: tuple[int, ...], ids: tuple[int, ...], pos: int) -> int:
    """How many leading tokens of ``key`` equal ``ids[pos:]``."""
    limit = min(len(key), len(ids) - pos)
    if key[:limit] == ids[pos : pos + limit]:  # the common case, compared in C
        return limit
    same = 0
    while key[same] == ids[pos + same]:
        same += 1
    return same
