"""The live re-split of device memory between the expert slot pool and the KV pool.

``POST /admin/cache/rebuild {"moe_slots"?, "kv_tokens"?}`` runs, in this order:

1. gate ``begin_rebuild`` (refused: ``not_ready`` / ``latched`` / ``busy``; nothing changed);
2. ``validate_rebuild`` — arithmetic against the measured budget, before anything is freed;
3. a bounded wait for idle: admission is closed, the requests in flight finish, and requests
   arriving now are **held** (:func:`hold_for_resplit`), not refused: they go on when the
   gate reopens, and get 503 + ``Retry-After`` only if it has not reopened by the
   re-split's deadline (the idle wait plus the transaction's timeout). The wait shows in
   the status snapshot (``rebuild_progress``: running requests, seconds waited of the
   timeout). It ends early on **stop-running** (:func:`stop_running_for_resplit`: those
   requests are stopped, then the re-split applies) or on **cancel**
   (:func:`cancel_resplit`: ``rebuild_cancelled``, nothing changed). A timeout reopens the
   gate untouched (``rebuild_never_dispatched``) and answers ``idle_timeout`` in plain
   words ("2 requests were still running after 30 s; nothing changed.");
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
whether the prefix cache was invalidated, and wall-clock durations: ``elapsed_ms`` in all,
``waited_ms`` for running requests, ``applied_ms`` for step 4): 200 when applied, else the
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
from dataclasses import dataclass
from typing import Any

from moetray.engine.core import Engine
from moetray.policy.maintenance import GateState
from moetray.policy.pool_budget import (
    PoolSizes,
    RebuildRejected,
    RebuildRequest,
    reserve_pages,
    validate_rebuild,
)
from moetray.policy.rebuild import Applied, RebuildTxn
from moetray.policy.wire import error_body, refusal_for

log = logging.getLogger("moetray.engine.rebuild")

TXN_TIMEOUT_S = 60.0
"""How long a reply waits for the destructive step (a 1 GiB KV re-split takes ~0.15 s).

With the default idle wait (30 s) it stays inside the tray client's 120 s rebuild timeout."""


class AllocationFailed(RuntimeError):
    """A pool could not be allocated (real or injected)."""


@dataclass
class PendingResplit:
    """The re-split under way (``engine.pending_resplit``): what it waits for, and until when.

    Times are ``time.perf_counter()`` readings. ``deadline`` is when requests held at the
    gate stop waiting (503); ``cancelled`` and ``stop_running`` end the idle wait early.
    """

    engine: Engine
    started: float
    timeout_s: float
    deadline: float
    stage: str = "waiting"
    held: int = 0
    cancelled: bool = False
    stop_running: bool = False

    def running(self) -> int:
        activity = self.engine.activity()
        return activity.pending_prefill + activity.running_decode + activity.undrained_replies

    def progress(self) -> dict[str, Any]:
        """``wire.RebuildProgress`` for the status snapshot."""
        return {"stage": self.stage, "running": self.running(),
                "waited_s": round(time.perf_counter() - self.started, 3), "timeout_s": self.timeout_s,
                "held": self.held}


async def hold_for_resplit(engine: Engine, *, poll_s: float = 0.01) -> None:
    """A request arriving during a re-split waits for the gate to reopen (bounded by the
    re-split's deadline); the admission check that follows refuses it only if it has not.

    Mutates the pending re-split's ``held`` count while waiting; returns at once otherwise.
    """
    pending = engine.pending_resplit
    if pending is None or engine.gate.state is not GateState.REBUILDING:
        return
    pending.held += 1
    try:
        while (engine.gate.state is GateState.REBUILDING and engine.pending_resplit is pending
               and time.perf_counter() < pending.deadline):
            await asyncio.sleep(poll_s)
    finally:
        pending.held -= 1


def stop_running_for_resplit(engine: Engine) -> list[str]:
    """"Stop them and apply": stop the requests a waiting re-split waits for; returns their ids.

    Refuses with ``RebuildWaitRefused("not_waiting")`` when no re-split is waiting.
    """
    pending = engine.pending_resplit
    if pending is None or pending.stage != "waiting":
        raise RebuildWaitRefused("not_waiting", "no re-split is waiting for running requests")
    pending.stop_running = True
    with engine.lock:
        ids = [rid for rid, rec in engine.registry.items() if not rec.done]
    stopped = [rid for rid in ids if engine.cancel(rid, by="resplit")]
    log.info("re-split: stopped %d running request(s) so it can apply", len(stopped))
    return stopped


def cancel_resplit(engine: Engine) -> None:
    """"Cancel": a re-split still waiting for requests gives up; nothing changes.

    Refuses with ``RebuildWaitRefused("not_waiting")`` when none is waiting (one already
    applying cannot be called back).
    """
    pending = engine.pending_resplit
    if pending is None or pending.stage != "waiting":
        raise RebuildWaitRefused("not_waiting", "no re-split is waiting for running requests")
    pending.cancelled = True


class RebuildWaitRefused(Exception):
    """Stop-running or cancel with no re-split waiting; ``kind`` is ``not_waiting``."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


async def _wait_for_idle(engine: Engine, pending: PendingResplit, *, poll_s: float = 0.01) -> str:
    """Wait until idle, cancelled or timed out; returns ``idle``, ``cancelled`` or ``timeout``.

    Stop-running lifts the timeout: the stopped requests leave at their next step boundary.
    """
    end = pending.started + pending.timeout_s
    while not engine.activity().is_idle():
        if pending.cancelled:
            return "cancelled"
        if time.perf_counter() >= end and not pending.stop_running:
            return "timeout"
        await asyncio.sleep(poll_s)
    return "idle"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _request_from(body: dict[str, Any], page_size: int) -> RebuildRequest:
    moe = body.get("moe_slots")
    kv_tokens = body.get("kv_tokens")
    return RebuildRequest(
        moe_slots=None if moe is None else int(moe),
        kv_pages=None if kv_tokens is None else reserve_pages(int(kv_tokens), page_size),
    )


def _preflight_kv_growth(engine: Engine, target_pages: int) -> None:
    """Refuse before teardown when the new KV pool cannot be allocated beside everything else.

    The old pool is freed before the new one is made, so only the growth must fit in the
    memory free right now (device memory on CUDA, available host RAM on the CPU tier).
    """
    runner = engine.runner
    if runner is None:
        return
    growth = (target_pages - runner.kv_pages) * engine.pricing.bytes_per_page
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
        raise AllocationFailed(f"the KV pool needs {growth} more bytes but only {free} are free")


def _free_then_allocate(engine: Engine, request: RebuildRequest):
    """The destructive step for ``RebuildTxn.run``: marks teardown before anything is freed."""
    faults = engine.faults
    runtime = engine.loaded.runtime

    def step(mark_teardown, target: PoolSizes) -> PoolSizes:
        faults.wait_hold()
        touched = request.touched()
        if "kv" not in touched:
            # Expert pool only: resized in place between two steps of the batch loop; the KV
            # pool and its prefix cache are untouched.
            if faults.take("before_teardown"):
                runtime.inject_resize_fault("before_teardown")
            if faults.take("after_teardown"):
                runtime.inject_resize_fault("after_teardown")
            with engine.runner.paused():
                runtime.resize(target.moe_slots, mark_teardown=mark_teardown)
            return PoolSizes(runtime.capacity, engine.runner.kv_pages)
        if faults.take("before_teardown"):
            raise AllocationFailed("injected: allocation failed before teardown")
        _preflight_kv_growth(engine, target.kv_pages)
        mark_teardown()
        old_runner, engine.runner = engine.runner, None
        old_runner.stop()
        del old_runner
        gc.collect()
        if "moe" in touched:
            runtime.resize(target.moe_slots)
        if faults.take("after_teardown"):
            raise AllocationFailed("injected: allocation failed after teardown")
        runner = engine.make_runner(target.kv_pages)
        runner.start()
        engine.runner = runner
        engine.resize_context()
        return PoolSizes(runtime.capacity, runner.kv_pages)

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
        if "kv" in touched:
            if engine.runner is not None:
                engine.runner.stop()
                engine.runner = None
                gc.collect()
            runner = engine.make_runner(old.kv_pages)
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
        return 400, error_body("invalid_request_error", "name at least one of moe_slots, kv_tokens")
    with engine.lock:
        engine.gate.begin_rebuild()  # RebuildRefused → mapped by the server, nothing changed
    timeout = engine.options.rebuild_idle_timeout_s if idle_timeout_s is None else idle_timeout_s
    pending = PendingResplit(engine, t0, timeout, deadline=t0 + timeout + txn_timeout_s)
    engine.pending_resplit = pending
    dispatched = False
    timing = Timing(t0)
    try:
        pricing = engine.pricing
        current = engine.pool_sizes()
        args = dict(
            budget_bytes=pricing.budget.budget_bytes,
            bytes_per_slot=pricing.bytes_per_slot,
            bytes_per_page=pricing.bytes_per_page,
            fixed_bytes=pricing.fixed_bytes,
        )
        if request.moe_slots is not None and request.moe_slots > pricing.max_moe_slots:
            raise RebuildRejected(
                "too_large",
                f"moe_slots {request.moe_slots} exceeds the {pricing.max_moe_slots} experts this model has",
                pool="moe",
                requested=request.moe_slots,
            )
        target = validate_rebuild(request, current, pricing.floors, idle=True, **args)
        waited = await _wait_for_idle(engine, pending)
        timing.waited()
        if waited != "idle":
            running = pending.running()
            with engine.lock:
                engine.gate.rebuild_never_dispatched()
            if waited == "cancelled":
                return _refusal("rebuild_cancelled", f"The re-split was cancelled after "
                                f"{timing.waited_ms / 1000:.1f} s; nothing changed.", current, page, timing)
            return _refusal(
                "idle_timeout",
                f"{_plural(running, 'request')} {'was' if running == 1 else 'were'} still running after "
                f"{timeout:g} s; nothing changed.",
                current,
                page,
                timing,
            )
        pending.stage = "applying"
        activity = engine.activity()
        target = validate_rebuild(request, current, pricing.floors, idle=activity.is_idle(), **args)
        txn = RebuildTxn.open(request, current)
        dispatched = True
        timing.applying()
        work = asyncio.ensure_future(
            asyncio.to_thread(txn.run, target, _free_then_allocate(engine, request), _restore(engine))
        )
        try:
            outcome = await asyncio.wait_for(asyncio.shield(work), txn_timeout_s)
        except TimeoutError:
            with engine.lock:
                engine.gate.rebuild_timed_out()
            pending.deadline = time.perf_counter()  # held requests stop waiting: 503 now
            work.add_done_callback(lambda done: _settle_late(engine, txn, done, timing))
            return _timed_out(txn_timeout_s, current, page, timing)
        timing.applied()
        result = _settle(engine, txn, outcome, timing)
        if isinstance(outcome, Applied):
            return 200, result
        message = getattr(outcome, "reason", outcome.outcome)
        if outcome.outcome == "latched":
            message = f"{outcome.reason}; rollback failed: {outcome.rollback_error}. Restart the engine."
        return refusal_for(outcome.refusal_kind).status, error_body(outcome.refusal_kind, message, **result)
    except RebuildRejected as exc:
        with engine.lock:
            engine.gate.rebuild_never_dispatched()
        status, err = _refusal(exc.kind, str(exc), engine.pool_sizes(), page, timing)
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
    finally:
        if engine.pending_resplit is pending:
            engine.pending_resplit = None


class Timing:
    """Wall-clock marks of one re-split (``time.perf_counter``): start, end of the wait, the
    transaction's start and end. Reported durations come from here and nowhere else."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self._waited: float | None = None
        self._applying: float | None = None
        self._applied: float | None = None

    def waited(self) -> None:
        self._waited = time.perf_counter()

    def applying(self) -> None:
        self._applying = time.perf_counter()

    def applied(self) -> None:
        self._applied = time.perf_counter()

    @property
    def waited_ms(self) -> float:
        end = self._waited if self._waited is not None else time.perf_counter()
        return round((end - self.t0) * 1000.0, 3)

    def fields(self) -> dict[str, float | None]:
        """``elapsed_ms`` (until now), ``waited_ms`` and ``applied_ms`` (``None`` if it never ran)."""
        now = time.perf_counter()
        applied = None
        if self._applying is not None:
            applied = round(((self._applied or now) - self._applying) * 1000.0, 3)
        return {"elapsed_ms": round((now - self.t0) * 1000.0, 3), "waited_ms": self.waited_ms,
                "applied_ms": applied}


def _settle(engine: Engine, txn: RebuildTxn, outcome, timing: Timing) -> dict[str, Any]:
    """Step 5 and the record of what happened: the gate reopens (or latches) on the outcome."""
    with engine.lock:
        engine.gate.finish_rebuild(outcome.engine_preserved)
    pricing, page = engine.pricing, engine.options.page_size
    times = timing.fields()
    elapsed_ms = times["elapsed_ms"]
    result = txn.result(outcome, page_size=page, elapsed_ms=elapsed_ms)
    result.update(waited_ms=times["waited_ms"], applied_ms=times["applied_ms"])
    engine.last_rebuild = result
    moved = (
        abs(result["after"]["moe_slots"] - result["before"]["moe_slots"]) * pricing.bytes_per_slot
        + abs(result["after"]["kv_pages"] - result["before"]["kv_pages"]) * pricing.bytes_per_page
    )
    engine.rebuild_timings.append(
        {"outcome": outcome.outcome, "elapsed_ms": elapsed_ms, "bytes_moved": moved}
    )
    log.info("rebuild %s in %.1f ms (waited %.1f ms, applied in %s ms): %s → %s", outcome.outcome, elapsed_ms,
             times["waited_ms"], times["applied_ms"], result["before"], result["after"])
    return result


def _settle_late(engine: Engine, txn: RebuildTxn, done: asyncio.Future, timing: Timing) -> None:
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
    timing.applied()
    _settle(engine, txn, done.result(), timing)


def _timed_out(timeout_s: float, sizes: PoolSizes, page: int, timing: Timing) -> tuple[int, dict[str, Any]]:
    status, body = _refusal(
        "rebuild_timed_out",
        f"the re-split is still running after {timeout_s:g}s; new requests get 503 until it ends "
        "(see /admin/status for its outcome)",
        sizes,
        page,
        timing,
    )
    # Not known yet: the transaction decides them.
    body["error"].update(outcome=None, after=None, applied_ms=None)
    return status, body


def _refusal(
    kind: str, message: str, sizes: PoolSizes, page: int, timing: Timing
) -> tuple[int, dict[str, Any]]:
    body = {"moe_slots": sizes.moe_slots, "kv_pages": sizes.kv_pages, "kv_tokens": sizes.kv_pages * page}
    result = {
        "outcome": "rejected_intact",
        "before": body,
        "after": body,
        "prefix_cache_invalidated": False,
        **timing.fields(),  # the true wall time, never a 0 ms placeholder
    }
    return refusal_for(kind).status, error_body(kind, message, **result)
