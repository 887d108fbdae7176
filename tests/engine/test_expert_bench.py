"""The two benchmark commands run end to end at toy sizes: receipts, profile, and their reader."""

from __future__ import annotations

import json

import pytest
import torch
from expert_helpers import isolated_profile_dir, one_torch_thread  # noqa: F401 (autouse fixtures)

from moetray.engine.bench import bw, decode, offload, peer, rss_goal
from moetray.engine.bench.results import RESULTS_DIR_ENV, receipt_name, write_receipt
from moetray.engine.experts.hybrid import lookup_profile, resolve_qstar


def test_bench_bw_writes_a_profile_the_engine_reads(tmp_path, monkeypatch):
    """`moetray bench bw` saves this device's profile where the loader looks for it, labelled
    as what it measured (a memcpy on a machine without a GPU, never "PCIe"), plus a receipt.
    Prevents: a producer and reader that disagree on the path or the device key."""
    monkeypatch.setenv(RESULTS_DIR_ENV, str(tmp_path / "results"))
    assert bw.main(["--device", "cpu", "--hidden", "64", "--inter", "32", "--dtype", "float32",
                    "--window-mb", "1", "--seconds", "0.05", "--threads", "1"]) == 0
    lookup = lookup_profile(torch.device("cpu"))
    assert lookup.status == "ok"
    profile = lookup.profile
    assert profile.link_gbs > 0 and profile.cpu_gbs > 0 and profile.overlapped
    assert "memcpy" in profile.link_label and "PCIe" not in profile.link_label
    assert profile.expert_bytes == 3 * 64 * 32 * 4
    receipt = json.loads((tmp_path / "results" / "bw.json").read_text())
    assert receipt["results"]["backend"] == profile.backend
    qstar = resolve_qstar(None, device=torch.device("cpu"))
    assert (qstar is None) == (profile.backend == "offload")


def test_bench_engine_runs_every_row_and_stays_identical(tmp_path, monkeypatch):
    """`moetray bench engine` at toy size: every row present, every row token-identical to the
    resident row of its own arithmetic (moetray's default compute to resident grouped_mm, its
    eager compute row and accelerate to resident eager), bytes over the link ordered as the
    design says (accelerate moves whole layers; moetray at 100 % moves nothing once warm)."""
    monkeypatch.setenv(RESULTS_DIR_ENV, str(tmp_path / "results"))
    assert offload.main(["--hidden", "64", "--inter", "32", "--layers", "2", "--experts", "8", "--top-k", "2",
                         "--vocab", "384", "--tokens", "4", "--prompt", "6", "--repeats", "1",
                         "--workdir", str(tmp_path / "work"), "--fetch-fraction", "1.0"]) == 0
    receipt = json.loads((tmp_path / "results" / "engine.json").read_text())
    rows = {r["name"]: r for r in receipt["results"]["rows"]}
    assert set(rows) == {"resident eager", "resident grouped_mm", "accelerate → disk", "accelerate → cpu",
                         "moetray 10%", "moetray 25%", "moetray 50%", "moetray 90%", "moetray 100%",
                         "moetray 100% (lru)", "moetray 100% (eager compute)"}
    assert all(r["identical"] for r in rows.values())
    assert rows["moetray 50%"]["identical_to"] == "resident grouped_mm"
    assert rows["moetray 100% (eager compute)"]["identical_to"] == "resident eager"
    assert rows["accelerate → cpu"]["identical_to"] == "resident eager"
    whole_layers = 2 * 8 * 3 * 64 * 32 * 4  # every expert of both layers, per token
    assert rows["accelerate → disk"]["bytes_per_token"] == whole_layers
    assert rows["moetray 100%"]["bytes_per_token"] <= rows["moetray 10%"]["bytes_per_token"]
    assert rows["moetray 10%"]["bytes_per_token"] < whole_layers


def test_bench_decode_states_the_rss_goal_bench_peer_measured(tmp_path, monkeypatch):
    """`bench decode`'s engines share its process, so its RSS goal is the one `bench peer` measured
    (moetray serve and llama.cpp in children of their own), named with its receipt; with no peer
    receipt it is None with a note, never a number. Prevents: the goal read as met or as 0."""

    monkeypatch.setenv(RESULTS_DIR_ENV, str(tmp_path / "results"))
    absent = decode.goals([], None)[rss_goal.RSS_GOAL]
    assert absent["ratio"] is None and absent["met"] is None and "bench peer" in absent["note"]

    files = {"demo F16": rss_goal.rss_goal(1300 << 20, 440 << 20, "float32"),
             "demo Q8_0": rss_goal.rss_goal(380 << 20, 300 << 20, "bfloat16")}
    assert files["demo Q8_0"]["met"] and not files["demo F16"]["met"]
    goal = rss_goal.rss_goal_summary(files)
    write_receipt("peer", params={}, results={"rows": [], "goals": {rss_goal.RSS_GOAL: goal}}, columns=[],
                  rows=[], title="peer", notes=[rss_goal.rss_goal_note(goal)])
    stated = decode.goals([], None)[rss_goal.RSS_GOAL]
    assert stated["met"] is False and abs(stated["ratio"] - 1300 / 440) < 1e-9
    assert stated["files"]["demo Q8_0"] == 380 / 300 and "peer.json" in stated["source"]
    assert "NOT met" in rss_goal.rss_goal_note(goal) and "2.95×" in rss_goal.rss_goal_note(goal)


def test_a_peer_starts_with_the_users_openmp_wait_policy_not_moetrays(monkeypatch):
    """llama.cpp started by a bench gets the user's environment: the OpenMP settings moetray set
    for itself (passive waits, which slowed llama.cpp's OpenMP build 5x, and a short spin) are
    dropped, settings the user made are kept.
    Prevents: a comparison that handicaps the peer."""
    from moetray.engine import serve as engine_serve
    from moetray.engine.bench.targets import peer_env
    from moetray.policy.step_threads import openmp_defaults

    moetrays = openmp_defaults(None)
    for name, value in moetrays.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(engine_serve, "MOETRAY_OPENMP", moetrays)
    env = peer_env(OMP_NUM_THREADS="2")
    assert not set(moetrays) & set(env) and env["OMP_NUM_THREADS"] == "2"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the user's own: moetray set nothing
    monkeypatch.setattr(engine_serve, "MOETRAY_OPENMP", {})
    assert peer_env()["OMP_WAIT_POLICY"] == "ACTIVE"


@pytest.mark.parametrize("bench", [bw, decode, offload, peer])
def test_a_receipt_given_as_a_path_is_refused_before_the_bench_runs(bench, tmp_path, monkeypatch, capsys):
    """``--receipt /tmp/x.json`` names no receipt (it would fail minutes later, when written): the
    argument is refused by name at parsing, and nothing is written. Prevents: a path joined under
    the results folder at the end of a run."""
    monkeypatch.setenv(RESULTS_DIR_ENV, str(tmp_path))
    for bad in ("/tmp/d1.json", "d1.json", "sub/d1", ".hidden"):
        with pytest.raises(SystemExit) as refused:
            bench.main(["--receipt", bad])
        assert refused.value.code == 2 and "a receipt is a name" in capsys.readouterr().err
    assert receipt_name("decode") == "decode" and not list(tmp_path.iterdir())
