"""The tray on a real X server: Xvfb, Debian's ``trayer`` as the tray host, ``QT_QPA_PLATFORM=xcb``.

Checks what offscreen Qt cannot: a system tray is available, the icon is embedded in the
tray host and visible, and its menu (rebuilt on open) has every item. Screenshots of the
dashboard and the open tray menu are taken from outside with ImageMagick's
``import -window root``; set ``MOETRAY_SCREENSHOT_DIR`` to keep them (the README's
screenshots come from this path).
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from bounded import exit_code, wait_until

from moetray.app.tray import COPY_API_URL, DEMO_LABEL, MODEL_MENU, OPEN_DASHBOARD, OPEN_FOLDER, QUIT

TOOLS = {"Xvfb": "xvfb", "trayer": "trayer", "import": "imagemagick", "xwininfo": "x11-utils"}
TABS = ["Experts", "Pools", "Memory"]
DRIVER = Path(__file__).with_name("xvfb_driver.py")


@pytest.fixture
def x_display(processes):
    """Xvfb with trayer's panel on it; both are ended with the test (``processes``)."""
    missing = sorted({pkg for tool, pkg in TOOLS.items() if shutil.which(tool) is None})
    if missing:
        pytest.skip(f"real-X test needs Debian packages: {' '.join(missing)} (make system-deps)")
    read, write = os.pipe()
    processes.spawn(["Xvfb", "-displayfd", str(write), "-screen", "0", "1280x800x24", "-nolisten", "tcp"],
                    pass_fds=(write,), stderr=subprocess.DEVNULL)
    os.close(write)
    with os.fdopen(read) as pipe:
        ready, _, _ = select.select([pipe], [], [], 60)
        display = ":" + pipe.readline().strip() if ready else ":"
    if display == ":":
        raise TimeoutError("waited 60 s for Xvfb to report its display number")
    env = dict(os.environ, DISPLAY=display)
    processes.spawn(["trayer", "--edge", "top", "--align", "right", "--widthtype", "pixel",
                     "--width", "160", "--height", "26", "--transparent", "false",
                     "--tint", "0x31363b"], env=env, stderr=subprocess.DEVNULL)
    wait_until(lambda: "\"panel\"" in xtree(env), 60, "trayer's panel on the X server")
    return env


def xtree(env) -> str:
    return subprocess.run(["xwininfo", "-root", "-tree"], env=env, capture_output=True, text=True,
                          timeout=60).stdout


def panel_children(env) -> list[tuple[int, int]]:
    """Sizes of the windows embedded in trayer's panel (the tray icons)."""
    lines = xtree(env).splitlines()
    for i, line in enumerate(lines):
        if '"panel"' in line:
            indent = len(line) - len(line.lstrip())
            sizes = []
            for child in lines[i + 1:]:
                if child.strip() and len(child) - len(child.lstrip()) <= indent:
                    break
                match = re.search(r"\)\s+(\d+)x(\d+)\+", child)
                if match:
                    sizes.append((int(match[1]), int(match[2])))
            return sizes
    return []


def screenshot(env, path: Path) -> Path:
    subprocess.run(["import", "-window", "root", str(path)], env=env, check=True, timeout=60)
    return path


def spread(path: Path, crop: str | None = None) -> float:
    """Standard deviation of the picture's grey levels (0 for a blank screen)."""
    args = ["convert", str(path)] + (["-crop", crop] if crop else []) + \
        ["-colorspace", "Gray", "-format", "%[fx:standard_deviation]", "info:"]
    return float(subprocess.run(args, capture_output=True, text=True, check=True, timeout=60).stdout)


CROPS = {"tray-menu.png": "560x170+720+0", "dashboard": "1100x760+0+30"}
"""README crops: the open menu under the tray icon; the dashboard window."""


@pytest.mark.slow
@pytest.mark.timeout(900)  # the tray builds nothing, but it starts a real engine and waits on X
def test_tray_icon_menu_and_dashboard_on_a_real_x_server(x_display, tiny_model, tmp_path, processes):
    env = dict(x_display, QT_QPA_PLATFORM="xcb", XDG_CONFIG_HOME=str(tmp_path / "config"),
               XDG_RUNTIME_DIR=str(tmp_path / "run"), XDG_STATE_HOME=str(tmp_path / "state"))
    (tmp_path / "run").mkdir(mode=0o700)
    with open(tmp_path / "driver.log", "wb") as log:
        driver = processes.spawn([sys.executable, str(DRIVER), str(tmp_path), str(tiny_model), *TABS],
                                 env=env, stdout=log, stderr=subprocess.STDOUT)

    def driver_log() -> str:
        return (tmp_path / "driver.log").read_text(errors="replace")[-4000:]

    def out(name: str) -> Path | None:
        if (tmp_path / "error.txt").exists():
            pytest.fail(f"{(tmp_path / 'error.txt').read_text()}\n{driver_log()}")
        if driver.poll() is not None and not (tmp_path / name).exists():
            pytest.fail(f"driver exited {driver.returncode} before writing {name}: {driver_log()}")
        return tmp_path / name if (tmp_path / name).exists() else None

    serving = json.loads(wait_until(lambda: out("serving.json"), 300, "the tray's engine to serve")
                         .read_text())
    processes.adopt(serving["pid"])  # the tray's engine runs in its own session: ended with the test too
    api = serving["api_url"]
    for i in range(3):  # some traffic, so the charts and the heatmap have something to show
        httpx.post(api + "/chat/completions", timeout=120, trust_env=False, json={
            "model": "default", "max_tokens": 12, "messages": [{"role": "user", "content": f"hi {i}"}]})
    (tmp_path / "traffic-done").touch()
    report = json.loads(wait_until(lambda: out("report.json"), 120, "the tray's report").read_text())
    assert report["tray_available"] and report["tray"], report
    assert report["visible"] and report["state"] == "serving"
    x, y, w, h = report["geometry"]
    assert w >= 16 and h >= 16 and y < 30  # inside trayer's panel at the top edge
    assert any(cw >= 16 and ch >= 16 for cw, ch in panel_children(x_display)), xtree(x_display)
    menu = report["menu"]
    assert menu[0].endswith("tok/s") and " — serving — " in menu[0]
    assert menu[1:4] == [OPEN_DASHBOARD, "Stop serving", MODEL_MENU]
    models = menu[4]
    assert models[0] == DEMO_LABEL and models[1] == tiny_model.name and models[-1] == OPEN_FOLDER
    assert menu[5:] == [COPY_API_URL, QUIT]

    shots = []
    for i, tab in enumerate(TABS):
        wait_until(lambda i=i: out(f"ready-{i}"), 60, f"the dashboard's {tab} tab")
        shots.append(screenshot(x_display, tmp_path / f"dashboard-{tab.lower()}.png"))
        (tmp_path / f"shot-{i}").touch()
    wait_until(lambda: out("ready-menu"), 60, "the open tray menu")
    shots.append(screenshot(x_display, tmp_path / "tray-menu.png"))
    (tmp_path / "shot-menu").touch()
    # The tray's Quit ran prepare-stop and ended its engine.
    assert exit_code(driver, 120, "the tray to quit through its own Quit") == 0, driver_log()
    assert not (tmp_path / "error.txt").exists()
    assert not Path(f"/proc/{serving['pid']}").exists()
    assert len(list((tmp_path / "state").rglob("*.json"))) == 1, driver_log()  # one stop receipt
    for shot in shots:
        crop = CROPS.get(shot.name, CROPS["dashboard"])
        assert spread(shot, crop) > 0.1, f"{shot} looks blank"
    keep = os.environ.get("MOETRAY_SCREENSHOT_DIR")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        for shot in shots:
            crop = CROPS.get(shot.name, CROPS["dashboard"])
            subprocess.run(["convert", str(shot), "-crop", crop, "+repage",
                            str(Path(keep) / shot.name)], check=True, timeout=60)
