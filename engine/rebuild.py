"""The live re-split of device memory between the expert slot pool, the KV pool and a hybrid's state pool.

``POST /admin/cache/rebuild {"moe_slots"?, "kv_tokens"?, "state_slots"?}`` runs, in this order:

1. gate ``begin_rebuild`` (refused: ``not_ready`` / ``latched`` / ``busy``; nothing changed);
2. ``Pools.validate`` (``PoolBudget.validate``) — arithmetic against the measured budget,
   before anything is freed;
3. a bounded wait for idle: admission is closed, so requests arriving now get 503 +
   ``Retry-After``, and the ones in flight finish; a timeout reopens the gate untouched
   (``rebuild_never_dispatched``) and answers ``idle_timeout``;
4. ``RebuildTxn.run`` over ``Pools.resize`` (the destructive step: it marks teardown before
   it frees anything — a MoE-only change resizes the slot pool in place with the batch loop
   paused, keeping the hottest experts, the KV pool and its prefix cache; a KV or state
   change stops the batch loop, drops the runner's pools and builds new ones, prefix cache
   and state snapshots invalidated) and
   ``Pools.restore`` (on failure only the touched pools are restored; a failed restore
   latches);
5. gate ``finish_rebuild(engine_preserved)``.

Step 4 runs in a worker thread, awaited for at most ``txn_timeout_s``. A transaction still
running then is not cancelled (it may be tearing pools down): the reply is
``rebuild_timed_out``, the gate stays closed (``rebuild_timed_out`` is the gate's named
no-op), and the transaction's own end settles the gate as in step 5. Timeouts fail closed.

No weight is reloaded. The reply is ``wire.RebuildResult`` (outcome, before / after sizes,
whether the prefix cache was invalidated, the time taken): 200 when applied, else the
outcome's refusal status with the same fields inside ``error``. The last result is kept on
the pools (``Pools.last_rebuild``) for the status snapshot.

The flow gets the gate (``engine.gate.Gate``), the pools and the request registry, never
the engine; it reaches the pools only through ``sizes``, ``validate``, ``resize`` and
``restore``. May import those rooms and ``moetray.policy``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from moetray.engine.gate import Gate
from moetray.engine.pools import Pools
from moetray.engine.requests import Requests
from moetray.policy.pool_budget import PoolSizes, RebuildRejected, RebuildRequest, reserve_pages
from moetray.policy.rebuild import Applied, Latched, RebuildTxn, sizes_body
from moetray.policy.wire import error_body, refusal_for

log = logging.getLogger("moetray.engine.rebuild")

TXN_TIMEOUT_S = 60.0
"""How long a reply waits for the destructive step (a 1 GiB KV re-split takes ~0.15 s).

With the default idle wait (30 s) it stays inside the tray client's 120 s rebuild timeout."""


def _request_from(body: dict[str, Any], page_size: int) -> RebuildRequest:
    moe = body.get("moe_slots")
    kv_tokens = body.get("kv_tokens")
    state = body.get("state_slots")
    return RebuildRequest(
        moe_slots=None if moe is None else int(moe),
        kv_pages=None if kv_tokens is None else reserve_pages(int(kv_tokens), page_size),
        state_slots=None if state is None else int(state),
    )


async def run_rebuild(
    body: dict[str, Any],
    *,
    gate: Gate,
    pools: Pools | None,
    requests: Requests,
    idle_timeout_s: float,
    txn_timeout_s: float = TXN_TIMEOUT_S,
):
    """Run one live re-split; returns ``(status, body)`` — body is ``wire.RebuildResult`` or an error.

    ``pools`` is ``None`` before the model loaded; the gate refuses then (``not_ready``).
    """
    t0 = time.perf_counter()
    if all(body.get(name) is None for name in ("moe_slots", "kv_tokens", "state_slots")):
        named = "name at least one of moe_slots, kv_tokens, state_slots"
        return 400, error_body("invalid_request_error", named)
    gate.begin_rebuild()  # RebuildRefused → mapped by the server, nothing changed
    if pools is None:  # the gate refuses (not_ready) before the pools exist: a bug if reached
        gate.rebuild_never_dispatched()
        raise AssertionError("the gate admitted a rebuild before the pools existed")
    dispatched = False
    try:
        page = pools.budget.page_size
        request = _request_from(body, page)
        current = pools.sizes()
        target = pools.validate(request, idle=True)
        if not await requests.wait_idle(idle_timeout_s):
            busy = ", ".join(requests.activity().busy_with())
            gate.rebuild_never_dispatched()
            return _refusal(
                "idle_timeout",
                f"requests did not finish within {idle_timeout_s:g}s ({busy}); nothing was changed",
                current,
                page,
            )
        target = pools.validate(request, idle=requests.activity().is_idle())
        txn = RebuildTxn.open(request, current)
        touched = request.touched()
        dispatched = True
        work = asyncio.ensure_future(
            asyncio.to_thread(
                txn.run, target, lambda mark, sizes: pools.resize(sizes, touched, mark), pools.restore
            )
        )
        try:
            outcome = await asyncio.wait_for(asyncio.shield(work), txn_timeout_s)
        except TimeoutError:
            gate.rebuild_timed_out()
            work.add_done_callback(lambda done: _settle_late(gate, pools, txn, done, t0))
            return _timed_out(txn_timeout_s, current, page)
        result = _settle(gate, pools, txn, outcome, t0)
        if isinstance(outcome, Applied):
            return 200, result
        message = outcome.reason
        if isinstance(outcome, Latched):
            message = f"{outcome.reason}; rollback failed: {outcome.rollback_error}. Restart the engine."
        return refusal_for(outcome.refusal_kind).status, error_body(outcome.refusal_kind, message, **result)
    except RebuildRejected as exc:
        gate.rebuild_never_dispatched()
        status, err = _refusal(exc.kind, str(exc), pools.sizes(), page)
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
        if dispatched:
            gate.latch_failed()
        else:
            gate.rebuild_never_dispatched()
        raise


def _settle(gate: Gate, pools: Pools, txn: RebuildTxn, outcome, t0: float) -> dict[str, Any]:
    """Step 5 and the record of what happened: the gate reopens (or latches) on the outcome."""
    gate.finish_rebuild(outcome.engine_preserved)
    elapsed_ms = round((time.perf_counter() - t0) * 1000.0, 3)
    result = txn.result(outcome, page_size=pools.budget.page_size, elapsed_ms=elapsed_ms)
    pools.last_rebuild = result
    log.info("rebuild %s in %.1f ms: %s → %s", outcome.outcome, elapsed_ms, result["before"], result["after"])
    return result


def _settle_late(gate: Gate, pools: Pools, txn: RebuildTxn, done: asyncio.Future, t0: float) -> None:
    """A transaction that outlived its reply ends here: settle the gate on its outcome.

    Raising inside the transaction (not a handled failure) leaves pools of unknown size:
    the gate latches, as it does when this happens within the reply.
    """
    error = None if done.cancelled() else done.exception()
    if done.cancelled() or error is not None:
        log.error("a re-split that outlived its reply raised: %r; the engine is latched failed", error)
        gate.latch_failed()
        return
    _settle(gate, pools, txn, done.result(), t0)


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
