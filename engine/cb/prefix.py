"""Prefix reuse: which policy a model gets, and ``policy.radix`` deciding the substrate's evictions.

A ``RadixLedger`` (a ``BlockLedger`` subclass swapped into the full-attention allocator) and
a ``RadixScheduler`` (a ``FIFOScheduler`` subclass, registered in the substrate's
``SCHEDULER_MAPPING`` under ``"moetray_radix"``). The substrate keeps matching prompts
against its block-hash table; ``policy.radix`` makes the eviction decision (how many cached
blocks, which ones: least-recently-used unlocked leaves first, never an anchor-locked
prefix) that the stock ledger makes by dropping every cached block at once, and how much of a
prompt's ragged last page a cached page can serve by copy. See
:class:`RadixLedger` for the exact division of labour. A finished turn that emitted the
tool-call opener keeps its prefix locked through ``policy.anchor.AnchorRetention`` until the
next turn arrives or pressure needs the room (:class:`SchedulerHooks`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers.generation.continuous_batching import RequestStatus
from transformers.generation.continuous_batching.cache_allocators.cache_allocator import BlockLedger
from transformers.generation.continuous_batching.scheduler import SCHEDULER_MAPPING, FIFOScheduler

from moetray.policy.anchor import AnchorRetention, AnchorState
from moetray.policy.radix import RadixCache
from moetray.policy.refused import Refused
from moetray.policy.step_threads import step_threads

if TYPE_CHECKING:
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    from moetray.engine.cb.runner import BatchRunner

RADIX_SCHEDULER = "moetray_radix"
PREFIX_POLICIES = ("radix", "stock", "off")
"""``radix``: policy.radix decides evictions; ``stock``: the substrate's evict-everything
ledger (kept for the side-by-side measurement); ``off``: no prefix reuse at all."""


class PrefixPolicyRefused(Refused, ValueError):
    """``radix_needs_full_attention``: radix was asked for by name on a model with sliding-window
    layers; ``stock_prefix_cannot_resume_state``: the stock prefix cache was asked for on a hybrid
    model, whose recurrent state only radix's snapshots can resume."""

    KINDS = ("radix_needs_full_attention", "stock_prefix_cannot_resume_state")


def choose_prefix_policy(requested: str | None, config) -> str:
    """The prefix policy a model is served with; decided from its config, before any weight loads.

    ``None`` (the default) is ``radix`` when every attention layer is full attention (a
    hybrid's linear-attention layers keep no KV: their state is resumed from radix's
    snapshots, ``state.py``), else ``stock``: the substrate keeps sliding-window layers in
    per-request rings of blocks that the radix tree cannot own (gpt-oss alternates them).
    Naming ``radix`` for such a model is refused with ``radix_needs_full_attention``, and
    naming ``stock`` for a hybrid with ``stock_prefix_cannot_resume_state`` (shared KV blocks
    without the state after them would decode garbage), rather than served otherwise.
    """
    from moetray.engine.cb.state import attention_groups, linear_layers

    if requested is not None and requested not in PREFIX_POLICIES:
        raise ValueError(f"prefix_policy must be one of {PREFIX_POLICIES}, got {requested!r}")
    text = config.get_text_config()
    groups = sorted(attention_groups(text))
    full_only = groups == ["full_attention"]
    hybrid = bool(linear_layers(text))
    if requested is None:
        return "radix" if full_only else "stock"
    if requested == "radix" and not full_only:
        raise PrefixPolicyRefused(
            "radix_needs_full_attention",
            f"--prefix-cache radix needs every layer to be full attention; this model has {groups} "
            "layers (leave --prefix-cache unset to serve it with the stock prefix cache)",
            groups=groups,
        )
    if requested == "stock" and hybrid:
        raise PrefixPolicyRefused(
            "stock_prefix_cannot_resume_state",
            "--prefix-cache stock cannot resume a hybrid model's recurrent state; leave --prefix-cache "
            "unset (radix, with state snapshots) or pass off",
            groups=groups,
        )
    return requested


class RadixLedger(BlockLedger):
    """The full-attention allocator's ledger, with ``policy.radix`` deciding evictions.

    Division of labour (the page-identity tests pin each line):

    - *matching* stays the substrate's: a new prompt is matched block by block against the
      hash table and matched blocks are shared (``acquire``). The radix tree
      (``slot_unit="page"``) mirrors the same blocks, one tree page per hashed block, and
      the scheduler stamps the matched path so recency follows real reuse; any
      disagreement between the two is raised, never papered over.
    - *retention* is radix's: every live request locks the tree path of its hashed blocks,
      so an unlocked tree page is a block the stock ledger holds as "cached" (hashed,
      unreferenced). An anchor lock additionally protects a finished turn's prefix up to
      its tool-call opener.
    - *eviction* is radix's: the stock ledger answers memory pressure by dropping every
      cached block at once; here the scheduler asks for exactly the deficit and
      ``radix.evict`` frees least-recently-used unlocked leaves first (cascading), never a
      locked path. The substrate's own flush entry (``evict_cached_blocks``, called before
      it offloads requests) is bounded the same way by ``demand``.
    - a prompt's ragged end (past its last whole matched page) may *copy* the rows a cached next
      page already holds into a page of the request's own (``radix.partial_page`` decides how
      many; :meth:`RadixScheduler._copy_partial_page`); the cached page is neither shared nor
      written, and the copy is hashed like any page the request completes.
    - a block the tree holds is never dropped behind its back: a ``no_cache`` release (the
      substrate's soft reset of an offloaded request) keeps such a block cached, so radix
      remains the only one that frees it (and the requeued request can re-match it).
    """

    def __init__(self, page_size: int, *, anchor_max_held_tokens: int = 0) -> None:
        super().__init__()
        self.page_size = page_size
        self.anchor_max_held_tokens = anchor_max_held_tokens
        self.radix = self.new_tree()
        self.retention = AnchorRetention(self.radix, anchor_max_held_tokens)
        self.tree_blocks: set[int] = set()
        self.demand: Callable[[], int] | None = None  # blocks the pressure at hand needs
        self.evictions: list[list[int]] = []  # block ids freed per eviction (page-identity tests)
        self.anchor_outcomes: dict[str, int] = {}  # HoldOutcome value -> count
        self.anchors_released = {"turn": 0, "pressure": 0, "bound": 0}
        self.partial_pages_copied = 0  # prompts whose ragged end copied a cached page's rows

    def new_tree(self) -> RadixCache:
        """The tree this ledger mirrors its blocks into (one page per block)."""
        return RadixCache(self.page_size, slot_unit="page")

    def reset(self) -> None:
        super().reset()
        self.radix = self.new_tree()
        self.retention = AnchorRetention(self.radix, self.anchor_max_held_tokens)
        self.tree_blocks = set()

    def release(self, block_id: int, no_cache: bool = False) -> bool:
        return super().release(block_id, no_cache=no_cache and block_id not in self.tree_blocks)

    def evict_cached_blocks(self) -> list[int]:
        """The substrate's flush entry, bounded by ``demand`` (everything only when unset)."""
        want = len(self.cached_blocks) if self.demand is None else self.demand()
        return self.evict_blocks(want)

    @property
    def evictable_blocks(self) -> int:
        return self.radix.evictable_size // self.page_size

    def insert(self, tokens: list[int], blocks: list[int]) -> Any:
        """Mirror ``blocks`` (the KV of ``tokens``, whole pages) into the tree; returns the end node.

        The substrate de-duplicated by hash before we get here, so the tree's copy of any
        span it already had must be these very blocks: a divergence raises.
        """
        result = self.radix.insert_prefix(tokens, blocks)
        tree = list(self.radix.slots_of(result.node))
        if tree != list(blocks):
            raise AssertionError(f"radix/ledger divergence: tree {tree} vs block table {blocks}")
        self.tree_blocks.update(blocks)
        return result.node

    def evict_blocks(self, n_blocks: int) -> list[int]:
        """Frees ``n_blocks`` cached blocks (fewer if fewer are evictable), radix choosing which.

        Returns the freed block ids, their hashes forgotten so no later match aliases a block
        that went back to the pool; the caller returns them to the pool. Mutates the tree
        and the ledger. ``n_blocks <= 0`` frees nothing.
        """
        want = min(n_blocks, self.evictable_blocks)
        if want <= 0:
            return []
        return self.forget_blocks(list(self.radix.evict(want * self.page_size)))

    def forget_blocks(self, blocks: list[int]) -> list[int]:
        """The tree let go of ``blocks``: drop them from the cached set and forget their hashes."""
        for block in blocks:
            if block not in self.cached_blocks:
                raise AssertionError(f"radix evicted block {block}, which the ledger does not hold as cached")
            self.cached_blocks.pop(block)
            self.hash_to_block.pop(self.block_to_hash.pop(block))
            self.tree_blocks.discard(block)
        self.evictions.append(blocks)
        return blocks


@dataclass
class _Tracked:
    """The tree node a live request holds locked, and how many of its blocks that covers."""

    node: Any = None
    locked_blocks: int = 0


class RadixScheduler(FIFOScheduler):
    """The substrate's FIFO scheduler with radix bookkeeping at its step boundaries.

    Hooks (each calls the stock method): ``_infer_request_tokens`` records how much of a
    prompt the prefix cache served, stamps and locks the matched tree path;
    ``schedule_batch`` mirrors every live request's hashed blocks into the tree before any
    eviction decision and, when nothing could be scheduled for want of pages, evicts what
    the head request needs and retries once; ``_try_to_meet_safety_margin`` evicts exactly
    the margin deficit; ``finish_request`` / ``clear_cancelled_requests`` mirror a request's
    last blocks and unlock its path before the substrate releases them. Without a
    :class:`RadixLedger` installed every hook defers to the stock behaviour.
    """

    hooks: SchedulerHooks | None = None  # set by BatchRunner before the loop starts
    copies_partial_pages = True  # a prompt's ragged end may copy a cached page's rows (below)
    hashes_last_pages = True  # a finished request's last written pages are hashed before release

    def __init__(
        self, cache: PagedAttentionCache, safety_margin: float | None, max_requests_per_batch: int
    ) -> None:
        super().__init__(cache, safety_margin, max_requests_per_batch)
        self._tracked: dict[str, _Tracked] = {}

    # -- helpers -------------------------------------------------------------------------------

    @property
    def _allocator(self):
        return self.cache.cache_allocators["full_attention"]

    @property
    def _ledger(self) -> RadixLedger | None:
        ledger = self._allocator.ledger
        return ledger if isinstance(ledger, RadixLedger) else None

    def _hashed_prefix_blocks(self, request_id: str) -> list[int]:
        hashed = self._allocator.ledger.block_to_hash
        out = []
        for block in self._allocator.block_table.get(request_id, []):
            if block not in hashed:
                break
            out.append(block)
        return out

    def _sync_request(self, ledger: RadixLedger, state) -> None:
        """Mirror a request's hashed blocks into the tree and move its lock to the deepest node."""
        tracked = self._tracked.setdefault(state.request_id, _Tracked())
        blocks = self._hashed_prefix_blocks(state.request_id)
        if len(blocks) <= tracked.locked_blocks:
            return
        # A soft reset folds generated tokens into initial_tokens: the concatenation is the
        # request's token sequence either way.
        tokens = (state.initial_tokens + state.generated_tokens)[: len(blocks) * ledger.page_size]
        node = ledger.insert(tokens, blocks)
        ledger.radix.lock(node)
        if tracked.node is not None:
            ledger.radix.unlock(tracked.node)
        tracked.node = node
        tracked.locked_blocks = len(blocks)

    def _release(self, ledger: RadixLedger, request_id: str) -> None:
        tracked = self._tracked.pop(request_id, None)
        if tracked is not None and tracked.node is not None:
            ledger.radix.unlock(tracked.node)

    def free_block_count(self) -> int:
        allocator = self._allocator
        pool = self.cache.pool
        return pool.count_free_blocks(allocator.index) + pool.num_free_sectors * allocator.blocks_per_sector

    def _margin_floor(self) -> int:
        return math.ceil(self.safety_margin * self.cache.num_blocks)

    def _evict_for(self, ledger: RadixLedger, n_blocks: int) -> int:
        """Evict ``n_blocks`` through radix; anchors give way only if that is not enough."""
        if n_blocks <= 0:
            return 0
        if ledger.evictable_blocks < n_blocks:
            # Memory pressure outranks retention: anchors give way, oldest first.
            released = ledger.retention.make_room(n_blocks * ledger.page_size)
            ledger.anchors_released["pressure"] += len(released)
        freed = ledger.evict_blocks(n_blocks)
        if freed:
            self.cache.pool.free_blocks(self._allocator.index, freed)
            self.cache.pool.try_to_free_sectors()
        return len(freed)

    def _pressure_demand(self) -> int:
        """Blocks to free now: the starved requests' shortfall, or the safety-margin deficit."""
        allocator = self._allocator
        free = self.free_block_count()
        starved_need = sum(
            allocator.needs_new_blocks(state.request_id, state.current_len(), n)
            for state, n in self.starved_requests
        )
        return max(starved_need - free, self._margin_floor() - free, 0)

    def _head_need(self) -> int:
        allocator = self._allocator
        states = list(self.active_requests.values())
        states += [
            self.waiting_requests[r] for r in self.waiting_requests_order if r in self.waiting_requests
        ]
        free = self.free_block_count()
        for state in states:
            if state.status == RequestStatus.DECODING:
                n = len(state.tokens_to_process)
            else:
                n = len(state.remaining_prefill_tokens)
            missing = allocator.needs_new_blocks(state.request_id, state.current_len(), max(n, 1)) - free
            if missing > 0:
                return missing
        return 0

    # -- substrate hooks ------------------------------------------------------------------------

    def _infer_request_tokens(self, state, request_ids_to_remove_from_waiting):
        was_pending = state.status == RequestStatus.PENDING and not state.is_cpu_offloaded
        before = state.position_offset
        tokens = super()._infer_request_tokens(state, request_ids_to_remove_from_waiting)
        if not was_pending:
            return tokens
        matched = state.position_offset - before
        ledger = self._ledger
        if ledger is not None and matched > 0:
            prompt = state.initial_tokens[:matched]
            cached_len, node = ledger.radix.match_prefix(prompt)  # stamps the path: recency follows reuse
            blocks = self._allocator.block_table.get(state.request_id, [])[: matched // ledger.page_size]
            tree = list(ledger.radix.slots_of(node))
            if cached_len != matched or tree != blocks:
                raise AssertionError(
                    f"radix/ledger divergence on match for {state.request_id}: "
                    f"tree {cached_len} tokens {tree}, substrate {matched} tokens {blocks}"
                )
            ledger.radix.lock(node)
            self._tracked[state.request_id] = _Tracked(node=node, locked_blocks=len(blocks))
            copied = self._copy_partial_page(ledger, state, node)
            matched += copied
            tokens = tokens[copied:]
            if self.hooks is not None:
                self.hooks.prefix_reused(ledger, state.initial_tokens)
        if self.hooks is not None:
            self.hooks.prefix_matched(state.request_id, matched)
        return tokens

    def _copy_partial_page(self, ledger: RadixLedger, state, node) -> int:
        """Serve the start of the prompt's ragged end from a cached page: returns the tokens served.

        ``policy.radix`` decides how many of the tokens after the whole-page match a page after
        ``node`` already holds (at most a page less one: a step must compute the last prompt token's
        logits); their rows are copied into the request's own next page, which it then writes on
        from there, so a repeated prompt computes one token instead of up to a page of them. Not
        for a model whose recurrent state resumes only at page boundaries
        (``copies_partial_pages``), nor when the pool cannot give the page now.
        """
        if not self.copies_partial_pages:
            return 0
        found = ledger.radix.partial_page(node, state.remaining_prefill_tokens[:-1])
        if found is None:
            return 0
        copied, source = found
        if not self.cache.can_store_request_tokens(state, copied):  # allocates the request's next page
            return 0
        target = self._allocator.block_table[state.request_id][-1]
        self._allocator.copy_blocks([source], [target])
        state.remaining_prefill_tokens = state.remaining_prefill_tokens[copied:]
        state.position_offset += copied
        ledger.partial_pages_copied += 1
        return copied

    def _try_to_meet_safety_margin(self) -> bool:
        ledger = self._ledger
        if ledger is None:
            return super()._try_to_meet_safety_margin()
        self.cache.pool.try_to_free_sectors()
        floor = self._margin_floor()
        self._evict_for(ledger, floor - self.free_block_count())
        return self.free_block_count() >= floor

    def schedule_batch(self, token_budget, cache_budget):
        if self.hooks is not None:
            self.hooks.before_step()
        result = self._schedule_tracked(token_budget, cache_budget)
        if self.hooks is not None and result[0]:
            self.hooks.step_scheduled(result[2])  # the step's query tokens
        return result

    def _schedule_tracked(self, token_budget, cache_budget):
        ledger = self._ledger
        if ledger is None:
            return super().schedule_batch(token_budget, cache_budget)
        ledger.demand = self._pressure_demand
        for state in list(self.active_requests.values()):
            self._sync_request(ledger, state)
        result = super().schedule_batch(token_budget, cache_budget)
        if result[0] is None and self._evict_for(ledger, self._head_need()) > 0:
            result = super().schedule_batch(token_budget, cache_budget)
        return result

    def finish_request(self, request_id):
        ledger = self._ledger
        if ledger is not None:
            state = self.active_requests.get(request_id)
            if state is not None:
                self._hash_last_pages(state)
                self._sync_request(ledger, state)
                if self.hooks is not None:
                    self.hooks.request_finishing(ledger, state)
            self._release(ledger, request_id)
        super().finish_request(request_id)

    def _hash_last_pages(self, state) -> None:
        """Hash the whole pages the request's last forward wrote, so they stay cached past its release.

        The substrate hashes the pages a forward completed only while their request is unfinished,
        so a request's last step left them unhashed and freed with it: a one-token answer, its whole
        prompt (the next identical prompt recomputed every token). Not for a hybrid
        (``hashes_last_pages``), whose match must also end at a state snapshot: left as it was.
        """
        if not self.hashes_last_pages:
            return
        allocator = self._allocator
        written = min(state.position_offset // allocator.tokens_per_page,
                      len(allocator.block_table.get(state.request_id, [])))
        unhashed = written - len(self._hashed_prefix_blocks(state.request_id))
        if unhashed > 0:
            allocator.mark_complete_blocks(state.request_id, state.initial_tokens + state.generated_tokens,
                                           unhashed)

    def clear_cancelled_requests(self):
        ledger = self._ledger
        if ledger is not None:
            with self._cancellation_lock:
                doomed = list(self._requests_to_cancel)
            for rid in doomed:
                state = self.active_requests.get(rid)
                if state is not None:
                    self._sync_request(ledger, state)
                self._release(ledger, rid)
        return super().clear_cancelled_requests()

    def reset(self):
        super().reset()
        self._tracked = {}


SCHEDULER_MAPPING.setdefault(RADIX_SCHEDULER, RadixScheduler)


class SchedulerHooks:
    """Callbacks from the generation thread into the runner (prefix accounting and anchors)."""

    def __init__(self, runner: BatchRunner) -> None:
        self._runner = runner
        self._budget = runner.config.thread_budget or torch.get_num_threads()

    def step_scheduled(self, query_tokens: int) -> None:
        """Run the step on the threads :func:`~moetray.policy.step_threads.step_threads` gives it
        (set on the generation thread, only when the count changes): a step it would keep on one
        thread (a decode step, a short prefill) asks the runner's ``decode_team`` whether the load
        lets it on the whole budget. Recorded as the runner's ``step_threads``."""
        team = self._runner.decode_team
        on_team = team is not None and query_tokens <= self._runner.one_thread_up_to and team.decides()
        threads = step_threads(query_tokens, self._budget, one_thread_up_to=self._runner.one_thread_up_to,
                               on_team=on_team)
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        self._runner.step_threads = threads

    def before_step(self) -> None:
        """Test hook: hold every step for ``step_delay_s`` (sleeping), so requests last long enough
        to be cancelled, drained or waited on in tests. Zero (the default) costs nothing. Each step
        is also the batch loop's heartbeat (``BatchRunner.beat``)."""
        self._runner.beat()
        delay = self._runner.config.step_delay_s
        if delay > 0:
            time.sleep(delay)

    def anchor_token(self) -> int | None:
        """The single-token tool-call opener this model's turns are anchored at, or None."""
        return self._runner.config.anchor_token

    def prefix_matched(self, request_id: str, tokens: int) -> None:
        self._runner._cached_tokens[request_id] = tokens

    def prefix_reused(self, ledger: RadixLedger, prompt: list[int]) -> None:
        """The new request locked its matched prefix: holds waiting for this turn are done."""
        ledger.anchors_released["turn"] += len(ledger.retention.on_turn(prompt))

    def request_finishing(self, ledger: RadixLedger, state) -> None:
        """A finished turn that emitted the tool-call opener keeps its prefix up to it, locked."""
        anchor_token = self._runner.config.anchor_token
        if anchor_token is None:
            return
        tracker = AnchorState()
        prompt_len = len(state.initial_tokens)
        generated = state.generated_tokens
        eos = set(self._runner.config.eos_token_ids)
        for i, token in enumerate(generated):
            finished = i == len(generated) - 1 and token in eos
            if tracker.observe(token, anchor_token, prompt_len + i + 1, finished):
                break
        if tracker.anchor_len is None:
            return
        ids = state.initial_tokens + generated
        decision = ledger.retention.hold(ids, tracker.anchor_len)
        key = decision.outcome.value
        ledger.anchor_outcomes[key] = ledger.anchor_outcomes.get(key, 0) + 1
        ledger.anchors_released["bound"] += len(decision.released)
