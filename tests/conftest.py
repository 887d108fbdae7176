"""Shared test setup: tier markers by folder, and the tiny-checkpoint factory.

Tiers follow the folders (``tests/unit`` → ``unit`` …) so ``-m unit`` picks the fast tier
without every test repeating its marker.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS_DIR))  # tiny_moe and other shared helpers live beside this file

from bounded import Processes  # noqa: E402

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Spinning OpenMP workers make tiny-tensor steps 20-100x slower when threads share 2 cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

_TIER_BY_FOLDER = {"unit": "unit", "engine": "engine", "api": "api", "gui": "gui"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        parts = Path(str(item.fspath)).resolve().relative_to(TESTS_DIR).parts
        tier = _TIER_BY_FOLDER.get(parts[0]) if len(parts) > 1 else None
        if tier:
            item.add_marker(getattr(pytest.mark, tier))


@pytest.fixture
def processes():
    """Start a test's processes with ``processes.spawn(argv, **popen)`` (own session each);
    every one's whole group is ended when the test ends, failed or not."""
    owned = Processes()
    yield owned
    owned.close()


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory):
    """``tiny_moe(family="qwen3_moe", layout="per_expert", **config)`` → a checkpoint folder.

    Folders are built once per session and per distinct argument set; treat them as
    read-only (copy one before mutating it).
    """
    from tiny_moe import make_tiny_moe

    built: dict[tuple, Path] = {}

    def factory(family: str = "qwen3_moe", layout: str = "per_expert", **config_kw) -> Path:
        key = (family, layout, tuple(sorted(config_kw.items())))
        if key not in built:
            dest = tmp_path_factory.mktemp(f"tiny-{family}-{layout}")
            built[key] = make_tiny_moe(dest, family, layout, **config_kw)
        return built[key]

    return factory
