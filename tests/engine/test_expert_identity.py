"""Token identity: the offloaded model decodes exactly what the stock resident model decodes.

Every comparison is against the transformers experts implementation whose arithmetic the
runtime reproduces (its ``compute`` mode), with all experts resident, in fp32, greedy: same
tokens and bit-identical logits. The default mode is ``"grouped_mm"``, transformers' own
default, so the reference is the stock ``grouped_mm`` model; ``compute="eager"`` is compared
with the stock ``eager`` model. (Until the grouped compute path existed these tests compared
with ``eager`` only, the runtime's single mode then.) At top-2 the two stock
implementations agree bit for bit (a two-term sum is the same in either order), so the
tests that tell the modes apart run at top-4.
"""

from __future__ import annotations

import pytest
import torch
from expert_helpers import (  # noqa: F401 (autouse fixtures)
    assert_identical,
    isolated_profile_dir,
    one_torch_thread,
    reference,
    resident,
)
from transformers import ContinuousBatchingConfig, GenerationConfig

from moetray.engine.experts import load_offloaded_model
from moetray.engine.experts.runtime import COMPUTE_MODES

FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"]
LAYOUTS = ["per_expert", "fused"]
# Capacities as slot counts on the tiny models (2 layers × 8 experts, top-2): the floor of one
# slot (every other miss computed from host memory), a mid-size pool that must evict, and all.
CAPACITIES = {"min": 1, "mid": 6, "full": 16}


@pytest.mark.parametrize("capacity", list(CAPACITIES))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_decode_is_token_identical(tiny_moe, family, layout, capacity):
    """At every capacity from the floor to 100 %, both on-disk layouts and four families
    (qwen2_moe with its shared expert), output equals the stock model bit for bit.
    Prevents: a wrong slot served (stale bytes after eviction), a reordered accumulation,
    gate/up swapped by the store, a family-specific flag ignored."""
    checkpoint = tiny_moe(family, layout)
    om = load_offloaded_model(checkpoint, capacity=CAPACITIES[capacity])
    assert_identical(checkpoint, om.model)
    om.runtime.check_integrity(deep=True)
    stats = om.runtime.cache.stats()
    assert stats.calls == om.runtime.calls > 0
    if capacity != "full":
        assert stats.misses > om.runtime.num_experts  # the pool really had to evict


@pytest.mark.parametrize("capacity", [1, 6, 16])
@pytest.mark.parametrize("compute", COMPUTE_MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_each_compute_mode_equals_its_stock_twin_at_top_4(tiny_moe, family, compute, capacity):
    """At top-4 the stock ``eager`` and ``grouped_mm`` implementations round differently (the
    sum over four experts is associated differently), so matching one of them bit for bit is a
    real constraint: each compute mode must equal its own stock twin, at the floor, mid-size
    and full capacities. Prevents: the grouped path summing in the eager order (or the
    reverse), a mode switch that is ignored, a group computed from the wrong slot."""
    checkpoint = tiny_moe(family, "per_expert", top_k=4)
    _, eager_logits = reference(checkpoint, "eager")
    _, grouped_logits = reference(checkpoint, "grouped_mm")
    assert not torch.equal(eager_logits, grouped_logits)  # the two references really differ
    om = load_offloaded_model(checkpoint, capacity=capacity, compute=compute)
    assert om.runtime.compute == compute
    assert_identical(checkpoint, om.model, compute)
    om.runtime.check_integrity(deep=True)


@pytest.mark.parametrize("compute", COMPUTE_MODES)
def test_continuous_batching_calls_the_runtime_and_matches(tiny_moe, compute):
    """transformers' continuous batching (paged KV, batched requests) must run the MoE layers
    through the registered runtime too, with the results of the same stock implementation
    under continuous batching. Prevents: a path that silently bypasses the experts interface,
    or a batched step (several tokens per call) that the compute path gets wrong."""
    checkpoint = tiny_moe("qwen3_moe", "per_expert", top_k=4)
    prompts = [[5, 17, 42, 99, 7], [250, 31, 8, 120, 64, 3, 77, 12, 9], [11, 12, 13]]
    gen = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(page_size=16, num_blocks=16, max_batch_tokens=64,
                                  max_requests_per_batch=4, use_cuda_graph=False)
    stock = resident(checkpoint, compute)
    want = stock.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb,
                                progress_bar=False)
    om = load_offloaded_model(checkpoint, capacity=CAPACITIES["mid"], compute=compute)
    got = om.model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb,
                                  progress_bar=False)
    assert om.runtime.calls >= 8 * om.runtime.num_layers
    assert {k: v.generated_tokens for k, v in got.items()} == {k: v.generated_tokens for k, v in want.items()}
    for i, prompt in enumerate(prompts):  # and CB agrees with plain generate
        ref = stock.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
        assert got[f"req_{i}"].generated_tokens == ref[0, len(prompt):].tolist()


@pytest.mark.parametrize("fraction", [0.0, 0.5])
def test_hybrid_cpu_path_is_identical(tiny_moe, fraction):
    """q*'s CPU share (misses computed from the host store, never copied) must not change a
    bit of the output; at fraction 0 nothing at all crosses the link.
    Prevents: a CPU-computed expert reading the wrong host row or being counted as fetched."""
    checkpoint = tiny_moe("mixtral", "fused")
    om = load_offloaded_model(checkpoint, capacity=CAPACITIES["mid"], fetch_fraction=fraction)
    assert om.runtime.backend == "hybrid" and om.runtime.fetch_fraction == fraction
    assert_identical(checkpoint, om.model)
    stats = om.runtime.cache.stats()
    assert stats.bypassed > 0
    if fraction == 0.0:
        assert stats.fetched == 0 and om.runtime.total_bytes == 0 and om.runtime.pool.copies == 0
    else:
        assert 0 < stats.fetched < stats.misses
        assert om.runtime.total_bytes == stats.fetched * om.runtime.bytes_per_slot
    om.runtime.check_integrity(deep=True)


def test_cpu_layers_are_never_copied_and_identical(tiny_moe):
    """A layer placed on the CPU (``cpu_layers``) computes every expert from host memory: none
    of its experts ever takes a slot, and the output is unchanged."""
    checkpoint = tiny_moe("qwen2_moe", "per_expert")
    om = load_offloaded_model(checkpoint, capacity=CAPACITIES["full"], cpu_layers="1,")
    assert om.runtime.cpu_layers == frozenset({1})
    # The residency plan ran on the live load: the CPU layer's bank was asked to be mlock-ed
    # (locked, or pageable where the lock quota is exhausted); the copied layer stays pageable
    # on the CPU device tier (there is no device to pin for).
    assert om.runtime.host_residency[0] == "pageable"
    assert om.runtime.host_residency[1] in {"locked", "pageable"}
    assert_identical(checkpoint, om.model)
    residency = om.runtime.snapshot()["residency"]
    assert all(slot is None for slot in residency[1])
    assert any(slot is not None for slot in residency[0])
    assert om.runtime.cache.layer_stats(1).fetched == 0 and om.runtime.cache.layer_stats(1).bypassed > 0
