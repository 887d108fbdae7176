"""Issue 16's house rule: no source file of the four layers grows past 700 lines.

A file that long holds several concerns; the next feature belongs in a room of its own.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("policy", "engine", "app", "ui")
MAX_LINES = 700


def test_no_source_file_is_over_700_lines():
    sizes = {
        str(path.relative_to(ROOT)): len(path.read_text().splitlines())
        for layer in LAYERS
        for path in (ROOT / layer).rglob("*.py")
    }
    assert len(sizes) > 100  # the walk found the layers
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}
