"""The one module that touches transformers' continuous-batching internals (pinned 5.24.x).

moetray plugs into ``transformers.generation.continuous_batching`` rather than shadowing
it: the substrate's ``ContinuousBatchingManager`` runs the generation loop, its scheduler
interleaves prefill and decode, and its ``PagedAttentionCache`` is the KV pool whose block
count ``pool_budget`` sizes. Every touch of those internals lives here, through the
narrowest hooks the substrate offers:

- **sampling** — three ``ContinuousBatchingLogitsProcessor`` subclasses installed as the
  manager's processor list: per-request temperature and top-p, then a *draw* processor that
  picks the next token (greedy, seeded inverse-CDF sampling, or a forced token for the test
  hook) and masks every other logit, so the substrate's own greedy sampler emits it. Greedy
  stays the stock argmax over fp32 logits (token identity with ``generate``).
- **prefix reuse** — a ``RadixLedger`` (a ``BlockLedger`` subclass swapped into the
  full-attention allocator) and a ``RadixScheduler`` (a ``FIFOScheduler`` subclass,
  registered in the substrate's ``SCHEDULER_MAPPING`` under ``"moetray_radix"``). The
  substrate keeps matching prompts against its block-hash table; ``policy.radix`` makes the
  eviction decision (how many cached blocks, which ones: least-recently-used unlocked leaves
  first, never an anchor-locked prefix) that the stock ledger makes by dropping every cached
  block at once. See :class:`RadixLedger` for the exact division of labour. A finished turn
  that emitted the tool-call opener keeps its prefix locked through
  ``policy.anchor.AnchorRetention`` until the next turn arrives or pressure needs the room.
- **lifecycle** — create a manager with a given block count and page size, add / stream /
  cancel requests, pause the loop (expert-pool resize), stop it (KV-pool resize). On the CPU
  the paged cache is backed by an anonymous mapping instead of an up-front memset (see
  :func:`_lazily_zeroed_cpu_cache`), so a large KV pool is ready at once.

Nothing outside this module imports ``transformers.generation.continuous_batching``.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching import ContinuousBatchingManager, RequestStatus
from transformers.generation.continuous_batching.cache import group_layers_by_attn_type
from transformers.generation.continuous_batching.cache_allocators.cache_allocator import BlockLedger
from transformers.generation.continuous_batching.cb_logits_processors import (
    ContinuousBatchingLogitsProcessor,
    ContinuousBatchingLogitsProcessorList,
)
from transformers.generation.continuous_batching.continuous_api import OutputRouter
from transformers.generation.continuous_batching.requests import GenerationOutput
from transformers.generation.continuous_batching.scheduler import SCHEDULER_MAPPING, FIFOScheduler
from transformers.generation.logits_process import LogitsProcessorList

from moetray.policy.anchor import AnchorRetention, AnchorState
from moetray.policy.radix import RadixCache
from moetray.policy.refused import Refused

log = logging.getLogger("moetray.engine.cb")

RADIX_SCHEDULER = "moetray_radix"
PREFIX_POLICIES = ("radix", "stock", "off")
"""``radix``: policy.radix decides evictions; ``stock``: the substrate's evict-everything
ledger (kept for the side-by-side measurement); ``off``: no prefix reuse at all."""


class PrefixPolicyRefused(Refused, ValueError):
    """``radix_needs_full_attention``: radix was asked for by name on a model with other layers."""

    KINDS = ("radix_needs_full_attention",)


def choose_prefix_policy(requested: str | None, config) -> str:
    """The prefix policy a model is served with; decided from its config, before any weight loads.

    ``None`` (the default) is ``radix`` when every layer is full attention, else ``stock``:
    the substrate keeps sliding-window layers in per-request rings of blocks that the radix
    tree cannot own (gpt-oss alternates them). Naming ``radix`` for such a model is refused
    with ``PrefixPolicyRefused("radix_needs_full_attention")`` rather than served otherwise.
    """
    if requested is not None and requested not in PREFIX_POLICIES:
        raise ValueError(f"prefix_policy must be one of {PREFIX_POLICIES}, got {requested!r}")
    groups = sorted(group_layers_by_attn_type(config.get_text_config()))
    full_only = groups == ["full_attention"]
    if requested is None:
        return "radix" if full_only else "stock"
    if requested == "radix" and not full_only:
        raise PrefixPolicyRefused(
            "radix_needs_full_attention",
            f"--prefix-cache radix needs every layer to be full attention; this model has {groups} "
            "layers (leave --prefix-cache unset to serve it with the stock prefix cache)",
            groups=groups,
        )
    return requested

_U_SCALE = float(2**31)


# --- sampling ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sampling:
    """How one request picks its tokens.

    ``temperature == 0`` is greedy (the stock argmax). ``seed`` makes sampling repeatable
    per request, independent of what else shares the batch. ``forced_tokens`` is the
    documented **test hook**: the real engine emits exactly these ids, then the first EOS
    id (or greedy when there is none), so tests can drive reasoning / tool-call plumbing
    deterministically through a random-weight model. ``ignore_eos`` (vLLM's extension, for
    benchmarks and load tests) runs to ``max_new_tokens`` whatever the model emits.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    forced_tokens: tuple[int, ...] | None = None
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def seeded_uniform(seed: int, step: int) -> float:
    """A uniform draw in [0, 1) that depends only on (seed, step): batching cannot change it."""
    return _splitmix64(_splitmix64(seed & 0xFFFFFFFFFFFFFFFF) ^ step) / 2.0**64


def _float_args(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device="cpu").view(dtype=torch.int32)


class _TemperatureProcessor(ContinuousBatchingLogitsProcessor):
    supported_kwargs = {"temperature": float}
    ignored_kwargs = ()

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.copy_(torch.ones_like(int32_tensor, dtype=torch.float32).view(dtype=torch.int32))

    def prepare_tensor_args(self, requests_with_new_token) -> torch.Tensor:
        temps = []
        for request in requests_with_new_token:
            t = float(request.state.logit_processor_kwargs.get("temperature", 1.0))
            temps.append(t if t > 0.0 else 1.0)  # greedy rows are drawn by argmax, unscaled
        return _float_args(temps)

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        temps = tensor_arg[: scores.size(0)].view(dtype=torch.float32)
        return scores / temps.unsqueeze(-1)


class _TopPProcessor(ContinuousBatchingLogitsProcessor):
    supported_kwargs = {"top_p": float}
    ignored_kwargs = ()

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.copy_(torch.ones_like(int32_tensor, dtype=torch.float32).view(dtype=torch.int32))

    def prepare_tensor_args(self, requests_with_new_token) -> torch.Tensor:
        return _float_args(
            [float(r.state.logit_processor_kwargs.get("top_p", 1.0)) for r in requests_with_new_token]
        )

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        top_p = tensor_arg[: scores.size(0)].view(dtype=torch.float32)
        keep_all = top_p >= 1.0
        if bool(keep_all.all()):  # the common case: no row asks for nucleus sampling
            return scores
        sorted_logits, sorted_idx = torch.sort(scores, descending=False, dim=-1)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= (1.0 - top_p).unsqueeze(-1)
        remove_sorted[..., -1:] = False  # the most likely token always survives
        remove_sorted &= ~keep_all.unsqueeze(-1)
        remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
        return scores.masked_fill(remove, float("-inf"))


class _DrawProcessor(ContinuousBatchingLogitsProcessor):
    """Picks each row's next token and masks all others, so the stock greedy sampler emits it.

    The per-row code is ``-1`` for greedy, ``<= -2`` for a forced token ``-(code + 2)``,
    and ``>= 0`` for a uniform draw ``code / 2**31`` sampled by inverse CDF.
    """

    supported_kwargs = {"seed": int, "forced_tokens": list, "prompt_len": int, "eos": int}
    ignored_kwargs = ()

    def __init__(self) -> None:
        self._rng = random.Random()

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.fill_(-1)

    def _code(self, state) -> int:
        kwargs = state.logit_processor_kwargs
        step = len(state.initial_tokens) + len(state.generated_tokens)  # invariant under soft resets
        forced = kwargs.get("forced_tokens")
        if forced is not None:
            j = step - kwargs["prompt_len"]
            if j < len(forced):
                return -(int(forced[j]) + 2)
            eos = kwargs.get("eos")
            return -(eos + 2) if eos is not None and eos >= 0 else -1
        temperature = kwargs.get("temperature", 1.0)
        if temperature <= 0.0:
            return -1
        seed = kwargs.get("seed")
        u = seeded_uniform(seed, step) if seed is not None else self._rng.random()
        return min(int(u * _U_SCALE), 2**31 - 1)

    def prepare_tensor_args(self, requests_with_new_token) -> torch.Tensor:
        return torch.tensor([self._code(r.state) for r in requests_with_new_token], dtype=torch.int32)

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        code = tensor_arg[: scores.size(0)].to(torch.int64)
        vocab = scores.size(-1)
        greedy = scores.argmax(dim=-1)
        if not bool((code >= 0).any()):  # greedy and forced rows only: no distribution needed
            choice = torch.where(code == -1, greedy, (-code - 2).clamp(min=0, max=vocab - 1))
            return torch.full_like(scores, float("-inf")).scatter_(-1, choice.unsqueeze(-1), 0.0)
        probs = torch.softmax(scores.float(), dim=-1)
        cdf = probs.cumsum(dim=-1)
        u = (code.clamp(min=0).to(torch.float64) / _U_SCALE).to(cdf.dtype).unsqueeze(-1)
        sampled = torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp(max=vocab - 1)
        # A draw landing on a masked (zero-probability) token falls back to the mode.
        sampled = torch.where(probs.gather(-1, sampled.unsqueeze(-1)).squeeze(-1) > 0, sampled, greedy)
        forced = (-code - 2).clamp(min=0, max=vocab - 1)
        choice = torch.where(code >= 0, sampled, torch.where(code == -1, greedy, forced))
        out = torch.full_like(scores, float("-inf"))
        out.scatter_(-1, choice.unsqueeze(-1), 0.0)
        return out


def needs_processors(kwargs: dict[str, Any]) -> bool:
    """Whether a row with these processor kwargs needs our processors to pick its token.

    A greedy row (temperature 0) with no nucleus (top-p 1) and no forced tokens does not:
    the processors would leave its logits as they are (temperature 1.0 for greedy rows,
    top-p keeping everything) and draw the argmax, which is what the substrate's stock
    greedy sampler picks from the raw fp32 logits. Every other row does (a greedy row with
    top-p < 1 included: its argmax is taken after the nucleus cut, as it always was).
    """
    if kwargs.get("forced_tokens") is not None:
        return True
    return float(kwargs.get("temperature", 1.0)) > 0.0 or float(kwargs.get("top_p", 1.0)) < 1.0


class _SamplingProcessors(ContinuousBatchingLogitsProcessorList):
    """Our three processors, run only on the steps where some row needs them.

    The substrate calls :meth:`prepare_tensor_args` on the generation thread before every
    forward (batching is synchronous) and reads ``do_processing`` during that forward, so
    the decision made here holds for exactly that step: a step whose rows all pass
    :func:`needs_processors` as false skips the argument tensors and the four full-vocab
    passes (temperature, top-p check, argmax, mask) and goes straight to the stock argmax.
    ``steps_processed`` / ``steps_skipped`` count the two paths.
    """

    def __init__(self) -> None:
        processors = [_TemperatureProcessor(), _TopPProcessor(), _DrawProcessor()]
        super().__init__(LogitsProcessorList(processors), per_request_processors=False)
        # The substrate counts argument rows only while converting its own warpers.
        self.tensors_required = len(processors)
        self.do_processing = True
        self.steps_processed = 0
        self.steps_skipped = 0

    def prepare_tensor_args(self, requests_in_batch, arg_storage: torch.Tensor) -> torch.Tensor:
        """Decides (mutating ``do_processing``) whether this step runs the processors; fills args if so."""
        needed = any(
            needs_processors(r.state.logit_processor_kwargs) for r in requests_in_batch if r.has_new_token
        )
        self.do_processing = needed
        if not needed:
            self.steps_skipped += 1
            return arg_storage
        self.steps_processed += 1
        return super().prepare_tensor_args(requests_in_batch, arg_storage)


def sampling_kwargs(sampling: Sampling, *, prompt_len: int, eos: int | None) -> dict[str, Any]:
    """The per-request keyword arguments our processors read (types checked by the substrate)."""
    kwargs: dict[str, Any] = {"temperature": float(sampling.temperature), "top_p": float(sampling.top_p)}
    if sampling.seed is not None:
        kwargs["seed"] = int(sampling.seed)
    if sampling.forced_tokens is not None:
        kwargs["forced_tokens"] = [int(t) for t in sampling.forced_tokens]
        kwargs["prompt_len"] = int(prompt_len)
        if eos is not None:
            kwargs["eos"] = int(eos)
    return kwargs


# --- radix-decided prefix eviction -------------------------------------------------------------


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
    - a block the tree holds is never dropped behind its back: a ``no_cache`` release (the
      substrate's soft reset of an offloaded request) keeps such a block cached, so radix
      remains the only one that frees it (and the requeued request can re-match it).
    """

    def __init__(self, page_size: int, *, anchor_max_held_tokens: int = 0) -> None:
        super().__init__()
        self.page_size = page_size
        self.anchor_max_held_tokens = anchor_max_held_tokens
        self.radix = RadixCache(page_size, slot_unit="page")
        self.retention = AnchorRetention(self.radix, anchor_max_held_tokens)
        self.tree_blocks: set[int] = set()
        self.demand: Callable[[], int] | None = None  # blocks the pressure at hand needs
        self.evictions: list[list[int]] = []  # block ids freed per eviction (page-identity tests)
        self.anchor_outcomes: dict[str, int] = {}  # HoldOutcome value -> count
        self.anchors_released = {"turn": 0, "pressure": 0, "bound": 0}

    def reset(self) -> None:
        super().reset()
        self.radix = RadixCache(self.page_size, slot_unit="page")
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
        blocks = list(self.radix.evict(want * self.page_size))
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

    hooks: _SchedulerHooks | None = None  # set by BatchRunner before the loop starts

    def __init__(self, cache, safety_margin, max_requests_per_batch):
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
        if self.hooks is not None:
            self.hooks.prefix_matched(state.request_id, matched)
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
            if self.hooks is not None:
                self.hooks.prefix_reused(ledger, state.initial_tokens)
        return tokens

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
                self._sync_request(ledger, state)
                if self.hooks is not None:
                    self.hooks.request_finishing(ledger, state)
            self._release(ledger, request_id)
        super().finish_request(request_id)

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


class _SchedulerHooks:
    """Callbacks from the generation thread into the runner (prefix accounting and anchors)."""

    def __init__(self, runner: BatchRunner) -> None:
        self._runner = runner

    def before_step(self) -> None:
        """Test hook: hold every step for ``step_delay_s`` (sleeping), so requests last long enough
        to be cancelled, drained or waited on in tests. Zero (the default) costs nothing."""
        delay = self._runner.config.step_delay_s
        if delay > 0:
            time.sleep(delay)

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


# --- the runner -------------------------------------------------------------------------------


@dataclass(frozen=True)
class KVStats:
    """The KV pool in pages: ``used`` excludes evictable (cached, unreferenced) prefix pages."""

    total: int
    used: int
    evictable: int
    free: int
    page_size: int


@dataclass(frozen=True)
class LiveRequest:
    request_id: str
    state: str  # "queued" | "prefill" | "decode"
    generated: int
    prompt_tokens: int


@dataclass
class RunnerConfig:
    kv_pages: int
    page_size: int = 16
    max_batch_tokens: int = 256
    max_requests_per_batch: int = 32
    prefix_policy: str = "radix"
    eos_token_ids: tuple[int, ...] = ()
    safety_margin: float = 0.15
    anchor_token: int | None = None  # the single-token tool-call opener (policy.anchor)
    anchor_max_held_tokens: int | None = None  # None: half the pool's tokens
    step_delay_s: float = 0.0  # test hook (see _SchedulerHooks.before_step)

    def __post_init__(self) -> None:
        if self.prefix_policy not in PREFIX_POLICIES:
            raise ValueError(f"prefix_policy must be one of {PREFIX_POLICIES}, got {self.prefix_policy!r}")


def kv_bytes_per_page(config, *, page_size: int, dtype: torch.dtype) -> int:
    """Bytes of KV one page holds across every layer (keys and values), from the model geometry."""
    from transformers.generation.continuous_batching.utils import find_head_dim, find_num_key_value_heads

    text = config.get_text_config()
    return (
        2
        * find_num_key_value_heads(text)
        * find_head_dim(text)
        * torch.empty((), dtype=dtype).element_size()
        * page_size
        * text.num_hidden_layers
    )


def kv_overhead_bytes(
    config, *, page_size: int, dtype: torch.dtype, max_batch_tokens: int
) -> tuple[int, int]:
    """(per-page, fixed) bytes the substrate spends beside the KV itself, by its own sizing rules.

    Mirrors ``PagedAttentionMemoryHandler`` for an eager/SDPA model with one full-attention
    group, no async double-buffering and no decode fast path (how :class:`BatchRunner`
    configures it). Per page: the attention-mask columns ``[M, page]``, the KV read back at
    the attention peak and the read indices. Fixed: two trash pages, the per-batch-token
    activation peak and IO rows, and the mask's ``[M, M]`` square.
    """
    from transformers.generation.continuous_batching.utils import find_head_dim, find_num_key_value_heads

    text = config.get_text_config()
    itemsize = torch.empty((), dtype=dtype).element_size()
    head_dim = find_head_dim(text)
    heads = text.num_attention_heads
    kv_heads = find_num_key_value_heads(text)
    kv_heads_at_peak = 2 * heads + kv_heads  # eager/SDPA repeat K and V to every query head
    m = max_batch_tokens
    per_cache_token = kv_heads_at_peak * head_dim * itemsize + 8  # read-back KV + int64 read index
    per_page = page_size * per_cache_token + m * page_size * itemsize  # + mask columns
    attention_peak = itemsize * (
        text.hidden_size + heads * head_dim + 2 * kv_heads * head_dim + kv_heads_at_peak * head_dim
    )
    io_bytes = 7 * 4 + 4 + 8 + 8
    fixed = (
        2 * kv_bytes_per_page(config, page_size=page_size, dtype=dtype)
        + m * (attention_peak + io_bytes)
        + m * m * itemsize
    )
    return per_page, fixed


Handler = Callable[[GenerationOutput], None]


class _TappingRouter(OutputRouter):
    """The substrate's output router, plus taps that keep intermediate outputs off the event loop.

    Stock routing wakes the server's event loop (``call_soon_threadsafe``) after every step
    for every streaming request, and the woken loop competes with the generation thread for
    the interpreter and the cores while the next step runs. A request registered with a
    *tap* (a consumer that only needs the whole reply, plus its accounting as it happens)
    has each intermediate output — not finished, no error — handed to the tap right here on
    the generation thread, under the router's lock, so unregistering under that lock
    (:meth:`BatchRunner.cancel`) means no tap runs afterwards. Its last output (finished or
    failed) still goes to its handler on the loop, as every output of an untapped request
    does. ``tapped_outputs`` / ``loop_outputs`` count the two routes.
    """

    def __init__(self) -> None:
        super().__init__()
        self.taps: dict[str, Handler] = {}
        self.tapped_outputs = 0
        self.loop_outputs = 0

    def deliver_batch(self, outputs: list[GenerationOutput]) -> None:
        to_loop = []
        with self._lock:
            for output in outputs:
                tap = self.taps.get(output.request_id)
                if tap is not None and output.error is None and not output.is_finished():
                    tap(output)
                    self.tapped_outputs += 1
                else:
                    to_loop.append(output)
        if to_loop:
            self.loop_outputs += len(to_loop)
            super().deliver_batch(to_loop)


@contextmanager
def _lazily_zeroed_cpu_cache(device: torch.device) -> Iterator[None]:
    """While the substrate builds its paged cache on the CPU, back it with anonymous memory.

    ``PagedAttentionCache`` allocates its one flat cache tensor with ``torch.zeros``, which on
    the CPU writes every byte up front (a 1 GiB pool: most of a second on a busy machine,
    which is most of a live KV re-split). An anonymous mapping is zero by definition and
    the kernel materialises each page on first touch, so the pool is ready at once and the
    cost moves to the steps that first use each page. Only the cache module's ``torch.zeros``
    for the CPU is affected, only while the cache is being built (no other batch loop runs
    then), and the real module is restored on exit. Off the CPU (CUDA memsets are fast) this
    does nothing.
    """
    if torch.device(device).type != "cpu":
        yield
        return
    import mmap

    from transformers.generation.continuous_batching import cache as cache_module

    real = cache_module.torch

    class _ZeroMappedTorch:
        def __getattr__(self, name: str):
            return getattr(real, name)

        @staticmethod
        def zeros(size, *, dtype, device):
            if (
                dtype is real.uint8
                and real.device(device).type == "cpu"
                and isinstance(size, int)
                and size > 0
            ):
                return real.frombuffer(mmap.mmap(-1, size), dtype=real.uint8)
            return real.zeros(size, dtype=dtype, device=device)

    cache_module.torch = _ZeroMappedTorch()
    try:
        yield
    finally:
        cache_module.torch = real


class BatchRunner:
    """One continuous-batching manager over a model, sized to ``kv_pages`` pages.

    Created stopped; :meth:`start` builds the KV pool (the substrate's paged cache) and the
    generation thread. A new KV size means :meth:`stop` and a new runner; an expert-pool
    resize happens inside :meth:`paused`. Thread model: ``submit``/``cancel`` run on the
    server's event loop; outputs come back on that loop through the substrate's handlers.
    """

    def __init__(self, model, config: RunnerConfig) -> None:
        self.model = model
        self.config = config
        self.manager: ContinuousBatchingManager | None = None
        self._cached_tokens: dict[str, int] = {}
        self._handlers: dict[str, Handler] = {}
        self._lock = threading.Lock()

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> None:
        """Allocate the KV pool and start the generation thread. Raises on allocation failure."""
        cfg = self.config
        eos = list(cfg.eos_token_ids) or [-1]
        gen = GenerationConfig(
            do_sample=False,
            max_new_tokens=256,
            eos_token_id=eos,
            pad_token_id=self.model.config.get_text_config().pad_token_id or 0,
        )
        cb = ContinuousBatchingConfig(
            page_size=cfg.page_size,
            num_blocks=cfg.kv_pages,
            max_batch_tokens=cfg.max_batch_tokens,
            max_requests_per_batch=cfg.max_requests_per_batch,
            max_blocks_per_request=0,  # no flash decode fast path: index-based reads work on every device
            allow_block_sharing=cfg.prefix_policy != "off",
            use_async_batching=False,
            use_cuda_graph=False,  # expert offloading makes data-dependent copies; graphs cannot hold them
            scheduler_type=RADIX_SCHEDULER,  # stock behaviour unless a RadixLedger is installed
            safety_margin=cfg.safety_margin,
            auto_switch_to_flash=False,
        )
        manager = self.model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        manager.logit_processor = _SamplingProcessors()
        manager.output_router = _TappingRouter()  # before warmup: the batch processor takes it there
        try:
            with _lazily_zeroed_cpu_cache(self.model.device):
                manager.warmup()  # builds the batch processor (and so the KV pool) on this thread
            processor = manager.batch_processor
            cache = processor.cache
            if choose_prefix_policy(cfg.prefix_policy, self.model.config) == "radix":
                allocator = cache.cache_allocators["full_attention"]
                held = cfg.anchor_max_held_tokens
                if held is None:
                    held = cfg.kv_pages * cfg.page_size // 2
                allocator.ledger = RadixLedger(cfg.page_size, anchor_max_held_tokens=held)
            processor.scheduler.hooks = _SchedulerHooks(self)
            manager.start()
        except BaseException:
            manager.batch_processor = None
            raise
        self.manager = manager
        log.info(
            "KV pool ready: %d pages of %d tokens (%s prefix policy)",
            self.kv_pages,
            cfg.page_size,
            cfg.prefix_policy,
        )

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the generation thread and release the KV pool. Idempotent."""
        manager, self.manager = self.manager, None
        if manager is None:
            return
        if manager.is_running():
            manager.stop(block=True, timeout=timeout)
        manager.batch_processor = None
        manager.destroy()

    @property
    def running(self) -> bool:
        return self.manager is not None and self.manager.is_running()

    @property
    def fatal_error(self) -> BaseException | None:
        return None if self.manager is None else self.manager.background_thread_status.fatal_error

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Hold the generation loop still (between steps) so the model may change in place."""
        if self.manager is None or not self.manager.is_running():
            yield
            return
        with self.manager.pause():
            yield

    # -- requests ---------------------------------------------------------------------------------

    def submit(
        self,
        request_id: str,
        input_ids: list[int],
        *,
        max_new_tokens: int,
        sampling: Sampling,
        on_output: Handler,
        on_progress: Handler | None = None,
    ) -> None:
        """Queue a request; ``on_output`` runs on the calling event loop for every step's output.

        With ``on_progress``, only the last output (finished or failed) reaches ``on_output``;
        every earlier one goes to ``on_progress`` on the generation thread instead (see
        :class:`_TappingRouter`), so it must be quick, thread-safe and must not raise. Must be
        called from a coroutine on the server's loop. Raises ``RuntimeError`` when the
        generation thread cannot take requests.
        """
        manager = self._require()
        eos = self.config.eos_token_ids[0] if self.config.eos_token_ids else None
        kwargs = sampling_kwargs(sampling, prompt_len=len(input_ids), eos=eos)

        def deliver(output: GenerationOutput) -> None:
            if output.is_finished():
                self._handlers.pop(request_id, None)
                self._drop_tap(request_id)
            on_output(output)

        self._handlers[request_id] = on_output
        manager.register_result_handler(request_id, deliver)
        if on_progress is not None:
            router = manager.output_router
            with router._lock:  # noqa: SLF001 - the lock every router table change takes
                router.taps[request_id] = on_progress
        added = manager.add_request(
            list(input_ids),
            request_id=request_id,
            max_new_tokens=max_new_tokens,
            streaming=True,
            eos_token_id=-1 if sampling.ignore_eos else (list(self.config.eos_token_ids) or -1),
            **kwargs,
        )
        if added is None:
            self._drop_handler(request_id)
            raise RuntimeError("the generation loop is not accepting requests")

    def cancel(self, request_id: str) -> bool:
        """Cancel a request at its next step boundary (prefill included); its pages are freed there.

        Returns whether the request was known. The cancelled request produces no further
        output; the caller ends its own stream.
        """
        known = request_id in self._handlers
        self._drop_handler(request_id)
        if self.manager is not None:
            self.manager.cancel_request(request_id)
        return known

    def _drop_handler(self, request_id: str) -> None:
        self._handlers.pop(request_id, None)
        manager = self.manager
        if manager is not None:
            with manager.output_router._lock:  # noqa: SLF001 - the router has no public unregister
                manager.output_router.result_handlers.pop(request_id, None)
                manager.output_router.taps.pop(request_id, None)

    def _drop_tap(self, request_id: str) -> None:
        manager = self.manager
        if manager is not None:
            with manager.output_router._lock:  # noqa: SLF001 - the router has no public unregister
                manager.output_router.taps.pop(request_id, None)

    def routing_counts(self) -> tuple[int, int] | None:
        """(outputs handed to the event loop, outputs tapped on the generation thread); None when stopped."""
        manager = self.manager
        if manager is None:
            return None
        router = manager.output_router
        return router.loop_outputs, router.tapped_outputs

    def sampling_steps(self) -> tuple[int, int] | None:
        """(steps that ran our logits processors, steps that skipped them); None when stopped."""
        manager = self.manager
        if manager is None:
            return None
        plist = manager.logit_processor
        return plist.steps_processed, plist.steps_skipped

    def cached_tokens(self, request_id: str) -> int:
        """Prompt tokens the prefix cache served for this request (0 before it was scheduled)."""
        return self._cached_tokens.get(request_id, 0)

    def forget(self, request_id: str) -> None:
        self._cached_tokens.pop(request_id, None)

    def _require(self) -> ContinuousBatchingManager:
        if self.manager is None or not self.manager.is_running():
            raise RuntimeError("the batch runner is not running")
        return self.manager

    # -- introspection ----------------------------------------------------------------------------

    @property
    def kv_pages(self) -> int:
        processor = self.manager.batch_processor if self.manager else None
        return processor.cache.num_blocks if processor is not None else self.config.kv_pages

    @property
    def page_size(self) -> int:
        return self.config.page_size

    @property
    def ledger(self) -> BlockLedger | None:
        processor = self.manager.batch_processor if self.manager else None
        if processor is None:
            return None
        return next(iter(processor.cache.cache_allocators.values())).ledger

    def kv_stats(self) -> KVStats | None:
        processor = self.manager.batch_processor if self.manager else None
        if processor is None:
            return None
        cache = processor.cache
        allocator = next(iter(cache.cache_allocators.values()))
        free = (
            cache.pool.count_free_blocks(allocator.index)
            + cache.pool.num_free_sectors * allocator.blocks_per_sector
        )
        evictable = len(allocator.ledger.cached_blocks)
        total = cache.num_blocks
        return KVStats(
            total=total,
            used=total - free - evictable,
            evictable=evictable,
            free=free,
            page_size=self.config.page_size,
        )

    def live_requests(self) -> list[LiveRequest]:
        processor = self.manager.batch_processor if self.manager else None
        if processor is None:
            return []
        scheduler = processor.scheduler
        out = []
        for state in list(scheduler.active_requests.values()):
            phase = "decode" if state.generated_tokens else "prefill"
            out.append(
                LiveRequest(state.request_id, phase, len(state.generated_tokens), len(state.initial_tokens))
            )
        for state in list(scheduler.waiting_requests.values()):
            out.append(
                LiveRequest(
                    state.request_id, "queued", len(state.generated_tokens), len(state.initial_tokens)
                )
            )
        return out

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` unless the pool's books balance and the radix tree agrees.

        free + cached + referenced pages == total, no page both cached and referenced, every
        cached page mirrored in the tree, and no more tree pages evictable than the ledger
        holds cached. Runs with the generation loop paused, so it sees one step boundary.
        """
        with self.paused():
            processor = self.manager.batch_processor if self.manager else None
            if processor is None:
                return
            allocator = next(iter(processor.cache.cache_allocators.values()))
            stats = self.kv_stats()
            owned = {b for table in allocator.block_table.values() for b in table}
            cached = set(allocator.ledger.cached_blocks)
            assert not (owned & cached), f"blocks both owned and cached: {sorted(owned & cached)}"
            assert stats.free + len(cached) + len(owned) == stats.total, (
                f"pool accounting: free {stats.free} + cached {len(cached)} + owned {len(owned)} "
                f"!= total {stats.total}"
            )
            ledger = allocator.ledger
            if isinstance(ledger, RadixLedger):
                ledger.radix.check_integrity()
                ledger.retention.check_integrity()
                assert cached <= ledger.tree_blocks, (
                    f"cached blocks outside the tree: {sorted(cached - ledger.tree_blocks)}"
                )
                assert ledger.evictable_blocks <= len(cached), (
                    f"tree says {ledger.evictable_blocks} pages evictable, ledger holds {len(cached)} cached"
                )


__all__ = [
    "PREFIX_POLICIES",
    "PrefixPolicyRefused",
    "choose_prefix_policy",
    "BatchRunner",
    "KVStats",
    "LiveRequest",
    "RadixLedger",
    "RadixScheduler",
    "RunnerConfig",
    "Sampling",
    "kv_bytes_per_page",
    "kv_overhead_bytes",
    "needs_processors",
    "sampling_kwargs",
    "seeded_uniform",
]
