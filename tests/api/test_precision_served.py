"""The served format through a live engine: auto follows the checkpoint and the CPU, the status says
which and why, the KV cache is in the compute dtype, int8 serves; and the decode bench's step
breakdown counts a served request's steps."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from moetray.engine.cb.compiled_step import WARM_UP_STEPS, decode_step_of
from moetray.engine.models import precision
from moetray.policy.step_threads import DECODE_STEP_TOKENS, one_thread_tokens


def _bf16_checkpoint(src, dest):
    """A copy of ``src`` whose config names bfloat16 (the weights are read and cast at load)."""
    shutil.copytree(src, dest)
    cfg = json.loads((dest / "config.json").read_text())
    cfg["dtype"] = "bfloat16"
    cfg.pop("torch_dtype", None)
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


def _chat(engine, n: int = 6) -> dict:
    with engine.client() as client:
        r = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hello"}], "max_tokens": n, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize(("features", "expected"), [
    (frozenset({"avx512f", "avx512_bf16"}), "bfloat16"),
    (frozenset({"avx2", "f16c"}), "float32"),
])
def test_auto_follows_the_checkpoint_and_this_cpu(tiny_qwen3, tmp_path, start_engine, monkeypatch,
                                                  features, expected):
    """A bfloat16 checkpoint is served in bfloat16 where the CPU computes it and widened to
    float32 where it does not; /admin/status says which and why, and the KV pool is in that
    dtype. Prevents: --dtype auto ignored (the engine pinned to float32 on the CPU), or a
    reason the status page cannot show."""
    monkeypatch.setattr(precision, "cpu_features", lambda: features)
    folder = _bf16_checkpoint(tiny_qwen3, tmp_path / "bf16")
    engine = start_engine(folder)
    model = engine.status()["model"]
    assert model["dtype"] == expected and model["weights"] == expected
    assert model["dtype_reason"].startswith("auto:")
    # Issue 15: a lossy format's decode steps run the compiled kernel; float32 stays exact.
    assert model["decode_kernel"] == ("compiled" if expected == "bfloat16" else "grouped_mm")
    assert (model["decode_kernel_reason"] is None) == (expected == "bfloat16")
    # ... and so does the whole decode step (engine/cb/compiled_step.py); float32 stays eager.
    assert model["decode_step"] == ("compiled" if expected == "bfloat16" else "eager")
    assert (model["decode_step_reason"] is None) == (expected == "bfloat16")
    cache = engine.engine.pools.runner.manager.batch_processor.cache
    assert cache.dtype == getattr(torch, expected)
    assert _chat(engine)["usage"]["completion_tokens"] == 6


def test_float32_checkpoint_stays_float32_under_auto(live):
    """The tiny test checkpoints are float32: auto keeps them exact (the token-identity reference)."""
    model = live.status()["model"]
    assert (model["dtype"], model["weights"]) == ("float32", "float32")
    # float32 keeps its thread budget on every step (its GEMMs split as the reference's do).
    _chat(live, 3)
    runner = live.engine.pools.runner
    assert runner.step_threads == runner.config.thread_budget


def test_int8_serves_and_says_so(tiny_qwen3, start_engine):
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # a budget the rule can shrink
    try:
        engine = start_engine(tiny_qwen3, dtype="int8")
    finally:
        torch.set_num_threads(before)
    model = engine.status()["model"]
    assert (model["dtype"], model["weights"]) == ("bfloat16", "int8")
    assert model["dtype_reason"] == "--dtype int8: weight-only int8 on bfloat16 activations"
    assert model["decode_kernel"] == "compiled"
    assert _chat(engine)["usage"]["completion_tokens"] == 6
    # The served request's decode steps went through the kernel (5 steps after the prefill's token).
    runtime = engine.engine.pools.runtime
    assert runtime.fused.calls >= 5 * runtime.num_layers
    # ... and ran on one intra-op thread (policy.step_threads: the kernel serves, so the rule applies).
    assert engine.engine.pools.runner.step_threads == 1
    # ... as the compiled decode step's graph (its warm-up steps, then the request's 5 decode steps).
    assert model["decode_step"] == "compiled"
    assert decode_step_of(engine.engine.pools.model).compiled_steps >= len(WARM_UP_STEPS) + 5
    # A short prompt's prefill (more tokens than a decode step, a small product on this narrow
    # model) ran on one thread too, of the engine's budget of two.
    runner = engine.engine.pools.runner
    assert runner.config.thread_budget == 2
    assert runner.one_thread_up_to == one_thread_tokens(engine.engine.pools.model.config.hidden_size)
    with engine.client() as client:
        r = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "tell me about the sea " * 4}], "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert DECODE_STEP_TOKENS < r.json()["usage"]["prompt_tokens"] <= runner.one_thread_up_to
    assert runner.step_threads == 1
    # ... while its expert groups were shared with a helper over that budget (engine/load.py sets
    # the runtime's share_threads; grouped.project).
    assert runtime.share_threads == 2 and runtime.shared_calls > 0


def test_step_breakdown_counts_a_served_request(tiny_qwen3, start_engine):
    """The decode bench's instrumentation on a live engine: a request of n tokens gives n−1
    decode steps (the first token comes from prefill), every category is measured and the
    parts fit inside the steps; uninstalling puts the model's calls back."""
    from moetray.engine.bench.breakdown import CATEGORIES, StepBreakdown, thread_cpu_seconds

    engine = start_engine(tiny_qwen3)
    loaded = engine.engine.served.loaded
    forward = loaded.model.forward
    breakdown = StepBreakdown(loaded.model, loaded.runtime,
                              engine.engine.pools.runner.manager.batch_processor).install()
    try:
        _chat(engine, n=8)
        engine.wait_idle()
        totals = breakdown.totals()
    finally:
        breakdown.uninstall()
    assert totals.decode_steps == 7 and totals.decode_tokens == 7
    assert totals.prefill_steps >= 1
    per_step = totals.per_step_ms()
    assert set(per_step) == {*CATEGORIES, "step"}
    assert all(per_step[k] >= 0 for k in CATEGORIES)
    assert per_step["attention"] > 0 and per_step["experts"] > 0
    assert sum(per_step[k] for k in CATEGORIES) <= per_step["step"] * 1.01
    assert breakdown.generation_thread is not None
    assert thread_cpu_seconds(breakdown.generation_thread) is not None
    assert loaded.model.forward == forward


def test_bench_decode_runs_end_to_end_at_toy_size(tiny_qwen3, tmp_path, monkeypatch):
    """`moetray bench decode` on a tiny checkpoint: one row per format and batch, the engine's
    own counters filled in (bytes per token, the bound, the step parts), a receipt written; and
    the float32 comparison of a lossy format. Prevents: a bench that rots between runs."""
    from moetray.engine.bench import decode
    from moetray.engine.bench.results import RESULTS_DIR_ENV

    monkeypatch.setenv(RESULTS_DIR_ENV, str(tmp_path / "results"))
    assert decode.main(["--model", str(tiny_qwen3), "--dtype", "float32,int8,int8:grouped", "--batch", "1,2",
                        "--rounds", "1", "--max-tokens", "5", "--threads", "1", "--no-llama",
                        "--no-quality"]) == 0
    receipt = json.loads((tmp_path / "results" / "decode.json").read_text())
    summary = {(e["label"], e["batch"]): e for e in receipt["results"]["summary"]}
    grouped = "int8 (grouped GEMMs)"  # the same format with --no-compile, beside it in the same rounds
    assert set(summary) == {(label, b) for label in ("float32", "int8", grouped) for b in (1, 2)}
    for e in summary.values():
        assert e["aggregate_tok_s"] > 0 and e["bytes_per_token"] > 0 and e["bound_tok_s"] > 0
        assert e["step_ms"]["step"] > 0 and e["server_cpu_ms_per_token"] > 0
    assert summary[("int8", 1)]["bytes_per_token"] < summary[("float32", 1)]["bytes_per_token"]
    assert receipt["results"]["dtypes"] == {"float32": "float32", "int8": "bfloat16", grouped: "bfloat16"}
    assert any(note.startswith("Compiled decode (the experts' kernel and the step's graph) ÷ --no-compile")
               and "int8 b1 " in note for note in receipt["notes"])
    # The compiled step's attention and experts are inside its graph: not timed apart (null), never
    # a made-up 0.
    assert summary[("int8", 1)]["step_ms"]["attention"] is None
    assert summary[("int8", 1)]["step_ms"]["experts"] is None
    assert summary[(grouped, 1)]["step_ms"]["attention"] > 0
    assert summary[(grouped, 1)]["step_ms"]["experts"] > 0
    assert "float32_fraction_of_bound_ge_0.8" in receipt["results"]["goals"]
    # Each int8 decode step asked engine/cores.py for its threads (a budget of one: never a team);
    # float32 and --no-compile keep their thread count (null, never a made-up 0).
    assert summary[("int8", 1)]["team_decode_share"] == 0.0
    assert summary[("float32", 1)]["team_decode_share"] is None
    assert summary[(grouped, 1)]["team_decode_share"] is None

    quality = decode.precision_report(tiny_qwen3, ["float32", "int8", "int8:grouped"], tokens=24,
                                      chat_tokens=4)
    assert set(quality["formats"]) == {"int8", grouped}
    q = quality["formats"]["int8"]
    assert 0 <= q["argmax_agreement"] <= 1 and q["max_abs_logit_diff"] >= q["mean_abs_logit_diff"] >= 0
    assert len(q["greedy_prefix_tokens"]) == quality["chat_prompts"]
