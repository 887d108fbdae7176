"""Daily use on a real X server (Xvfb + ``trayer``), from fresh temporary profiles, driven from
outside as a user and a client would (``xvfb_daily_driver.py`` runs the real tray):

- the first launch serves the default model on 127.0.0.1:8765 with no click;
- a second tray, with 8765 taken, serves on the next free port and says so (menu line and
  notification);
- three engine kills, each after it served again, are each restarted;
- a re-split during a long stream makes a second request wait and then succeed, and the
  outcome's durations are within 25 % of the wall time;
- killing a tray (no clean exit) ends its engine too.

Screenshots of the dashboard and the tray menu, light and dark, are taken from outside with
ImageMagick; set ``MOETRAY_SCREENSHOT_DIR`` to keep them (the README's come from here).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from bounded import wait_until as wait_for
from test_real_x_tray import screenshot, spread, x_display  # noqa: F401 - x_display is a fixture

from moetray.app.settings import DEFAULT_PORT
from moetray.app.supervisor import port_is_free
from moetray.app.tray import COPY_API_URL, QUIT, SETTINGS

DRIVER = Path(__file__).with_name("xvfb_daily_driver.py")
SHOTS = {  # name of the kept screenshot → (driver step, crop)
    "demo-experts-light.png": ("light-experts", "900x700+0+30"),
    "demo-pools-light.png": ("light-pools", "900x700+0+30"),
    "tray-menu-light.png": ("light-menu", "600x380+680+0"),
    "demo-experts-dark.png": ("dark-experts", "900x700+0+30"),
    "demo-pools-dark.png": ("dark-pools", "900x700+0+30"),
    "tray-menu-dark.png": ("dark-menu", "600x380+680+0"),
}
WAITING_SHOT = ("pools-waiting.png", "900x700+0+30")
STREAM_TOKENS = 150


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


class Driver:
    """One tray process run by the driver, its output folder and its log."""

    def __init__(self, out: Path, env: dict, *args: str) -> None:
        out.mkdir()
        self.out = out
        self.log = out / "driver.log"
        self.proc = subprocess.Popen([sys.executable, str(DRIVER), str(out), *args], env=env,
                                     stdout=open(self.log, "wb"), stderr=subprocess.STDOUT)

    def file(self, name: str, timeout_s: float, what: str) -> Path:
        def ready() -> Path | None:
            if (self.out / "error.txt").exists():
                pytest.fail(f"{what}: {(self.out / 'error.txt').read_text()}\n{self.text()[-3000:]}")
            if self.proc.poll() is not None and not (self.out / name).exists():
                pytest.fail(f"{what}: the tray exited {self.proc.returncode}\n{self.text()[-3000:]}")
            return self.out / name if (self.out / name).exists() else None

        return wait_for(ready, timeout_s, f"{what} ({name})\n{self.text()[-3000:]}")

    def json(self, name: str, timeout_s: float, what: str) -> dict:
        return json.loads(self.file(name, timeout_s, what).read_text())

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def touch(self, name: str) -> None:
        (self.out / name).touch()

    def end(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def _chat(api: str, max_tokens: int, *, stream: bool = False) -> dict:
    body = {"model": "default", "max_tokens": max_tokens, "ignore_eos": True, "stream": stream,
            "messages": [{"role": "user", "content": "tell me a story"}]}
    if stream:
        body["stream_options"] = {"include_usage": True}
    result: dict = {}

    def run() -> None:
        try:
            if not stream:
                r = httpx.post(api + "/chat/completions", json=body, timeout=300, trust_env=False)
                result.update(status=r.status_code, body=r.json())
                return
            with httpx.stream("POST", api + "/chat/completions", json=body, timeout=300,
                              trust_env=False) as reply:
                result["status"] = reply.status_code
                for line in reply.iter_lines():
                    if line.startswith("data: {"):
                        result["chunks"] = result.get("chunks", 0) + 1
                        usage = json.loads(line[6:]).get("usage")
                        if usage:
                            result["completion_tokens"] = usage["completion_tokens"]
        finally:
            result["ended"] = time.time()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    result["thread"] = thread
    return result


def _shoot(x_env, driver: Driver, step: str, name: str, crop: str, keep: Path | None, tmp: Path) -> None:
    driver.file(f"ready-{step}", 120, f"the tray to show {step}")
    shot = screenshot(x_env, tmp / name)
    driver.touch(f"shot-{step}")
    assert spread(shot, crop) > 0.1, f"{shot} looks blank"
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        subprocess.run(["convert", str(shot), "-crop", crop, "+repage", str(keep / name)], check=True)


@pytest.mark.slow
def test_daily_use_on_a_real_x_server(x_display, tiny_model, tmp_path):  # noqa: F811 - the fixture
    if not port_is_free("127.0.0.1", DEFAULT_PORT):
        pytest.skip(f"port {DEFAULT_PORT} is in use by another program on this machine")
    env = dict(x_display, QT_QPA_PLATFORM="xcb", XDG_CONFIG_HOME=str(tmp_path / "config"),
               XDG_RUNTIME_DIR=str(tmp_path / "run"), XDG_STATE_HOME=str(tmp_path / "state"))
    (tmp_path / "run").mkdir(mode=0o700)
    keep = Path(os.environ["MOETRAY_SCREENSHOT_DIR"]) if os.environ.get("MOETRAY_SCREENSHOT_DIR") else None
    first = Driver(tmp_path / "first", env, "first")
    second: Driver | None = None
    engines: list[int] = []
    try:
        # 1. A fresh profile: the first launch serves the default model on 8765, no click.
        served = first.json("serving.json", 900, "the first launch to serve")
        engines.append(served["pid"])
        assert served["api_url"] == f"http://127.0.0.1:{DEFAULT_PORT}/v1" and served["port_note"] is None
        assert served["tray"] and served["visible"]
        models = httpx.get(served["api_url"] + "/models", timeout=30, trust_env=False).json()["data"]
        assert models and "demo" in models[0]["label"]
        for i in range(3):  # traffic, so the charts and the heatmap have something to show
            r = _chat(served["api_url"], 12)
            r["thread"].join(300)
            assert r["status"] == 200, (i, r)
        first.touch("traffic-done")
        for name, (step, crop) in SHOTS.items():
            _shoot(x_display, first, step, name, crop, keep, tmp_path)

        # 2. A second tray: 8765 is taken (the first tray's engine), so it serves elsewhere and says so.
        second = Driver(tmp_path / "second", env, "second", str(tiny_model))
        s0 = second.json("serving-0.json", 600, "the second tray to serve")
        engines.append(s0["pid"])
        port = int(s0["api_url"].rsplit(":", 1)[1].split("/")[0])
        note = f"Port {DEFAULT_PORT} is taken: serving on {port} ({s0['api_url']})"
        assert port != DEFAULT_PORT and s0["port_note"] == note
        assert note in s0["menu"]  # said in the tray menu …
        assert f"moetray: another port: {note}" in second.text()  # … and as a notification
        api_at = s0["menu"].index(f"API: {s0['api_url']}")
        assert s0["menu"][api_at + 1:] == [COPY_API_URL, SETTINGS, QUIT]

        # 3. Three engine kills, each after it served again: each is restarted.
        previous = s0
        for crash in (1, 2, 3):
            os.kill(previous["pid"], signal.SIGKILL)
            now = second.json(f"serving-{crash}.json", 600, f"a restart after kill {crash}")
            engines.append(now["pid"])
            assert now["pid"] != previous["pid"] and now["crashes"] == crash
            assert now["api_url"] == s0["api_url"]  # the same port again: clients keep working
            assert f"Crashes in the last 10 min: {crash}" in " ".join(
                line for line in now["menu"] if isinstance(line, str))
            previous = now
        second.touch("crashes-done")
        # A terminal user sees the same on stderr: the crashes and the state changes.
        said = second.text()
        assert said.count("WARNING engine crashed: ") == 3, said[-3000:]
        assert said.count("INFO engine serving") >= 4 and "INFO engine loading" in said, said[-3000:]

        # 4. A re-split during a long stream: a second request waits, then succeeds.
        api = previous["api_url"]
        stream = _chat(api, STREAM_TOKENS, stream=True)
        wait_for(lambda: stream.get("chunks", 0) > 2 or "ended" in stream, 120, "the long stream to flow")
        second.touch("stream-running")
        waiting = second.json("waiting.json", 120, "the Pools panel to say what the re-split waits for")
        assert waiting["text"].startswith("Waiting for 1 running request… (")
        assert "ended" not in stream, "the stream ended before the re-split could wait for it"
        later = _chat(api, 4)
        name, crop = WAITING_SHOT
        _shoot(x_display, second, "waiting", name, crop, keep, tmp_path)
        stream["thread"].join(300)
        later["thread"].join(300)
        assert stream["status"] == 200 and stream["completion_tokens"] == STREAM_TOKENS  # not cut short
        assert later["status"] == 200, later  # held, not refused
        assert later["ended"] >= stream["ended"] - 0.5  # it waited for the re-split to apply
        applied = second.json("applied.json", 300, "the re-split's outcome")
        assert applied["outcome"] == "applied", applied["text"]
        assert applied["pools_text"].startswith("Applied: ")
        # The durations are true wall time, within 25 %.
        assert 0.75 * applied["wall_ms"] <= applied["elapsed_ms"] <= 1.25 * applied["wall_ms"]
        waited_s = stream["ended"] - applied["started"]
        assert 0.75 * waited_s <= applied["waited_ms"] / 1000.0 <= 1.25 * waited_s, (waited_s, applied)
        second.touch("quit")
        assert second.proc.wait(120) == 0, second.text()[-3000:]
        assert not _alive(applied["pid"])  # Quit ended its engine

        # 5. A tray that dies without a clean exit takes its engine with it.
        first.file("shots-done", 60, "the first tray to finish its screenshots")
        first.proc.kill()
        first.proc.wait(10)
        wait_for(lambda: not _alive(served["pid"]), 60, "the killed tray's engine to end")
    finally:
        for driver in (second, first):
            if driver is not None:
                driver.end()
        for pid in engines:
            if _alive(pid):
                os.killpg(pid, signal.SIGKILL)
