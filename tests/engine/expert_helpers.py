"""Shared helpers for the expert-runtime tests: stock references and greedy decoding."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

PROMPT = torch.tensor([[5, 17, 42, 99, 7, 250, 31, 8, 120, 64, 3, 77]])
NEW_TOKENS = 10


@functools.cache
def resident(checkpoint: Path):
    """The checkpoint fully resident with the stock eager experts (cached per folder; read-only)."""
    from moetray.engine.experts import load_resident_model

    return load_resident_model(checkpoint, experts_implementation="eager")


@functools.cache
def reference(checkpoint: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Stock greedy tokens for PROMPT and the stock logits over prompt + those tokens."""
    model = resident(checkpoint)
    return greedy(model)


def greedy(model) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        tokens = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                do_sample=False)
        logits = model(tokens).logits
    return tokens, logits


def assert_identical(checkpoint: Path, model) -> None:
    """Token identity and bit-identical fp32 logits against the stock resident model."""
    ref_tokens, ref_logits = reference(checkpoint)
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
