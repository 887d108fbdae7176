"""``compile_region`` on a torch without a region's own recompile limit (torch < 2.12, as a CUDA
machine may bring): dynamo's global limit is raised to the region's, never lowered."""

from __future__ import annotations

import torch
import torch._dynamo.config as dynamo_config

from moetray.engine import compiling


def test_an_older_torch_shares_the_global_limit_raised_to_the_regions(monkeypatch):
    monkeypatch.setattr(compiling, "TAKES_REGION_LIMIT", False)
    seen = {}
    monkeypatch.setattr(torch, "compile", lambda fn, **options: seen.update(options) or fn)
    with dynamo_config.patch(recompile_limit=8):  # the config module's own undo (monkeypatch's deletes it)
        compiling.compile_region(abs, recompile_limit=64, fullgraph=True)
        assert dynamo_config.recompile_limit == 64 and seen == {"fullgraph": True}
        compiling.compile_region(abs, recompile_limit=4)
        assert dynamo_config.recompile_limit == 64


def test_this_torch_takes_the_regions_own_limit(monkeypatch):
    """The pinned torch (2.13) takes it: the keyword is passed and the global limit is left alone."""
    assert compiling.TAKES_REGION_LIMIT
    before = dynamo_config.recompile_limit
    seen = {}
    monkeypatch.setattr(torch, "compile", lambda fn, **options: seen.update(options) or fn)
    compiling.compile_region(abs, recompile_limit=64)
    assert seen == {"recompile_limit": 64} and dynamo_config.recompile_limit == before
