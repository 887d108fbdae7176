"""The engine: one model, its two pools, the gate in front of them, and the requests inside.

``Engine`` owns the ``MaintenanceGate`` (every admission, rebuild and stop goes through it),
the loaded model with its expert runtime, the ``BatchRunner`` (transformers' continuous
batching: the KV pool), the request registry and the telemetry. The HTTP layer calls it;
the live re-split and the stop flows live in ``rebuild.py`` and ``stop.py``.

Threads: the server's event loop runs admission, streaming and the flows; the loading
thread runs :meth:`Engine.load`; the batch runner has its generation thread. Gate
transitions and the registry are guarded by one lock, so admission is atomic with state
changes (a request is either refused or registered before a rebuild checks for idleness).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moetray.engine.budget import MAX_TOKENS_CEILING, ContextCeiling, DeviceBudget
from moetray.engine.cb import (
    BatchRunner,
    RunnerConfig,
    Sampling,
    choose_prefix_policy,
    kv_bytes_per_page,
    kv_overhead_bytes,
)
from moetray.engine.telemetry import Telemetry, device_memory
from moetray.policy import wire
from moetray.policy.maintenance import GateState, MaintenanceGate, SealedAccounting
from moetray.policy.pool_budget import (
    DEFAULT_KV_RESERVE_TOKENS,
    DEFAULT_MEMORY_RATIO,
    BudgetTooSmall,
    PoolFloors,
    PoolSizes,
    RebuildRequest,
    plan_budget,
    reserve_pages,
    slider_limits,
    validate_rebuild,
)
from moetray.policy.rebuild import EngineActivity
from moetray.policy.refused import Refused

log = logging.getLogger("moetray.engine")


@dataclass
class EngineOptions:
    """Everything ``moetray serve`` can set; defaults are the documented CLI defaults."""

    model_dir: Path | None  # None: the embedded demo model
    device: str = "auto"
    dtype: str = "auto"
    moe_capacity: int | None = None  # expert slots; None: planned from the budget
    kv_tokens: int | None = None  # None: planned from the budget
    budget_bytes: int | None = None  # CPU: the device tier's budget; CUDA: overrides the measurement
    memory_ratio: float = DEFAULT_MEMORY_RATIO
    kv_reserve_tokens: int = DEFAULT_KV_RESERVE_TOKENS
    page_size: int = 16
    max_batch_tokens: int = 256
    max_requests_per_batch: int = 32
    prefix_policy: str | None = None  # None: cb.choose_prefix_policy decides per model
    top_k: int | None = None
    expert_policy: str | None = None
    link_gbps: float | None = None
    outbox_dir: Path | None = None
    rebuild_idle_timeout_s: float = 30.0
    test_hooks: bool = False
    test_step_delay_s: float = 0.0  # test hook: every batch step sleeps this long (needs test_hooks)
    instance_id: str | None = None


class EngineUnavailable(Refused):
    """The engine cannot take work for a reason the gate does not express; ``.kind`` is a gate state."""


@dataclass
class RebuildFaults:
    """Fault-injection hooks for the rebuild matrix (tests only; each fires once, then clears).

    ``before_teardown``: the allocation fails before anything is freed. ``after_teardown``:
    it fails after the old pool was torn down. ``restore``: the rollback fails too.
    ``hold``: the transaction waits for this event before its first step (a slow re-split).
    """

    before_teardown: bool = False
    after_teardown: bool = False
    restore: bool = False
    hold: threading.Event | None = None

    def take(self, name: str) -> bool:
        armed = getattr(self, name)
        setattr(self, name, False)
        return armed

    def wait_hold(self) -> None:
        """Blocks the calling transaction until an armed ``hold`` is set; then disarms it."""
        hold, self.hold = self.hold, None
        if hold is not None:
            hold.wait()


@dataclass(frozen=True)
class Step:
    """New tokens of one request since the last step; ``finish_reason`` once it is over."""

    tokens: list[int]
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "cancelled"


_CANCELLED = object()


@dataclass
class RequestRecord:
    id: str
    prompt_tokens: int
    max_new_tokens: int
    sampling: Sampling
    prompt_ids: list[int]
    created: float
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    generated: int = 0
    first_token_at: float | None = None
    done: bool = False
    cancelled: bool = False
    cached_tokens: int = 0


@dataclass
class PoolPricing:
    """The unit costs and budget every pool decision uses (measured once, at load)."""

    budget: DeviceBudget
    bytes_per_slot: int
    bytes_per_page: int
    fixed_bytes: int
    floors: PoolFloors
    max_moe_slots: int

    def limits(self):
        return slider_limits(
            self.floors,
            budget_bytes=self.budget.budget_bytes,
            bytes_per_slot=self.bytes_per_slot,
            bytes_per_page=self.bytes_per_page,
            max_moe_slots=self.max_moe_slots,
            fixed_bytes=self.fixed_bytes,
        )


class Engine:
    """The engine process's state and verbs (see the module docstring)."""

    def __init__(self, options: EngineOptions, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.options = options
        self.clock = clock
        self.started_at = clock()
        self.started_unix = time.time()
        self.gate = MaintenanceGate()
        self.lock = threading.RLock()
        self.telemetry = Telemetry(clock)
        self.faults = RebuildFaults()
        self.identity = (
            options.instance_id
            or os.environ.get("MOETRAY_INSTANCE_ID")
            or (f"pid:{os.getpid()}:started:{int(self.started_unix)}")
        )
        self.load_progress: dict[str, Any] | None = {"stage": "starting", "done": 0, "total": None}
        self.load_error: str | None = None
        self.load_error_kind: str | None = None  # the refusal's kind when loading was refused by name
        self.prefix_policy: str | None = None  # decided from the model's config at load
        self.loaded = None  # moetray.engine.models.checkpoint.LoadedModel
        self.runner: BatchRunner | None = None
        self.pricing: PoolPricing | None = None
        self.ceiling: ContextCeiling | None = None
        self.chat = None  # moetray.engine.chat.ChatSupport
        self.eos_ids: tuple[int, ...] = ()
        self.registry: dict[str, RequestRecord] = {}
        self.last_rebuild: dict[str, Any] | None = None
        self.stop_counts: dict[str, int] | None = None  # drained / aborted, fixed by the first stop
        self.rebuild_timings: list[dict[str, Any]] = []
        self._loader_thread: threading.Thread | None = None

    # ------------------------------------------------------------------ loading

    def start_loading(self) -> threading.Thread:
        """Load the model on a background thread; the gate ends ``serving`` or ``failed``."""
        thread = threading.Thread(target=self.load, name="moetray-load", daemon=True)
        self._loader_thread = thread
        thread.start()
        return thread

    def _progress(self, stage: str, done: int, total: int | None) -> None:
        self.load_progress = {
            "stage": stage,
            "done": int(done),
            "total": None if total is None else int(total),
        }

    def load(self) -> None:
        """Read, price, load and start serving; any failure latches the gate ``failed`` with its reason."""
        try:
            self._load()
        except Exception as exc:  # the reason travels to /health; the gate latches
            log.exception("loading failed")
            self.load_error_kind = getattr(exc, "kind", None)
            self.load_error = str(exc) if self.load_error_kind else f"{type(exc).__name__}: {exc}"
            with self.lock:
                self.gate.finish_loading(False)
            return
        with self.lock:
            state = self.gate.finish_loading(True)
        self._progress("ready", 1, 1)
        log.info("engine %s: %s", state.value, self.loaded.info.label)

    def _load(self) -> None:
        import torch

        from moetray.engine.budget import cpu_budget, cuda_budget, cuda_free_bytes
        from moetray.engine.chat import ChatSupport
        from moetray.engine.models import checkpoint as loader

        opts = self.options
        model_dir = opts.model_dir
        if model_dir is None:
            self._progress("preparing the embedded demo model", 0, None)
            from moetray.engine.demo import ensure_demo_model

            model_dir = ensure_demo_model(self._progress)
        self._progress("reading config", 0, None)
        info = loader.inspect_checkpoint(model_dir)
        self.prefix_policy = choose_prefix_policy(opts.prefix_policy, info.config)
        device = loader.resolve_device(opts.device)
        fmt = loader.serving_format(opts.dtype, info, device)
        top_k = opts.top_k or info.default_top_k
        if top_k != info.top_k and not info.top_k_adjustable:
            raise loader.CheckpointError(
                "top_k_fixed",
                f"this checkpoint was built for top-{info.top_k}; "
                f"its sidecar says top-k is not adjustable (asked for {top_k})",
            )
        if not 1 <= top_k <= info.num_experts:
            raise loader.CheckpointError(
                "bad_top_k", f"top-k must lie in [1, {info.num_experts}], got {top_k}"
            )
        floor_slots = info.num_experts  # one layer of experts
        baseline_free = cuda_free_bytes(device)[0] if device.type == "cuda" else None
        loaded = loader.load_checkpoint(
            info,
            device=device,
            fmt=fmt,
            capacity=floor_slots,
            top_k=top_k,
            progress=self._progress,
            link_gbps=opts.link_gbps,
            policy=opts.expert_policy,
        )
        runtime = loaded.runtime
        bytes_per_slot = int(runtime.bytes_per_slot)
        if device.type == "cuda":
            budget = cuda_budget(
                device,
                baseline_free=baseline_free,
                free_after_weights=cuda_free_bytes(device)[0],
                pools_already_allocated=floor_slots * bytes_per_slot,
                budget_bytes=opts.budget_bytes,
                ratio=opts.memory_ratio,
            )
        else:
            budget = cpu_budget(opts.budget_bytes)
        page = opts.page_size
        dtype = loaded.dtype  # activations and the KV cache
        kv_page = kv_bytes_per_page(loaded.model.config, page_size=page, dtype=dtype)
        overhead_page, fixed = kv_overhead_bytes(
            loaded.model.config, page_size=page, dtype=dtype, max_batch_tokens=opts.max_batch_tokens
        )
        floors = PoolFloors(moe_slots=floor_slots, kv_pages=reserve_pages(opts.max_batch_tokens, page) + 1)
        pricing = PoolPricing(
            budget=budget,
            bytes_per_slot=bytes_per_slot,
            bytes_per_page=kv_page + overhead_page,
            fixed_bytes=fixed,
            floors=floors,
            max_moe_slots=runtime.num_layers * runtime.num_experts,
        )
        sizes = self._plan(pricing)
        log.info(
            "pool split: %d expert slots (%d B each), %d KV pages of %d tokens (%d B each); budget %d B (%s)",
            sizes.moe_slots,
            bytes_per_slot,
            sizes.kv_pages,
            page,
            pricing.bytes_per_page,
            budget.budget_bytes,
            budget.source,
        )
        self._progress("sizing the expert slot pool", 0, 1)
        if sizes.moe_slots != runtime.capacity:
            runtime.resize(sizes.moe_slots)
        self.loaded = loaded
        self.pricing = pricing
        self.eos_ids = loader.eos_token_ids(loaded.model, loaded.tokenizer)
        self._progress("probing the chat template", 0, 1)
        self.chat = ChatSupport.probe(loaded.tokenizer, info, eos_ids=self.eos_ids)
        self.eos_ids += tuple(t for t in self.chat.turn_stop_ids if t not in self.eos_ids)
        # The model and the libraries are long-lived: freeze them out of the cyclic GC, or every
        # gc.collect() the batching substrate runs when a manager stops (each KV re-split) walks
        # the whole heap (~1 s instead of ~1 ms). Frozen before the KV pool exists: the batch
        # manager is a reference cycle, and a frozen cycle is never collected, so a pool built
        # before the freeze would stay mapped after its first re-split (issue 11, defect 2).
        gc.freeze()
        self._progress("allocating the KV pool", 0, 1)
        self.runner = self.make_runner(sizes.kv_pages)
        self.runner.start()
        self.ceiling = ContextCeiling.for_model(info.context_length, self.runner.kv_pages * page)
        del torch

    def _plan(self, pricing: PoolPricing) -> PoolSizes:
        """The start-up split: ``plan_budget`` unless the CLI pinned a pool, then checked like a rebuild."""
        opts = self.options
        planned = plan_budget(
            pricing.floors,
            budget_bytes=pricing.budget.budget_bytes,
            bytes_per_slot=pricing.bytes_per_slot,
            bytes_per_page=pricing.bytes_per_page,
            max_moe_slots=pricing.max_moe_slots,
            reserve_pages=reserve_pages(opts.kv_reserve_tokens, opts.page_size),
            fixed_bytes=pricing.fixed_bytes,
        )
        pinned = RebuildRequest(
            moe_slots=opts.moe_capacity,
            kv_pages=None if opts.kv_tokens is None else reserve_pages(opts.kv_tokens, opts.page_size),
        )
        if pinned.is_empty():
            return planned
        # A pinned pool keeps its size; the other is re-planned around it within the same budget.
        if pinned.moe_slots is not None and pinned.kv_pages is None:
            room = (
                pricing.budget.budget_bytes - pricing.fixed_bytes - pinned.moe_slots * pricing.bytes_per_slot
            )
            pinned = pinned._replace(kv_pages=max(room // pricing.bytes_per_page, pricing.floors.kv_pages))
        elif pinned.kv_pages is not None and pinned.moe_slots is None:
            room = (
                pricing.budget.budget_bytes - pricing.fixed_bytes - pinned.kv_pages * pricing.bytes_per_page
            )
            slots = min(room // pricing.bytes_per_slot, pricing.max_moe_slots)
            pinned = pinned._replace(moe_slots=max(slots, pricing.floors.moe_slots))
        if pinned.moe_slots > pricing.max_moe_slots:
            pinned = pinned._replace(moe_slots=pricing.max_moe_slots)
        return validate_rebuild(
            pinned,
            planned,
            pricing.floors,
            idle=True,
            budget_bytes=pricing.budget.budget_bytes,
            bytes_per_slot=pricing.bytes_per_slot,
            bytes_per_page=pricing.bytes_per_page,
            fixed_bytes=pricing.fixed_bytes,
        )

    def make_runner(self, kv_pages: int) -> BatchRunner:
        """A stopped batch runner over the loaded model with ``kv_pages`` KV pages."""
        opts = self.options
        anchor_token = self.chat.anchor_token if self.chat is not None else None
        config = RunnerConfig(
            kv_pages=kv_pages,
            page_size=opts.page_size,
            max_batch_tokens=opts.max_batch_tokens,
            max_requests_per_batch=opts.max_requests_per_batch,
            prefix_policy=self.prefix_policy,
            eos_token_ids=self.eos_ids,
            anchor_token=anchor_token,
            step_delay_s=opts.test_step_delay_s if opts.test_hooks else 0.0,
        )
        return BatchRunner(self.loaded.model, config)

    # ------------------------------------------------------------------ pools

    def pool_sizes(self) -> PoolSizes:
        runtime = self.loaded.runtime
        kv = self.runner.kv_pages if self.runner is not None else 0
        return PoolSizes(runtime.capacity, kv)

    def resize_context(self) -> None:
        """Re-derive the context ceiling after the KV pool changed size."""
        if self.runner is not None and self.loaded is not None:
            self.ceiling = ContextCeiling.for_model(
                self.loaded.info.context_length, self.runner.kv_pages * self.options.page_size
            )

    # ------------------------------------------------------------------ requests

    def activity(self) -> EngineActivity:
        """What the engine is doing now: registered requests (replies not yet drained included),
        plus any request the batch loop still holds after its reply ended (a cancelled request
        keeps its pages until the loop's next step boundary)."""
        with self.lock:
            records = list(self.registry.values())
        live = {r.request_id: r.state for r in self.runner.live_requests()} if self.runner else {}
        prefill = decode = undrained = 0
        for rec in records:
            if rec.done:
                undrained += 1
            elif live.get(rec.id) == "decode" or rec.generated > 0:
                decode += 1
            else:
                prefill += 1
        known = {rec.id for rec in records}
        for rid, state in live.items():
            if rid not in known:
                if state == "decode":
                    decode += 1
                else:
                    prefill += 1
        return EngineActivity(pending_prefill=prefill, running_decode=decode, undrained_replies=undrained)

    def chat_support(self):
        """The loaded model's chat support; before a model is loaded, refuses with the gate's state.

        Not the admission check (``admit`` is, atomically with registration): only what
        building a prompt needs.
        """
        chat = self.chat
        if chat is None or self.ceiling is None:
            state = self.gate.state.value
            raise EngineUnavailable(state, f"server unavailable: engine is {state}")
        return chat

    def admit(
        self, prompt_ids: list[int], *, max_new_tokens: int, sampling: Sampling, request_id: str | None = None
    ) -> RequestRecord:
        """Admit one request through the gate and register it; refuses before registering anything.

        Raises ``AdmissionClosed`` (gate not serving) or ``EngineUnavailable`` (the batch
        loop died). ``max_new_tokens`` must already be fitted to the context ceiling.
        """
        rid = request_id or f"req-{uuid.uuid4().hex[:12]}"
        with self.lock:
            self.gate.check_admission()
            runner = self.runner
            if runner is None or not runner.running:
                # The batch loop died under us: nothing can be served any more, say so for good.
                reason = runner.fatal_error if runner is not None else None
                self.gate.latch_failed()
                self.load_error = self.load_error or f"the batch loop stopped: {reason}"
                raise EngineUnavailable("failed", f"the batch loop is not running ({reason})")
            if rid in self.registry:
                raise ValueError(f"request id {rid!r} is already in flight")
            record = RequestRecord(
                id=rid,
                prompt_tokens=len(prompt_ids),
                max_new_tokens=max_new_tokens,
                sampling=sampling,
                prompt_ids=list(prompt_ids),
                created=self.clock(),
            )
            self.registry[rid] = record
        return record

    async def stream(self, record: RequestRecord, *, every_step: bool = True) -> AsyncIterator[Step]:
        """Run an admitted request; yields its new tokens step by step until it finishes.

        ``every_step=False`` is for a consumer that only needs the whole reply (a
        non-streaming response with no stop string to watch): the intermediate steps are
        accounted (first token, token counts, ``record.generated``) on the generation thread
        as they happen, without waking this loop, and the stream yields one final ``Step``
        carrying every token (or the cancellation). Leaving the iteration early (the client
        went away, a stop string matched) cancels the request in the batch loop, freeing its
        pages. The record leaves the registry and its tokens enter the totals either way.
        """
        runner = self.runner
        finished = False
        seen = 0
        try:
            runner.submit(
                record.id,
                record.prompt_ids,
                max_new_tokens=record.max_new_tokens,
                sampling=record.sampling,
                on_output=record.queue.put_nowait,
                on_progress=None if every_step else (lambda out: self._account(record, out.generated_tokens)),
            )
            while True:
                item = await record.queue.get()
                if item is _CANCELLED:
                    finished = True
                    yield Step([], True, "cancelled")
                    return
                tokens = item.generated_tokens
                self._account(record, tokens)
                new = list(tokens[seen:])
                seen = len(tokens)
                if item.error is not None:
                    finished = True
                    raise EngineUnavailable("failed", f"generation failed: {item.error}")
                if item.is_finished():
                    finished = True
                    ended_by_eos = not record.sampling.ignore_eos and tokens and tokens[-1] in self.eos_ids
                    reason = "stop" if ended_by_eos else "length"
                    yield Step(new, True, reason)
                    return
                if new:
                    yield Step(new, False)
        finally:
            if not finished:
                runner.cancel(record.id)
            record.done = True
            record.cached_tokens = runner.cached_tokens(record.id)
            runner.forget(record.id)
            self.release(record)

    def _account(self, record: RequestRecord, tokens: list[int]) -> None:
        """The request has generated ``tokens`` so far: note its first token and count the new ones.

        Mutates the record and the telemetry; a list no longer than what was counted changes
        nothing. Runs on the loop, or on the generation thread for an ``every_step=False``
        stream (the telemetry is locked; the router's lock orders it before cancellation).
        """
        new = len(tokens) - record.generated
        if new <= 0:
            return
        if record.first_token_at is None:
            record.first_token_at = self.clock()
            self.telemetry.first_token(record.first_token_at - record.created)
        record.generated = len(tokens)
        self.telemetry.tokens(new)

    def release(self, record: RequestRecord) -> None:
        """The reply is over: the request leaves the registry and its tokens join the totals."""
        with self.lock:
            if self.registry.pop(record.id, None) is None:
                return
        self.telemetry.finished(
            prompt_tokens=record.prompt_tokens,
            completion_tokens=record.generated,
            cached_tokens=record.cached_tokens,
        )

    def abandon(self, request_id: str) -> None:
        """The reply ended without draining its steps (the client vanished): cancel and release now."""
        with self.lock:
            record = self.registry.get(request_id)
        if record is None or record.done:
            return
        record.done = True
        if self.runner is not None:
            self.runner.cancel(request_id)
            record.cached_tokens = self.runner.cached_tokens(request_id)
        self.release(record)

    def cancel(self, request_id: str) -> bool:
        """End one request now, at any point (prefill included); returns whether it was in flight.

        The batch loop frees its pages at the next step boundary; the request's reply ends
        with ``finish_reason: "cancelled"``.
        """
        with self.lock:
            record = self.registry.get(request_id)
        if record is None or record.done:
            return False
        record.cancelled = True
        if self.runner is not None:
            self.runner.cancel(request_id)
        record.queue.put_nowait(_CANCELLED)
        return True

    def active_requests(self) -> list[dict[str, Any]]:
        """``policy.wire.ActiveRequest`` rows for every request in flight."""
        with self.lock:
            records = list(self.registry.values())
        live = {r.request_id: r for r in self.runner.live_requests()} if self.runner else {}
        now = self.clock()
        rows = []
        for rec in records:
            lr = live.get(rec.id)
            state = lr.state if lr is not None else ("decode" if rec.generated else "queued")
            rows.append(
                {
                    "id": rec.id,
                    "state": state,
                    "tokens": lr.generated if lr else rec.generated,
                    "prompt_tokens": rec.prompt_tokens,
                    "age_s": round(now - rec.created, 3),
                }
            )
        return rows

    async def wait_idle(self, timeout_s: float, *, poll_s: float = 0.01) -> bool:
        """Wait (bounded) until no request is in flight; returns whether the engine went idle."""
        deadline = self.clock() + max(timeout_s, 0.0)
        while not self.activity().is_idle():
            if self.clock() >= deadline:
                return False
            await asyncio.sleep(poll_s)
        return True

    # ------------------------------------------------------------------ accounting & telemetry

    def model_id(self) -> str | None:
        return self.loaded.info.model_id if self.loaded is not None else None

    def uptime_s(self) -> float:
        return self.clock() - self.started_at

    def sealed_accounting(self) -> SealedAccounting:
        t = self.telemetry
        return SealedAccounting(
            model_id=self.model_id(),
            prompt_tokens_total=t.prompt_tokens_total,
            completion_tokens_total=t.completion_tokens_total,
            uptime_seconds=round(self.uptime_s(), 3),
        )

    def health(self) -> wire.Health:
        body: wire.Health = {"state": self.gate.state.value, "load_progress": self.load_progress}
        if self.load_error is not None:
            body["error"] = self.load_error
            body["error_kind"] = self.load_error_kind
        if self.loaded is not None:
            body["model"] = self.loaded.info.model_id
        runner = self.runner
        if runner is not None:
            last = runner.last_step_at
            body["heartbeat"] = {
                "steps": runner.steps,
                "age_s": None if last is None else round(time.monotonic() - last, 3),
                "busy": not self.activity().is_idle(),
            }
        return body

    def model_info(self) -> dict[str, Any] | None:
        if self.loaded is None:
            return None
        info = self.loaded.info
        return {
            "id": info.model_id,
            "path": str(info.path),
            "architecture": info.architecture,
            "label": info.label,
            "num_layers": self.loaded.runtime.num_layers,
            "num_experts": info.num_experts,
            "top_k": self.loaded.top_k,
            "dtype": str(self.loaded.dtype).removeprefix("torch."),
            "weights": self.loaded.format.weights,
            "dtype_reason": self.loaded.format.reason,
            "context_length": self.ceiling.limit if self.ceiling else info.context_length,
        }

    def pools_info(self) -> dict[str, Any] | None:
        if self.pricing is None or self.loaded is None:
            return None
        p = self.pricing
        sizes = self.pool_sizes()
        stats = self.runner.kv_stats() if self.runner is not None else None
        try:
            limits = p.limits().to_wire()
        except BudgetTooSmall:
            limits = {}
        return {
            "moe_slots": sizes.moe_slots,
            "kv_pages": sizes.kv_pages,
            "page_size": self.options.page_size,
            "kv_tokens": sizes.kv_pages * self.options.page_size,
            "bytes_per_slot": p.bytes_per_slot,
            "bytes_per_page": p.bytes_per_page,
            "budget_bytes": p.budget.budget_bytes,
            "fixed_bytes": p.fixed_bytes,
            "floors": {"moe_slots": p.floors.moe_slots, "kv_pages": p.floors.kv_pages},
            "limits": limits,
            "kv_pages_used": stats.used if stats else None,
            "kv_pages_evictable": stats.evictable if stats else None,
            "live_bytes": {
                "moe_slots": int(self.loaded.runtime.pool.rows.nbytes),
                "kv_pages": self.runner.pool_bytes() if self.runner is not None else None,
            },
        }

    def snapshot(self) -> dict[str, Any]:
        """``policy.wire.StatusSnapshot``: everything the dashboard shows, unknowns as ``None``."""
        t = self.telemetry
        p50, p95 = t.ttft()
        footprint = t.footprint()
        rows = self.active_requests()
        device = None
        if self.loaded is not None and self.pricing is not None:
            device = device_memory(self.loaded.device, self.pricing.budget, footprint)
        return {
            "state": self.gate.state.value,
            "load_progress": self.load_progress,
            "uptime_s": round(self.uptime_s(), 3),
            "model": self.model_info(),
            "device": device,
            "pools": self.pools_info(),
            "experts": self.loaded.runtime.snapshot() if self.loaded is not None else None,
            "throughput": {
                "tok_s": t.tok_s(),
                "ttft_p50_ms": p50,
                "ttft_p95_ms": p95,
                "queue": sum(1 for r in rows if r["state"] == "queued"),
                "requests_served": t.requests_served,
                "prompt_tokens_total": t.prompt_tokens_total,
                "completion_tokens_total": t.completion_tokens_total,
            },
            "requests": rows,
            "footprint": footprint.to_wire() if footprint is not None else None,
            "last_rebuild": self.last_rebuild,
        }

    def shutdown(self) -> None:
        """Stop the batch loop (process exit); idempotent."""
        runner, self.runner = self.runner, None
        if runner is not None:
            runner.stop()

    # ------------------------------------------------------------------ request-side helpers

    def fit_max_tokens(self, prompt_tokens: int, requested: int | None) -> int:
        """Granted ``max_tokens`` under the context ceiling (raises ``ContextTooLong``)."""
        if self.ceiling is None:
            raise EngineUnavailable(self.gate.state.value, "the engine is not serving yet")
        if requested is not None and (requested < 1 or requested > MAX_TOKENS_CEILING):
            from moetray.engine.api.errors import ApiError

            raise ApiError(
                "invalid_request_error",
                f"max_tokens must be between 1 and {MAX_TOKENS_CEILING}, got {requested}",
                param="max_tokens",
            )
        return self.ceiling.fit(prompt_tokens, requested)

    @property
    def state(self) -> GateState:
        return self.gate.state
