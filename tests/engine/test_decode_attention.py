"""The CUDA attention rule (``engine/load.py``): no backend that plans per shape serves decode steps."""

from __future__ import annotations

import pytest
import torch

from moetray.engine import load
from moetray.engine.core import EngineOptions


@pytest.fixture
def cudnn_restored():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


def test_cuda_turns_cudnn_attention_off_and_the_cpu_leaves_it(cudnn_restored):
    """cuDNN plans each new KV length (every decode step): off on CUDA; the CPU's setting is left as it
    is. Prevents: ~2 ms of planning per layer per step on a GPU (measured 169 against 72 ms a step)."""
    torch.backends.cuda.enable_cudnn_sdp(True)
    assert load.keep_decode_attention_planless(torch.device("cpu")) is False
    assert torch.backends.cuda.cudnn_sdp_enabled()
    assert load.keep_decode_attention_planless(torch.device("cuda", 0)) is True
    assert not torch.backends.cuda.cudnn_sdp_enabled()


class _Stop(Exception):
    """Ends a load at the rule, before any weight is read."""


def test_loading_applies_the_rule_to_the_device_it_resolved(tiny_moe, monkeypatch):
    """``load_model`` hands its resolved device to the rule before reading any weight. Prevents: the
    rule left uncalled (a pure function nothing uses)."""
    seen = []

    def record(device):
        seen.append(device)
        raise _Stop

    monkeypatch.setattr(load, "keep_decode_attention_planless", record)
    with pytest.raises(_Stop):
        load.load_model(EngineOptions(model_dir=tiny_moe("qwen3_moe", "per_expert"), device="cpu"),
                        load.LoadState())
    assert seen == [torch.device("cpu")]
