"""Replayed engine output for the view-model tests (vorta's recorded-output fixtures).

``snapshots.jsonl`` is a status stream in the contract's shape (loading → serving idle →
busy → rebuilding → re-split applied); ``events.sse`` is the same stream as SSE bytes with
a keep-alive comment and a foreign event, CRLF line ends as servers send them.
"""

from __future__ import annotations

import json
from pathlib import Path

REPLAY = Path(__file__).resolve().parent / "replay"


def snapshots() -> list[dict]:
    return [json.loads(line) for line in (REPLAY / "snapshots.jsonl").read_text().splitlines() if line]


def sse_lines() -> list[str]:
    return (REPLAY / "events.sse").read_bytes().decode().split("\n")
