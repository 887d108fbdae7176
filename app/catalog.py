"""The local models on disk, for the Model menu: ``moetray models --json`` run off the UI thread.

The tray never imports the engine, so it asks the engine's own command, as a user would,
and reads its rows (``wire.LocalModel``: ``name``, ``source``, ``path``, ``format``,
``family``, ``moe``, ``bytes``, ``servable``, ``refusal``). The command runs in a worker thread (the asyncio
loop's executor), bounded by ``timeout_s``; a failure keeps the rows of the last success
and says why in ``error``. Servable models are listed first; refused ones keep their
reason, which the menu shows greyed.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PySide6.QtCore import QObject, Signal

from moetray.app.settings import DEMO_MODEL
from moetray.policy import wire

MODELS_COMMAND = (sys.executable, "-m", "moetray.app.cli", "models", "--json")
REFUSAL_WORDS = {
    "not_moe": "not a mixture-of-experts model",
    "unsupported_quant_type": "quantization type not supported",
    "quantized_checkpoint": "quantization not supported",
    "unreadable_checkpoint": "unreadable or incomplete files",
    "unsupported_architecture": "architecture not supported",
}
"""How the menu says why a model cannot be served (else the wire summary, else the kind in words)."""


def refusal_words(kind: str | None) -> str:
    if not kind:
        return "cannot be served"
    if kind in REFUSAL_WORDS:
        return REFUSAL_WORDS[kind]
    if kind in wire.REFUSALS:
        return wire.refusal_for(kind).summary.rstrip(".")
    return kind.replace("_", " ")


@dataclass(frozen=True)
class CatalogRow:
    """One local model as ``moetray models --json`` lists it."""

    name: str
    source: str
    path: str
    format: str | None
    family: str | None
    moe: bool | None
    bytes: int | None
    servable: bool
    refusal: str | None

    @classmethod
    def from_wire(cls, row: wire.LocalModel | Mapping[str, Any]) -> CatalogRow:
        size = row.get("bytes")
        moe = row.get("moe")
        return cls(str(row["name"]), str(row.get("source") or ""), str(row.get("path") or ""),
                   row.get("format"), row.get("family"), None if moe is None else bool(moe),
                   None if size is None else int(size), bool(row.get("servable")), row.get("refusal"))

    @property
    def is_demo(self) -> bool:
        return self.source == "demo" or self.name == "demo"

    @property
    def launch_value(self) -> str:
        """What ``moetray serve --model`` gets: a folder as its path, anything else by name."""
        if self.is_demo:
            return DEMO_MODEL
        if self.path and Path(self.path).is_dir():
            return self.path
        return self.name


def parse_rows(text: str) -> tuple[CatalogRow, ...]:
    """Rows from the command's JSON (a list of objects), servable first, each group by name.

    Refuses output that is not such a list with ``ValueError``.
    """
    data = json.loads(text)
    if isinstance(data, Mapping):
        data = data.get("models", data.get("data"))
    if not isinstance(data, list):
        raise ValueError("`moetray models --json` did not print a list")
    rows = [CatalogRow.from_wire(r) for r in data if isinstance(r, Mapping) and r.get("name")]
    return tuple(sorted(rows, key=lambda r: (not r.servable, r.name.lower())))


class ModelCatalog(QObject):
    """The last listing of local models; ``refresh()`` runs the command again (``changed`` after)."""

    changed = Signal()

    def __init__(self, command: Sequence[str] = MODELS_COMMAND, *, timeout_s: float = 30.0) -> None:
        super().__init__()
        self.command = tuple(command)
        self.timeout_s = timeout_s
        self.rows: tuple[CatalogRow, ...] = ()
        self.error: str | None = None
        self.loaded = False
        self._running: asyncio.Future[None] | None = None

    def _run(self) -> tuple[CatalogRow, ...]:
        done = subprocess.run(list(self.command), capture_output=True, text=True, timeout=self.timeout_s,
                              stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
            raise RuntimeError(last)
        return parse_rows(done.stdout)

    async def refresh(self) -> None:
        """List again in a worker thread; concurrent calls share one run. Never raises."""
        if self._running is not None and not self._running.done():
            await asyncio.shield(self._running)
            return
        self._running = asyncio.get_running_loop().create_future()
        try:
            rows = await asyncio.get_running_loop().run_in_executor(None, self._run)
        except (OSError, subprocess.SubprocessError, RuntimeError, ValueError) as exc:
            self.error = f"could not list the local models: {exc}"
        else:
            self.rows, self.error = rows, None
        finally:
            self.loaded = True
            self._running.set_result(None)
        self.changed.emit()
