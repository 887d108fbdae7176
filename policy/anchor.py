"""Anchor: which position an agentic turn will come back to, and what to keep for it.

An agent turn reasons, emits a tool call, and stops; the harness runs the tool and sends
the conversation back. It edits the context at that boundary (canonicalizes the call,
appends the result), so the next prompt agrees with this turn's sequence **up to the
tool-call opener** and diverges after it. The opener's position is therefore the deepest
prefix worth keeping.

The anchor is found by an integer compare on sampled ids: the opener text must encode to
exactly one token (``resolve_anchor_token``), and only the first opener of a turn counts
(``AnchorState.observe``). What the anchor then keeps depends on the attention:

* **Full attention**: the radix cache already keeps every finished prefix, but only until
  LRU pressure takes it. ``AnchorRetention`` locks the prefix up to the opener in the radix
  tree so it outlives other prefixes, and releases that lock when the conversation's next
  turn arrives, when pressure needs the room, or when the held total would exceed a bound.
  Soft, never a leak.
* **Recurrent state** (hybrid models, ``policy.radix_state``): KV alone cannot resume a
  turn; the state snapshot must sit at the boundary. The hold is then on the deepest
  snapshot within the opener's prefix, and it locks that snapshot with its KV
  (``lock_state``), so the state is retained exactly like the KV prefix; snapshot
  pressure releases holds through ``make_room_states``.
* **Sliding-window attention**: a request periodically frees the KV that slid out of its
  window (``decode_slide`` / ``prefill_slide``). An anchor only ever makes that slide less
  aggressive, keeping the window that ends at the opener, and is dropped once the cursor
  drifts more than a window past it, so held tokens stay bounded.

All positions are token counts; spans are half-open ``[free_from, free_to)``. Refusals
are ``AnchorError`` (a ``ValueError``) with a snake_case ``.kind``, raised before any
state changes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import NamedTuple, TypeGuard

from .radix import RadixCache, RadixNode
from .radix_state import HybridRadixCache
from .refused import Refused

__all__ = [
    "RETAIN_GAP",
    "AnchorError",
    "AnchorRetention",
    "AnchorState",
    "Hold",
    "HoldDecision",
    "HoldOutcome",
    "SlideDecision",
    "SlidingRequest",
    "WindowPolicy",
    "decode_slide",
    "prefill_slide",
    "resolve_anchor_token",
]

RETAIN_GAP = 16
"""Tokens kept below a retained window: a re-rendered prompt may diverge a few tokens
early (a generation prompt such as ``<think>\\n`` that vanishes from history)."""


class AnchorError(Refused, ValueError):
    """An anchor refusal; ``.kind`` is ``invalid_argument`` (``.field`` names the argument)."""

    KINDS = ("invalid_argument",)

    def __init__(self, field: str, message: str) -> None:
        super().__init__("invalid_argument", f"invalid_argument: {field}: {message}", field=field)


def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise AnchorError(field, message)


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _require_int(field: str, value: object, minimum: int) -> None:
    _require(_is_int(value) and value >= minimum, field, f"must be an int >= {minimum}, got {value!r}")


# ---------------------------------------------------------------- detection


def resolve_anchor_token(opener_text: str | None, encode: Callable[[str], Sequence[int]]) -> int | None:
    """Decides which sampled token id marks a tool-call opener, or None for no anchors.

    ``opener_text`` is the tool-call format's opener (``ToolCallFormat.opener()``);
    ``encode`` turns literal text into ids WITHOUT special-token decoration (for a
    Hugging Face tokenizer: ``lambda s: tok.encode(s, add_special_tokens=False)``). The
    opener counts only if it encodes to exactly one token, so detection stays one integer
    compare per sampled id. None, an empty opener, or a multi-token encoding give None
    (caching degrades to plain prefix reuse). Pure: refuses nothing.
    """
    if not opener_text:
        return None
    ids = list(encode(opener_text))
    return int(ids[0]) if len(ids) == 1 else None


class AnchorState:
    """One request's anchor: the sequence length just past the first tool-call opener.

    ``anchor_len`` is None until an opener is observed.
    """

    __slots__ = ("anchor_len",)

    def __init__(self) -> None:
        self.anchor_len: int | None = None

    def clear(self) -> None:
        """Forgets the anchor (a slide dropped it, or the request restarted). Mutates."""
        self.anchor_len = None

    def observe(self, token: int, anchor_token: int | None, position: int, finished: bool) -> bool:
        """Decides whether the sampled ``token`` anchors this turn; returns True when it did.

        ``position`` is the sequence length including ``token``. Only the first opener
        of a turn anchors (the deepest prefix a rewrite of the echoed call still
        shares); a token that finishes the request never anchors; no ``anchor_token``
        means never. Mutates ``anchor_len`` only on True. Refuses ``invalid_argument``
        when ``position < 1``.
        """
        _require_int("position", position, 1)
        if anchor_token is None or finished or self.anchor_len is not None or token != anchor_token:
            return False
        self.anchor_len = position
        return True


# ---------------------------------------------------------------- sliding window


@dataclass(frozen=True)
class WindowPolicy:
    """Geometry of a sliding-window model's KV release: window, page, decode cadence (tokens)."""

    sliding_window: int
    page_size: int
    eviction_interval: int = 128

    def __post_init__(self) -> None:
        for name in ("sliding_window", "page_size", "eviction_interval"):
            _require_int(name, getattr(self, name), 1)

    def with_eviction_interval(self, interval: int) -> WindowPolicy:
        """A copy with another decode cadence, clamped to at least every forward. Pure."""
        return replace(self, eviction_interval=max(1, int(interval)))


@dataclass(frozen=True)
class SlidingRequest:
    """What a slide needs to know about one request, in tokens.

    ``position``: tokens in the sequence. ``already_released``: ``[0, already_released)``
    was freed by earlier slides. ``locked_prefix``: tokens owned by the prefix cache,
    never released by the request. ``decode_step``: decode forwards done so far.
    """

    position: int
    already_released: int = 0
    locked_prefix: int = 0
    decode_step: int = 0

    def __post_init__(self) -> None:
        for name in ("position", "already_released", "locked_prefix", "decode_step"):
            _require_int(name, getattr(self, name), 0)
        _require(
            self.already_released <= self.position,
            "already_released",
            f"{self.already_released} is past the position {self.position}",
        )


class SlideDecision(NamedTuple):
    """The half-open span ``[free_from, free_to)`` to release, and whether to drop the anchor."""

    free_from: int
    free_to: int
    drop_anchor: bool

    def frees_nothing(self) -> bool:
        return self.free_to <= self.free_from

    def released(self) -> int:
        """Tokens this decision releases."""
        return max(0, self.free_to - self.free_from)


def _release_span(request: SlidingRequest, threshold: int, page_size: int, drop: bool) -> SlideDecision:
    aligned = (threshold // page_size) * page_size  # floor toward -inf for negative thresholds
    start = max(request.already_released, request.locked_prefix)
    return SlideDecision(start, aligned if aligned > start else start, drop)


def decode_slide(
    request: SlidingRequest, anchor_len: int | None, policy: WindowPolicy, forward_iter: int
) -> SlideDecision | None:
    """Decides which out-of-window KV a decoding request releases now, or None (not this forward).

    Runs every ``policy.eviction_interval`` forwards, never on a request's first decode
    step (its prefill may still be in flight). The frontier keeps the window plus one
    page behind the last written token, aligned down to a page, and never reaches into
    ``locked_prefix`` or re-frees ``already_released``. With an anchor the frontier is
    capped ``RETAIN_GAP`` below the window ending at the anchor, so an anchor only ever
    makes the slide less aggressive; once the plain frontier is more than a window (plus
    the gap) past that cap, ``drop_anchor`` is set and the plain frontier is used, which
    bounds what a request holds. Pure. Refuses ``invalid_argument`` for a negative
    ``forward_iter`` or an ``anchor_len`` outside ``[1, position]``.
    """
    _require_int("forward_iter", forward_iter, 0)
    if anchor_len is not None:
        _require(
            _is_int(anchor_len) and 1 <= anchor_len <= request.position,
            "anchor_len",
            f"{anchor_len!r} is not within [1, {request.position}]",
        )
    if forward_iter % policy.eviction_interval or request.decode_step < 1:
        return None
    window, page = policy.sliding_window, policy.page_size
    threshold = (request.position - 1) - window - page
    drop = False
    if anchor_len is not None:
        cap = anchor_len - window - RETAIN_GAP
        if threshold - cap > window + RETAIN_GAP:
            drop = True
        else:
            threshold = min(threshold, cap)
    return _release_span(request, threshold, page, drop)


def prefill_slide(request: SlidingRequest, policy: WindowPolicy) -> SlideDecision:
    """Decides which out-of-window KV a prefilling request releases before its next chunk.

    Runs on every prefill batch (a chunk can add thousands of tokens): the frontier keeps
    the window plus one page behind ``position``, aligned down to a page, floored at
    ``locked_prefix`` and ``already_released``. No anchor exists during prefill. Pure.
    """
    threshold = request.position - policy.sliding_window - policy.page_size
    return _release_span(request, threshold, policy.page_size, False)


# ---------------------------------------------------------------- full-attention retention


class Hold(NamedTuple):
    """A retained prefix: the held token ids (whole pages) and the radix node locked for them.

    ``state`` is True when the lock is a state lock (the node's snapshot and its KV path).
    """

    prefix: tuple[int, ...]
    node: RadixNode
    state: bool = False


class HoldOutcome(StrEnum):
    """Why ``AnchorRetention.hold`` did or did not take a lock."""

    HELD = "held"  # a new lock was taken
    REFRESHED = "refreshed"  # the same prefix was already held; it is now the newest hold
    BELOW_ONE_PAGE = "below_one_page"  # the opener sits inside the first page: nothing to keep
    OVER_BOUND = "over_bound"  # the prefix alone exceeds max_held_tokens
    NOT_CACHED = "not_cached"  # the radix tree holds no page of it (insert before holding)
    NO_SNAPSHOT = "no_snapshot"  # hybrid: no state snapshot within it, so nothing can resume there


class HoldDecision(NamedTuple):
    outcome: HoldOutcome
    held: Hold | None
    """The hold now in force for this prefix, or None."""
    released: tuple[Hold, ...]
    """Older holds released (oldest first) to keep the total within ``max_held_tokens``."""


class AnchorRetention:
    """Keeps the prefix up to each finished turn's tool-call opener locked in a radix cache.

    Owns every lock it takes and releases each exactly once: on the conversation's next
    turn (``on_turn``), under memory pressure (``make_room``), when the bound on held
    tokens pushes the oldest out (``hold``), or all at once (``release_all``). Holds are
    kept oldest first. ``max_held_tokens`` bounds the sum of held prefix lengths (a
    prefix shared by two holds counts twice, so the bound is conservative).
    """

    def __init__(self, cache: RadixCache, max_held_tokens: int) -> None:
        _require_int("max_held_tokens", max_held_tokens, 0)
        self._cache = cache
        self._max = max_held_tokens
        self._holds: dict[tuple[int, ...], Hold] = {}  # insertion order = age, oldest first
        self._held_tokens = 0

    @property
    def holds(self) -> tuple[Hold, ...]:
        """Current holds, oldest first."""
        return tuple(self._holds.values())

    @property
    def held_tokens(self) -> int:
        return self._held_tokens

    @property
    def max_held_tokens(self) -> int:
        return self._max

    def __len__(self) -> int:
        return len(self._holds)

    def hold(self, ids: Sequence[int], anchor_len: int) -> HoldDecision:
        """Decides whether to retain ``ids[:anchor_len]`` (the turn up to its opener) and does.

        Call when a request that observed an anchor finishes, after its sequence was
        inserted into the radix cache. Keeps the whole pages of ``ids[:anchor_len]`` the
        tree holds: matches them (stamping them recent and splitting the node at the
        page boundary, so the lock covers exactly that prefix) and locks the end node. On a
        ``HybridRadixCache`` the hold is on the deepest state snapshot within that prefix
        (``NO_SNAPSHOT`` when there is none) and takes a state lock, which keeps the
        snapshot with its KV. The same prefix held again only becomes the newest hold (no second lock). Then
        releases the oldest other holds while the total exceeds ``max_held_tokens``.
        Mutates the radix cache (stamps, a split, lock/unlock) and this object. Refuses
        ``invalid_argument`` when ``anchor_len`` is outside ``[1, len(ids)]``.
        """
        ids = tuple(ids)
        _require(
            _is_int(anchor_len) and 1 <= anchor_len <= len(ids),
            "anchor_len",
            f"{anchor_len!r} is not within [1, {len(ids)}]",
        )
        page = self._cache.page_size
        aligned = anchor_len - anchor_len % page
        if aligned == 0:
            return HoldDecision(HoldOutcome.BELOW_ONE_PAGE, None, ())
        if aligned > self._max:
            return HoldDecision(HoldOutcome.OVER_BOUND, None, ())
        cache = self._cache
        if isinstance(cache, HybridRadixCache):
            if cache.match_prefix(ids[:aligned]).cached_len == 0:
                return HoldDecision(HoldOutcome.NOT_CACHED, None, ())
            cached_len, node, _ = cache.match_state(ids[:aligned])
            if cached_len == 0:
                return HoldDecision(HoldOutcome.NO_SNAPSHOT, None, ())
        else:
            cached_len, node = cache.match_prefix(ids[:aligned])
            if cached_len == 0:
                return HoldDecision(HoldOutcome.NOT_CACHED, None, ())
        prefix = ids[:cached_len]
        existing = self._holds.pop(prefix, None)
        if existing is not None:
            self._holds[prefix] = existing
            return HoldDecision(HoldOutcome.REFRESHED, existing, ())
        if isinstance(cache, HybridRadixCache):
            cache.lock_state(node)
        else:
            cache.lock(node)
        held = Hold(prefix, node, isinstance(cache, HybridRadixCache))
        self._holds[prefix] = held
        self._held_tokens += len(prefix)
        released: list[Hold] = []
        while self._held_tokens > self._max:
            oldest = next(iter(self._holds.values()))
            assert oldest is not held, "a single hold never exceeds the bound"
            released.append(self._release(oldest))
        return HoldDecision(HoldOutcome.HELD, held, tuple(released))

    def on_turn(self, prompt_ids: Sequence[int]) -> tuple[Hold, ...]:
        """Releases every hold whose prefix ``prompt_ids`` continues: the turn it waited for came.

        Call after the new request has matched and locked its own prefix in the radix
        cache, so the shared pages never pass through an unlocked moment. A prompt that
        diverges before a hold's end does not release it (pressure or the bound will).
        Mutates: unlocks and forgets those holds. Returns them, oldest first.
        """
        prompt = tuple(prompt_ids)
        due = [h for h in self._holds.values() if prompt[: len(h.prefix)] == h.prefix]
        return tuple(self._release(h) for h in due)

    def make_room(self, n_tokens: int) -> tuple[Hold, ...]:
        """Releases the oldest holds until the radix cache can evict ``n_tokens``, or none are left.

        Memory pressure outranks retention: call before ``RadixCache.evict`` when
        ``evictable_size`` falls short; releases nothing when it already suffices.
        Mutates: unlocks and forgets the released holds. Returns them, oldest first.
        Refuses ``invalid_argument`` for a negative ``n_tokens``.
        """
        _require_int("n_tokens", n_tokens, 0)
        released: list[Hold] = []
        while self._holds and self._cache.evictable_size < n_tokens:
            released.append(self._release(next(iter(self._holds.values()))))
        return tuple(released)

    def make_room_states(self, n: int) -> tuple[Hold, ...]:
        """Releases the oldest state holds until the hybrid cache can evict ``n`` snapshots, or none are left.

        Snapshot pressure (a request needs a state slot) outranks retention, as KV pressure
        does in ``make_room``; releases nothing when enough snapshots are already evictable
        or the cache holds no snapshots. Mutates: unlocks and forgets the released holds.
        Returns them, oldest first. Refuses ``invalid_argument`` for a negative ``n``.
        """
        _require_int("n", n, 0)
        cache = self._cache
        if not isinstance(cache, HybridRadixCache):
            return ()
        released: list[Hold] = []
        while cache.evictable_states < n:
            oldest = next((h for h in self._holds.values() if h.state), None)
            if oldest is None:
                break
            released.append(self._release(oldest))
        return tuple(released)

    def release_all(self) -> tuple[Hold, ...]:
        """Releases every hold (the KV pool is being rebuilt or the engine stops). Mutates."""
        return tuple(self._release(h) for h in list(self._holds.values()))

    def check_integrity(self) -> None:
        """Raises ``AssertionError`` unless every hold's node is alive and locked and the held
        total is the sum of the holds and within the bound. Does not mutate."""
        total = 0
        for prefix, hold in self._holds.items():
            if hold.prefix != prefix or not (hold.node.alive and hold.node.locked):
                raise AssertionError(f"hold of {len(prefix)} tokens lost its lock or its key")
            if hold.state and not (
                isinstance(self._cache, HybridRadixCache) and self._cache.state_of(hold.node) is not None
            ):
                raise AssertionError(f"state hold of {len(prefix)} tokens lost its snapshot")
            total += len(prefix)
        if total != self._held_tokens or total > self._max:
            raise AssertionError(f"held_tokens={self._held_tokens}, recomputed {total}, bound {self._max}")

    def _release(self, hold: Hold) -> Hold:
        del self._holds[hold.prefix]
        self._held_tokens -= len(hold.prefix)
        if hold.state and isinstance(self._cache, HybridRadixCache):
            self._cache.unlock_state(hold.node)
        else:
            self._cache.unlock(hold.node)
        return hold
