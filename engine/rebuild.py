"""The live re-split of device memory between the expert slot pool, the KV pool and a hybrid's state pool.

``POST /admin/cache/rebuild {"moe_slots"?, "kv_tokens"?, "state_slots"?}`` runs, in this order:

1. gate ``begin_rebuild`` (refused: ``not_ready`` / ``latched`` / ``busy``; nothing changed);
2. ``Pools.validate`` (``PoolBudget.validate``) — arithmetic against the measured budget,
   before anything is freed;
3. a bounded wait for idle: admission is closed, the requests in flight finish, and requests
   arriving now are **held** at the gate (``Gate.hold``), not refused: they go on when the
   gate reopens, and get 503 + ``Retry-After`` only if it has not reopened by the
   re-split's deadline (the idle wait plus the transaction's timeout). The wait shows in
   the status snapshot (``rebuild_progress``: running requests, seconds waited of the
   timeout). It ends early on **stop-running** (:func:`stop_running_for_resplit`: those
   requests are stopped, then the re-split applies) or on **cancel**
   (:func:`cancel_resplit`: ``rebuild_cancelled``, nothing changed). A timeout reopens the
   gate untouched (``rebuild_never_dispatched``) and answers ``idle_timeout`` in plain
   words ("2 requests were still running after 30 s; nothing changed.");
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
whether the prefix cache was invalidated, and wall-clock durations: ``elapsed_ms`` in all,
``waited_ms`` for running requests, ``applied_ms`` for step 4): 200 when applied, else the
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

from moetray.engine.gate import Gate, ResplitWait
from moetray.engine.pools import Pools
from moetray.engine.requests import Requests
from moetray.policy.pool_budget import reserve_pages
from moetray.policy.pool_sizes import PoolSizes, RebuildRejected, RebuildRequest
from moetray.policy.rebuild import Applied, Latched, RebuildTxn, sizes_body
from moetray.policy.refused import Refused
from moetray.policy.wire import error_body, refusal_for

log = logging.getLogger("moetray.engine.rebuild")

TXN_TIMEOUT_S = 60.0
"""How long a reply waits for the destructive step (a 1 GiB KV re-split takes ~0.15 s).

With the default idle wait (30 s) it stays inside the tray client's 120 s rebuild timeout."""


class RebuildWaitRefused(Refused, RuntimeError):
    """Stop-running or cancel with no re-split waiting; ``kind`` is ``not_waiting``."""

    KINDS = ("not_waiting",)


def _waiting(gate: Gate) -> ResplitWait:
    wait = gate.resplit
    if wait is None or wait.stage != "waiting":
        raise RebuildWaitRefused("not_waiting", "no re-split is waiting for running requests")
    return wait


def stop_running_for_resplit(gate: Gate, requests: Requests) -> list[str]:
    """"Stop them and apply": stop the requests a waiting re-split waits for; returns their ids.

    Refuses with ``RebuildWaitRefused("not_waiting")`` when no re-split is waiting.
    """
    _waiting(gate).stop_running = True
    stopped = requests.cancel_all(by="resplit")
    log.info("re-split: stopped %d running request(s) so it can apply", len(stopped))
    return stopped


def cancel_resplit(gate: Gate) -> None:
    """"Cancel": a re-split still waiting for requests gives up; nothing changes.

    Refuses with ``RebuildWaitRefused("not_waiting")`` when none is waiting (one already
    applying cannot be called back).
    """
    _waiting(gate).cancelled = True


async def _wait_for_idle(requests: Requests, wait: ResplitWait, *, poll_s: float = 0.01) -> str:
    """Wait until idle, cancelled or timed out; returns ``idle``, ``cancelled`` or ``timeout``.

    Stop-running lifts the timeout: the stopped requests leave at their next step boundary.
    """
    end = wait.started + wait.timeout_s
    while not requests.activity().is_idle():
        if wait.cancelled:
            return "cancelled"
        if time.perf_counter() >= end and not wait.stop_running:
            return "timeout"
        await asyncio.sleep(poll_s)
    return "idle"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _running(requests: Requests) -> int:
    activity = requests.activity()
    return activity.pending_prefill + activity.running_decode + activity.undrained_replies


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
    def elapsed_ms(self) -> float:
        return round((time.perf_counter() - self.t0) * 1000.0, 3)

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
        return {
            "elapsed_ms": round((now - self.t0) * 1000.0, 3),
            "waited_ms": self.waited_ms,
            "applied_ms": applied,
        }


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
    wait = ResplitWait(
        lambda: _running(requests), t0, idle_timeout_s, deadline=t0 + idle_timeout_s + txn_timeout_s
    )
    gate.resplit = wait
    dispatched = False
    timing = Timing(t0)
    try:
        page = pools.budget.page_size
        request = _request_from(body, page)
        current = pools.sizes()
        target = pools.validate(request, idle=True)
        waited = await _wait_for_idle(requests, wait)
        timing.waited()
        if waited != "idle":
            running = wait.running()
            gate.rebuild_never_dispatched()
            if waited == "cancelled":
                seconds = timing.waited_ms / 1000
                message = f"The re-split was cancelled after {seconds:.1f} s; nothing changed."
                return _refusal("rebuild_cancelled", message, current, page, timing)
            were = "was" if running == 1 else "were"
            message = f"{_plural(running, 'request')} {were} still running after {idle_timeout_s:g} s; "
            message += "nothing changed."
            return _refusal("idle_timeout", message, current, page, timing)
        wait.stage = "applying"
        target = pools.validate(request, idle=requests.activity().is_idle())
        txn = RebuildTxn.open(request, current)
        touched = request.touched()
        dispatched = True
        timing.applying()
        work = asyncio.ensure_future(
            asyncio.to_thread(
                txn.run, target, lambda mark, sizes: pools.resize(sizes, touched, mark), pools.restore
            )
        )
        try:
            outcome = await asyncio.wait_for(asyncio.shield(work), txn_timeout_s)
        except TimeoutError:
            gate.rebuild_timed_out()
            wait.deadline = time.perf_counter()  # held requests stop waiting: 503 now
            work.add_done_callback(lambda done: _settle_late(gate, pools, txn, done, timing))
            return _timed_out(txn_timeout_s, current, page, timing)
        timing.applied()
        result = _settle(gate, pools, txn, outcome, timing)
        if isinstance(outcome, Applied):
            return 200, result
        message = outcome.reason
        if isinstance(outcome, Latched):
            message = f"{outcome.reason}; rollback failed: {outcome.rollback_error}. Restart the engine."
        return refusal_for(outcome.refusal_kind).status, error_body(outcome.refusal_kind, message, **result)
    except RebuildRejected as exc:
        gate.rebuild_never_dispatched()
        status, err = _refusal(exc.kind, str(exc), pools.sizes(), page, timing)
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
    finally:
        if gate.resplit is wait:
            gate.resplit = None


def _settle(gate: Gate, pools: Pools, txn: RebuildTxn, outcome, timing: Timing) -> dict[str, Any]:
    """Step 5 and the record of what happened: the gate reopens (or latches) on the outcome."""
    gate.finish_rebuild(outcome.engine_preserved)
    times = timing.fields()
    result = txn.result(outcome, page_size=pools.budget.page_size, elapsed_ms=timing.elapsed_ms)
    result.update(waited_ms=times["waited_ms"], applied_ms=times["applied_ms"])
    pools.last_rebuild = result
    log.info(
        "rebuild %s in %.1f ms (waited %.1f ms, applied in %s ms): %s → %s",
        outcome.outcome, times["elapsed_ms"], times["waited_ms"], times["applied_ms"],
        result["before"], result["after"],
    )
    return result


def _settle_late(gate: Gate, pools: Pools, txn: RebuildTxn, done: asyncio.Future, timing: Timing) -> None:
    """A transaction that outlived its reply ends here: settle the gate on its outcome.

    Raising inside the transaction (not a handled failure) leaves pools of unknown size:
    the gate latches, as it does when this happens within the reply.
    """
    error = None if done.cancelled() else done.exception()
    if done.cancelled() or error is not None:
        log.error("a re-split that outlived its reply raised: %r; the engine is latched failed", error)
        gate.latch_failed()
        return
    timing.applied()
    _settle(gate, pools, txn, done.result(), timing)


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
    body = sizes_body(sizes, page)
    result = {
        "outcome": "rejected_intact",
        "before": body,
        "after": body,
        "prefix_cache_invalidated": False,
        **timing.fields(),  # the true wall time, never a 0 ms placeholder
    }
    return refusal_for(kind).status, error_body(kind, message, **result)
