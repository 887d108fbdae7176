"""`bench peer`'s RSS goal (issue 15): moetray's RSS ≤ :data:`RSS_GOAL_RATIO` × llama.cpp's for the same
file, both read once both servers have served every request, each server's own memory (its RSS less
mapped files' pages) stated beside the ratio. :func:`rss_goal_from_receipt` reads it back for
``bench decode``, whose engines share its process.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from moetray.engine.bench.results import results_dir
from moetray.engine.bench.serve import MIB

RSS_GOAL_RATIO = 1.3
RSS_GOAL = "rss_le_1.3x"
"""The goal's name in receipts (``bench decode``'s too): moetray's RSS ≤ 1.3 × llama.cpp's."""


def rss_goal(moetray_rss: int, llama_rss: int, dtype: str | None, *,
             moetray_own: int | None = None, llama_own: int | None = None) -> dict[str, Any]:
    """One file's RSS goal: moetray's RSS over llama.cpp's, and whether it is ≤ :data:`RSS_GOAL_RATIO`;
    each one's own memory (``policy.footprint.own_memory``) beside them."""
    ratio = moetray_rss / llama_rss
    return {"ratio": ratio, "met": ratio <= RSS_GOAL_RATIO, "moetray_rss": moetray_rss,
            "llama_rss": llama_rss, "moetray_dtype": dtype,
            "moetray_own": moetray_own, "llama_own": llama_own}


def rss_goal_summary(files: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The receipt's ``goals[RSS_GOAL]``: met only where every file meets it; the worst ratio."""
    return {
        "ratio_max": max(g["ratio"] for g in files.values()),
        "met": all(g["met"] for g in files.values()),
        "files": files,
    }


def rss_goal_note(goal: dict[str, Any]) -> str:
    """The goal's sentence under the table (``goal``: the receipt's ``goals[RSS_GOAL]``)."""
    def own(g: dict[str, Any]) -> str:
        mine, theirs = g.get("moetray_own"), g.get("llama_own")
        if mine is None or theirs is None:
            return ""
        return f"; its own memory, mapped files aside, {mine / MIB:.0f} against {theirs / MIB:.0f} MiB"

    parts = "; ".join(
        f"{label} {g['ratio']:.2f}× (moetray in {g['moetray_dtype'] or 'unknown dtype'}{own(g)})"
        for label, g in goal["files"].items()
    )
    return (
        f"Goal {RSS_GOAL} (moetray's RSS ≤ {RSS_GOAL_RATIO}× llama.cpp's for the same file, both read "
        f"after serving every request): {'met' if goal['met'] else 'NOT met'}: {parts}."
    )


def rss_goal_from_receipt(path: Path | None = None) -> dict[str, Any] | None:
    """The RSS goal of the last ``bench peer`` receipt (``bench/results/peer.json``) with where it
    came from, or None where there is no such receipt or it predates the goal."""
    path = path or results_dir() / "peer.json"
    try:
        receipt = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    goal = (receipt.get("results") or {}).get("goals", {}).get(RSS_GOAL)
    if goal is None:
        return None
    return {
        "ratio": goal["ratio_max"],
        "met": goal["met"],
        "files": {label: g["ratio"] for label, g in goal["files"].items()},
        "source": f"{path} (bench peer, created_unix {receipt.get('created_unix')})",
    }
