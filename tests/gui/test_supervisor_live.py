"""The supervisor with a real engine child: load progress, crash and hang detection, restarts
within the budget, a refused model never remembered, and a Quit that runs prepare-stop
before ending the child.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest
from bounded import wait_qt
from live import is_zombie, pid_exists, private_xdg_dirs, run_async

from moetray.app.application import AppOptions, MoetrayApp
from moetray.app.settings import SETTINGS_FILE, Settings
from moetray.app.supervisor import EngineSupervisor, Phase
from moetray.policy.restart import RestartBudget
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


@pytest.fixture
def supervised(qapp, qloop, qtbot, tmp_path, monkeypatch):
    """A tray app (window only) that starts its own engines; torn down like Quit."""
    private_xdg_dirs(tmp_path, monkeypatch)
    settings = Settings.at(tmp_path / SETTINGS_FILE)
    settings.engine_args = SMALL_POOLS
    settings.port = 0  # any free port: tests run side by side
    supervisor = EngineSupervisor(restart_budget=RestartBudget(backoff_s=(0.2, 0.4, 0.8), max_crashes=2),
                                  unresponsive_after_s=UNRESPONSIVE_AFTER_S)
    app = MoetrayApp(qapp, settings, AppOptions(no_tray=True), supervisor=supervisor)
    app.initialize()
    notes: list[tuple[str, str, bool]] = []
    app.notified.connect(lambda title, message, err: notes.append((title, message, err)))
    app.notes = notes
    yield app
    try:
        run_async(qtbot, app.shutdown(), timeout_ms=60000)
    finally:  # never leave an engine behind, even when the test broke the loop
        pid = app.supervisor.pid
        if pid is not None and pid_exists(pid):
            os.killpg(pid, signal.SIGKILL)


def _serve(app, qtbot, model: Path) -> int:
    assert app.start_serving(str(model))
    wait_qt(qtbot, lambda: app.model.engine.state == EngineState.SERVING, START_MS, "the engine to serve")
    return app.supervisor.pid


def test_crashes_and_hangs_are_restarted_within_the_budget_then_the_engine_stays_down(supervised, tiny_model,
                                                                                      qtbot):
    app, sup = supervised, supervised.supervisor
    first = _serve(app, qtbot, tiny_model)
    with qtbot.waitSignal(sup.crashed, timeout=NOTICE_MS) as crashed:
        os.kill(first, signal.SIGKILL)
    assert crashed.args[0] == f"The engine exited with code {-signal.SIGKILL}."  # the exit, by its code
    wait_qt(qtbot, lambda: app.model.engine.state == EngineState.SERVING and sup.pid not in (None, first),
            START_MS, "the restarted engine to serve")
    assert app.model.engine.api_url is not None  # serving again, at a URL to copy
    hung = sup.pid
    assert (sup.crash_count, sup.spawn_count) == (1, 2)
    os.kill(hung, signal.SIGSTOP)  # alive but silent: only the /health watchdog can tell
    try:
        with qtbot.waitSignal(sup.crashed, timeout=NOTICE_MS) as stopped:
            pass
    finally:
        if pid_exists(hung):
            os.kill(hung, signal.SIGCONT)
    # The watchdog's verdict, after at least its threshold of silence (never before it).
    silence = re.fullmatch(r"The engine stopped answering \(no /health reply for ([\d.]+) s\)\.",
                           stopped.args[0])
    assert silence and float(silence[1]) >= UNRESPONSIVE_AFTER_S, stopped.args[0]
    wait_qt(qtbot, lambda: app.model.engine.state == EngineState.SERVING and sup.pid not in (None, hung),
            START_MS, "the engine restarted after the hang to serve")
    assert (sup.crash_count, sup.spawn_count) == (2, 3)
    assert app.model.engine.crash_count == 2  # shown: the count and the last reason
    assert "stopped answering" in app.model.engine.last_crash
    third = sup.pid
    with qtbot.waitSignal(sup.gave_up, timeout=NOTICE_MS) as gave_up:  # past this budget (2): final
        os.kill(third, signal.SIGKILL)
    assert "exited" in gave_up.args[0]
    wait_qt(qtbot, lambda: not pid_exists(third) or is_zombie(third), NOTICE_MS,
            "the last engine to be reaped")
    # Terminal: failed, shown with the reason, no restart scheduled, no fourth engine.
    assert sup.phase == Phase.FAILED and sup._restart_task is None and sup.spawn_count == 3
    assert app.model.engine.state == EngineState.FAILED and app.model.engine.api_url is None
    assert "exited" in app.model.engine.detail
    assert [err for _, _, err in app.notes] == [True, True, True]  # crash, crash, stays down
    assert "stays down" in app.notes[-1][1] and "Restart engine" in app.notes[-1][1]


def test_quit_takes_the_stop_receipt_then_ends_the_engine(supervised, tiny_model, qtbot):
    app, sup = supervised, supervised.supervisor
    healths: list[dict] = []
    sup.health.connect(healths.append)
    # The tiny model loads faster than /health is probed (0.5 s) on a quiet machine: the load is held
    # for several probes, so the loading state is seen whatever the machine's speed.
    app.settings.engine_args = [*SMALL_POOLS, "--test-hooks", "--test-load-delay-ms", "3000"]
    pid = _serve(app, qtbot, tiny_model)
    assert app.settings.last_model == str(tiny_model)  # served, so remembered
    assert app.settings.recent_models == [str(tiny_model)]
    # Load progress was shown while loading (the engine answers /health before its model is in).
    assert any(h.get("state") == "loading" and h.get("load_progress") for h in healths)
    receipt = run_async(qtbot, app.stop_serving(), timeout_ms=120000)
    assert receipt and receipt.get("drain_complete") is True
    # Ended by the polite path: it exited on SIGINT by itself, no SIGTERM or SIGKILL needed.
    assert not pid_exists(pid) and sup.phase == Phase.IDLE and sup.last_returncode == 0
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
    # A refused model is never saved as the last or a recent one.
    assert str(dense) not in supervised.settings.recent_models
    assert supervised.settings.last_model != str(dense)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_settings_that_need_a_restart_say_so_and_restart_the_engine_on_the_lan_with_its_key(
        supervised, tiny_model, qtbot):
    """The Settings dialog on a serving engine: LAN and a new port need a restart, the dialog says
    so and offers it; accepting restarts the engine there, and the API then wants the key kept
    in the 0600 file beside the settings."""
    import httpx

    from moetray.app.settings import LAN

    app = supervised
    first = _serve(app, qtbot, tiny_model)
    dialog = app.open_settings()
    assert not dialog.restart_box.isVisible()
    port = _free_port()
    dialog.port.setValue(port)
    dialog.host.setCurrentIndex(dialog.host.findData(LAN))
    assert dialog.engine_changes() == ["address", "port"]
    assert "needs an engine restart" in dialog.restart_note.text() and dialog.restart_note.isVisible()
    assert dialog.restart_box.isVisible() and dialog.restart_now  # offered, and on by default
    assert dialog.api_key_note.isVisible() and str(app.settings.api_key_path) in dialog.api_key_note.text()
    dialog.accept()
    assert app.settings.host == LAN and app.settings.port == port
    wait_qt(qtbot, lambda: app.model.engine.state == EngineState.SERVING
            and (app.model.engine.api_url or "").endswith(f":{port}/v1"), START_MS,
            "the engine restarted on the new port to serve")
    assert app.supervisor.pid != first and (not pid_exists(first) or is_zombie(first))
    key_file = app.settings.api_key_path
    assert key_file.stat().st_mode & 0o777 == 0o600
    key = key_file.read_text().strip()
    models = f"http://127.0.0.1:{port}/v1/models"
    assert httpx.get(models, timeout=30, trust_env=False).status_code == 401
    r = httpx.get(models, headers={"Authorization": f"Bearer {key}"}, timeout=30, trust_env=False)
    assert r.status_code == 200, r.text
