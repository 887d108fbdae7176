"""Rules of the tray's parts that need no engine: SSE decoding, launch validation, settings,
autostart and the single-instance socket.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from replay_data import snapshots, sse_lines

from moetray.app import autostart
from moetray.app.client import EngineError, SseDecoder, error_from_reply
from moetray.app.settings import DEMO_MODEL, RECENT_MAX, Settings
from moetray.app.single_instance import SingleInstance, server_name
from moetray.app.supervisor import LaunchRefused, LaunchSpec, free_port, prepare_launch
from moetray.policy import wire

# --- SSE ------------------------------------------------------------------------------


def test_sse_decoder_yields_each_snapshot_of_a_recorded_stream():
    decoder = SseDecoder()
    events = [e for line in sse_lines() if (e := decoder.feed(line)) is not None]
    status = [json.loads(data) for name, data in events if name == wire.SNAPSHOT_EVENT]
    assert status == snapshots()[:3]
    assert [name for name, _ in events] == ["status", "status", "status", "ping"]  # comment dropped


def test_sse_multi_line_data_joins_with_newlines():
    decoder = SseDecoder()
    for line in ("event: status", "data: {\"a\":", "data: 1}"):
        assert decoder.feed(line) is None
    assert decoder.feed("") == ("status", "{\"a\":\n1}")


def test_error_replies_keep_the_engines_kind_and_sentence():
    err = error_from_reply(503, wire.error_body("rebuilding", "pools are being re-split"))
    assert (err.kind, err.message, err.retry) == ("rebuilding", "pools are being re-split", "now")
    assert EngineError("unreachable", "x").retry == "later"


# --- launch validation (vorta's test_create: the exact argv, no process) ----------------


def test_launch_plan_is_the_exact_argv_and_the_token_never_in_it(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    plan = prepare_launch(LaunchSpec(model=str(tmp_path), port=0, kv_tokens=4096),
                          python="/py", token="s3cret", environ={"HOME": "/h"})
    port = plan.base_url.rsplit(":", 1)[1]
    assert plan.argv == ("/py", "-m", "moetray.app.cli", "serve", "--model", str(tmp_path.resolve()),
                         "--host", "127.0.0.1", "--port", port, "--device", "auto", "--kv-tokens", "4096")
    assert all("s3cret" not in arg for arg in plan.argv)
    assert plan.env[wire.ADMIN_TOKEN_ENV] == "s3cret" and plan.env["HOME"] == "/h"
    assert "s3cret" not in repr(plan)


def test_the_demo_default_is_served_without_a_model_flag():
    plan = prepare_launch(LaunchSpec(model=None), python="/py")
    assert "--model" not in plan.argv


def test_each_launch_gets_a_fresh_token():
    a, b = (prepare_launch(LaunchSpec(), python="/py") for _ in range(2))
    assert a.token != b.token and len(a.token) >= 32


@pytest.mark.parametrize(("spec", "kind"), [
    (LaunchSpec(host="0.0.0.0"), "not_loopback"),
    (LaunchSpec(model="/no/such/folder"), "no_such_model"),
])
def test_launch_refusals_are_named(spec, kind):
    with pytest.raises(LaunchRefused) as refused:
        prepare_launch(spec)
    assert refused.value.kind == kind


def test_a_folder_without_config_is_not_a_checkpoint(tmp_path):
    with pytest.raises(LaunchRefused) as refused:
        prepare_launch(LaunchSpec(model=str(tmp_path)))
    assert refused.value.kind == "not_a_checkpoint"


def test_a_busy_port_is_refused_before_spawning():
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(LaunchRefused) as refused:
            prepare_launch(LaunchSpec(port=busy.getsockname()[1]))
    assert refused.value.kind == "port_in_use"
    assert free_port() > 0


# --- settings -------------------------------------------------------------------------


def test_recent_models_are_deduplicated_newest_first_and_bounded(tmp_path):
    settings = Settings.at(tmp_path / "s.conf")
    for i in range(RECENT_MAX + 2):
        settings.remember_model(f"/m/{i}")
    settings.remember_model("/m/3")
    recent = settings.recent_models
    assert recent[0] == "/m/3" and len(recent) == RECENT_MAX and len(set(recent)) == RECENT_MAX


def test_a_single_recent_folder_survives_a_restart(tmp_path):
    # INI stores a one-item list as a bare string; reading it as a list of characters
    # would list "/", "m", … in the Model menu.
    Settings.at(tmp_path / "s.conf").remember_model("/m/only")
    from PySide6.QtCore import QSettings

    raw = QSettings(str(tmp_path / "s.conf"), QSettings.Format.IniFormat)
    raw.setValue("models/recent", "/m/only")
    raw.sync()
    assert Settings.at(tmp_path / "s.conf").recent_models == ["/m/only"]


def test_the_demo_model_is_remembered_but_never_listed(tmp_path):
    settings = Settings.at(tmp_path / "s.conf")
    settings.remember_model("/m/a")
    settings.remember_model(DEMO_MODEL)
    assert settings.recent_models == ["/m/a"] and settings.last_model == DEMO_MODEL


# --- autostart ------------------------------------------------------------------------


def test_autostart_entry_starts_the_tray_hidden(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert not autostart.is_enabled()
    path = autostart.set_enabled(True, ["/opt/moetray/bin/moetray"])
    assert path == tmp_path / "autostart" / f"{autostart.APP_ID}.desktop"
    text = path.read_text()
    assert "Exec=/opt/moetray/bin/moetray --hidden" in text.splitlines()
    assert "Type=Application" in text and autostart.is_enabled()
    autostart.set_enabled(False)
    assert not path.exists() and not autostart.is_enabled()
    autostart.set_enabled(False)  # removing a missing entry is fine


def test_autostart_disabled_by_hidden_true_counts_as_off(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    path = autostart.set_enabled(True, ["moetray"])
    path.write_text(path.read_text() + "Hidden=true\n")
    assert not autostart.is_enabled()


def test_launch_command_runs_this_installation():
    command = autostart.launch_command()
    assert command[0].startswith(str(Path(sys.executable).parent))


# --- single instance ------------------------------------------------------------------


def test_second_launch_reaches_the_first_and_a_stale_socket_is_cleared(qtbot, tmp_path):
    name = server_name(str(tmp_path / "s.conf"))
    first = SingleInstance(name)
    assert not first.forward()  # nobody listening yet
    assert first.listen()
    second = SingleInstance(name)
    with qtbot.waitSignal(first.message_received, timeout=30000) as got:
        assert second.forward("show")
    assert got.args == ["show"]
    first.close()
    # A crash leaves the socket file behind; the next tray must still start.
    stale = Path("/tmp") / name
    if not stale.exists():
        stale.touch()
    third = SingleInstance(name)
    assert not third.forward() and third.listen()
    third.close()


def test_instance_names_differ_per_settings_store_and_user(tmp_path):
    a, b = server_name(str(tmp_path / "a.conf")), server_name(str(tmp_path / "b.conf"))
    assert a != b and str(os.getuid()) in a


def test_extra_engine_arguments_round_trip_as_argv_words(tmp_path):
    settings = Settings.at(tmp_path / "s.conf")
    args = ["--budget-bytes", "4194304", "--outbox-dir", "/a b/c"]
    settings.engine_args = args
    settings.sync()
    assert Settings.at(tmp_path / "s.conf").engine_args == args


def test_the_tray_process_never_loads_torch():
    # Import contracts catch static imports; this catches a dependency pulling torch in at
    # run time (the tray must stay small and survive an engine crash).
    import subprocess

    code = ("import sys; import moetray.app.main, moetray.app.application, moetray.ui.dashboard, "
            "moetray.app.tray; bad = sorted(m for m in ('torch', 'transformers', 'moetray.engine') "
            "if m in sys.modules); print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**os.environ, "QT_QPA_PLATFORM": "offscreen"}, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
