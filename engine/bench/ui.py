"""`moetray bench ui`: what the tray process costs while its dashboard refreshes at 1 Hz.

Measured from outside, as a user's system monitor would: an engine (``moetray serve``) and
the tray (``moetray --attach URL --hidden`` under offscreen Qt, where no tray exists, so
the dashboard window opens and stays open) run as child processes; after a warm-up, psutil
samples the tray's RSS and PSS once per interval and its CPU time over the whole window.
Light traffic (one short chat every few seconds) keeps the charts, heatmap and request
table changing. Goals: RSS ≤ 250 MB and ≤ 2 % of one core.

Writes ``bench/results/ui.json`` through :mod:`moetray.engine.bench.results`; run
``moetray bench tables`` afterwards. Imports nothing from the tray (app/, ui/): it runs
it as a user would.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

RSS_GOAL_MB = 250.0
CPU_GOAL_PCT = 2.0
MB = 1e6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_serving(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the engine exited with code {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2.0, trust_env=False).json().get("state") == "serving":
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.25)
    raise RuntimeError(f"the engine did not serve within {timeout_s:.0f} s")


def _stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int | None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


class _Traffic(threading.Thread):
    """One short chat completion every ``period_s`` until stopped."""

    def __init__(self, url: str, period_s: float) -> None:
        super().__init__(daemon=True)
        self.url, self.period_s = url, period_s
        self.stop = threading.Event()
        self.sent = 0
        self.failed = 0

    def run(self) -> None:
        import httpx

        while not self.stop.is_set():
            try:
                httpx.post(self.url + "/v1/chat/completions", timeout=60, trust_env=False, json={
                    "model": "default", "max_tokens": 16,
                    "messages": [{"role": "user", "content": f"Say something short ({self.sent})."}]})
                self.sent += 1
            except httpx.HTTPError:
                self.failed += 1
            self.stop.wait(self.period_s)


def _sample(proc, interval_s: float, duration_s: float) -> dict[str, Any]:
    """RSS/PSS each interval and CPU time over the window, for ``proc`` and its children."""
    import psutil

    def family() -> list[psutil.Process]:
        try:
            return [proc, *proc.children(recursive=True)]
        except psutil.NoSuchProcess:
            return [proc]

    def cpu_seconds() -> float:
        total = 0.0
        for p in family():
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return total

    samples = []
    cpu0, wall0 = cpu_seconds(), time.monotonic()
    next_at = wall0
    while time.monotonic() - wall0 < duration_s:
        next_at += interval_s
        rss = pss = 0
        for p in family():
            try:
                info = p.memory_full_info()
            except psutil.NoSuchProcess:
                continue
            rss += info.rss
            pss += getattr(info, "pss", 0)
        samples.append({"t_s": round(time.monotonic() - wall0, 3), "rss_bytes": rss,
                        "pss_bytes": pss or None})
        time.sleep(max(0.0, next_at - time.monotonic()))
    cpu1, wall1 = cpu_seconds(), time.monotonic()
    return {"samples": samples, "cpu_seconds": cpu1 - cpu0, "wall_seconds": wall1 - wall0}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="moetray bench ui", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None,
                        help="checkpoint folder for the engine (default: the embedded demo model)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds sampled")
    parser.add_argument("--warmup", type=float, default=15.0, help="seconds before sampling starts")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    parser.add_argument("--traffic-period", type=float, default=3.0,
                        help="seconds between chat requests (0: no traffic)")
    parser.add_argument("--engine-args", default="--budget-bytes 67108864",
                        help="extra `moetray serve` flags (default keeps the pools small)")
    parser.add_argument("--name", default="ui", help="receipt name under bench/results")
    args = parser.parse_args(argv)

    import psutil

    from moetray.engine.bench.results import write_receipt

    model = args.model
    if model is None:
        from moetray.engine.demo import demo_model_path

        model = demo_model_path()
        if not (model / "config.json").is_file():
            print(f"moetray bench ui: no demo model at {model}; build it with `moetray model build-demo` "
                  "or pass --model DIR", file=sys.stderr)
            return 2
    config = json.loads((model / "config.json").read_text())
    geometry = {key: config.get(key) for key in ("architectures", "num_hidden_layers", "num_experts",
                                                 "num_local_experts", "num_experts_per_tok")}
    token = secrets.token_urlsafe(24)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    work = Path(tempfile.mkdtemp(prefix="moetray-bench-ui-"))
    env = dict(os.environ, MOETRAY_ADMIN_TOKEN=token, PYTHONUNBUFFERED="1",
               XDG_CONFIG_HOME=str(work / "config"), XDG_RUNTIME_DIR=str(work / "run"),
               XDG_STATE_HOME=str(work / "state"))
    (work / "run").mkdir(mode=0o700)
    engine_argv = [sys.executable, "-m", "moetray.app.cli", "serve", "--model", str(model),
                   "--port", str(port), *args.engine_args.split()]
    tray_argv = [sys.executable, "-m", "moetray.app.cli", "--attach", url, "--hidden"]
    engine = subprocess.Popen(engine_argv, env=env, stdout=open(work / "engine.log", "wb"),
                              stderr=subprocess.STDOUT, start_new_session=True)
    tray = traffic = None
    try:
        _wait_serving(url, engine, timeout_s=600)
        tray = subprocess.Popen(tray_argv, env=dict(env, QT_QPA_PLATFORM="offscreen"),
                                stdout=open(work / "tray.log", "wb"), stderr=subprocess.STDOUT,
                                start_new_session=True)
        if args.traffic_period > 0:
            traffic = _Traffic(url, args.traffic_period)
            traffic.start()
        time.sleep(args.warmup)
        if tray.poll() is not None:
            raise RuntimeError(f"the tray exited with code {tray.returncode}: "
                               f"{(work / 'tray.log').read_text()[-2000:]}")
        measured = _sample(psutil.Process(tray.pid), args.interval, args.duration)
        if tray.poll() is not None:
            raise RuntimeError("the tray exited during the measurement")
    finally:
        if traffic is not None:
            traffic.stop.set()
        tray_code = _stop(tray) if tray is not None else None
        _stop(engine, signal.SIGINT)

    rss = [s["rss_bytes"] / MB for s in measured["samples"]]
    pss = [s["pss_bytes"] / MB for s in measured["samples"] if s["pss_bytes"]]
    cpu_pct = 100.0 * measured["cpu_seconds"] / measured["wall_seconds"]
    results = {
        "rss_mb_mean": statistics.fmean(rss), "rss_mb_max": max(rss),
        "pss_mb_mean": statistics.fmean(pss) if pss else None, "pss_mb_max": max(pss) if pss else None,
        "cpu_pct_of_one_core": cpu_pct, "cpu_seconds": measured["cpu_seconds"],
        "wall_seconds": measured["wall_seconds"],
        "requests_sent": traffic.sent if traffic else 0, "requests_failed": traffic.failed if traffic else 0,
        "tray_exit_code": tray_code, "samples": measured["samples"],
    }
    rows = [
        ["tray RSS, max (MB)", round(max(rss), 1), f"≤ {RSS_GOAL_MB:.0f}", max(rss) <= RSS_GOAL_MB],
        ["tray RSS, mean (MB)", round(statistics.fmean(rss), 1), f"≤ {RSS_GOAL_MB:.0f}",
         statistics.fmean(rss) <= RSS_GOAL_MB],
        ["tray PSS, mean (MB)", None if not pss else round(statistics.fmean(pss), 1), "—", None],
        ["tray CPU (% of one core)", round(cpu_pct, 2), f"≤ {CPU_GOAL_PCT:.0f}", cpu_pct <= CPU_GOAL_PCT],
    ]
    path = write_receipt(
        args.name,
        params={"model": str(model), "model_geometry": geometry,
                "duration_s": args.duration, "warmup_s": args.warmup,
                "interval_s": args.interval, "traffic_period_s": args.traffic_period,
                "engine_argv": engine_argv[3:], "tray_argv": tray_argv[3:],
                "qt_platform": "offscreen", "events_interval_s": 1.0},
        results=results, columns=["metric", "value", "goal", "met"], rows=rows,
        title="Tray process while the dashboard refreshes at 1 Hz (measured from outside)",
        notes=[
            "The tray runs `moetray --attach URL --hidden` under offscreen Qt: no system tray exists "
            "there, so the dashboard window opens (Memory tab) and stays open for the whole run.",
            "RSS/PSS sampled with psutil once per interval; CPU is the tray's user+system time over "
            "the sampling window divided by its wall time.",
            f"Traffic: one 16-token chat every {args.traffic_period:g} s keeps charts and tables changing.",
        ])
    shutil.rmtree(work, ignore_errors=True)
    print(f"tray RSS max {max(rss):.1f} MB (goal ≤ {RSS_GOAL_MB:.0f}), CPU {cpu_pct:.2f} % of one core "
          f"(goal ≤ {CPU_GOAL_PCT:.0f}); receipt {path}")
    return 0
