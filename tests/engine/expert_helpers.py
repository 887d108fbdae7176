"""Shared helpers for the expert-runtime tests: stock references and greedy decoding."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

PROMPT = torch.tensor([[5, 17, 42, 99, 7, 250, 31, 8, 120, 64, 3, 77]])
NEW_TOKENS = 10


@functools.cache
def resident(checkpoint: Path, impl: str = "grouped_mm"):
    """The checkpoint fully resident with the stock experts implementation ``impl`` (cached per
    folder and implementation; read-only). The default is transformers' own default, which the
    offloaded runtime reproduces by default."""
    from moetray.engine.experts import load_resident_model

    return load_resident_model(checkpoint, experts_implementation=impl)


@functools.cache
def reference(checkpoint: Path, impl: str = "grouped_mm") -> tuple[torch.Tensor, torch.Tensor]:
    """Stock greedy tokens for PROMPT and the stock logits over prompt + those tokens."""
    model = resident(checkpoint, impl)
    return greedy(model)


def runtime_of(model):
    """The ExpertRuntime an offloaded model's Experts modules are attached to."""
    from moetray.engine.experts.loader import expert_modules

    return expert_modules(model)[0][1]._moetray_runtime


def greedy(model) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        tokens = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                do_sample=False)
        logits = model(tokens).logits
    return tokens, logits


def assert_identical(checkpoint: Path, model, impl: str | None = None) -> None:
    """Token identity and bit-identical fp32 logits against the stock resident model whose
    experts implementation is ``impl`` (default: the one the offloaded runtime reproduces)."""
    ref_tokens, ref_logits = reference(checkpoint, impl or runtime_of(model).compute)
    tokens, logits = greedy(model)
    assert tokens.tolist() == ref_tokens.tolist()
    assert torch.equal(logits, ref_logits), f"max |Δlogit| = {(logits - ref_logits).abs().max().item()}"


@pytest.fixture(autouse=True)
def isolated_profile_dir(tmp_path, monkeypatch):
    """No test may pick up a bandwidth profile from the user's real cache folder."""
    from moetray.engine.experts.hybrid import CACHE_DIR_ENV

    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny tensors on a shared 2-core box: OpenMP workers only spin. One thread, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
