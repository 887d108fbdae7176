"""Who may talk to the engine: the admin token, the API key, loopback binds and Host checks.

- The admin token guards ``/admin/*``. It comes from ``MOETRAY_ADMIN_TOKEN`` when the tray
  set it, else from the file ``MOETRAY_ADMIN_TOKEN_FILE`` names, else it is generated per
  launch and written to a 0600 file in the user's runtime directory, whose path the engine
  logs at start (never argv, never the log itself).
- An API key (``--api-key`` or ``MOETRAY_API_KEY``) guards ``/v1/*``; a non-loopback bind
  without one is refused before the server starts.
- Every request's ``Host`` header must name a loopback host or a configured one, so a web
  page cannot reach the engine through DNS rebinding. No CORS headers are ever sent.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from moetray.policy.refused import Refused
from moetray.policy.wire import ADMIN_TOKEN_ENV, ADMIN_TOKEN_FILE_ENV, API_KEY_ENV

log = logging.getLogger("moetray.engine.api.security")

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "localhost.localdomain"})


class BindRefused(Refused):
    """The requested bind is unsafe; ``.kind`` is ``non_loopback_without_key``."""

    KINDS = ("non_loopback_without_key",)

    def __init__(self, host: str) -> None:
        super().__init__(
            "non_loopback_without_key",
            f"refusing to listen on {host!r}: a non-loopback address needs an API key "
            f"(--api-key or {API_KEY_ENV}) so that /v1/* is not open to the network",
            host=host,
        )


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address, brackets allowed) is this machine only."""
    host = host.strip().strip("[]").lower()
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, api_key: str | None) -> None:
    """Refuses (``BindRefused``) a non-loopback bind without an API key; mutates nothing."""
    if not is_loopback(host) and not api_key:
        raise BindRefused(host)


def host_of(header: str | None) -> str | None:
    """The host part of a ``Host`` header (port and IPv6 brackets removed), lowercased."""
    if not header:
        return None
    header = header.strip().lower()
    if header.startswith("["):
        end = header.find("]")
        return header[1:end] if end > 0 else None
    if header.count(":") == 1:
        header = header.split(":", 1)[0]
    return header or None


@dataclass(frozen=True)
class HostPolicy:
    """Which ``Host`` headers are accepted: loopback names plus the configured ones."""

    allowed: frozenset[str] = field(default_factory=frozenset)

    def accepts(self, header: str | None) -> bool:
        host = host_of(header)
        if host is None:
            return False
        return is_loopback(host) or host in self.allowed


def _constant_time_equal(given: str | None, expected: str | None) -> bool:
    if given is None or expected is None:
        return False
    return hmac.compare_digest(given.encode(), expected.encode())


def bearer(header: str | None) -> str | None:
    """The token of an ``Authorization: Bearer …`` header, or None."""
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


@dataclass(frozen=True)
class Credentials:
    """The admin token (always set) and the API key (None: /v1/* is open on loopback)."""

    admin_token: str
    api_key: str | None
    token_file: Path | None  # where a generated token was written, for the start-up log

    def admin_ok(self, authorization: str | None) -> bool:
        return _constant_time_equal(bearer(authorization), self.admin_token)

    def api_ok(self, authorization: str | None) -> bool:
        return self.api_key is None or _constant_time_equal(bearer(authorization), self.api_key)


def runtime_dir() -> Path:
    """The user's runtime directory for moetray (XDG_RUNTIME_DIR on Linux)."""
    import platformdirs

    return Path(platformdirs.user_runtime_dir("moetray", ensure_exists=True))


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by the owner only (0600 from creation on)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def load_credentials(
    *, api_key: str | None, port: int, env: dict[str, str] | None = None, token_dir: Path | None = None
) -> Credentials:
    """The admin token from the environment, a token file, or a fresh one written 0600.

    ``api_key`` (the CLI flag) wins over ``MOETRAY_API_KEY``. A generated token lands in
    ``<token_dir or runtime dir>/engine-<port>.token``.
    """
    env = os.environ if env is None else env
    key = api_key or env.get(API_KEY_ENV) or None
    token = env.get(ADMIN_TOKEN_ENV) or None
    if token is None and env.get(ADMIN_TOKEN_FILE_ENV):
        token = Path(env[ADMIN_TOKEN_FILE_ENV]).read_text().strip() or None
    if token is not None:
        return Credentials(admin_token=token, api_key=key, token_file=None)
    token = secrets.token_urlsafe(32)
    path = (token_dir or runtime_dir()) / f"engine-{port}.token"
    write_private(path, token + "\n")
    return Credentials(admin_token=token, api_key=key, token_file=path)
