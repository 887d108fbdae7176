"""The live re-split of device memory between the expert slot pool and the KV pool.

``POST /admin/cache/rebuild {"moe_slots"?, "kv_tokens"?, "state_slots"?}`` runs, in this order:

1. gate ``begin_rebuild`` (refused: ``not_ready`` / ``latched`` / ``busy``; nothing changed);
2. ``validate_rebuild`` — arithmetic against the measured budget, before anything is freed;
3. a bounded wait for idle: admission is closed, so requests arriving now get 503 +
   ``Retry-After``, and the ones in flight finish; a timeout reopens the gate untouched
   (``rebuild_never_dispatched``) and answers ``idle_timeout``;
4. ``RebuildTxn.run``: the destructive step marks teardown before it frees anything —
   a MoE-only change resizes the slot pool in place with the batch loop paused (H5's
   runtime keeps the hottest experts; the KV pool and its prefix cache survive); a KV change
   stops the batch loop, drops the KV pool and builds a new one (prefix cache invalidated).
   On failure the transaction restores only the touched pools; a failed restore latches;
5. gate ``finish_rebuild(engine_preserved)``.

Step 4 runs in a worker thread, awaited for at most ``txn_timeout_s``. A transaction still
running then is not cancelled (it may be tearing pools down): the reply is
``rebuild_timed_out``, the gate stays closed (``rebuild_timed_out`` is the gate's named
no-op), and the transaction's own end settles the gate as in step 5. Timeouts fail closed.

No weight is reloaded. The reply is ``wire.RebuildResult`` (outcome, before / after sizes,
whether the prefix cache was invalidated, the time taken): 200 when applied, else the
outcome's refusal status with the same fields inside ``error``.

Fault injection (tests): ``engine.faults`` arms a one-shot failure before teardown, after
teardown, or in the restore, or a hold that keeps the transaction from finishing; MoE-side
faults go through the runtime's own ``inject_resize_fault`` so the real resize path fails
where it would in life.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from typing import Any

from moetray.engine.core import Engine
from moetray.policy.pool_budget import (
    PoolSizes,
    RebuildRejected,
    RebuildRequest,
    reserve_pages,
    validate_rebuild,
)
from moetray.policy.rebuild import RUNNER_POOLS, Applied, RebuildTxn, sizes_body
from moetray.policy.wire import error_body, refusal_for

log = logging.getLogger("moetray.engine.rebuild")

TXN_TIMEOUT_S = 60.0
"""How long a reply waits for the destructive step (a 1 GiB KV re-split takes ~0.15 s).

With the default idle wait (30 s) it stays inside the tray client's 120 s rebuild timeout."""


class AllocationFailed(RuntimeError):
    """A pool could not be allocated (real or injected)."""


def _request_from(body: dict[str, Any], page_size: int) -> RebuildRequest:
    moe = body.get("moe_slots")
    kv_tokens = body.get("kv_tokens")
    state = body.get("state_slots")
    return RebuildRequest(
        moe_slots=None if moe is None else int(moe),
        kv_pages=None if kv_tokens is None else reserve_pages(int(kv_tokens), page_size),
        state_slots=None if state is None else int(state),
    )


def _preflight_kv_growth(engine: Engine, target: PoolSizes) -> None:
    """Refuse before teardown when the new KV and state pools cannot be allocated beside everything else.

    The old pools are freed before the new ones are made, so only the growth must fit in the
    memory free right now (device memory on CUDA, available host RAM on the CPU tier).
    """
    runner = engine.runner
    if runner is None:
        return
    pricing = engine.pricing
    growth = (target.kv_pages - runner.kv_pages) * pricing.bytes_per_page
    growth += (target.state_slots - runner.state_slots) * pricing.bytes_per_state_slot
    if growth <= 0:
        return
    device = engine.loaded.device
    if device.type == "cuda":
        import torch

        free = int(torch.cuda.mem_get_info(device)[0])
    else:
        import psutil

        free = int(psutil.virtual_memory().available)
    if growth > free:
        raise AllocationFailed(f"the KV and state pools need {growth} more bytes but only {free} are free")


def _free_then_allocate(engine: Engine, request: RebuildRequest):
    """The destructive step for ``RebuildTxn.run``: marks teardown before anything is freed."""
    faults = engine.faults
    runtime = engine.loaded.runtime

    def step(mark_teardown, target: PoolSizes) -> PoolSizes:
        faults.wait_hold()
        touched = request.touched()
        if not touched & RUNNER_POOLS:
            # Expert pool only: resized in place between two steps of the batch loop; the KV
            # and state pools and the prefix cache are untouched.
            if faults.take("before_teardown"):
                runtime.inject_resize_fault("before_teardown")
            if faults.take("after_teardown"):
                runtime.inject_resize_fault("after_teardown")
            with engine.runner.paused():
                runtime.resize(target.moe_slots, mark_teardown=mark_teardown)
            return engine.pool_sizes()
        if faults.take("before_teardown"):
            raise AllocationFailed("injected: allocation failed before teardown")
        _preflight_kv_growth(engine, target)
        mark_teardown()
        old_runner, engine.runner = engine.runner, None
        old_runner.stop()
        del old_runner
        gc.collect()
        if "moe" in touched:
            runtime.resize(target.moe_slots)
        if faults.take("after_teardown"):
            raise AllocationFailed("injected: allocation failed after teardown")
        runner = engine.make_runner(target.kv_pages, target.state_slots)
        runner.start()
        engine.runner = runner
        engine.resize_context()
        return engine.pool_sizes()

    return step


def _restore(engine: Engine):
    """Re-create only the touched pools at their old sizes; raises if that fails too."""
    faults = engine.faults
    runtime = engine.loaded.runtime

    def restore(old: PoolSizes, touched: frozenset[str]) -> None:
        if faults.take("restore"):
            raise AllocationFailed("injected: restoring the old pools failed")
        if "moe" in touched and runtime.capacity != old.moe_slots:
            if engine.runner is not None:
                with engine.runner.paused():
                    runtime.resize(old.moe_slots)
            else:
                runtime.resize(old.moe_slots)
        if touched & RUNNER_POOLS:
            if engine.runner is not None:
                engine.runner.stop()
                engine.runner = None
                gc.collect()
            runner = engine.make_runner(old.kv_pages, old.state_slots)
            runner.start()
            engine.runner = runner
            engine.resize_context()

    return restore


async def run_rebuild(
    engine: Engine,
    body: dict[str, Any],
    *,
    idle_timeout_s: float | None = None,
    txn_timeout_s: float = TXN_TIMEOUT_S,
):
    """Run one live re-split; returns ``(status, body)`` — body is ``wire.RebuildResult`` or an error."""
    t0 = time.perf_counter()
    page = engine.options.page_size
    request = _request_from(body, page)
    if request.is_empty():
        named = "name at least one of moe_slots, kv_tokens, state_slots"
        return 400, error_body("invalid_request_error", named)
    with engine.lock:
        engine.gate.begin_rebuild()  # RebuildRefused → mapped by the server, nothing changed
    dispatched = False
    try:
        pricing = engine.pricing
        current = engine.pool_sizes()
        args = pricing.costs()
        if request.moe_slots is not None and request.moe_slots > pricing.max_moe_slots:
            raise RebuildRejected(
                "too_large",
                f"moe_slots {request.moe_slots} exceeds the {pricing.max_moe_slots} experts this model has",
                pool="moe",
                requested=request.moe_slots,
            )
        target = validate_rebuild(request, current, pricing.floors, idle=True, **args)
        timeout = engine.options.rebuild_idle_timeout_s if idle_timeout_s is None else idle_timeout_s
        if not await engine.wait_idle(timeout):
            busy = ", ".join(engine.activity().busy_with())
            with engine.lock:
                engine.gate.rebuild_never_dispatched()
            return _refusal(
                "idle_timeout",
                f"requests did not finish within {timeout:g}s ({busy}); nothing was changed",
                current,
                page,
            )
        activity = engine.activity()
        target = validate_rebuild(request, current, pricing.floors, idle=activity.is_idle(), **args)
        txn = RebuildTxn.open(request, current)
        dispatched = True
        work = asyncio.ensure_future(
            asyncio.to_thread(txn.run, target, _free_then_allocate(engine, request), _restore(engine))
        )
        try:
            outcome = await asyncio.wait_for(asyncio.shield(work), txn_timeout_s)
        except TimeoutError:
            with engine.lock:
                engine.gate.rebuild_timed_out()
            work.add_done_callback(lambda done: _settle_late(engine, txn, done, t0))
            return _timed_out(txn_timeout_s, current, page)
        result = _settle(engine, txn, outcome, t0)
        if isinstance(outcome, Applied):
            return 200, result
        message = getattr(outcome, "reason", outcome.outcome)
        if outcome.outcome == "latched":
            message = f"{outcome.reason}; rollback failed: {outcome.rollback_error}. Restart the engine."
        return refusal_for(outcome.refusal_kind).status, error_body(outcome.refusal_kind, message, **result)
    except RebuildRejected as exc:
        with engine.lock:
            engine.gate.rebuild_never_dispatched()
        status, err = _refusal(exc.kind, str(exc), engine.pool_sizes(), page)
        err["error"].update(
            {
                k: v
                for k, v in (
                    ("pool", exc.pool),
                    ("requested", exc.requested),
                    ("floor", exc.floor),
                    ("needed_bytes", exc.needed_bytes),
                    ("budget_bytes", exc.budget_bytes),
                )
                if v is not None
            }
        )
        return status, err
    except BaseException:
        with engine.lock:
            if dispatched:
                engine.gate.latch_failed()
            else:
                engine.gate.rebuild_never_dispatched()
        raise


def _settle(engine: Engine, txn: RebuildTxn, outcome, t0: float) -> dict[str, Any]:
    """Step 5 and the record of what happened: the gate reopens (or latches) on the outcome."""
    with engine.lock:
        engine.gate.finish_rebuild(outcome.engine_preserved)
    pricing, page = engine.pricing, engine.options.page_size
    elapsed_ms = round((time.perf_counter() - t0) * 1000.0, 3)
    result = txn.result(outcome, page_size=page, elapsed_ms=elapsed_ms)
    engine.last_rebuild = result
    before, after = result["before"], result["after"]
    moved = (
        abs(after["moe_slots"] - before["moe_slots"]) * pricing.bytes_per_slot
        + abs(after["kv_pages"] - before["kv_pages"]) * pricing.bytes_per_page
        + abs(after["state_slots"] - before["state_slots"]) * pricing.bytes_per_state_slot
    )
    engine.rebuild_timings.append(
        {"outcome": outcome.outcome, "elapsed_ms": elapsed_ms, "bytes_moved": moved}
    )
    log.info("rebuild %s in %.1f ms: %s → %s", outcome.outcome, elapsed_ms, result["before"], result["after"])
    return result


def _settle_late(engine: Engine, txn: RebuildTxn, done: asyncio.Future, t0: float) -> None:
    """A transaction that outlived its reply ends here: settle the gate on its outcome.

    Raising inside the transaction (not a handled failure) leaves pools of unknown size:
    the gate latches, as it does when this happens within the reply.
    """
    error = None if done.cancelled() else done.exception()
    if done.cancelled() or error is not None:
        log.error("a re-split that outlived its reply raised: %r; the engine is latched failed", error)
        with engine.lock:
            engine.gate.latch_failed()
        return
    _settle(engine, txn, done.result(), t0)


def _timed_out(timeout_s: float, sizes: PoolSizes, page: int) -> tuple[int, dict[str, Any]]:
    status, body = _refusal(
        "rebuild_timed_out",
        f"the re-split is still running after {timeout_s:g}s; new requests wait until it ends "
        "(see /admin/status for its outcome)",
        sizes,
        page,
    )
    body["error"].update(outcome=None, after=None)  # not known yet: the transaction decides them
    return status, body


def _refusal(kind: str, message: str, sizes: PoolSizes, page: int) -> tuple[int, dict[str, Any]]:
    body = sizes_body(sizes, page)
    result = {
        "outcome": "rejected_intact",
        "before": body,
        "after": body,
        "prefix_cache_invalidated": False,
        "elapsed_ms": 0.0,
    }
    return refusal_for(kind).status, error_body(kind, message, **result)
