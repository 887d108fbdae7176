"""Live engines for the API tests: real servers on free loopback ports over a tiny MoE.

``live`` is shared by the whole session (tests that leave it serving and idle); tests that
stop, latch or reconfigure an engine start their own with ``start_engine``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as `moetray serve` sets it (before torch loads)

import pytest  # noqa: E402
import torch  # noqa: E402
from engine_harness import LiveEngine
from rebuild_faults import RebuildFaults

# CI and this machine share two cores between many processes: one intra-op thread per
# process avoids OpenMP spin contention that makes a tiny model 5-10x slower.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_qwen3(tiny_moe):
    return tiny_moe("qwen3_moe", "per_expert")


@pytest.fixture(scope="session")
def live(tiny_qwen3, tmp_path_factory):
    engine = LiveEngine(tiny_qwen3, tmp_path_factory.mktemp("live"))
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def slow(tiny_qwen3, tmp_path_factory):
    """An engine whose batch steps are held 20 ms each (the ``test_step_delay_s`` hook).

    Requests then last long enough to be cancelled, drained or waited on, without burning
    CPU (the hook sleeps). A random tiny model routes too repetitively for a throttled
    expert link to slow it down reliably.
    """
    engine = LiveEngine(tiny_qwen3, tmp_path_factory.mktemp("slow"), test_step_delay_s=0.02)
    yield engine
    engine.close()


@pytest.fixture
def start_engine(tmp_path):
    """Factory for a private engine (closed at the end of the test)."""
    started: list[LiveEngine] = []

    def start(model_dir, **options) -> LiveEngine:
        engine = LiveEngine(model_dir, tmp_path / f"e{len(started)}", **options)
        started.append(engine)
        return engine

    yield start
    for engine in started:
        engine.close()


@pytest.fixture
def rebuild_faults(monkeypatch):
    """Arms one-shot re-split faults on a live engine's pools (``tests/rebuild_faults.py``).

    ``rebuild_faults(engine)`` returns the engine's ``RebuildFaults``; the wrapping ends with the test.
    """

    def arm(engine: LiveEngine) -> RebuildFaults:
        return RebuildFaults.install(engine.engine.pools, monkeypatch)

    return arm


@pytest.fixture(autouse=True)
def _live_left_clean(request):
    """Every test that used the shared engine leaves it serving, idle and with consistent books."""
    yield
    for name in ("live", "slow"):
        if name in request.fixturenames:
            engine = request.getfixturevalue(name)
            snap = engine.wait_idle()
            assert snap["state"] == "serving", snap["state"]
            engine.engine.pools.runner.check_integrity()
