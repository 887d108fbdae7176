"""`moetray bench peer`'s settings, its refusals, and the random twin it serves where the demo cannot
be built (a lent GPU). The servers themselves are measured by the bench, not here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from moetray.engine.bench import peer, rss_goal
from moetray.engine.bench.random_model import ensure_random_model, ensure_random_twin

KILLED_BY_SIGILL = "import os, signal; os.kill(os.getpid(), signal.SIGILL)"
"""A child's code that ends it as an illegal instruction would (what ggml's AMX kernels do on a VM
without AMX state)."""


def test_offload_pairs_follow_the_resident_row_with_both_engines_settings():
    """Each ``CAPACITY:N`` pair is one row: moetray at that expert capacity, llama.cpp with that
    ``--n-cpu-moe``; the resident row (every expert on the device) comes first and carries the RSS
    goal. Prevents: a pair whose halves are swapped or an offload row read as the resident one."""
    args = peer.parser().parse_args(["--llama-server", "/bin/true", "--offload", "50%:15,25%:23"])
    assert peer._settings(args) == [
        ("resident", None, "100%"),
        ("moetray 50% / llama.cpp --n-cpu-moe 15", 15, "50%"),
        ("moetray 25% / llama.cpp --n-cpu-moe 23", 23, "25%"),
    ]
    assert peer._settings(peer.parser().parse_args([])) == [("resident", None, "100%")]


def test_offload_without_llama_server_is_refused_before_any_work(tmp_path, capsys):
    """llama-cpp-python has no ``--n-cpu-moe``: the run is refused by name, exporting nothing."""
    assert peer.main(["--offload", "50%:15", "--workdir", str(tmp_path)]) == 2
    assert "--offload needs --llama-server" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_device_column_is_measured_or_null():
    """A child's device memory is NVML's per-process figure, else the device's use over its start, else
    null (no NVIDIA GPU): never 0 for unknown."""
    assert peer._device_mib({"device_process_bytes": None, "device_delta_bytes": None}) is None
    assert peer._device_mib({"device_process_bytes": None, "device_delta_bytes": 3 << 20}) == 3
    assert peer._device_mib({"device_process_bytes": 5 << 20, "device_delta_bytes": 3 << 20}) == 5


@pytest.mark.slow
def test_a_twin_has_the_sources_geometry_and_tokenizer_and_is_seeded(tmp_path):
    """The twin keeps the source's config (so the same bytes and kernels per token) and tokenizer, with
    weights of its own seed: built twice, the same model. Prevents: a twin of another shape."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2MoeConfig

    source = ensure_random_model(tmp_path / "source", Qwen2MoeConfig, shared_expert_intermediate_size=128)
    a, b = ensure_random_twin(source, tmp_path / "a"), ensure_random_twin(source, tmp_path / "b")
    ours, theirs = (json.loads((d / "config.json").read_text()) for d in (a, source))
    for key in ("hidden_size", "num_hidden_layers", "num_experts", "num_experts_per_tok", "vocab_size",
                "moe_intermediate_size", "num_key_value_heads"):
        assert ours[key] == theirs[key]
    assert AutoTokenizer.from_pretrained(a).get_vocab() == AutoTokenizer.from_pretrained(source).get_vocab()
    wa, wb = (AutoModelForCausalLM.from_pretrained(d).state_dict()["model.layers.0.mlp.gate.weight"]
              for d in (a, b))
    assert torch.equal(wa, wb)


def test_the_reproduce_line_drops_the_scratch_folder_and_its_value():
    """Prevents: a receipt whose reproduce line names this run's temporary folder as a bare argument."""
    argv = ["--types", "F16", "--workdir", "/tmp/x", "--tokens", "8", "--workdir=/tmp/y"]
    assert peer._without_workdir(argv) == ["--types", "F16", "--tokens", "8"]


def test_a_peer_killed_by_an_illegal_instruction_is_named_with_the_rebuild_that_avoids_it(tmp_path):
    """A peer that dies says how, by name, through the same ``Child`` both benches start it with: a
    real child killed by SIGILL (ggml's AMX kernels on a VM without AMX state do that at the first
    multi-token batch) names the signal and the AMX-free rebuild; another signal and an exit code are
    named as they are. Prevents: ``llama.cpp child failed:`` with nothing after it, which is what a
    SIGILL left before."""
    import signal
    import sys

    from moetray.engine.bench.exits import AMX_FREE_BUILD, exit_reason
    from moetray.engine.bench.serve import Child, free_port

    child = Child("peer", [sys.executable, "-c", KILLED_BY_SIGILL], free_port(), {}, tmp_path / "peer.log")
    with pytest.raises(RuntimeError, match="exited early") as refused:
        child.wait_ready(lambda r: True, timeout=120)
    assert "SIGILL" in str(refused.value) and AMX_FREE_BUILD in str(refused.value)
    assert exit_reason(-signal.SIGKILL) == "killed by SIGKILL"
    assert exit_reason(3) == "exit code 3"


def test_a_round_against_a_peer_that_died_says_how_it_died():
    """``bench decode``'s round against a peer whose process died reports the death by name, not the
    load generator's lost connection. Prevents: a peer crash read as a client bug."""
    import subprocess
    import sys

    from moetray.engine.bench.serve import free_port
    from moetray.engine.bench.targets import run_client

    dead = subprocess.Popen([sys.executable, "-c", KILLED_BY_SIGILL])
    dead.wait(timeout=60)
    with pytest.raises(RuntimeError, match="the server died during the round .*SIGILL"):
        run_client(f"http://127.0.0.1:{free_port()}", "peer", concurrency=1, max_tokens=2, tag="t",
                   warm_up=False, server=dead)


def test_the_long_prompt_shares_no_prefix_with_the_rounds_prompts_and_has_its_words():
    text = peer.long_prompt(400)
    assert not any(text[:20] == p[:20] for p in peer.PROMPTS)
    assert len(text.split()) == 400 + 7 and peer.long_prompt(400) == text  # the same for both servers


def test_the_long_prompt_goal_is_met_only_when_moetrays_first_token_is_no_later():
    faster = peer.long_prompt_ttft({"ttft": 2.0}, {"ttft": 1.0}, 400)
    slower = peer.long_prompt_ttft({"ttft": 1.0}, {"ttft": 2.0}, 400)
    assert faster["met"] and faster["ratio"] == 0.5 and not slower["met"]
    assert "NOT met" in peer.long_prompt_note({"a": faster, "b": slower})
    assert ": met:" in peer.long_prompt_note({"a": faster}) and "not measured" in peer.long_prompt_note({})


def _run(tokens: int, decode_s: float, ttft: float, wall_s: float) -> dict:
    return {"requests": [{"tokens": tokens, "decode_s": decode_s, "ttft": ttft}], "wall_s": wall_s}


def test_rounds_summarise_as_medians_and_ratios_pair_each_round_with_its_turn():
    """Rounds alternate the two servers, so a machine that slows between rounds slows both figures of
    a pair: the ratio is the median of the rounds' own ratios, not a ratio of medians taken at different
    speeds. Prevents: one slow hour on one side reading as a win or a loss (each side used to run once,
    one after the other)."""
    # moetray 2x llama.cpp in every round, the machine 3x slower in the last one.
    theirs = [_run(11, 1.0, 0.01, 1.0), _run(11, 1.0, 0.01, 1.0), _run(11, 3.0, 0.03, 3.0)]
    ours = [_run(11, 0.5, 0.01, 0.5), _run(11, 0.5, 0.01, 0.5), _run(11, 1.5, 0.03, 1.5)]
    ls, ms = peer.summary({"1": theirs}), peer.summary({"1": ours})
    assert ls["1"]["decode_tok_s"] == 10.0 and ms["1"]["decode_tok_s"] == 20.0
    assert len(ms["1"]["rounds"]) == 3
    assert peer.paired_ratio(ms["1"]["rounds"], ls["1"]["rounds"], "decode_tok_s") == 2.0
    # Out of turn (moetray's slow round paired with a fast llama.cpp round) the median would still be 2;
    # a ratio of one slow round against one fast one would not.
    assert peer.paired_ratio(ms["1"]["rounds"][2:], ls["1"]["rounds"][:1], "decode_tok_s") != 2.0
    assert peer.paired_ratio([{"decode_tok_s": None}], [{"decode_tok_s": 1.0}], "decode_tok_s") is None


def test_both_servers_are_asked_for_text_only_each_control_token_banned(tmp_path):
    """The bias both clients send bans exactly the file's control tokens (end of text, end of turn),
    so every request decodes the tokens asked on both servers. Prevents: one server stopping early,
    or a text token banned."""
    from transformers import AutoTokenizer

    from moetray.engine.cb.sampling import BIAS_BAN
    from moetray.engine.models.gguf import read_headers
    from moetray.engine.models.gguf_export import export_gguf
    from tests.tiny_moe import make_tiny_moe

    source = make_tiny_moe(tmp_path / "src", "qwen3_moe", hidden=64, expert_inter=64, num_experts=4, top_k=2)
    path = export_gguf(source, tmp_path / "tiny.gguf", "F32")[0]
    bias = peer.text_only_bias(path)
    _, metadata, _ = read_headers(path)
    special = {token for token, added in AutoTokenizer.from_pretrained(source).added_tokens_decoder.items()
               if added.special}
    assert bias and set(bias.values()) == {BIAS_BAN}
    assert str(metadata["tokenizer.ggml.eos_token_id"]) in bias
    assert {int(token) for token in bias} <= special


def test_the_llama_child_answers_one_command_per_line_and_names_its_death(tmp_path):
    """The persistent llama.cpp child is driven a line at a time; one that dies mid-run is named by how
    it died (here before it loaded: no llama_cpp model at that path), never waited on forever."""
    import argparse

    pytest.importorskip("llama_cpp")
    args = argparse.Namespace(threads=1, tokens=4, timeout=120)
    with pytest.raises(RuntimeError, match="llama.cpp child failed"):
        peer._LlamaChild(tmp_path / "missing.gguf", args, {})


def test_the_speed_goals_are_stated_per_file_met_or_not():
    rows = [{"file": "demo Q8_0", "setting": "resident", "concurrency": 1, "decode_tok_s_ratio": 0.67,
             "ttft_ms_ratio": 0.43},
            {"file": "demo Q8_0", "setting": "resident", "concurrency": 4, "aggregate_tok_s_ratio": 1.6}]
    note = peer.speed_goals_note(rows)
    assert "decode tok/s 0.67× (goal >= 1.0: NOT met)" in note
    assert "four requests 1.60× (goal >= 1.5: met)" in note
    assert "first token 0.43× (goal <= 1.0: met)" in note


def test_a_footprints_rss_parts_add_up_to_the_processs_rss_or_are_null():
    """This process's RSS split by the kernel into its own memory, mapped files and shared memory:
    each measured, together the RSS psutil reads (generous: both reads are moments apart); a process
    that does not exist has every part null, never 0. Prevents: a part misnamed (and so always null),
    a value left in kB, or an unknown part written as 0."""
    import psutil

    parts = peer.rss_parts(os.getpid())
    assert set(parts) == {"rss_anon", "rss_file", "rss_shmem"}
    assert parts["rss_anon"] > 0 and parts["rss_file"] > 0 and parts["rss_shmem"] is not None
    rss = psutil.Process().memory_info().rss
    assert 0.8 * rss < sum(parts.values()) < 1.25 * rss
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert peer.rss_parts(gone.pid) == dict.fromkeys(parts)


def test_the_rss_goal_states_each_servers_own_memory_where_both_were_read():
    """The goal's sentence states each server's own memory beside the ratio when both were read,
    and leaves it out (never 0) when either was not. Prevents: llama.cpp's mapped model file
    compared as if it were heap, or an unread figure shown as 0."""
    read = rss_goal.rss_goal(960 << 20, 330 << 20, "int8", moetray_own=840 << 20, llama_own=141 << 20)
    unread = rss_goal.rss_goal(960 << 20, 330 << 20, "int8", moetray_own=840 << 20)
    assert "own memory, mapped files aside, 840 against 141 MiB" in rss_goal.rss_goal_note(
        rss_goal.rss_goal_summary({"demo Q8_0": read}))
    assert "own memory" not in rss_goal.rss_goal_note(rss_goal.rss_goal_summary({"demo Q8_0": unread}))
