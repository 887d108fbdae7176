"""How the real-X drivers hand a file to the test that waits for it: whole or not at all.

The test polls for a file's existence and reads it at once; a plain ``write_text`` lets it see
the file created but still empty (a CI run read ``report.json`` as ``''``). Written beside its
name, then renamed over it, the file appears complete.
"""

from __future__ import annotations

import os
from pathlib import Path


def publish(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that a reader sees either no file or all of it."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)
