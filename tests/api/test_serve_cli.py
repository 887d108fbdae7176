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
from bounded import COLD_START_S, exit_code


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
        "--model-alias",
        "gpt-4o-mini",
    ]
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = processes.spawn(cmd, env=child_env(tmp_path), stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        states, deadline = [], time.monotonic() + COLD_START_S
        while True:
            assert time.monotonic() < deadline, f"waited {COLD_START_S:g} s for the engine to serve: {states}"
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
        token_file = tmp_path / "run" / "moetray" / f"engine-{port}.{proc.pid}.token"
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        assert stat.S_IMODE(token_file.parent.stat().st_mode) == 0o700
        token = token_file.read_text().strip()
        ok = httpx.get(f"http://127.0.0.1:{port}/admin/status", headers={"Authorization": f"Bearer {token}"})
        assert ok.status_code == 200 and ok.json()["pools"]["kv_tokens"] == 1024
        assert httpx.get(f"http://127.0.0.1:{port}/admin/status").status_code == 401
        assert token not in " ".join(proc.args)  # never on argv
        models = f"http://127.0.0.1:{port}/v1/models"
        assert httpx.get(f"{models}/gpt-4o-mini").status_code == 200  # --model-alias
        assert httpx.get(f"{models}/gpt-4o").json()["error"]["code"] == "model_not_found"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        exit_code(proc, 30, "the engine to end on SIGTERM")
    out = log.read_text()
    assert str(token_file) in out  # the path is logged at start…
    assert token not in out  # …the token itself never is
    assert not token_file.exists()  # removed at a clean exit (SIGTERM)


def _spawn_stopped(cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    """Start ``cmd`` in a process that stops itself (SIGSTOP) before it execs: its PID is known
    before the engine runs a line, so a test can plant files named after it, then SIGCONT."""
    shim = ("import os, signal, sys; os.kill(os.getpid(), signal.SIGSTOP); "
            "os.execv(sys.executable, sys.argv[1:])")
    proc = subprocess.Popen([sys.executable, "-c", shim, *cmd], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 30
    while Path(f"/proc/{proc.pid}/stat").read_text().split(") ", 1)[1][0] != "T":
        assert time.monotonic() < deadline, "the shim never stopped itself"
        time.sleep(0.01)
    return proc


def test_a_planted_symlink_never_receives_the_admin_token_and_stale_tokens_go(tiny_qwen3, tmp_path):
    """Defect 6: the token was written through a predictable temporary name opened without
    O_EXCL/O_NOFOLLOW, so a symlink planted there made the engine write its admin token into
    the file the link pointed at; token files of killed engines stayed forever; the API key
    was on the command line."""
    port = free_port()
    env = child_env(tmp_path)
    tokens = tmp_path / "run" / "moetray"
    tokens.mkdir(mode=0o755)  # too open: the engine tightens its own directory to 0700
    stale = tokens / f"engine-{free_port()}.999999999.token"  # no process has this PID
    stale.write_text("old\n")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    key_file = tmp_path / "api.key"
    key_file.write_text("sk-from-a-file\n")
    cmd = [sys.executable, "-m", "moetray.app.cli", "serve", "--model", str(tiny_qwen3), "--port", str(port),
           "--budget-bytes", "256M", "--kv-tokens", "1024", "--threads", "1", "--outbox-dir",
           str(tmp_path / "out"), "--api-key-file", str(key_file)]
    proc = _spawn_stopped(cmd, env)
    try:
        # Every name the engine could write its token through points at the victim.
        for name in (f".engine-{port}.token.{proc.pid}.tmp", f"engine-{port}.{proc.pid}.token",
                     f"engine-{port}.token"):
            (tokens / name).symlink_to(victim)
        os.kill(proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + COLD_START_S
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json()["state"] == "serving":
                    break
            except httpx.TransportError:
                assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.05)
        assert victim.read_text() == "precious\n"
        token_file = tokens / f"engine-{port}.{proc.pid}.token"
        assert not token_file.is_symlink() and stat.S_IMODE(token_file.stat().st_mode) == 0o600
        assert stat.S_IMODE(tokens.stat().st_mode) == 0o700
        assert not stale.exists()  # its PID is dead
        token = token_file.read_text().strip()
        admin = {"Authorization": f"Bearer {token}"}
        assert httpx.get(f"http://127.0.0.1:{port}/admin/status", headers=admin).status_code == 200
        v1 = f"http://127.0.0.1:{port}/v1/models"
        assert httpx.get(v1).status_code == 401
        assert httpx.get(v1, headers={"Authorization": "Bearer sk-from-a-file"}).status_code == 200
        assert "sk-from-a-file" not in " ".join(proc.args)
    finally:
        os.killpg(proc.pid, signal.SIGCONT)
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert not token_file.exists()  # removed at a clean exit (SIGINT)


def test_the_api_key_flag_warns_that_other_users_can_read_it(tiny_qwen3, tmp_path):
    with socket.socket() as taken:  # the port is busy, so the engine warns and exits at once
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        cmd = [sys.executable, "-m", "moetray.app.cli", "serve", "--model", str(tiny_qwen3),
               "--port", str(taken.getsockname()[1]), "--api-key", "sk-visible"]
        done = subprocess.run(cmd, env=child_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "other users can read it" in done.stderr


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
