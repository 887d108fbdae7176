"""The host expert store and the offloaded loader: what is read, packed and never materialised."""

from __future__ import annotations

import shutil

import pytest
import torch
from expert_helpers import isolated_profile_dir, one_torch_thread, resident  # noqa: F401 (autouse)
from safetensors import safe_open
from safetensors.torch import save_file

from moetray.engine.experts import ExpertStoreError, load_offloaded_model
from moetray.engine.experts.loader import expert_modules, load_skeleton_and_store
from moetray.engine.experts.slots import LinkThrottle, SlotPool


def _store(checkpoint):
    _, store, _ = load_skeleton_and_store(checkpoint, device=torch.device("cpu"), dtype=torch.float32,
                                          pin=False)
    return store


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_both_layouts_pack_identical_rows(tiny_moe, family):
    """Per-expert files (incl. Mixtral's legacy w1/w3/w2 names) and fused stacks of the same
    weights must give byte-identical rows, equal to the fused parameters transformers builds.
    Prevents: swapping gate and up (w1/w3), misreading a fused stack's expert axis."""
    per_expert = _store(tiny_moe(family, "per_expert"))
    fused = _store(tiny_moe(family, "fused"))
    stock = resident(tiny_moe(family, "per_expert")).state_dict()
    assert [layer.layout for layer in per_expert.layers] == ["per_expert"] * per_expert.num_layers
    assert [layer.layout for layer in fused.layers] == ["fused"] * fused.num_layers
    for layer in range(per_expert.num_layers):
        assert torch.equal(per_expert.banks[layer], fused.banks[layer])
        name = per_expert.layers[layer].module_name
        for expert in range(per_expert.num_experts):
            for seg, tensor in per_expert.weights(layer, expert).items():
                assert torch.equal(tensor, stock[f"{name}.{seg}"][expert]), (layer, expert, seg)


def test_rows_are_contiguous_and_aligned(tiny_moe):
    """A miss must be one copy of one contiguous row, and every segment must start aligned
    (unaligned weights take other GEMM paths and break bit-identity with the stock model)."""
    store = _store(tiny_moe("qwen3_moe", "per_expert"))
    row = store.row(1, 3)
    assert row.is_contiguous() and row.dim() == 1 and row.numel() * 4 == store.row_bytes
    for seg in store.layers[0].geometry.segments:
        assert (row.data_ptr() + seg.offset * 4) % 64 == 0, seg


def test_offloaded_model_holds_no_expert_parameters(tiny_moe):
    """The expert weights must exist only in the host store: the model's Experts modules hold
    no parameters and the model's parameter bytes are the stock model's minus the experts'.
    Prevents: materialising the fused [E, …] stacks on the device behind the store's back."""
    checkpoint = tiny_moe("qwen2_moe", "per_expert")
    om = load_offloaded_model(checkpoint, capacity=4, fetch_fraction=None, cpu_layers=None)
    stock = resident(checkpoint)
    for _, module in expert_modules(om.model):
        assert module.gate_up_proj is None and module.down_proj is None
    expert_bytes = sum(p.numel() * p.element_size() for n, p in stock.named_parameters()
                       if ".experts." in n)
    model_bytes = sum(p.numel() * p.element_size() for p in om.model.parameters())
    stock_bytes = sum(p.numel() * p.element_size() for p in stock.parameters())
    assert model_bytes == stock_bytes - expert_bytes
    assert om.store.total_bytes >= expert_bytes
    assert om.model.config._experts_implementation == "moetray"


def test_missing_expert_tensor_is_refused(tiny_moe, tmp_path):
    """A checkpoint lacking one expert tensor must fail the load by name, not run on garbage."""
    src = tiny_moe("qwen3_moe", "per_expert")
    dst = tmp_path / "broken"
    shutil.copytree(src, dst)
    shard = next(dst.glob("*.safetensors"))
    with safe_open(str(shard), framework="pt") as fh:
        state = {k: fh.get_tensor(k) for k in fh.keys() if k != "model.layers.1.mlp.experts.3.up_proj.weight"}
    save_file(state, str(shard), metadata={"format": "pt"})
    with pytest.raises(ExpertStoreError) as err:
        load_offloaded_model(dst, capacity=4)
    assert err.value.kind == "missing_expert_tensor"


def test_throttle_holds_the_average_rate():
    """The emulated link must deliver at most `gbps` on average while sleeping only in chunks
    above its slack (not once per tiny copy)."""
    now = [0.0]
    sleeps: list[float] = []

    def sleep(s):
        sleeps.append(s)
        now[0] += s

    link = LinkThrottle(1.0, clock=lambda: now[0], sleep=sleep, slack_s=1e-3)
    for _ in range(100):
        link.transfer(100_000)  # 100 µs each at 1 GB/s
    link.drain()
    assert now[0] == pytest.approx(100 * 100_000 / 1e9)
    assert len(sleeps) <= 11  # roughly one sleep per ms of booked time, not 100


def test_slot_pool_refuses_a_row_of_the_wrong_size():
    pool = SlotPool(2, 8, torch.float32, "cpu")
    with pytest.raises(ValueError):
        pool.write(0, torch.zeros(7))
    pool.write(1, torch.arange(8, dtype=torch.float32))
    assert torch.equal(pool.rows[1], torch.arange(8, dtype=torch.float32))
    assert pool.bytes_copied == 32


def test_throttled_copy_costs_the_slower_of_copy_and_link():
    """A throttled copy takes max(its own memcpy time, bytes / rate) — a DMA engine's cost —
    not the sum: the booking is made before the copy and only the remainder is slept after.
    Prevents: charging the emulated link twice (memcpy + sleep) on a CPU-only machine."""
    now = [0.0]
    sleeps: list[float] = []

    def sleep(s):
        sleeps.append(s)
        now[0] += s

    link = LinkThrottle(1.0, clock=lambda: now[0], sleep=sleep, slack_s=0.0)
    link.book(1_000_000)  # 1 ms of link time
    now[0] += 0.0004  # the memcpy itself took 0.4 ms
    link.settle()
    assert now[0] == pytest.approx(0.001) and sleeps == [pytest.approx(0.0006)]
    link.book(1_000_000)
    now[0] += 0.003  # a slow memcpy (3 ms) hides the link time entirely
    link.settle()
    assert now[0] == pytest.approx(0.004) and len(sleeps) == 1


def test_non_expert_weights_own_aligned_memory_on_the_cpu(tiny_moe):
    """On the CPU the non-expert weights are copied out of the memory-mapped checkpoint into
    the allocator's own (64-byte aligned) memory, as the stock resident model's are.
    Prevents: weights left at the file's byte offset, where the GEMM kernels take another,
    slower path than for the stock model (and page-cache pages replace huge pages)."""
    om = load_offloaded_model(tiny_moe("qwen3_moe", "per_expert"), capacity=4)
    misaligned = [name for name, p in om.model.named_parameters() if p.data_ptr() % 64]
    assert misaligned == []
