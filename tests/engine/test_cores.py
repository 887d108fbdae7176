"""engine/cores.py: the other programs' load is measured from the kernel's counters, the engine
starts with a short OpenMP spin, and a served bfloat16 decode step runs on the whole budget while
the load leaves the cores free, on one thread when it does not, on graphs compiled at start."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time

import torch
from test_cb_runner import EOS, PAGE, prompt_ids, run_all

from moetray.engine.cb import Sampling
from moetray.engine.cb.compiled_step import install_decode_step
from moetray.engine.cb.runner import BatchRunner, RunnerConfig
from moetray.engine.cores import DecodeTeam, OthersLoad
from moetray.engine.experts import load_offloaded_model
from moetray.engine.experts.fused import FUSED_MAX_TOKENS
from moetray.policy.step_threads import TEAM_LEAVE_WINDOW_S, TEAM_RETURN_WINDOW_S, TEAM_SPIN_COUNT

BUSY = "import time\nend = time.monotonic() + 30\nwhile time.monotonic() < end: pass\n"


def test_a_busy_program_beside_the_engine_reads_as_others_load(processes):
    """A child spinning on a core reads as at least half a core of others' load over an interval
    (more where the machine is busier). Prevents: the engine's own CPU time, or nothing, read as
    the others'."""
    load = OthersLoad()
    assert load.cores() is None  # no window has passed yet
    processes.spawn([sys.executable, "-c", BUSY])
    time.sleep(0.3)  # the child is running
    first = load.readings
    deadline = time.monotonic() + 30
    while load.readings < first + 7 and time.monotonic() < deadline:  # a whole window with the child busy
        time.sleep(0.1)
    assert load.readings >= first + 7, "no window of CPU counters was read within 30 s"
    assert load.cores(TEAM_LEAVE_WINDOW_S) >= 0.5 and load.cores(TEAM_RETURN_WINDOW_S) >= 0.5


def test_a_window_is_read_once_the_history_spans_it():
    """A reading covers the window asked for, from readings sampled at the interval; a window
    longer than the history kept (the leaving window) or than the time sampled so far reads None.
    Prevents: a short window answered from a stale long interval (the return to the team late by
    half a second), or a reading over less time than asked."""
    load = OthersLoad(interval_s=0.05)
    assert load.cores(0.1) is None
    deadline = time.monotonic() + 30
    while load.cores(TEAM_LEAVE_WINDOW_S) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert load.cores(TEAM_LEAVE_WINDOW_S) is not None, "no half second of readings within 30 s"
    assert load.cores(0.1) is not None
    assert load.cores(2 * TEAM_LEAVE_WINDOW_S) is None  # older readings are not kept


def test_the_load_is_sampled_without_a_reader_and_the_sampler_ends_with_it():
    """After the first reading the counters are sampled with nobody asking, so the window a decode
    step reads after an idle spell is the latest; the sampler thread ends once the reader is
    dropped. Prevents: a first step after idle that averages the whole spell, or a thread waking
    every 0.1 s per retired batch runner left running."""
    def samplers() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name == "moetray-others-load"}

    before = samplers()
    load = OthersLoad(interval_s=0.05)
    assert load.cores() is None
    (sampler,) = samplers() - before
    deadline = time.monotonic() + 30
    while load.readings < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert load.readings >= 3, "the counters were not sampled in the background within 30 s"
    del load
    gc.collect()
    sampler.join(timeout=30)
    assert not sampler.is_alive(), "the sampler outlived its reader"


def test_a_team_reads_the_latest_load_off_it_and_both_windows_on_it():
    """Off the team a decode step's choice reads the latest 0.2 s of others' load; on it the latest
    and the last 0.5 s, and leaves only when both are busy. Prevents: steps held on one thread for
    most of a short reply after another program's burst had ended (bench peer's turns: 77 against
    95 tok/s), or switching at every step after one (the half second still held the burst)."""
    asked: list[float] = []
    others = {TEAM_RETURN_WINDOW_S: 0.0, TEAM_LEAVE_WINDOW_S: 0.9}  # a burst that has just ended
    team = DecodeTeam(2, spinning=True, cores=2,
                      load=lambda window_s: asked.append(window_s) or others[window_s])
    asked.clear()  # the construction's first reading
    assert team.decides() and team.decides()  # joins, and stays: the burst is over
    assert asked == [TEAM_RETURN_WINDOW_S, TEAM_LEAVE_WINDOW_S, TEAM_RETURN_WINDOW_S]
    others[TEAM_RETURN_WINDOW_S] = 1.0  # busy again, and for long
    assert not team.decides()


def test_a_team_that_cannot_form_never_reads_the_load():
    """Passive OpenMP waits (the tests' own setting) or a budget of one thread: every decode step
    on one thread, and no load reading (no sampler thread) for it."""
    asked = []
    for team in (DecodeTeam(2, spinning=False, load=lambda window_s: asked.append(1) or 0.0, cores=2),
                 DecodeTeam(1, spinning=True, load=lambda window_s: asked.append(1) or 0.0, cores=2)):
        assert not team.possible
        assert [team.decides() for _ in range(3)] == [False] * 3
        assert team.one_thread_steps == 3
    assert asked == []


def test_a_team_that_can_form_has_a_load_reading_before_its_first_step():
    """Where a team can form, the load is sampled from the team's construction (the runner's, at
    load), so the first request's first step reads a measured interval. Prevents: the first request
    after start running its prefill and first half second of decode on one thread (the reading
    was None until an interval after the first step asked)."""
    load = OthersLoad(interval_s=0.05)
    team = DecodeTeam(2, spinning=True, load=load.cores, cores=2)
    deadline = time.monotonic() + 60
    while load.readings == 0 and time.monotonic() < deadline:  # sampled in the background, unasked
        time.sleep(0.05)
    assert load.readings > 0, "no load reading 60 s after the team was made"
    assert team.team_steps == team.one_thread_steps == 0  # no step asked for it


def test_the_engine_starts_with_a_short_spin_unless_the_user_set_a_wait_policy():
    """``moetray serve`` sets TEAM_SPIN_COUNT spins (under the ACTIVE policy, for the throttled
    count) before torch loads; a wait policy of the user's own is kept whole. Prevents: decode
    teams that sleep between regions (a slower team than one thread), or a user's setting
    overridden."""
    code = ("import os, moetray.engine.serve\n"
            "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    ours = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    users = subprocess.run([sys.executable, "-c", code], env={**env, "OMP_WAIT_POLICY": "ACTIVE"},
                           capture_output=True, text=True, timeout=120)
    assert ours.stdout.split() == ["ACTIVE", str(TEAM_SPIN_COUNT)], ours.stderr
    assert users.stdout.split() == ["ACTIVE", "None"], users.stderr


async def test_served_decode_steps_take_the_team_while_the_cores_are_free(tiny, tiny_moe):
    """bfloat16 tiny MoE, compiled step, a budget of two threads, spinning workers: with no other
    load every decode step runs on both threads, with a busy core beside it on one, both on graphs
    compiled at start (none while serving; the LM head's one-row region too), and the tokens agree.
    Prevents: the load never asked, or a team graph compiled mid-request."""
    from torch._dynamo.utils import counters

    off = load_offloaded_model(tiny_moe("qwen3_moe", "per_expert"), dtype=torch.bfloat16, capacity=8)
    off.runtime.warm_up()
    step = install_decode_step(off.model, max_tokens=FUSED_MAX_TOKENS)
    others = {"cores": 0.0}
    config = RunnerConfig(kv_pages=64, page_size=PAGE, prefix_policy="off", eos_token_ids=(EOS,),
                          one_thread_small_steps=True, thread_budget=2)
    runner = BatchRunner(off.model, config)
    team = runner.decode_team = DecodeTeam(2, spinning=True, load=lambda window_s: others["cores"],
                                          cores=2)
    runner.start()
    try:
        graphs = counters["stats"]["unique_graphs"]
        request = {"r": (prompt_ids(tiny[1], "Decode on the team"), 6, Sampling(temperature=0.0))}
        head_calls = step.head.one_row_calls
        on_team = (await run_all(runner, {**request}))["r"].generated_tokens
        assert team.team_steps >= 5 and team.one_thread_steps == 0 and runner.step_threads == 2
        assert step.head.one_row_calls - head_calls >= team.team_steps  # the head's region at 2 threads
        others["cores"] = 1.0  # another program keeps a core busy
        one_thread = (await run_all(runner, {**request}))["r"].generated_tokens
        assert team.one_thread_steps >= 5 and runner.step_threads == 1
        assert counters["stats"]["unique_graphs"] == graphs
        assert step.compiled_steps >= team.team_steps + team.one_thread_steps
    finally:
        runner.stop()
    assert on_team == one_thread and len(on_team) == 6
