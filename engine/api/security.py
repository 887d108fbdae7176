"""Who may talk to the engine: the admin token, the API key, loopback binds and Host checks.

- The admin token guards ``/admin/*``. It comes from ``MOETRAY_ADMIN_TOKEN`` when the tray
  set it, else from the file ``MOETRAY_ADMIN_TOKEN_FILE`` names, else it is generated per
  launch and written to ``engine-<port>.<pid>.token`` in the user's runtime directory, whose
  path the engine logs at start (never argv, never the log itself). That file is created
  with ``O_CREAT | O_EXCL | O_NOFOLLOW`` and mode 0600 in a 0700 directory (a planted symlink
  makes the open fail instead of being written through), removed at a clean exit, and the
  files of engines whose PID is dead are removed at start.
- An API key (``--api-key-file``, ``MOETRAY_API_KEY``, or ``--api-key``, which other users
  can read in ``ps``) guards ``/v1/*``; a non-loopback bind without one is refused before
  the server starts.
- Every request's ``Host`` header must name a loopback host or a configured one, so a web
  page cannot reach the engine through DNS rebinding. No CORS headers are ever sent.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import re
import secrets
import stat
from collections.abc import Mapping
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
            f"(--api-key-file, {API_KEY_ENV} or --api-key) so that /v1/* is not open to the network",
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

    def forget(self) -> None:
        """Remove the generated token file (a clean exit); idempotent."""
        if self.token_file is not None:
            self.token_file.unlink(missing_ok=True)


def runtime_dir() -> Path:
    """The user's runtime directory for moetray (XDG_RUNTIME_DIR on Linux)."""
    import platformdirs

    return Path(platformdirs.user_runtime_dir("moetray", ensure_exists=False))


class UnsafeTokenPath(Refused):
    """The token directory or file is not ours alone; ``.kind`` is ``unsafe_token_path``."""

    KINDS = ("unsafe_token_path",)

    def __init__(self, message: str) -> None:
        super().__init__("unsafe_token_path", message)


def private_dir(path: Path) -> Path:
    """``path`` as a directory only this user can enter (0700), created if missing.

    Refuses (``UnsafeTokenPath``) a symlink, a non-directory or a directory owned by someone
    else; tightens the mode of our own directory when it is looser than 0700.
    """
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeTokenPath(f"{path} is not a directory (a symlink?); refusing to keep tokens there")
    if info.st_uid != os.geteuid():
        raise UnsafeTokenPath(f"{path} belongs to uid {info.st_uid}, not to this user")
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


def write_private(path: Path, text: str) -> None:
    """Create ``path`` holding ``text``, readable by the owner only, never through a link.

    ``O_CREAT | O_EXCL | O_NOFOLLOW``: an existing file or a planted symlink makes the open
    fail instead of writing through it; mode 0600 from creation on. The directory must
    already be private (:func:`private_dir`). Raises ``FileExistsError`` when the name is taken.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags, 0o600)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


_TOKEN_NAME = re.compile(r"^engine-(\d+)\.(\d+)\.token$")


def token_path(directory: Path, port: int, pid: int) -> Path:
    """Where the engine with ``pid`` on ``port`` keeps its generated admin token."""
    return directory / f"engine-{port}.{pid}.token"


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists (one we may not signal still counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_tokens(directory: Path, *, alive=pid_alive) -> list[Path]:
    """Delete the token files of engines that are gone (their PID is dead); returns what went."""
    removed = []
    for entry in directory.iterdir() if directory.is_dir() else ():
        m = _TOKEN_NAME.match(entry.name)
        if m and not alive(int(m.group(2))):
            entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed


def read_secret(path: Path) -> str:
    """The first line of a secret file (a token or an API key), stripped; refuses an empty one."""
    text = Path(path).read_text().strip().splitlines()
    if not text or not text[0].strip():
        raise ValueError(f"{path} is empty")
    return text[0].strip()


def api_key_from(*, flag: str | None, file: Path | None, env: Mapping[str, str] | None = None) -> str | None:
    """The key ``/v1/*`` requires: ``--api-key-file``, else ``--api-key``, else ``MOETRAY_API_KEY``."""
    environ = os.environ if env is None else env
    if file is not None:
        return read_secret(file)
    return flag or environ.get(API_KEY_ENV) or None


def load_credentials(
    *, api_key: str | None, port: int, env: Mapping[str, str] | None = None, token_dir: Path | None = None
) -> Credentials:
    """The API key (``api_key``, else ``MOETRAY_API_KEY``) and the admin token. The admin token:
    ``MOETRAY_ADMIN_TOKEN``, else the file ``MOETRAY_ADMIN_TOKEN_FILE`` names, else a fresh one
    written to ``<token_dir or runtime dir>/engine-<port>.<pid>.token`` (0600 in a 0700
    directory) after removing the token files of engines whose PID is dead. The caller
    removes that file at a clean exit (:meth:`Credentials.forget`).
    """
    environ = os.environ if env is None else env
    key = api_key or environ.get(API_KEY_ENV) or None
    token = environ.get(ADMIN_TOKEN_ENV) or None
    if token is None and environ.get(ADMIN_TOKEN_FILE_ENV):
        token = read_secret(Path(environ[ADMIN_TOKEN_FILE_ENV]))
    if token is not None:
        return Credentials(admin_token=token, api_key=key, token_file=None)
    token = secrets.token_urlsafe(32)
    directory = private_dir(token_dir or runtime_dir())
    for gone in remove_stale_tokens(directory):
        log.info("removed the token file of an engine that is gone: %s", gone)
    path = token_path(directory, port, os.getpid())
    try:
        write_private(path, token + "\n")
    except FileExistsError:
        # Ours by name (this PID) yet not written by us: whatever sits there is replaced, not
        # written through; a second collision means someone is racing us, so give up.
        path.unlink()
        write_private(path, token + "\n")
    return Credentials(admin_token=token, api_key=key, token_file=path)
