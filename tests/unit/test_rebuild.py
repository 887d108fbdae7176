"""Rules of the rebuild transaction: commit, reject intact, roll back only what was touched, or latch."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moetray.policy.pool_budget import PoolSizes, RebuildRequest
from moetray.policy.rebuild import (
    RUNNER_POOLS,
    Applied,
    EngineActivity,
    Latched,
    RebuildTxn,
    RejectedIntact,
    RolledBack,
)

CURRENT = PoolSizes(moe_slots=8, kv_pages=64)


class Engine:
    """Records what the transaction made it do; each step can be told to fail."""

    def __init__(
        self,
        *,
        mark: bool = True,
        fail: str | None = None,
        restore_fails: str | None = None,
        landed: PoolSizes | None = None,
    ) -> None:
        self.mark, self.fail, self.restore_fails, self.landed = mark, fail, restore_fails, landed
        self.events: list[object] = []

    def free_then_allocate(self, mark_teardown, target):
        if self.mark:
            mark_teardown()
        self.events.append(("free_then_allocate", target))
        if self.fail:
            raise MemoryError(self.fail)
        return self.landed

    def restore(self, old_sizes, touched):
        self.events.append(("restore", old_sizes, touched))
        if self.restore_fails:
            raise RuntimeError(self.restore_fails)


def run(request: RebuildRequest, target: PoolSizes, engine: Engine) -> tuple[RebuildTxn, object]:
    txn = RebuildTxn.open(request, CURRENT)
    return txn, txn.run(target, engine.free_then_allocate, engine.restore)


# --- activity -----------------------------------------------------------------------------


def test_finished_rows_do_not_block_a_rebuild():
    """Counting finished rows would make a quiet server wait for the next request before resizing."""
    activity = EngineActivity(finished=12)
    assert activity.is_idle()
    assert activity.busy_with() == ()


@pytest.mark.parametrize(
    ("activity", "name"),
    [
        (EngineActivity(pending_prefill=1), "prefill"),
        (EngineActivity(running_decode=1), "decode"),
        (EngineActivity(undrained_replies=1), "undrained replies"),
    ],
)
def test_each_kind_of_work_blocks_and_is_named(activity, name):
    """Resizing under any live work frees pages it reads; the refusal must say which work, by name."""
    assert not activity.is_idle()
    assert activity.busy_with() == (name,)


# --- outcomes -----------------------------------------------------------------------------


def test_failure_before_teardown_rejects_intact_without_restore():
    """Restoring pools that were never freed would wipe the prefix cache of a healthy engine."""
    engine = Engine(mark=False, fail="cannot allocate")
    txn, outcome = run(RebuildRequest(kv_pages=128), PoolSizes(8, 128), engine)
    assert isinstance(outcome, RejectedIntact)
    assert "cannot allocate" in outcome.reason
    assert outcome.engine_preserved
    assert [e[0] for e in engine.events] == ["free_then_allocate"]
    assert not txn.teardown_started


def test_failure_after_teardown_restores_only_touched_pools():
    """Without a rollback every later request fails; restoring untouched pools wipes their state."""
    engine = Engine(fail="out of memory")
    _, outcome = run(RebuildRequest(kv_pages=4096), PoolSizes(8, 4096), engine)
    assert outcome == RolledBack("MemoryError: out of memory", CURRENT)
    assert outcome.engine_preserved
    assert engine.events[-1] == ("restore", CURRENT, frozenset({"kv"}))


def test_failed_rollback_latches_with_both_reasons():
    """Calling a failed rollback "rolled back" would keep clients sending work to an engine with no pools."""
    engine = Engine(fail="out of memory", restore_fails="still out of memory")
    _, outcome = run(RebuildRequest(kv_pages=4096), PoolSizes(8, 4096), engine)
    assert isinstance(outcome, Latched)
    assert "still out of memory" in outcome.rollback_error
    assert "out of memory" in outcome.reason
    assert not outcome.engine_preserved


def test_only_latched_is_unrecoverable():
    """Latching on a merely failed rebuild would take a serving engine offline over a no-op resize."""
    outcomes = [Applied(CURRENT), RejectedIntact("x"), RolledBack("x", CURRENT), Latched("x", "y")]
    assert [o.engine_preserved for o in outcomes] == [True, True, True, False]


def test_success_applies_target_and_never_restores():
    """A restore after success would undo the applied sizes."""
    engine = Engine()
    _, outcome = run(RebuildRequest(kv_pages=256), PoolSizes(8, 256), engine)
    assert outcome == Applied(PoolSizes(8, 256))
    assert [e[0] for e in engine.events] == ["free_then_allocate"]


def test_applied_reports_what_the_engine_landed_on():
    """Echoing the request would show sizes the engine does not have (e.g. rounded to a whole page group)."""
    engine = Engine(landed=PoolSizes(8, 240))
    _, outcome = run(RebuildRequest(kv_pages=256), PoolSizes(8, 256), engine)
    assert outcome == Applied(PoolSizes(8, 240))


def test_a_transaction_runs_once():
    """Re-running would free the pools a second time with a stale rollback snapshot."""
    engine = Engine()
    txn, _ = run(RebuildRequest(kv_pages=256), PoolSizes(8, 256), engine)
    with pytest.raises(RuntimeError):
        txn.run(PoolSizes(8, 256), engine.free_then_allocate, engine.restore)


def test_keyboard_interrupt_is_not_an_outcome():
    """Swallowing Ctrl-C into an outcome would keep a process running that the user asked to stop."""

    def interrupted(mark_teardown, target):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        RebuildTxn.open(RebuildRequest(kv_pages=9), CURRENT).run(
            PoolSizes(8, 9), interrupted, lambda *a: None
        )


# --- transaction state --------------------------------------------------------------------


def test_fresh_transaction_state():
    """A transaction that started with teardown set would roll back failures that freed nothing."""
    txn = RebuildTxn.open(RebuildRequest(kv_pages=128), CURRENT)
    assert txn.touched == {"kv"}
    assert txn.rollback_target == CURRENT
    assert txn.rollback_target.kv_pages == 64
    assert not txn.teardown_started


@pytest.mark.parametrize(
    ("request_", "touched"),
    [
        (RebuildRequest(kv_pages=1), {"kv"}),
        (RebuildRequest(moe_slots=16), {"moe"}),
        (RebuildRequest(moe_slots=16, kv_pages=1), {"moe", "kv"}),
        (RebuildRequest(state_slots=4), {"state"}),
        (RebuildRequest(kv_pages=1, state_slots=4), {"kv", "state"}),
        (RebuildRequest(), set()),
    ],
)
def test_touched_follows_the_request(request_, touched):
    """Touched drives the rollback: a wrong set restores a pool never freed, or skips one that was."""
    assert RebuildTxn.open(request_, CURRENT).touched == frozenset(touched)


def test_prefix_cache_invalidation_follows_kv_teardown():
    """The UI warns that cached prompts were dropped; a MoE-only or intact outcome drops none."""
    kv = RebuildTxn.open(RebuildRequest(kv_pages=9), CURRENT)
    moe = RebuildTxn.open(RebuildRequest(moe_slots=9), CURRENT)
    assert kv.prefix_cache_invalidated(Applied(CURRENT))
    assert kv.prefix_cache_invalidated(RolledBack("x", CURRENT))
    assert not kv.prefix_cache_invalidated(RejectedIntact("x"))
    assert not moe.prefix_cache_invalidated(Applied(CURRENT))


def test_a_state_pool_change_replaces_the_runner_and_drops_the_prefix_cache():
    """KV and state belong to one batch runner: a state-only re-split re-creates it, and the
    radix tree's snapshots pointed into the old state pool, so cached prompts are gone too."""
    state = RebuildTxn.open(RebuildRequest(state_slots=12), CURRENT)
    assert state.replaces_runner() and state.touched == {"state"}
    assert state.prefix_cache_invalidated(Applied(CURRENT._replace(state_slots=12)))
    assert not RebuildTxn.open(RebuildRequest(moe_slots=9), CURRENT).replaces_runner()
    assert RUNNER_POOLS == {"kv", "state"}


def test_a_failed_state_resize_restores_the_state_pool_it_touched():
    """The restore re-creates exactly the touched pools at the sizes that fitted a moment ago."""
    now = PoolSizes(8, 64, 6)
    txn = RebuildTxn.open(RebuildRequest(state_slots=40), now)
    engine = Engine(fail="oom")
    outcome = txn.run(now._replace(state_slots=40), engine.free_then_allocate, engine.restore)
    assert isinstance(outcome, RolledBack) and outcome.restored == now
    assert [e for e in engine.events if e[0] == "restore"] == [("restore", now, frozenset({"state"}))]
    body = txn.result(outcome, page_size=16, elapsed_ms=1.0)
    assert body["before"]["state_slots"] == body["after"]["state_slots"] == 6


def test_result_body_matches_the_wire_shape():
    """The dashboard shows the rebuild reply verbatim; after must equal before unless applied."""
    txn = RebuildTxn.open(RebuildRequest(kv_pages=4096), CURRENT)
    outcome = txn.run(PoolSizes(8, 4096), Engine(fail="oom").free_then_allocate, Engine().restore)
    body = txn.result(outcome, page_size=16, elapsed_ms=12.5)
    assert body == {
        "outcome": "rolled_back",
        "before": {"moe_slots": 8, "kv_pages": 64, "kv_tokens": 1024, "state_slots": 0},
        "after": {"moe_slots": 8, "kv_pages": 64, "kv_tokens": 1024, "state_slots": 0},
        "prefix_cache_invalidated": True,
        "elapsed_ms": 12.5,
    }
    applied = RebuildTxn.open(RebuildRequest(moe_slots=16), CURRENT)
    done = applied.run(PoolSizes(16, 64), Engine().free_then_allocate, Engine().restore)
    assert applied.result(done, page_size=16, elapsed_ms=1.0)["after"] == {
        "moe_slots": 16,
        "kv_pages": 64,
        "kv_tokens": 1024,
        "state_slots": 0,
    }


# --- property -----------------------------------------------------------------------------


@given(
    moe=st.one_of(st.none(), st.integers(1, 512)),
    kv=st.one_of(st.none(), st.integers(2, 4096)),
    mark=st.booleans(),
    fail=st.booleans(),
    restore_fails=st.booleans(),
)
def test_outcome_is_decided_by_the_teardown_bit(moe, kv, mark, fail, restore_fails):
    """Property: restore runs iff a marked step failed, and only a failed restore latches."""
    request = RebuildRequest(moe, kv)
    target = PoolSizes(moe or CURRENT.moe_slots, kv or CURRENT.kv_pages)
    engine = Engine(
        mark=mark, fail="boom" if fail else None, restore_fails="again" if restore_fails else None
    )
    _, outcome = run(request, target, engine)
    restored = [e for e in engine.events if e[0] == "restore"]
    assert bool(restored) == (mark and fail)
    if restored:
        assert restored[0][2] == request.touched()
    expected = (
        Applied if not fail else RejectedIntact if not mark else Latched if restore_fails else RolledBack
    )
    assert type(outcome) is expected
