"""`moetray serve` as the tray launches it: a real child process, health while loading, the token file."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
from bounded import exit_code


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOETRAY_")}
    env["XDG_RUNTIME_DIR"] = str(tmp_path / "run")
    (tmp_path / "run").mkdir(mode=0o700)
    env["OMP_NUM_THREADS"] = "1"
    return env


def test_serve_comes_up_before_the_model_and_writes_a_private_token_file(tiny_qwen3, tmp_path, processes):
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "moetray.app.cli",
        "serve",
        "--model",
        str(tiny_qwen3),
        "--port",
        str(port),
        "--budget-bytes",
        "256M",
        "--kv-tokens",
        "1024",
        "--threads",
        "1",
        "--outbox-dir",
        str(tmp_path / "out"),
    ]
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = processes.spawn(cmd, env=child_env(tmp_path), stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        states, deadline = [], time.monotonic() + 120
        while True:
            assert time.monotonic() < deadline, f"waited 120 s for the engine to serve: {states}"
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json()
            except httpx.TransportError:
                assert proc.poll() is None, log.read_text()
                time.sleep(0.05)
                continue
            states.append(health["state"])
            if health["state"] in ("serving", "failed"):
                break
            assert health["load_progress"]["stage"]
            time.sleep(0.05)
        assert states[-1] == "serving", states
        token_file = tmp_path / "run" / "moetray" / f"engine-{port}.token"
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        token = token_file.read_text().strip()
        ok = httpx.get(f"http://127.0.0.1:{port}/admin/status", headers={"Authorization": f"Bearer {token}"})
        assert ok.status_code == 200 and ok.json()["pools"]["kv_tokens"] == 1024
        assert httpx.get(f"http://127.0.0.1:{port}/admin/status").status_code == 401
        assert token not in " ".join(proc.args)  # never on argv
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        exit_code(proc, 30, "the engine to end on SIGTERM")
    out = log.read_text()
    assert str(token_file) in out  # the path is logged at start…
    assert token not in out  # …the token itself never is


def test_serve_refuses_a_network_bind_without_an_api_key(tiny_qwen3, tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "moetray.app.cli",
        "serve",
        "--model",
        str(tiny_qwen3),
        "--host",
        "0.0.0.0",
        "--port",
        str(free_port()),
    ]
    done = subprocess.run(cmd, env=child_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "non-loopback" in done.stderr and "--api-key" in done.stderr


def test_the_listening_socket_gives_accepted_connections_tcp_nodelay():
    """asyncio (hence uvicorn) sets TCP_NODELAY on a connection only when the listening
    socket's protocol is TCP; without it Nagle holds each small reply ~40 ms behind the
    client's delayed ACK (seen as a 44 ms ``GET /v1/models``)."""
    import asyncio

    from moetray.engine.serve import bind_socket

    async def nodelay_of_an_accepted_connection() -> int:
        accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def on_connect(reader, writer):
            sock = writer.get_extra_info("socket")
            accepted.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connect, sock=bind_socket("127.0.0.1", 0))
        port = server.sockets[0].getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            return await asyncio.wait_for(accepted, 10)
        finally:
            writer.close()
            server.close()
            await server.wait_closed()

    assert asyncio.run(nodelay_of_an_accepted_connection()) == 1
