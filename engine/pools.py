"""The device pools: experts, KV, a hybrid's recurrent state, and the budget that splits memory among them.

``Pools`` owns the experts runtime (its slot pool holds the resident experts), the batch
runner (transformers' continuous batching, whose paged cache is the KV pool) and the
``policy.pool_budget.PoolBudget`` priced once at load. Every size, limit, projection and
the ``/admin/status`` ``pools`` payload (``PoolBudget.to_wire``) come from that budget;
``Pools`` applies sizes and reports what it holds, it does no arithmetic of its own.

Pools are named as ``RebuildRequest.touched()`` names them. ``"moe"`` is resized in place,
between two steps of the paused batch loop, keeping the hottest experts. The pools in
:data:`RUNNER_POOLS` live inside the batch runner and are re-created with it: ``"kv"`` and,
on hybrid models, ``"state"`` (``PoolSizes.state_slots``, priced by ``PoolBudget`` from
``engine.cb.state.StateGeometry``, allocated by the runner beside the KV pool: one slot of conv and recurrent
states per linear-attention layer for each running request or kept snapshot).

The re-split's destructive step (:meth:`Pools.resize`) and its rollback
(:meth:`Pools.restore`) are the two callables ``policy.rebuild.RebuildTxn`` runs; the live
re-split (``engine/rebuild.py``) reaches the pools only through them, :meth:`Pools.sizes`
and :meth:`Pools.validate`.

May import torch (lazily), ``moetray.engine.cb``, ``moetray.engine.budget`` and
``moetray.policy``; never the HTTP layer, the engine front or the control operations.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from moetray.engine.budget import ContextCeiling, DeviceBudget
from moetray.engine.cb import BatchRunner, RunnerConfig, kv_bytes_per_page, kv_overhead_bytes
from moetray.engine.cb.compiled_step import decode_step_of
from moetray.engine.cb.state import StateGeometry
from moetray.policy.pool_budget import PoolBudget, reserve_pages
from moetray.policy.pool_sizes import MIN_STATE_SLOTS, PoolFloors, PoolSizes, RebuildRequest
from moetray.policy.rebuild import RUNNER_POOLS

log = logging.getLogger("moetray.engine.pools")

__all__ = ["RUNNER_POOLS", "AllocationFailed", "Pools", "RunnerSettings", "price_pools"]


class AllocationFailed(RuntimeError):
    """A pool could not be allocated beside everything else; raised before anything was freed."""


@dataclass(frozen=True)
class RunnerSettings:
    """What every batch runner of this engine shares; only the KV and state pools' sizes differ."""

    page_size: int
    max_batch_tokens: int
    max_requests_per_batch: int
    prefix_policy: str
    eos_token_ids: tuple[int, ...]
    anchor_token: int | None
    step_delay_s: float = 0.0
    one_thread_small_steps: bool = False
    thread_budget: int | None = None

    def config(self, kv_pages: int, state_slots: int = 0) -> RunnerConfig:
        return RunnerConfig(
            kv_pages=kv_pages,
            state_slots=state_slots,
            page_size=self.page_size,
            max_batch_tokens=self.max_batch_tokens,
            max_requests_per_batch=self.max_requests_per_batch,
            prefix_policy=self.prefix_policy,
            eos_token_ids=self.eos_token_ids,
            anchor_token=self.anchor_token,
            step_delay_s=self.step_delay_s,
            one_thread_small_steps=self.one_thread_small_steps,
            thread_budget=self.thread_budget,
        )


def price_pools(
    model_config, runtime, device: DeviceBudget, *, page_size: int, max_batch_tokens: int, dtype
) -> PoolBudget:
    """The pools' ``PoolBudget``: unit costs from the model geometry, floors, the measured budget.

    The MoE floor is one layer of experts; the KV floor holds one full batch of tokens plus
    a page. A KV page costs its keys and values over every layer plus what the substrate
    spends per page beside them; what it spends regardless of size is ``fixed_bytes``. A
    hybrid model (linear-attention layers) gets a state pool: one slot costs its conv and
    recurrent states over every linear layer, its floor is ``MIN_STATE_SLOTS``; any other
    model has none (``floors.state_slots`` is ``None``).
    """
    geometry = StateGeometry.from_config(model_config, dtype)
    kv_page = kv_bytes_per_page(model_config, page_size=page_size, dtype=dtype)
    overhead_page, fixed = kv_overhead_bytes(
        model_config, page_size=page_size, dtype=dtype, max_batch_tokens=max_batch_tokens
    )
    return PoolBudget(
        budget_bytes=device.budget_bytes,
        bytes_per_slot=int(runtime.bytes_per_slot),
        bytes_per_page=kv_page + overhead_page,
        page_size=page_size,
        floors=PoolFloors(
            moe_slots=runtime.num_experts,
            kv_pages=reserve_pages(max_batch_tokens, page_size) + 1,
            state_slots=None if geometry is None else MIN_STATE_SLOTS,
        ),
        max_moe_slots=runtime.num_layers * runtime.num_experts,
        fixed_bytes=fixed,
        bytes_per_state_slot=0 if geometry is None else geometry.bytes_per_slot,
    )


class Pools:
    """One model's pools: the expert slot pool (``runtime``), the runner's KV and state pools, their budget.

    Built by the loader with the runtime already holding a floor of slots; :meth:`open`
    gives every pool its start-up size. ``runner`` is ``None`` only while a runner-pool
    re-split has torn the old pools down (or after a failed restore latched the engine). ``ceiling``
    is the context every request is held to, re-derived whenever a KV pool is built.
    Thread model: the request path reads ``runner`` on the server's loop; resizes run in the
    re-split's worker thread while the gate keeps requests out.
    """

    def __init__(
        self,
        model,
        runtime,
        budget: PoolBudget,
        device: DeviceBudget,
        settings: RunnerSettings,
        *,
        trained_context: int | None,
    ) -> None:
        self.model = model
        self.runtime = runtime
        self.budget = budget
        self.device = device
        self.settings = settings
        self.trained_context = trained_context
        self.runner: BatchRunner | None = None
        self.ceiling: ContextCeiling | None = None
        self.last_rebuild: dict[str, Any] | None = None  # wire.RebuildResult of the last re-split

    # -- sizes -------------------------------------------------------------------------------

    def open(self, sizes: PoolSizes, progress: Callable[[str, int, int | None], None]) -> None:
        """Give every pool its start-up size and start the batch loop.

        Before the runner pools are built, the engine's long-lived objects leave the cyclic GC
        (``gc.freeze``): the model, the libraries and the compiled decode step's graphs (built
        first, on a scratch runner that is stopped and collected). Unfrozen, the graphs' ~500k
        objects made every full collection walk them: one took 480 ms mid-request, on the
        server's loop with the GIL held, stalling the batch loop too; and every ``gc.collect()``
        the substrate runs when a manager stops (each KV re-split) walked the whole heap (~1 s
        instead of ~1 ms). Frozen before the runner's own pools: the batch manager is a
        reference cycle, and a frozen cycle is never collected, so a KV pool built before the
        freeze would stay mapped after its first re-split (issue 11, defect 2)."""
        progress("sizing the expert slot pool", 0, 1)
        if sizes.moe_slots != self.runtime.capacity:
            self.runtime.resize(sizes.moe_slots)
        if decode_step_of(self.model) is not None:
            progress("compiling the decode step", 0, 1)
            scratch = BatchRunner(self.model, self.settings.config(sizes.kv_pages, sizes.state_slots))
            scratch.start()  # its warm-up builds the graphs; the real runner's finds them built
            scratch.stop()  # collected, so its KV pool is unmapped before the freeze
        gc.freeze()
        stage = "the KV and state pools" if self.budget.has_state_pool else "the KV pool"
        progress(f"allocating {stage}", 0, 1)
        self.open_kv(sizes.kv_pages, sizes.state_slots)

    def sizes(self) -> PoolSizes:
        """What the pools hold now (KV pages and state slots 0 while no runner exists)."""
        runner = self.runner
        if runner is None:
            return PoolSizes(self.runtime.capacity, 0, 0)
        return PoolSizes(self.runtime.capacity, runner.kv_pages, runner.state_slots)

    def validate(self, request: RebuildRequest, *, idle: bool) -> PoolSizes:
        """The sizes a re-split would land on (``PoolBudget.validate``); refuses with ``RebuildRejected``."""
        return self.budget.validate(request, self.sizes(), idle=idle)

    def to_wire(self) -> dict[str, object]:
        """``policy.wire.PoolInfo``: ``PoolBudget.to_wire`` for the current sizes, pool use, live bytes."""
        runner = self.runner
        stats = runner.kv_stats() if runner is not None else None
        states = runner.state_stats() if runner is not None else None
        return self.budget.to_wire(
            self.sizes(),
            kv_pages_used=stats.used if stats else None,
            kv_pages_evictable=stats.evictable if stats else None,
            state_slots_used=states.used if states else None,
            live_moe_bytes=int(self.runtime.pool.rows.nbytes),
            live_kv_bytes=runner.pool_bytes() if runner is not None else None,
            live_state_bytes=runner.state_pool_bytes() if runner is not None else None,
        )

    # -- the re-split's two callables ------------------------------------------------------------

    def resize(
        self, target: PoolSizes, touched: frozenset[str], mark_teardown: Callable[[], None]
    ) -> PoolSizes:
        """The destructive step: the ``touched`` pools take their ``target`` sizes; returns what landed.

        Calls ``mark_teardown()`` before freeing anything and raises on failure (a failure
        before that point left everything as it was). In-place only: the expert pool is
        resized between two steps of the paused loop (the runtime marks teardown itself,
        after its new pool was allocated). A runner pool touched: the growth is checked
        against free memory first, then the runner stops, its pools are dropped, the expert
        pool is resized and a new runner is built at the target.
        """
        if not touched & RUNNER_POOLS:
            with self._paused():
                self.runtime.resize(target.moe_slots, mark_teardown=mark_teardown)
            return self.sizes()
        self.check_kv_growth(target.kv_pages, target.state_slots)
        mark_teardown()
        self.close_kv()
        if "moe" in touched:
            self.runtime.resize(target.moe_slots)
        self.open_kv(target.kv_pages, target.state_slots)
        return self.sizes()

    def restore(self, old: PoolSizes, touched: frozenset[str]) -> None:
        """The rollback: re-create only the ``touched`` pools at their ``old`` sizes; raises if it fails."""
        if "moe" in touched and self.runtime.capacity != old.moe_slots:
            with self._paused():
                self.runtime.resize(old.moe_slots)
        if touched & RUNNER_POOLS:
            self.close_kv()
            self.open_kv(old.kv_pages, old.state_slots)

    # -- the batch runner (the runner pools) -----------------------------------------------------

    def open_kv(self, kv_pages: int, state_slots: int = 0) -> None:
        """Build and start a batch runner with ``kv_pages`` KV pages (and, on a hybrid model,
        ``state_slots`` state slots); re-derives the context ceiling."""
        runner = BatchRunner(self.model, self.settings.config(kv_pages, state_slots))
        runner.start()
        self.runner = runner
        self.ceiling = ContextCeiling.for_model(
            self.trained_context, runner.kv_pages * self.settings.page_size
        )

    def close_kv(self) -> None:
        """Stop the batch runner and free its pools (KV, state, the prefix cache); idempotent."""
        runner, self.runner = self.runner, None
        if runner is None:
            return
        runner.stop()
        del runner
        gc.collect()

    def check_kv_growth(self, kv_pages: int, state_slots: int = 0) -> None:
        """Refuse, before teardown, KV and state pools that cannot be allocated beside everything else.

        The old pools are freed before the new ones are made, so only the growth must fit in
        the memory free right now (device memory on CUDA, available host RAM on the CPU tier).
        Raises ``AllocationFailed``; mutates nothing.
        """
        if self.runner is None:
            return
        growth = (kv_pages - self.runner.kv_pages) * self.budget.bytes_per_page
        growth += (state_slots - self.runner.state_slots) * self.budget.bytes_per_state_slot
        if growth <= 0:
            return
        if self.runtime.device.type == "cuda":
            import torch

            free = int(torch.cuda.mem_get_info(self.runtime.device)[0])
        else:
            import psutil

            free = int(psutil.virtual_memory().available)
        if growth > free:
            raise AllocationFailed(f"the runner's pools need {growth} more bytes but only {free} are free")

    @contextmanager
    def _paused(self) -> Iterator[None]:
        if self.runner is None:
            yield
            return
        with self.runner.paused():
            yield

    # -- checks and shutdown ---------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise unless every pool's books balance (the KV and state ledgers, the expert slot map)."""
        if self.runner is not None:
            self.runner.check_integrity()
        self.runtime.check_integrity()

    def close(self) -> None:
        """Stop the batch loop (process exit); idempotent."""
        runner, self.runner = self.runner, None
        if runner is not None:
            runner.stop()
