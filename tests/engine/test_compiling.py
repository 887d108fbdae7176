"""``compile_region``: on a torch without a region's own recompile limit (torch < 2.12, as a CUDA
machine may bring) dynamo's global limit is raised to the region's, never lowered; and a compiled
region keeps no traced graph alive (``inductor_keeping_no_graph``) and fuses multiply-adds."""

from __future__ import annotations

import gc

import torch
import torch._dynamo.config as dynamo_config
import torch._inductor.config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass

from moetray.engine import compiling


def test_an_older_torch_shares_the_global_limit_raised_to_the_regions(monkeypatch):
    monkeypatch.setattr(compiling, "TAKES_REGION_LIMIT", False)
    seen = {}
    monkeypatch.setattr(torch, "compile", lambda fn, **options: seen.update(options) or fn)
    with dynamo_config.patch(recompile_limit=8):  # the config module's own undo (monkeypatch's deletes it)
        compiling.compile_region(abs, recompile_limit=64, fullgraph=True)
        assert dynamo_config.recompile_limit == 64
        assert seen == {"fullgraph": True, "backend": compiling.inductor_keeping_no_graph}
        compiling.compile_region(abs, recompile_limit=4)
        assert dynamo_config.recompile_limit == 64


def test_this_torch_takes_the_regions_own_limit(monkeypatch):
    """The pinned torch (2.13) takes it: the keyword is passed and the global limit is left alone."""
    assert compiling.TAKES_REGION_LIMIT
    before = dynamo_config.recompile_limit
    seen = {}
    monkeypatch.setattr(torch, "compile", lambda fn, **options: seen.update(options) or fn)
    compiling.compile_region(abs, recompile_limit=64)
    assert seen == {"recompile_limit": 64, "backend": compiling.inductor_keeping_no_graph}
    assert dynamo_config.recompile_limit == before


def _graphs_calling(op: object) -> list[torch.fx.GraphModule]:
    return [o for o in gc.get_objects() if isinstance(o, torch.fx.GraphModule)
            and any(n.target in (op, getattr(torch.ops.aten, op.__name__).default) for n in o.graph.nodes)]


def test_a_compiled_region_keeps_no_traced_graph_alive():
    """The compiled code never runs the traced graphs, so none outlives its compilation (on the demo
    they held ~170 MiB of the engine's RSS); the region still computes and serves another size."""
    def region(x: torch.Tensor) -> torch.Tensor:
        return torch.atan2(x, x + 1) * 3

    compiled = compiling.compile_region(region, recompile_limit=4, fullgraph=True)
    for size in (4, 5, 6):  # a second size recompiles with a symbolic one: that graph goes too
        x = torch.linspace(0.5, 2, size)
        assert torch.allclose(compiled(x), region(x))
    gc.collect()
    assert _graphs_calling(torch.atan2) == []


def test_a_compiled_region_keeps_no_cache_entries_in_memory(monkeypatch):
    """The compile caches' entries that torch records in memory (for ``save_cache_artifacts``, which
    moetray never calls; 36 MiB on the demo) are dropped once a region's graph is compiled."""
    from torch.compiler._cache import CacheArtifactManager

    recorded: list[str] = []
    record = CacheArtifactManager.record_artifact.__func__

    def counting(cls, artifact_type: str, key: str, content: object) -> None:
        recorded.append(artifact_type)
        record(cls, artifact_type, key, content)

    monkeypatch.setattr(CacheArtifactManager, "record_artifact", classmethod(counting))

    def region(x: torch.Tensor) -> torch.Tensor:
        return torch.hypot(x, x + 2) * 5

    compiled = compiling.compile_region(region, recompile_limit=4, fullgraph=True)
    x = torch.linspace(0.5, 2, 7)
    assert torch.allclose(compiled(x), region(x))
    assert recorded  # the caches recorded entries while the region compiled
    assert not CacheArtifactManager._new_cache_artifacts and not CacheArtifactManager._seen_artifacts


def test_a_compiled_regions_kernels_fuse_multiply_and_add():
    """Every region's C++ kernels are built with fused multiply-adds (inductor's config in force while
    it compiles, seen by a pass of the region's own): its one-row products save an instruction."""
    seen: list[str] = []
    before = inductor_config.cpp.enable_floating_point_contract_flag

    class RecordContract(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            seen.append(inductor_config.cpp.enable_floating_point_contract_flag)

        def uuid(self) -> bytes:
            return b"test-record-contract"

    def region(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (x.unsqueeze(-2) * w).sum(-1)

    compiled = compiling.compile_region(region, recompile_limit=4, fullgraph=True,
                                        options={"post_grad_custom_post_pass": RecordContract(),
                                                 "fx_graph_cache": False})
    x, w = torch.randn(1, 64), torch.randn(32, 64)
    assert torch.allclose(compiled(x, w), region(x, w), atol=1e-5)
    assert seen == ["fast"]
    assert inductor_config.cpp.enable_floating_point_contract_flag == before  # a patch, not a global
