"""The test-only seam for the rebuild fault matrix: one-shot failures wrapped around a live engine's pools.

``RebuildFaults.install(pools, monkeypatch)`` wraps the calls the live re-split makes into
one ``Pools`` object (``resize``, the destructive step; ``open_kv``, building a batch runner
and its KV pool; ``restore``, the rollback) with ``monkeypatch``, which unwraps them when the
test ends. Production code knows nothing of it. Each fault fires once, then clears:

- ``before_teardown``: the allocation fails before anything is freed. A KV change fails
  before its growth check; an expert-only change arms the runtime's own
  ``inject_resize_fault``, so the real resize fails allocating its new slot pool.
- ``after_teardown``: it fails after the old pool was torn down. A KV change fails building
  the new runner (the old one is stopped, a touched expert pool already resized); an
  expert-only change fails in the runtime right after it marked teardown.
- ``restore``: the rollback fails too (the engine latches).
- ``hold``: the transaction waits for this event before its first step (a slow re-split).
"""

from __future__ import annotations

import threading

import pytest

from moetray.engine.pools import RUNNER_POOLS, AllocationFailed, Pools

HOLD_DEADLINE_S = 120.0


class RebuildFaults:
    """The armed faults of one engine's pools (see the module docstring)."""

    def __init__(self) -> None:
        self.before_teardown = False
        self.after_teardown = False
        self.restore = False
        self.hold: threading.Event | None = None

    def take(self, name: str) -> bool:
        armed = getattr(self, name)
        setattr(self, name, False)
        return armed

    @classmethod
    def install(cls, pools: Pools, monkeypatch: pytest.MonkeyPatch) -> RebuildFaults:
        faults = cls()
        resize, open_kv, restore = pools.resize, pools.open_kv, pools.restore

        def faulty_resize(target, touched, mark_teardown):
            hold, faults.hold = faults.hold, None
            if hold is not None and not hold.wait(HOLD_DEADLINE_S):
                raise AssertionError(f"the test never released the held re-split ({HOLD_DEADLINE_S:g}s)")
            if not touched & RUNNER_POOLS:
                for stage in ("before_teardown", "after_teardown"):
                    if faults.take(stage):
                        pools.runtime.inject_resize_fault(stage)
            elif faults.take("before_teardown"):
                raise AllocationFailed("injected: allocation failed before teardown")
            return resize(target, touched, mark_teardown)

        def faulty_open_kv(kv_pages, state_slots=0):
            if faults.take("after_teardown"):
                raise AllocationFailed("injected: allocation failed after teardown")
            return open_kv(kv_pages, state_slots)

        def faulty_restore(old, touched):
            if faults.take("restore"):
                raise AllocationFailed("injected: restoring the old pools failed")
            return restore(old, touched)

        monkeypatch.setattr(pools, "resize", faulty_resize)
        monkeypatch.setattr(pools, "open_kv", faulty_open_kv)
        monkeypatch.setattr(pools, "restore", faulty_restore)
        return faults
