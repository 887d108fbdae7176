"""GGUF files served with their experts kept quantized: token identity with transformers' own load of
the same file, quantized bytes in the store, and refusals by name for files that cannot be served."""

from __future__ import annotations

import copy
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from moetray.engine.experts import offload_loaded
from moetray.engine.experts.store import unpack_row
from moetray.engine.models.checkpoint import CheckpointError
from moetray.engine.models.gguf import load_gguf, load_gguf_tokenizer, read_gguf
from moetray.engine.models.gguf_export import export_gguf
from tests.gguf_fixtures import random_k_blocks
from tests.tiny_moe import make_tiny_moe

pytestmark = pytest.mark.engine

# Rows of 256: every K-quant really occurs (llama.cpp falls back to Q8_0/Q5_0 for narrower rows).
GEOMETRY = dict(hidden=256, expert_inter=256, num_experts=8, top_k=2)
WRITABLE = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4"]  # gguf-py quantizes these
K_QUANTS = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]  # Q4_K encoded by the exporter, the rest random blocks
PROMPT = torch.tensor([[5, 17, 33, 99, 120, 7, 42, 250]])


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-src")
    return {fam: make_tiny_moe(root / fam, fam, **GEOMETRY) for fam in ("qwen3_moe", "qwen2_moe", "mixtral")}


def _export(hf_dir: Path, dest: Path, qtype, **kw) -> Path:
    return export_gguf(hf_dir, dest, qtype, blocks=random_k_blocks, **kw)[0]


def _greedy(model, tokens: int = 10) -> list[int]:
    with torch.no_grad():
        out = model.generate(PROMPT, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    return out[0].tolist()


def _reference(path: Path, config):
    """transformers' own load of the file (gguf-py dequantizes every tensor), our config passed
    because its legacy mapping gets qwen2moe/qwen3moe sizes wrong."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path.parent,
        gguf_file=path.name,
        config=copy.deepcopy(config),
        dtype=torch.float32,
        experts_implementation="grouped_mm",
    )
    return model.eval()


def _offloaded(path: Path, capacity_fraction: float = 1.0, **kw):
    ck = read_gguf(path)
    model, store, modules = load_gguf(ck, device=torch.device("cpu"), dtype=torch.float32)
    total = store.num_layers * store.num_experts
    om = offload_loaded(
        model,
        store,
        modules,
        device=torch.device("cpu"),
        capacity=max(1, round(capacity_fraction * total)),
        **kw,
    )
    return ck, om


def _assert_identical_at_full_and_quarter(path: Path):
    ck, om = _offloaded(path)
    want = _greedy(_reference(path, ck.config))
    assert _greedy(om.model) == want, "100 % capacity"
    om.runtime.resize(max(1, om.store.num_layers * om.store.num_experts // 4))
    om.runtime.reset_window()
    assert _greedy(om.model) == want, "25 % capacity"
    snap = om.runtime.snapshot()
    assert snap["total_misses"] > 0 and snap["total_bytes"] > 0
    om.runtime.check_integrity(deep=True)
    return ck, om


@pytest.mark.parametrize("qtype", WRITABLE + K_QUANTS)
def test_qwen3moe_gguf_is_token_identical_to_transformers(hf_dirs, tmp_path, qtype):
    path = _export(hf_dirs["qwen3_moe"], tmp_path / f"tiny-{qtype}.gguf", qtype)
    ck, om = _assert_identical_at_full_and_quarter(path)
    assert om.store.format == qtype  # the experts are kept as the file stores them …
    stored = sum(om.store.link_bytes(layer) for layer in range(om.store.num_layers)) * om.store.num_experts
    assert om.store.total_bytes == stored  # … and only so: no decoded copy in host memory


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_qwen2moe_gguf_is_token_identical_to_transformers(hf_dirs, tmp_path, qtype):
    _assert_identical_at_full_and_quarter(_export(hf_dirs["qwen2_moe"], tmp_path / "q2.gguf", qtype))


def test_a_q4_k_m_mix_keeps_each_tensors_type_and_counts_its_own_bytes(hf_dirs, tmp_path):
    # Q4_K_M's habit: some layers' down projections in Q6_K, the rest Q4_K (rows of unequal width).
    def mix(name: str) -> str:
        return "Q6_K" if name == "blk.0.ffn_down_exps.weight" else "Q4_K"

    path = _export(hf_dirs["qwen3_moe"], tmp_path / "mix.gguf", mix)
    ck, om = _assert_identical_at_full_and_quarter(path)
    store = om.store
    assert store.format == "Q4_K+Q6_K"
    assert store.link_bytes(0) > store.link_bytes(1)  # layer 0's down is wider
    assert store.row_bytes == store.link_bytes(0)  # rows padded to the widest layer …
    om.runtime.resize(1)  # every routed expert now misses
    bytes_before, fills_before = om.runtime.pool.bytes_copied, om.runtime.pool.copies
    _greedy(om.model, 2)
    moved, fills = om.runtime.pool.bytes_copied - bytes_before, om.runtime.pool.copies - fills_before
    assert fills > 0 and moved < fills * store.row_bytes  # … but a fill moves only its own bytes


def test_store_holds_quantized_blocks_and_status_reports_them(hf_dirs, tmp_path):
    path = _export(hf_dirs["qwen3_moe"], tmp_path / "q4.gguf", "Q4_0")
    ck, om = _offloaded(path, 0.25)
    expert_bytes = sum(int(np.prod(t.shape)) // 32 * 18 for t in ck.tensors.values() if "_exps" in t.name)
    assert om.store.total_bytes == expert_bytes  # the file's blocks, byte for byte in size
    decoded = om.store.num_layers * om.store.num_experts * om.store.slot_bytes
    assert om.store.total_bytes < decoded / 6
    snap = om.runtime.snapshot()
    assert snap["expert_store_bytes"] == expert_bytes and snap["expert_store_format"] == "Q4_0"
    assert om.runtime.bytes_per_slot == om.store.slot_bytes  # device slots hold decoded rows


def test_the_cpu_path_decodes_per_call_and_keeps_no_copy(hf_dirs, tmp_path):
    path = _export(hf_dirs["qwen3_moe"], tmp_path / "q8.gguf", "Q8_0")
    ck, om = _offloaded(path, 0.25, cpu_layers="1")
    assert _greedy(om.model) == _greedy(_reference(path, ck.config))
    assert om.runtime._bank_mats == {}  # noqa: SLF001 - nothing decoded was kept


def test_mixtral_style_llama_file_matches_its_source_model(hf_dirs, tmp_path):
    # transformers cannot load a Mixtral GGUF (its legacy mapping lacks the type), so the reference is
    # the Hugging Face model the F32 file was written from: same weights, Q/K permuted and back.
    from moetray.engine.experts import load_resident_model

    path = _export(hf_dirs["mixtral"], tmp_path / "mixtral.gguf", "F32")
    ck, om = _offloaded(path, 0.25)
    assert ck.arch == "llama" and ck.config.model_type == "mixtral"
    assert _greedy(om.model) == _greedy(load_resident_model(hf_dirs["mixtral"]))


def test_tokenizer_and_chat_template_come_from_the_metadata(hf_dirs, tmp_path):
    from transformers import AutoTokenizer

    path = _export(hf_dirs["qwen3_moe"], tmp_path / "tok.gguf", "Q8_0")
    ours, source = load_gguf_tokenizer(read_gguf(path)), AutoTokenizer.from_pretrained(hf_dirs["qwen3_moe"])
    text = "Hello! Mixture of experts models route each token."
    assert ours(text)["input_ids"] == source(text)["input_ids"]
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages, tokenize=False) == source.apply_chat_template(
        messages, tokenize=False
    )


def test_a_split_set_loads_and_a_missing_part_is_refused_by_name(hf_dirs, tmp_path):
    files = export_gguf(hf_dirs["qwen3_moe"], tmp_path / "split.gguf", "Q8_0", split_max_tensors=12)
    assert len(files) >= 2 and files[0].name.endswith(f"-00001-of-{len(files):05d}.gguf")
    whole = _export(hf_dirs["qwen3_moe"], tmp_path / "whole" / "whole.gguf", "Q8_0")
    assert _greedy(_offloaded(files[0])[1].model) == _greedy(_offloaded(whole)[1].model)
    assert read_gguf(tmp_path).files == files  # a folder names its one model (the set's first part)
    files[-1].unlink()
    with pytest.raises(CheckpointError) as refused:
        read_gguf(files[0])
    assert refused.value.kind == "unreadable_checkpoint" and files[-1].name in str(refused.value)


def test_a_truncated_file_is_refused_by_name(hf_dirs, tmp_path):
    path = _export(hf_dirs["qwen3_moe"], tmp_path / "cut.gguf", "Q8_0")
    data = path.read_bytes()
    for keep in (len(data) - 1000, 40):  # inside the tensor data, inside the header
        path.write_bytes(data[:keep])
        with pytest.raises(CheckpointError) as refused:
            read_gguf(path)
        assert refused.value.kind == "unreadable_checkpoint" and str(path) in str(refused.value)


def test_an_unsupported_tensor_type_is_refused_naming_it(hf_dirs, tmp_path):
    path = _export(
        hf_dirs["qwen3_moe"], tmp_path / "iq.gguf", lambda name: "IQ2_XXS" if "_exps" in name else "Q8_0"
    )
    with pytest.raises(CheckpointError) as refused:
        read_gguf(path)
    assert refused.value.kind == "unsupported_quant_type" and refused.value.quant_type == "IQ2_XXS"
    assert "IQ2_XXS" in str(refused.value)


def _write_minimal(path: Path, arch: str, tensors: dict[str, np.ndarray]) -> Path:
    import gguf

    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(1)
    writer.add_embedding_length(64)
    writer.add_head_count(4)
    for name, value in tensors.items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_dense_gguf_is_refused_as_not_moe_and_an_unknown_family_by_name(tmp_path):
    dense = {
        "token_embd.weight": np.zeros((32, 64), np.float32),
        "blk.0.ffn_gate.weight": np.zeros((128, 64), np.float32),
    }
    with pytest.raises(CheckpointError) as refused:
        read_gguf(_write_minimal(tmp_path / "dense.gguf", "qwen2", dense))
    assert refused.value.kind == "not_moe"
    with pytest.raises(CheckpointError) as refused:
        read_gguf(_write_minimal(tmp_path / "next.gguf", "jamba", dense))
    assert refused.value.kind == "unsupported_family" and "jamba" in str(refused.value)
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + struct.pack("<I", 3) + b"\x00" * 3)
    with pytest.raises(CheckpointError) as refused:
        read_gguf(tmp_path / "junk.gguf")
    assert refused.value.kind == "unreadable_checkpoint"


def test_the_hybrid_choice_prices_experts_at_their_stored_size(hf_dirs, tmp_path, monkeypatch):
    """The same bandwidth profile sends misses to the CPU for a float32 store (the CPU reads the
    bytes the link would move, 3× faster) but not for Q8_0, whose fills move ~¼ of the bytes the CPU
    would read decoded: q* compares experts per second, with bytes per expert as stored."""
    import torch

    from moetray.engine.experts import load_offloaded_model
    from moetray.engine.experts.hybrid import device_identity
    from moetray.policy.moe.bench_profile import BandwidthProfile, save_profile

    monkeypatch.setenv("MOETRAY_CACHE_DIR", str(tmp_path / "cache"))
    save_profile(tmp_path / "cache", BandwidthProfile(device=device_identity(torch.device("cpu")),
                                                      link_gbs=1.0, cpu_gbs=3.0))
    full = load_offloaded_model(hf_dirs["qwen3_moe"], capacity=8)
    assert full.runtime.backend == "hybrid" and full.runtime.fetch_fraction == pytest.approx(1 / 3, abs=1e-4)
    _, quantized = _offloaded(_export(hf_dirs["qwen3_moe"], tmp_path / "q8.gguf", "Q8_0"), 0.5)
    assert quantized.runtime.backend == "offload"


def test_a_q8_0_file_serves_its_experts_through_the_int8_kernel(hf_dirs, tmp_path):
    """``--dtype int8`` on a Q8_0 file: the experts' blocks are re-rounded per output channel into
    int8 rows (one byte per weight in the store and the slots, no 16-bit copy), each weight within
    half a channel step of the file's value, and the logits stay close to the file's float32 load."""
    from moetray.engine.experts.int8 import Int8ExpertStore

    path = _export(hf_dirs["qwen3_moe"], tmp_path / "q8.gguf", "Q8_0")
    ck = read_gguf(path)
    model, store, modules = load_gguf(ck, device=torch.device("cpu"), dtype=torch.bfloat16)
    file_row = store.codecs[1].decode(store.banks[1][3], torch.float32)
    om = offload_loaded(model, store, modules, device=torch.device("cpu"), capacity=5, expert_format="int8")
    assert isinstance(om.store, Int8ExpertStore) and om.store.source_format == "Q8_0"
    assert om.runtime.bytes_per_slot < 1.1 * om.store.layers[0].geometry.row_numel  # ~1 byte per weight
    want = unpack_row(file_row, om.store.layers[1].geometry)
    first, _, down, _ = om.store.operands(om.store.row(1, 3))
    for w, name in ((first, "gate_up_proj"), (down, "down_proj")):
        back = w.qweight.float() * w.scale.float()[:, None]
        assert float(((back - want[name]).abs() / w.scale.float()[:, None]).max()) <= 0.5 + 1e-2
    _, ref = _offloaded(path)
    with torch.no_grad():
        got = om.model(PROMPT).logits[0].float()
        exp = ref.model(PROMPT).logits[0].float()
    assert float((got - exp).abs().max()) < 0.25 * float(exp.std()) + 0.05
    assert float((got.argmax(-1) == exp.argmax(-1)).float().mean()) >= 0.75
    om.runtime.check_integrity(deep=True)


def test_int8_refuses_experts_stored_below_eight_bits(hf_dirs, tmp_path):
    """A 4-bit file's experts stay decoded per slot: int8 would read more bytes than the file's."""
    from moetray.engine.experts.store import ExpertStoreError

    path = _export(hf_dirs["qwen3_moe"], tmp_path / "q4.gguf", "Q4_K")
    model, store, modules = load_gguf(read_gguf(path), device=torch.device("cpu"), dtype=torch.bfloat16)
    with pytest.raises(ExpertStoreError) as err:
        offload_loaded(model, store, modules, device=torch.device("cpu"), capacity=5, expert_format="int8")
    assert err.value.kind == "int8_needs_float_experts"
