"""The supervisor with a real engine child: load progress, crash and hang detection, one
restart and no loop, and a Quit that runs prepare-stop before ending the child.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest
from bounded import wait_qt
from live import run_async

from moetray.app.application import AppOptions, MoetrayApp
from moetray.app.settings import Settings
from moetray.app.supervisor import Phase
from moetray.ui.viewmodels import EngineState

pytestmark = pytest.mark.slow  # each test starts real engine children (5-30 s apiece)

START_MS = 240000
NOTICE_MS = 60000
"""How long a test waits for the supervisor to notice a crash or a hang: generous, since the
rule under test is *how* it notices (the reason it gives), not how fast on a busy machine."""
SMALL_POOLS = ["--budget-bytes", str(4 * 1024 * 1024), "--moe-capacity", "10"]
UNRESPONSIVE_AFTER_S = 10.0
"""The watchdog's threshold in these tests: a loaded CI machine can hold a healthy engine's
/health reply for a few seconds, which must not count as the hang a test provokes."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def supervised(qapp, qloop, qtbot, tmp_path, monkeypatch):
    """A tray app (window only) that starts its own engines; torn down like Quit."""
    for var in ("XDG_STATE_HOME", "XDG_RUNTIME_DIR", "XDG_DATA_HOME"):
        path = tmp_path / var.lower()
        path.mkdir(mode=0o700)
        monkeypatch.setenv(var, str(path))  # the child's receipts and token files stay here
    settings = Settings.at(tmp_path / "moetray.conf")
    settings.engine_args = SMALL_POOLS
    app = MoetrayApp(qapp, settings, AppOptions(no_tray=True))
    app.supervisor.backoff_s = 0.2
    app.supervisor.unresponsive_after_s = UNRESPONSIVE_AFTER_S
    app.initialize()
    notes: list[tuple[str, str, bool]] = []
    app.notified.connect(lambda title, message, err: notes.append((title, message, err)))
    app.notes = notes
    yield app
    try:
        run_async(qtbot, app.shutdown(), timeout_ms=60000)
    finally:  # never leave an engine behind, even when the test broke the loop
        pid = app.supervisor.pid
        if pid is not None and _alive(pid):
            os.killpg(pid, signal.SIGKILL)


def _serve(app, qtbot, model: Path) -> int:
    assert app.start_serving(str(model))
    wait_qt(qtbot, lambda: app.model.engine.state == EngineState.SERVING, START_MS, "the engine to serve")
    return app.supervisor.pid


def test_a_crashed_engine_is_restarted_once_then_a_hang_is_final(supervised, tiny_model, qtbot):
    app, sup = supervised, supervised.supervisor
    first = _serve(app, qtbot, tiny_model)
    with qtbot.waitSignal(sup.crashed, timeout=NOTICE_MS) as crashed:
        os.kill(first, signal.SIGKILL)
    assert crashed.args[0] == f"The engine exited with code {-signal.SIGKILL}."  # the exit, by its code
    wait_qt(qtbot, lambda: app.model.engine.state == EngineState.SERVING and sup.pid not in (None, first),
            START_MS, "the restarted engine to serve")
    hung = sup.pid
    assert (sup.restarts_used, sup.spawn_count) == (1, 2)
    os.kill(hung, signal.SIGSTOP)  # alive but silent: only the /health watchdog can tell
    try:
        with qtbot.waitSignal(sup.gave_up, timeout=NOTICE_MS) as gave_up:
            pass
    finally:
        if _alive(hung):
            os.kill(hung, signal.SIGCONT)
    # The watchdog's verdict, after at least its threshold of silence (never before it).
    silence = re.fullmatch(r"The engine stopped answering \(no /health reply for ([\d.]+) s\)\.",
                           gave_up.args[0])
    assert silence and float(silence[1]) >= UNRESPONSIVE_AFTER_S, gave_up.args[0]
    wait_qt(qtbot, lambda: not _alive(hung) or _zombie(hung), NOTICE_MS, "the hung engine to be ended")
    # Terminal: failed, shown with the reason, no restart scheduled, no third engine.
    assert sup.phase == Phase.FAILED and sup._restart_task is None and sup.spawn_count == 2
    assert app.model.engine.state == EngineState.FAILED
    assert "stopped answering" in app.model.engine.detail
    assert [err for _, _, err in app.notes] == [True, True, True]  # crash, crash, gave up
    assert "restarted once already" in app.notes[-1][1]


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return False


def test_quit_takes_the_stop_receipt_then_ends_the_engine(supervised, tiny_model, qtbot):
    app, sup = supervised, supervised.supervisor
    healths: list[dict] = []
    sup.health.connect(healths.append)
    pid = _serve(app, qtbot, tiny_model)
    # Load progress was shown while loading (the engine answers /health before its model is in).
    assert any(h.get("state") == "loading" and h.get("load_progress") for h in healths)
    receipt = run_async(qtbot, app.stop_serving(), timeout_ms=120000)
    assert receipt and receipt.get("drain_complete") is True
    # Ended by the polite path: it exited on SIGINT by itself, no SIGTERM or SIGKILL needed.
    assert not _alive(pid) and sup.phase == Phase.IDLE and sup.last_returncode == 0
    assert app.model.engine.state == EngineState.STOPPED
    assert any("stop receipt" in line for line in app.model.logs.lines)
    receipts = list(Path(os.environ["XDG_STATE_HOME"]).rglob("*.json"))
    assert len(receipts) == 1, receipts


def test_a_model_the_engine_refuses_shows_the_engines_own_reason(supervised, qtbot, tmp_path):
    """A folder the launcher accepts (it has a config.json) but the engine refuses while
    reading it: the tray must say the engine's sentence, not just "failed, see Logs"."""
    import json

    dense = tmp_path / "dense-llama"
    dense.mkdir()
    (dense / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "vocab_size": 384}))
    assert supervised.start_serving(str(dense))
    wait_qt(qtbot, lambda: supervised.model.engine.state == EngineState.FAILED, START_MS,
            "the engine to refuse the model")
    # The state can arrive first (a status snapshot carries no failure reason); the reason
    # follows with the next /health, so wait for it rather than read the first frame.
    wait_qt(qtbot, lambda: "is not a mixture-of-experts checkpoint" in (supervised.model.engine.detail or ""),
            START_MS, "the tray to show the engine's reason")
    assert supervised.model.engine.state == EngineState.FAILED
    assert supervised.model.engine.detail.startswith("The engine failed: ")
