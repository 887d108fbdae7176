"""The app's own flows that need no engine: the Model menu from ``moetray models --json`` (a real
subprocess the test controls), the Settings dialog applied, the theme, and logging to stderr."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import pytest
from live import run_async

from moetray.app import autostart
from moetray.app.application import AppOptions, MoetrayApp
from moetray.app.catalog import ModelCatalog
from moetray.app.settings import SETTINGS_FILE, Settings
from moetray.app.tray import DEMO_LABEL, OPEN_FOLDER
from moetray.ui.theme import DARK, LIGHT, themes

ROWS = [
    {"name": "hf:acme/dense-7b", "source": "huggingface", "path": "/hub/dense", "format": "safetensors",
     "family": "llama", "moe": False, "bytes": 14 * 2**30, "servable": False, "refusal": "not_moe"},
    {"name": "demo", "source": "demo", "path": "/data/demo", "format": "safetensors", "family": "qwen2_moe",
     "moe": True, "bytes": 2**28, "servable": True, "refusal": None},
    {"name": "ollama:qwen3:30b-a3b", "source": "ollama", "path": "/ollama/blobs/sha256-1", "format": "gguf",
     "family": "qwen3moe", "moe": True, "bytes": 18 * 2**30, "servable": True, "refusal": None},
]


def models_script(tmp_path: Path, rows: list[dict], code: int = 0) -> list[str]:
    """A stand-in for ``moetray models --json``: a real process printing ``rows`` (or failing)."""
    script = tmp_path / "models.py"
    script.write_text("import json, sys\n"
                      f"print(json.dumps({rows!r}))\n"
                      f"sys.stderr.write('moetray models: no such store\\n')\nsys.exit({code})\n")
    return [sys.executable, str(script)]


@pytest.fixture
def app(qapp, qloop, qtbot, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    settings = Settings.at(tmp_path / SETTINGS_FILE)
    settings.serve_on_start = False
    app = MoetrayApp(qapp, settings, AppOptions(no_tray=True),
                     catalog=ModelCatalog(models_script(tmp_path, ROWS)))
    app.initialize()
    yield app
    run_async(qtbot, app.shutdown())
    themes().apply("light")
    if app.window is not None:
        app.window.deleteLater()


def test_the_model_menu_lists_the_local_models_from_the_command(app, qtbot):
    run_async(qtbot, app.catalog.refresh())
    assert app.catalog.error is None
    names = [r.name for r in app.tray_snapshot().catalog]
    assert names == ["demo", "ollama:qwen3:30b-a3b", "hf:acme/dense-7b"]  # servable first
    app.open_dashboard()
    menu = app.window.header.model_button.menu()
    menu.aboutToShow.emit()
    texts = [a.text() for a in menu.actions() if not a.isSeparator()]
    assert texts[0] == DEMO_LABEL and texts[-1] == OPEN_FOLDER
    assert texts[1].startswith("ollama:qwen3:30b-a3b") and texts[2].startswith("hf:acme/dense-7b")
    refused = next(a for a in menu.actions() if a.text() == texts[2])
    assert not refused.isEnabled() and "not a mixture-of-experts model" in refused.text()


def test_a_failing_listing_keeps_the_last_rows_and_says_why(app, qtbot, tmp_path):
    run_async(qtbot, app.catalog.refresh())
    app.catalog.command = tuple(models_script(tmp_path, [], code=2))
    run_async(qtbot, app.catalog.refresh())
    assert "no such store" in app.catalog.error and len(app.catalog.rows) == 3
    assert app.tray_snapshot().catalog_note == app.catalog.error


def test_settings_apply_the_theme_now_and_engine_ones_at_the_next_start(app, qtbot):
    app.open_dashboard()
    dialog = app.open_settings()
    assert dialog.values() == app.settings_values()
    dialog.theme.setCurrentIndex(dialog.theme.findData("dark"))
    dialog.port.setValue(9123)
    dialog.kv_tokens.setValue(4096)
    dialog.threads.setValue(1)
    dialog.autostart.setChecked(True)
    assert not dialog.restart_box.isVisible()  # no engine runs: nothing to restart
    dialog.accept()
    s = app.settings
    assert (s.port, s.kv_tokens, s.threads, s.theme) == (9123, 4096, 1, "dark")
    assert themes().theme is DARK and autostart.is_enabled()
    spec = app.launch_spec("")
    assert (spec.port, spec.kv_tokens, spec.threads, spec.port_fallback) == (9123, 4096, 1, True)
    assert "port 9123" in app.window.settings.summary.text()
    assert any("settings changed: port, context, threads" in line for line in app.model.logs.lines)
    app.apply_settings(replace(app.settings_values(), theme="light"))
    assert themes().theme is LIGHT


def test_the_tray_logs_refusals_to_stderr(tmp_path):
    settings = Settings.at(tmp_path / SETTINGS_FILE)
    settings.remember_model(str(tmp_path / "gone"))  # the last model was deleted since
    settings.sync()
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", XDG_CONFIG_HOME=str(tmp_path / "config"),
               XDG_RUNTIME_DIR=str(tmp_path / "run"))
    (tmp_path / "run").mkdir(mode=0o700)
    argv = [sys.executable, "-m", "moetray.app.cli", "--settings", str(tmp_path / SETTINGS_FILE), "--no-tray"]
    tray = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    said = threading.Event()

    def read() -> None:
        for line in tray.stderr:
            lines.append(line)
            if "cannot start the engine" in line:
                said.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert said.wait(120), "".join(lines)  # serve on start tried the last model, and said why not
        tray.send_signal(signal.SIGTERM)
        assert tray.wait(60) == 0
    finally:
        if tray.poll() is None:
            tray.kill()
    reader.join(10)
    text = "".join(lines)
    assert "moetray: cannot start the engine: No such model folder" in text, text


def test_the_rows_are_the_wire_contracts_keys():
    from dataclasses import fields

    from moetray.app.catalog import CatalogRow
    from moetray.policy.wire import LOCAL_MODEL_KEYS

    assert tuple(f.name for f in fields(CatalogRow)) == LOCAL_MODEL_KEYS


@pytest.mark.slow
def test_the_real_listing_command_feeds_the_model_menu(qapp, qloop, qtbot, tmp_path, tiny_model,
                                                      monkeypatch):
    """``moetray models --json`` itself, over a planted Hugging Face cache: its rows reach the menu."""
    import shutil

    hub = tmp_path / "hub"
    snap = hub / "models--acme--tiny-moe" / "snapshots" / ("0" * 40)
    shutil.copytree(tiny_model, snap)
    (hub / "models--acme--tiny-moe" / "refs").mkdir()
    (hub / "models--acme--tiny-moe" / "refs" / "main").write_text("0" * 40)
    for var, value in (("HF_HUB_CACHE", hub), ("HOME", tmp_path / "home"),
                       ("OLLAMA_MODELS", tmp_path / "o"), ("XDG_DATA_HOME", tmp_path / "data")):
        monkeypatch.setenv(var, str(value))
    catalog = ModelCatalog()
    run_async(qtbot, catalog.refresh(), timeout_ms=120000)
    assert catalog.error is None
    row = next(r for r in catalog.rows if r.name == "hf:acme/tiny-moe")
    assert row.servable and row.moe and row.launch_value == str(snap)
