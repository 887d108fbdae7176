"""GUI test fixtures: a qasync loop under pytest-qt, live engines, an app attached to one."""

from __future__ import annotations

import gc

import pytest
from live import start_engine

from moetray.app import compat

SLOW_LINK_GBPS = "0.001"
"""Expert copies throttled to ~1 MB/s: each miss sleeps ~25 ms (cheap on CPU: the throttle
sleeps), so the heatmap shows a partly resident map that moves."""
STEP_DELAY_MS = "100"
"""Every batch step held 100 ms (the engine's test hook; it sleeps): a long chat (900 tokens,
``test_live_dashboard.LONG_CHAT``) lasts at least 90 s however idle the machine, three times the
30 s a test may wait to see its row and as long again for its Stop to land, so a test that
stops it never races its natural end (a loaded CI once let a 20 s chat run out first)."""


@pytest.fixture(scope="module")
def qloop(qapp):
    """A qasync loop that counts as running while Qt processes events (qtbot waits)."""
    loop = compat.attach_loop(qapp)
    yield loop
    compat.detach_loop(loop)


@pytest.fixture(scope="session")
def tiny_model(tiny_moe):
    return tiny_moe("qwen3_moe", "per_expert")


@pytest.fixture(scope="session")
def dashboard_engine(tiny_model, tmp_path_factory):
    """One engine for the dashboard tests: 10 of 16 experts resident, a slow link, held
    steps, small pools.

    ``--budget-bytes`` keeps the pools small enough that the slider's range is a real
    trade; ``--rebuild-idle-timeout`` leaves a re-split under load waiting long enough for
    the tests to press Stop them and apply, or Cancel.
    """
    engine = start_engine(tiny_model, tmp_path_factory.mktemp("dash-engine"),
                          "--moe-capacity", "10", "--budget-bytes", str(4 * 1024 * 1024),
                          "--link-gbps", SLOW_LINK_GBPS, "--rebuild-idle-timeout", "60",
                          "--test-hooks", "--test-step-delay-ms", STEP_DELAY_MS)
    yield engine
    engine.close()


@pytest.fixture(autouse=True)
def _collect_widget_garbage():
    """Free each test's discarded widgets between tests, not inside a later test's paint.

    pyqtgraph widgets hold reference cycles; left to the collector, one may be freed while
    Qt paints another view, and Qt crashes (seen as a segfault in ``QPainter::restore``).
    The app itself keeps its widgets for its whole life and updates its plot items in place.
    """
    yield
    gc.collect()
