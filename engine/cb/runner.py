"""The batch runner: one continuous-batching manager over the model (the KV pool), its lifecycle and outputs.

moetray plugs into ``transformers.generation.continuous_batching`` rather than shadowing
it: the substrate's ``ContinuousBatchingManager`` runs the generation loop, its scheduler
interleaves prefill and decode, and its ``PagedAttentionCache`` is the KV pool whose block
count ``pool_budget`` sizes. :class:`BatchRunner` creates a manager with a given block count
and page size, adds / streams / cancels requests, pauses the loop (expert-pool resize) and
stops it (KV-pool resize); the sampling stages (``sampling``) and the radix ledger
(``prefix``) are installed into it here. A hybrid model (linear-attention layers) gets the
state pool beside the KV pool (``state``, ``hybrid``) and its linear layers routed through it
(``recurrent``); the two pools are sized, started and stopped together.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching import ContinuousBatchingManager
from transformers.generation.continuous_batching.cache_allocators.cache_allocator import BlockLedger
from transformers.generation.continuous_batching.continuous_api import OutputRouter
from transformers.generation.continuous_batching.requests import GenerationOutput

from moetray.engine.cb.compiled_step import decode_step_of
from moetray.engine.cb.hybrid import HYBRID_SCHEDULER, HybridPagedCache, hybrid_substrate
from moetray.engine.cb.kv import lazily_zeroed_cpu_cache, map_attention_mask_lazily, return_freed_heap
from moetray.engine.cb.prefix import (
    PREFIX_POLICIES,
    RADIX_SCHEDULER,
    RadixLedger,
    SchedulerHooks,
    choose_prefix_policy,
)
from moetray.engine.cb.recurrent import install_linear_attention
from moetray.engine.cb.sampling import Sampling, SamplingProcessors, TokenLogprob, sampling_kwargs
from moetray.engine.cb.state import HybridLedger, StateGeometry
from moetray.engine.cores import DecodeTeam
from moetray.policy.step_threads import one_thread_tokens

log = logging.getLogger("moetray.engine.cb")

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
class StateStats:
    """The recurrent-state pool in slots: ``used`` is live requests, filling snapshots and locked
    snapshots; ``evictable`` snapshots (unlocked, in the radix tree) are not used."""

    total: int
    used: int
    live: int
    snapshots: int
    evictable: int
    free: int


@dataclass(frozen=True)
class LiveRequest:
    request_id: str
    state: str  # "queued" | "prefill" | "decode"
    generated: int
    prompt_tokens: int


@dataclass
class RunnerConfig:
    kv_pages: int
    state_slots: int = 0  # recurrent-state slots (hybrid models only; 0 for every other model)
    page_size: int = 16
    max_batch_tokens: int = 256
    max_requests_per_batch: int = 32
    prefix_policy: str = "radix"
    eos_token_ids: tuple[int, ...] = ()
    safety_margin: float = 0.15
    anchor_token: int | None = None  # the single-token tool-call opener (policy.anchor)
    anchor_max_held_tokens: int | None = None  # None: half the pool's tokens
    step_delay_s: float = 0.0  # test hook (see SchedulerHooks.before_step)
    one_thread_small_steps: bool = False  # small steps on one intra-op thread (policy.step_threads)
    thread_budget: int | None = None  # the engine's intra-op threads (None: torch's count at start)

    def __post_init__(self) -> None:
        if self.prefix_policy not in PREFIX_POLICIES:
            raise ValueError(f"prefix_policy must be one of {PREFIX_POLICIES}, got {self.prefix_policy!r}")


Handler = Callable[[GenerationOutput], None]


def _router(manager: ContinuousBatchingManager) -> _TappingRouter:
    """The manager's output router: the runner installs a ``_TappingRouter`` before the loop starts."""
    router = manager.output_router
    assert isinstance(router, _TappingRouter), type(router).__name__
    return router


def _processors(manager: ContinuousBatchingManager) -> SamplingProcessors:
    """The manager's logits processors: the runner installs ``SamplingProcessors`` at start."""
    plist = manager.logit_processor
    assert isinstance(plist, SamplingProcessors), type(plist).__name__
    return plist


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
        self.steps = 0  # batch steps taken: the loop's heartbeat
        self.last_step_at: float | None = None  # time.monotonic() of the latest step
        self.step_threads: int | None = None  # intra-op threads of the latest step (policy.step_threads)
        # Steps of at most this many query tokens run on one intra-op thread (policy.step_threads).
        self.one_thread_up_to = (one_thread_tokens(model.config.get_text_config().hidden_size)
                                 if config.one_thread_small_steps else 0)
        # Decode steps on the whole budget while the cores are the engine's alone (policy.step_threads).
        self.decode_team = (DecodeTeam(config.thread_budget or torch.get_num_threads())
                            if config.one_thread_small_steps else None)

    def beat(self) -> None:
        """The generation thread is about to run a step (called from the scheduler hooks)."""
        self.steps += 1
        self.last_step_at = time.monotonic()

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> None:
        """Allocate the KV pool (and a hybrid's state pool) and start the generation thread.

        Raises on allocation failure."""
        cfg = self.config
        geometry = StateGeometry.from_config(self.model.config, self.model.dtype)
        if geometry is not None:
            if cfg.state_slots < 1:
                raise ValueError(f"a hybrid model needs state slots to run, got {cfg.state_slots}")
            install_linear_attention(self.model, geometry)
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
            # stock behaviour unless a RadixLedger is installed; a hybrid's adds the state half
            scheduler_type=RADIX_SCHEDULER if geometry is None else HYBRID_SCHEDULER,
            safety_margin=cfg.safety_margin,
            auto_switch_to_flash=False,
        )
        substrate = nullcontext() if geometry is None else hybrid_substrate(geometry, cfg.state_slots)
        with substrate:
            manager = self.model.init_continuous_batching(
                generation_config=gen, continuous_batching_config=cb
            )
            manager.logit_processor = SamplingProcessors()
            manager.output_router = _TappingRouter()  # before warmup: the batch processor takes it there
            try:
                with lazily_zeroed_cpu_cache(self.model.device):
                    manager.warmup()  # builds the batch processor (and so the KV pool) on this thread
                processor = manager.batch_processor
                map_attention_mask_lazily(processor)
                cache = processor.cache
                step = decode_step_of(self.model)  # never on a hybrid (refused at load)
                if step is not None:
                    step.install(cache)
                    step.warm_up(processor.model_runner, self.model, page_size=cfg.page_size,
                                 thread_budget=cfg.thread_budget or torch.get_num_threads(),
                                 one_thread_up_to=self.one_thread_up_to,
                                 team=self.decode_team is not None and self.decode_team.possible)
                    cache.reset()  # the warm-up batches' pages go back to the pool
                if choose_prefix_policy(cfg.prefix_policy, self.model.config) == "radix":
                    allocator = cache.cache_allocators["full_attention"]
                    held = cfg.anchor_max_held_tokens
                    if held is None:
                        held = cfg.kv_pages * cfg.page_size // 2
                    if isinstance(cache, HybridPagedCache):
                        allocator.ledger = HybridLedger(
                            cfg.page_size, state_pool=cache.states.pool, anchor_max_held_tokens=held
                        )
                    else:
                        allocator.ledger = RadixLedger(cfg.page_size, anchor_max_held_tokens=held)
                processor.scheduler.hooks = SchedulerHooks(self)
                manager.start()
            except BaseException:
                manager.batch_processor = None
                raise
        self.manager = manager
        log.info(
            "KV pool ready: %d pages of %d tokens (%s prefix policy)%s",
            self.kv_pages,
            cfg.page_size,
            cfg.prefix_policy,
            "" if geometry is None else f"; {cfg.state_slots} state slots of {geometry.bytes_per_slot} B",
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
        del manager
        if self.step_threads is not None and self.config.thread_budget:  # a decode step left 1 thread
            torch.set_num_threads(self.config.thread_budget)
        gc.collect()  # the manager is a reference cycle: its buffers are freed here, not at some later GC
        return_freed_heap()

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
        _processors(manager).register(request_id, sampling, len(input_ids))
        manager.register_result_handler(request_id, deliver)
        if on_progress is not None:
            router = _router(manager)
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
            _processors(manager).release(request_id)
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
            router = _router(manager)
            with router._lock:  # noqa: SLF001 - the router has no public unregister
                router.result_handlers.pop(request_id, None)
                router.taps.pop(request_id, None)

    def _drop_tap(self, request_id: str) -> None:
        manager = self.manager
        if manager is not None:
            router = _router(manager)
            with router._lock:  # noqa: SLF001 - the router has no public unregister
                router.taps.pop(request_id, None)

    def routing_counts(self) -> tuple[int, int] | None:
        """(outputs handed to the event loop, outputs tapped on the generation thread); None when stopped."""
        manager = self.manager
        if manager is None:
            return None
        router = _router(manager)
        return router.loop_outputs, router.tapped_outputs

    def sampling_steps(self) -> tuple[int, int] | None:
        """(steps that ran our logits processors, steps that skipped them); None when stopped."""
        manager = self.manager
        if manager is None:
            return None
        plist = _processors(manager)
        return plist.steps_processed, plist.steps_skipped

    def cached_tokens(self, request_id: str) -> int:
        """Prompt tokens the prefix cache served for this request (0 before it was scheduled)."""
        return self._cached_tokens.get(request_id, 0)

    def logprobs(self, request_id: str) -> list[TokenLogprob] | None:
        """The log-probabilities taken so far, one per generated token; None when not asked for."""
        manager = self.manager
        return None if manager is None else _processors(manager).logprobs(request_id)

    def masks_computed(self) -> int | None:
        """Grammar masks computed since start (one per constrained row per step); None when stopped."""
        manager = self.manager
        return None if manager is None else _processors(manager).masks_computed

    def forget(self, request_id: str) -> None:
        """The reply is over: drop what was kept for it (prefix accounting, sampling-stage state)."""
        self._cached_tokens.pop(request_id, None)
        if self.manager is not None:
            _processors(self.manager).release(request_id)

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

    def pool_bytes(self) -> int | None:
        """Bytes the live KV pool's cache tensor holds (measured, not priced); None when stopped."""
        processor = self.manager.batch_processor if self.manager else None
        if processor is None:
            return None
        return int(processor.cache.cache_tensor.nbytes)

    def state_pool_bytes(self) -> int | None:
        """Bytes the live state pool's tensors hold (0 without one); None when stopped."""
        cache = self._cache()
        if cache is None:
            return None
        if not isinstance(cache, HybridPagedCache):
            return 0
        pool = cache.states.pool
        return sum(int(t.nbytes) for t in (*pool.conv.values(), *pool.recurrent.values()))

    @property
    def state_slots(self) -> int:
        """State-pool slots (0 for a model without linear-attention layers)."""
        cache = self._cache()
        if isinstance(cache, HybridPagedCache):
            return cache.states.pool.capacity
        return self.config.state_slots

    def _cache(self):
        processor = self.manager.batch_processor if self.manager else None
        return processor.cache if processor is not None else None

    def state_stats(self) -> StateStats | None:
        """The state pool's gauges; None for a model without one, or when stopped."""
        cache = self._cache()
        if not isinstance(cache, HybridPagedCache):
            return None
        states = cache.states
        ledger = cache.ledger
        snapshots = ledger.radix.state_count if ledger is not None else 0
        evictable = ledger.radix.evictable_states if ledger is not None else 0
        live = len(states.live)
        total = states.pool.capacity
        return StateStats(
            total=total,
            used=total - states.pool.free_count - evictable,
            live=live,
            snapshots=snapshots,
            evictable=evictable,
            free=states.pool.free_count,
        )

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
            assert stats is not None  # the batch processor exists (checked above)
            owned = {b for table in allocator.block_table.values() for b in table}
            cached = set(allocator.ledger.cached_blocks)
            assert not (owned & cached), f"blocks both owned and cached: {sorted(owned & cached)}"
            assert stats.free + len(cached) + len(owned) == stats.total, (
                f"pool accounting: free {stats.free} + cached {len(cached)} + owned {len(owned)} "
                f"!= total {stats.total}"
            )
            ledger = allocator.ledger
            cache = processor.cache
            if isinstance(cache, HybridPagedCache):
                if isinstance(ledger, HybridLedger):
                    ledger.check_states(cache.states)
                else:
                    held = len(cache.states.held_slots())
                    assert held + cache.states.pool.free_count == cache.states.pool.capacity, (
                        f"state pool: {held} held + {cache.states.pool.free_count} free "
                        f"!= {cache.states.pool.capacity}"
                    )
            if isinstance(ledger, RadixLedger):
                ledger.radix.check_integrity()
                ledger.retention.check_integrity()
                assert cached <= ledger.tree_blocks, (
                    f"cached blocks outside the tree: {sorted(cached - ledger.tree_blocks)}"
                )
                assert ledger.evictable_blocks <= len(cached), (
                    f"tree says {ledger.evictable_blocks} pages evictable, ledger holds {len(cached)} cached"
                )
