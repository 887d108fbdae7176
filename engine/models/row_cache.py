"""The header cache behind ``moetray models``: what a GGUF model's headers said, kept with the size and
modification time of each of its files.

Reading a GGUF header needs transformers' reader, and importing torch and transformers costs
seconds before the first byte is read; a listing whose files are all known reads no header and
imports neither, so the tray's Model menu and a terminal listing come back at once. A row is read
again when any of its files changes size or modification time, or when the modules whose rules
decide a row change (an upgrade that learns a family must not keep yesterday's refusal). The cache
is a convenience: one that cannot be read or written is ignored and the headers are read.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["CACHE_FILE", "RowCache", "cache_path", "file_stamp"]

CACHE_FILE = "model-rows.json"
_RULE_MODULES = (
    Path(__file__).with_name("discovery.py"),
    Path(__file__).with_name("gguf.py"),
    Path(__file__).with_name("files.py"),
    Path(__file__).parent.parent / "experts" / "codecs.py",
)

Stamp = list[list[Any]]


def cache_folder(environ: Mapping[str, str]) -> Path:
    """``$XDG_CACHE_HOME/moetray``, else ``~/.cache/moetray``: where moetray keeps what it derives
    once per machine (the model rows here, the few-rows kernel's build)."""
    base = environ.get("XDG_CACHE_HOME") or str(Path(environ.get("HOME") or Path.home()) / ".cache")
    return Path(base) / "moetray"


def cache_path(environ: Mapping[str, str]) -> Path:
    """``model-rows.json`` in :func:`cache_folder`."""
    return cache_folder(environ) / CACHE_FILE


def file_stamp(files: Iterable[Path]) -> Stamp | None:
    """``[[path, size, mtime_ns], …]`` of a model's files; None when one cannot be stat'ed."""
    try:
        return [[str(p), st.st_size, st.st_mtime_ns] for p in files for st in (p.stat(),)]
    except OSError:
        return None


def _rules_stamp() -> Stamp | None:
    return file_stamp(_RULE_MODULES)


class RowCache:
    """Facts per model path, valid while the path's file stamp and the rules' stamp are unchanged."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._rules = _rules_stamp()
        self._rows: dict[str, dict[str, Any]] = {}
        self._dirty = False
        try:
            saved = json.loads(path.read_text())
        except (OSError, ValueError):
            return
        rows = saved.get("rows") if isinstance(saved, dict) else None
        if isinstance(rows, dict) and saved.get("rules") == self._rules:
            self._rows = rows

    def get(self, key: str, stamp: Stamp | None) -> dict[str, Any] | None:
        entry = self._rows.get(key)
        if stamp is None or not isinstance(entry, dict) or entry.get("stamp") != stamp:
            return None
        facts = entry.get("facts")
        return facts if isinstance(facts, dict) else None

    def put(self, key: str, stamp: Stamp | None, facts: dict[str, Any]) -> None:
        if stamp is None or self._rules is None:
            return
        self._rows[key] = {"stamp": stamp, "facts": facts}
        self._dirty = True

    def save(self) -> None:
        """Writes the cache if a row was added (whole-file replace, so a reader never sees half)."""
        if not self._dirty:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
        except OSError:
            return
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump({"rules": self._rules, "rows": self._rows}, fh)
            os.replace(tmp, self.path)
            self._dirty = False
        except OSError:
            Path(tmp).unlink(missing_ok=True)
