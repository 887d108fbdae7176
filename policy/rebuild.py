"""How a live re-split of the pools commits, rolls back, or latches.

``pool_budget.validate_rebuild`` is the arithmetic before anything is freed. This module
is the other half: the arithmetic said yes and the allocation still failed. A resize is
destructive in the middle (free old, allocate new), so one bit decides what a failure
means: whether teardown had started. Before it, the engine is intact and the rebuild is
simply rejected. After it, the old sizes must be put back (only the pools the request
touched: re-creating an untouched KV pool would wipe the prefix cache for nothing), and
only if that also fails is the engine latched.

The KV pool and the recurrent-state pool (hybrid models) belong to one batch runner, so
either one touched re-creates both, and either one re-created drops the prefix cache (its
pages and its snapshots pointed into them). ``RUNNER_POOLS`` names them.

The transaction does no I/O and keeps no clock: the engine passes the destructive step
and the restore as callables.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from moetray.policy.pool_budget import PoolSizes, RebuildRequest

__all__ = [
    "OUTCOME_REFUSAL_KINDS",
    "RUNNER_POOLS",
    "Applied",
    "EngineActivity",
    "Latched",
    "RebuildOutcome",
    "RebuildTxn",
    "RejectedIntact",
    "RolledBack",
    "sizes_body",
]


@dataclass(frozen=True)
class EngineActivity:
    """What the engine is doing, counted: the input to "may a rebuild run now?"."""

    pending_prefill: int = 0
    running_decode: int = 0
    undrained_replies: int = 0
    finished: int = 0

    def is_idle(self) -> bool:
        """Whether nothing holds pages, slots or in-flight batches; mutates nothing.

        ``finished`` rows are deliberately excluded: they hold no resources, and gating on
        them would make a resize wait for bookkeeping that a quiet server only clears when
        the next request arrives.
        """
        return self.pending_prefill == 0 and self.running_decode == 0 and self.undrained_replies == 0

    def busy_with(self) -> tuple[str, ...]:
        """What keeps the engine busy, by name (not count), in a stable order; empty when idle."""
        names = []
        if self.pending_prefill:
            names.append("prefill")
        if self.running_decode:
            names.append("decode")
        if self.undrained_replies:
            names.append("undrained replies")
        return tuple(names)


@dataclass(frozen=True)
class Applied:
    """The re-split landed on ``sizes`` (what the engine actually has, not an echo of the request)."""

    sizes: PoolSizes
    outcome = "applied"
    refusal_kind = None
    engine_preserved = True


@dataclass(frozen=True)
class RejectedIntact:
    """The destructive step failed before freeing anything: the engine is untouched and serving."""

    reason: str
    outcome = "rejected_intact"
    refusal_kind = "rejected_intact"
    engine_preserved = True


@dataclass(frozen=True)
class RolledBack:
    """The step failed after teardown; the touched pools were re-created at ``restored``.

    Reported apart from ``RejectedIntact`` because teardown invalidated what those pools held.
    """

    reason: str
    restored: PoolSizes
    outcome = "rolled_back"
    refusal_kind = "rolled_back"
    engine_preserved = True


@dataclass(frozen=True)
class Latched:
    """The step failed after teardown and so did the rollback: the only unrecoverable outcome."""

    reason: str
    rollback_error: str
    outcome = "latched"
    refusal_kind = "rebuild_latched"
    engine_preserved = False


RebuildOutcome = Applied | RejectedIntact | RolledBack | Latched

RUNNER_POOLS = frozenset({"kv", "state"})
"""The pools one batch runner owns: touching either one re-creates the runner (and its prefix cache)."""

OUTCOME_REFUSAL_KINDS = ("rejected_intact", "rolled_back", "rebuild_latched")
"""Every ``refusal_kind`` a non-applied outcome carries (each a key of ``wire.REFUSALS``)."""

FreeThenAllocate = Callable[[Callable[[], None], PoolSizes], "PoolSizes | None"]
Restore = Callable[[PoolSizes, frozenset[str]], object]


def sizes_body(sizes: PoolSizes, page_size: int) -> dict[str, int]:
    """``wire.PoolSizesBody`` for ``sizes``: what a rebuild reply says the pools were or are."""
    return {
        "moe_slots": sizes.moe_slots,
        "kv_pages": sizes.kv_pages,
        "kv_tokens": sizes.kv_pages * page_size,
        "state_slots": sizes.state_slots,
    }


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class RebuildTxn:
    """One live re-split: its rollback snapshot, the pools it touches and its teardown bit.

    Build with ``open``; ``run`` once.
    """

    def __init__(self, request: RebuildRequest, current: PoolSizes) -> None:
        self._request = request
        self._rollback_target = PoolSizes(*current)
        self._touched = request.touched()
        self._teardown_started = False
        self._ran = False

    @classmethod
    def open(cls, request: RebuildRequest, current: PoolSizes) -> RebuildTxn:
        """Starts a transaction: snapshots ``current`` for rollback; teardown not started."""
        return cls(request, current)

    @property
    def request(self) -> RebuildRequest:
        return self._request

    @property
    def touched(self) -> frozenset[str]:
        """The pools the request names (a subset of ``POOLS``): the only ones a rollback restores."""
        return self._touched

    @property
    def teardown_started(self) -> bool:
        """Whether the destructive step has begun freeing (after which a failure needs a rollback)."""
        return self._teardown_started

    @property
    def rollback_target(self) -> PoolSizes:
        """The sizes the engine had when the transaction opened."""
        return self._rollback_target

    def _mark_teardown(self) -> None:
        self._teardown_started = True

    def run(
        self, target: PoolSizes, free_then_allocate: FreeThenAllocate, restore: Restore
    ) -> RebuildOutcome:
        """Runs the destructive step and decides the outcome; mutates the teardown bit, runs once.

        ``free_then_allocate(mark_teardown, target)`` must call ``mark_teardown()`` before
        it frees anything, raise on failure, and may return the sizes it actually landed
        on (``None`` means ``target``). On success: ``Applied``, ``restore`` never called.
        On failure before teardown: ``RejectedIntact``, ``restore`` never called. After
        teardown: ``restore(rollback_target, touched)`` must re-create only the touched
        pools; ``RolledBack`` if it returns, ``Latched`` if it raises. Exceptions from
        either callable become outcomes (``Exception`` only; a ``KeyboardInterrupt``
        propagates). Running a transaction twice is a programming error (``RuntimeError``).
        """
        if self._ran:
            raise RuntimeError("a RebuildTxn runs once; open a new one")
        self._ran = True
        try:
            landed = free_then_allocate(self._mark_teardown, target)
        except Exception as failure:
            reason = _describe(failure)
            if not self._teardown_started:
                return RejectedIntact(reason)
            try:
                restore(self._rollback_target, self._touched)
            except Exception as rollback_failure:
                return Latched(reason, _describe(rollback_failure))
            return RolledBack(reason, self._rollback_target)
        return Applied(target if landed is None else PoolSizes(*landed))

    def replaces_runner(self) -> bool:
        """Whether the request touches a pool of the batch runner (KV or state), which is then re-created."""
        return bool(self._touched & RUNNER_POOLS)

    def prefix_cache_invalidated(self, outcome: RebuildOutcome) -> bool:
        """Whether ``outcome`` dropped the prefix cache: a KV or state pool was replaced or restored."""
        if isinstance(outcome, RejectedIntact):
            return False
        return self.replaces_runner()

    def result(self, outcome: RebuildOutcome, *, page_size: int, elapsed_ms: float) -> dict[str, object]:
        """The rebuild reply's fields (``wire.RebuildResult``); ``after`` equals ``before`` unless applied."""
        before = self._rollback_target
        after = outcome.sizes if isinstance(outcome, Applied) else before

        def body(sizes: PoolSizes) -> dict[str, int]:
            return sizes_body(sizes, page_size)

        return {
            "outcome": outcome.outcome,
            "before": body(before),
            "after": body(after),
            "prefix_cache_invalidated": self.prefix_cache_invalidated(outcome),
            "elapsed_ms": elapsed_ms,
        }
