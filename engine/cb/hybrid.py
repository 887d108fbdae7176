"""Hybrid models in the continuous-batching substrate: the cache, the scheduler and the start-up swap.

transformers 5.24's continuous batching groups layers with ``group_layers_by_attn_type``, which
raises ``ValueError: Invalid layer type: linear_attention`` twice for a hybrid model: when the
manager resolves its config (the decode fast-path check) and when it builds its
``PagedAttentionCache``. ``hybrid_substrate`` swaps exactly those two names for the duration of
start-up (``init_continuous_batching`` and ``warmup``, on the starting thread, before the
generation thread exists):

- the fast-path check sees only the KV-keeping layers (``state.attention_groups``);
- the cache class becomes :class:`HybridPagedCache`: the stock paged cache over the attention
  layers only (a view of the config listing just them, so its KV blocks are exactly the
  attention layers' pages), with the state allocator (``state.StateAllocator``) beside its
  full-attention allocator. It admits a request only with a state slot for it, matches a prompt
  only as far as a state snapshot reaches, restores that snapshot into the request's slot
  (taken at the match), and frees both at the end.

:class:`HybridScheduler` (the radix scheduler plus the recurrent half) plans which state slot
each scheduled request computes in and where it snapshots (at its deepest page boundary in
this forward), commits filled snapshots to the radix tree at its step boundaries (a prompt's
boundaries at once, a generated boundary when it is the tool-call opener's or at finish), and
pins the opener's boundary when a decoding request samples it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any, cast

import torch
from transformers.generation.continuous_batching import RequestStatus
from transformers.generation.continuous_batching import continuous_api as _continuous_api
from transformers.generation.continuous_batching import initialization as _initialization
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.generation.continuous_batching.scheduler import SCHEDULER_MAPPING

from moetray.engine.cb.prefix import RadixScheduler
from moetray.engine.cb.state import (
    HybridLedger,
    Segment,
    Snapshot,
    StateAllocator,
    StateGeometry,
    StatePool,
    attention_groups,
    attention_layers,
)
from moetray.policy.anchor import AnchorState

HYBRID_SCHEDULER = "moetray_hybrid"


class _AttentionLayersView:
    """The text config as the paged cache should see a hybrid: only its KV-keeping layers, renumbered.

    Every other attribute is the real config's. The cache sizes its blocks by
    ``num_hidden_layers`` and groups by ``layer_types``; with the linear layers hidden, a block
    is exactly the attention layers' pages (so ``num_blocks`` is the KV page count moetray
    priced), and ``HybridPagedCache.update`` maps each real layer index to its compact one.
    """

    def __init__(self, config: Any, layers: tuple[int, ...]) -> None:
        self._config = config
        self.num_hidden_layers = len(layers)
        self.layer_types = ["full_attention"] * len(layers)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


class HybridPagedCache(PagedAttentionCache):
    """The substrate's paged KV cache over a hybrid's attention layers, with the state allocator beside it."""

    def __init__(
        self,
        config: Any,
        continuous_batching_config: Any,
        device: torch.device | str,
        distributed_helper: Any,
        dtype: torch.dtype = torch.float16,
        model_supports_logits_to_keep: bool = False,
        *,
        geometry: StateGeometry,
        state_slots: int,
    ) -> None:
        layers = attention_layers(config)
        if set(attention_groups(config)) != {"full_attention"}:
            raise ValueError(
                f"a hybrid's attention layers must all be full attention: {attention_groups(config)}"
            )
        super().__init__(
            cast(Any, _AttentionLayersView(config, layers)),  # the config, its attention layers only
            continuous_batching_config,
            device,
            distributed_helper,
            dtype=dtype,
            model_supports_logits_to_keep=model_supports_logits_to_keep,
        )
        self.layer_index = {layer: i for i, layer in enumerate(layers)}
        pool = StatePool(geometry, state_slots, device)
        self.states = StateAllocator(pool, continuous_batching_config.page_size)

    # -- helpers ---------------------------------------------------------------------------------

    @property
    def kv_allocator(self) -> Any:
        return self.cache_allocators["full_attention"]

    @property
    def ledger(self) -> HybridLedger | None:
        """The radix ledger when the prefix policy is radix (snapshots on), else None."""
        ledger = self.kv_allocator.ledger
        return ledger if isinstance(ledger, HybridLedger) else None

    def _return_blocks(self, blocks: list[int]) -> None:
        if blocks:
            self.pool.free_blocks(self.kv_allocator.index, blocks)
            self.pool.try_to_free_sectors()

    def state_slot_available(self) -> bool:
        """Whether a state slot can be had now: free, an evictable snapshot, or a state hold to release."""
        if self.states.pool.free_count:
            return True
        ledger = self.ledger
        if ledger is None:
            return False
        return ledger.radix.evictable_states > 0 or any(hold.state for hold in ledger.retention.holds)

    def take_state_slot(self) -> int | None:
        """A free state slot, evicting the least recently used snapshot (anchor holds giving way last)."""
        pool = self.states.pool
        slot = pool.take()
        ledger = self.ledger
        if slot is not None or ledger is None:
            return slot
        if ledger.radix.evictable_states == 0:
            ledger.anchors_released["pressure"] += len(ledger.retention.make_room_states(1))
        if ledger.radix.evictable_states == 0:
            return None
        self._return_blocks(ledger.evict_snapshots(1))
        return pool.take()

    # -- substrate hooks -------------------------------------------------------------------------

    @torch.compiler.disable
    def update(self, key_states, value_states, layer_idx, kwargs):  # noqa: ANN001 - the substrate's signature
        return super().update(key_states, value_states, self.layer_index[layer_idx], kwargs)

    def search_prefix_match(self, request_id: str, prompt_ids: list[int]) -> int:
        """Reuse only as far as a state snapshot reaches: KV blocks alone cannot resume a linear layer.

        The substrate's hash match finds the shared blocks; ``match_state`` truncates them to
        the deepest snapshot. The request takes its live state slot here and the snapshot is
        copied into it at once (held under a state lock only for that copy, so the slot
        search cannot evict it); no slot to be had means no reuse this time (the request
        waits for a slot as any new one does). The match's blocks are then acquired.
        """
        ledger = self.ledger
        if not self.use_prefix_sharing or ledger is None:
            return 0
        allocator = self.kv_allocator
        blocks = allocator.match_prefix_blocks(prompt_ids)
        page = allocator.tokens_per_page
        match = ledger.radix.match_state(prompt_ids[: len(blocks) * page])
        if match.cached_len == 0 or match.state_slot is None:
            return 0
        tree = list(ledger.radix.slots_of(match.node))
        if tree != blocks[: match.cached_len // page]:
            raise AssertionError(
                f"radix/ledger divergence on a state match for {request_id}: tree {tree}, hashes {blocks}"
            )
        ledger.radix.lock_state(match.node)
        try:
            slot = self.take_state_slot()
            if slot is not None:
                self.states.pool.copy(match.state_slot, slot)
        finally:
            ledger.radix.unlock_state(match.node)
        if slot is None:
            return 0
        self.states.live[request_id] = slot
        self.states.counters["resumed"] += 1
        allocator.acquire_prefix_blocks(request_id, match.cached_len, blocks)
        return match.cached_len

    def can_store_request_tokens(self, state: Any, request_len: int, dry_run: bool = False) -> bool:
        """The stock KV check, plus one state slot for a request that holds none yet (taken on success)."""
        request_id = state.request_id
        if request_id in self.states.live:
            return super().can_store_request_tokens(state, request_len, dry_run=dry_run)
        if dry_run:
            return self.state_slot_available() and super().can_store_request_tokens(state, request_len, True)
        slot = self.take_state_slot()  # first: taking one may evict a snapshot leaf, freeing KV too
        if slot is None:
            return False
        if not super().can_store_request_tokens(state, request_len):
            self.states.pool.give(slot)
            return False
        self.states.live[request_id] = slot
        return True

    def free_blocks(self, request_id: str, no_cache: bool = False) -> None:
        super().free_blocks(request_id, no_cache=no_cache)
        self.states.release(request_id)

    def free_all_requests(self, clear_ledgers: bool = False) -> None:
        self.states.release_all()
        super().free_all_requests(clear_ledgers=clear_ledgers)

    # -- the forward's plan and the snapshots' commits -------------------------------------------

    def plan_batch(self, scheduled: list[Any]) -> None:
        """Records each scheduled request's segment and, with prefix reuse on, the snapshot its forward
        takes at the deepest page boundary it reaches (one snapshot slot per request, rolled forward
        until committed; none when no slot can be had: reuse degrades, output does not)."""
        states = self.states
        page = states.page_size
        plan = []
        for future in scheduled:
            state = future.state
            request_id = state.request_id
            past, length = state.position_offset, future.query_length
            end = past + length
            boundary = end - end % page
            snapshot = None
            if self.ledger is not None and boundary > past:
                snapshot = states.filling.get(request_id)
                if snapshot is None:
                    slot = self.take_state_slot()
                    if slot is not None:
                        snapshot = states.filling[request_id] = Snapshot(slot, boundary)
                if snapshot is not None:
                    snapshot.boundary = boundary
                    states.counters["snapshots_taken"] += 1
            plan.append(Segment(request_id, past, length, states.live[request_id], snapshot))
        states.plan = plan

    def commit_snapshot(self, state: Any, *, final: bool) -> None:
        """Gives a filled snapshot to the radix tree when it should outlive the request.

        A prompt's boundary (a chunk commit) and the pinned tool-call boundary are committed as
        soon as their KV is in the tree; a generated boundary only at ``final`` (the last one,
        which the next turn resumes from). A snapshot the tree declines (it has one there, or
        lacks the KV) stays with the request to roll forward, or is freed when ``final``.
        """
        ledger = self.ledger
        states = self.states
        request_id = state.request_id
        snapshot = states.filling.get(request_id)
        if ledger is None or snapshot is None or snapshot.boundary > state.position_offset:
            return
        tokens = (state.initial_tokens + state.generated_tokens)[: snapshot.boundary]
        due = final or snapshot.boundary <= len(state.initial_tokens)
        due = due or snapshot.boundary == states.pinned.get(request_id)
        if not due or len(tokens) < snapshot.boundary:
            return
        if ledger.radix.insert_state(tokens, snapshot.slot):
            del states.filling[request_id]
            states.counters["snapshots_committed"] += 1
        elif final:
            del states.filling[request_id]
            states.pool.give(snapshot.slot)


class HybridScheduler(RadixScheduler):
    """The radix scheduler plus the recurrent half (see the module docstring).

    Hooks, each calling the radix scheduler's: ``_sync_request`` commits due snapshots right
    after the request's blocks are mirrored into the tree and pins a sampled tool-call opener;
    ``schedule_batch`` plans the forward; ``finish_request`` commits the last snapshot before
    the anchor hold and the release.
    """

    cache: HybridPagedCache
    copies_partial_pages = False  # the recurrent state resumes only at a snapshot's page boundary
    hashes_last_pages = False  # kept as it was: a match here must also end at a state snapshot

    def _sync_request(self, ledger, state) -> None:  # noqa: ANN001 - the radix scheduler's signature
        super()._sync_request(ledger, state)
        if isinstance(ledger, HybridLedger):
            self._pin_opener(state)
            self.cache.commit_snapshot(state, final=False)

    def _pin_opener(self, state: Any) -> None:
        """A decoding request that just sampled the tool-call opener pins the boundary at it."""
        hooks = self.hooks
        anchor_token = None if hooks is None else hooks.anchor_token()
        pinned = self.cache.states.pinned
        if anchor_token is None or state.request_id in pinned or state.status != RequestStatus.DECODING:
            return
        generated = state.generated_tokens
        if not generated:
            return
        position = len(state.initial_tokens) + len(generated)
        if AnchorState().observe(generated[-1], anchor_token, position, finished=False):
            pinned[state.request_id] = position - position % self.cache.states.page_size

    def schedule_batch(self, token_budget, cache_budget):  # noqa: ANN001 - the substrate's signature
        result = super().schedule_batch(token_budget, cache_budget)
        if result[0]:
            self.cache.plan_batch(result[0])
        return result

    def finish_request(self, request_id):  # noqa: ANN001 - the substrate's signature
        ledger = self._ledger
        state = self.active_requests.get(request_id)
        if isinstance(ledger, HybridLedger) and state is not None:
            self._sync_request(ledger, state)
            self.cache.commit_snapshot(state, final=True)
        super().finish_request(request_id)


SCHEDULER_MAPPING.setdefault(HYBRID_SCHEDULER, HybridScheduler)


@contextmanager
def hybrid_substrate(geometry: StateGeometry, state_slots: int) -> Iterator[None]:
    """While the manager is built and warmed up, the substrate groups only KV layers and builds a
    :class:`HybridPagedCache` with ``state_slots`` state slots. Restores both names on exit."""
    real_groups = _initialization.group_layers_by_attn_type
    real_cache = _continuous_api.PagedAttentionCache
    # The substrate's two names are swapped on purpose (mypy sees a function and a class replaced).
    _initialization.group_layers_by_attn_type = attention_groups  # type: ignore[assignment]
    _continuous_api.PagedAttentionCache = partial(  # type: ignore[misc, assignment]
        HybridPagedCache, geometry=geometry, state_slots=state_slots
    )
    try:
        yield
    finally:
        _initialization.group_layers_by_attn_type = real_groups
        _continuous_api.PagedAttentionCache = real_cache  # type: ignore[misc]
