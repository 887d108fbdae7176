"""The serving path's two fast paths, on a real tiny MoE through transformers' own batcher.

- an all-greedy step skips our logits processors (the stock argmax picks the same token);
- a tapped request's intermediate outputs stay on the generation thread (one event-loop
  hand-off per request instead of one per step).

Each test pins that the fast path is taken (a counter) and that its output equals the
slow path's (token identity with ``generate`` / with an untapped run).
"""

from __future__ import annotations

import asyncio
import threading

from test_cb_runner import EOS, greedy_reference, make_runner, prompt_ids, run_all, wait_until

from moetray.engine.cb import Sampling, needs_processors, sampling_kwargs


def _kwargs(sampling: Sampling) -> dict:
    return sampling_kwargs(sampling, prompt_len=5, eos=EOS)


def test_only_a_plain_greedy_row_can_skip_the_processors():
    """Sampling, nucleus and forced rows need the processors; only temperature 0, top-p 1, unforced skips."""
    assert not needs_processors(_kwargs(Sampling(temperature=0.0)))
    assert needs_processors(_kwargs(Sampling(temperature=0.7)))
    assert needs_processors(_kwargs(Sampling(temperature=0.0, top_p=0.9)))
    assert needs_processors(_kwargs(Sampling(temperature=0.0, forced_tokens=(5, 6))))


async def test_all_greedy_steps_skip_the_processors_and_still_match_generate(tiny):
    """Greedy requests alone never run the processors (counter), and their tokens equal `generate`."""
    model, tok = tiny
    prompts = [prompt_ids(tok, f"Greedy number {i}, about experts") for i in range(4)]
    refs = [greedy_reference(model, p, 10) for p in prompts]
    runner = make_runner(model, policy="off")
    try:
        before = runner.sampling_steps()
        finals = await run_all(
            runner, {f"g{i}": (p, 10, Sampling(temperature=0.0)) for i, p in enumerate(prompts)}
        )
        processed, skipped = (a - b for a, b in zip(runner.sampling_steps(), before, strict=True))
    finally:
        runner.stop()
    assert processed == 0
    assert skipped >= 10  # at least one step per generated token
    for i, ref in enumerate(refs):
        assert finals[f"g{i}"].generated_tokens == ref


async def test_a_row_that_needs_them_runs_the_processors_for_the_whole_batch(tiny):
    """Next to a forced row the processors run (the forced ids come out), and the greedy rows'
    tokens are still `generate`'s: the slow path and the fast path pick the same greedy tokens."""
    model, tok = tiny
    greedy = [prompt_ids(tok, f"Greedy neighbour {i}") for i in range(3)]
    refs = [greedy_reference(model, p, 8) for p in greedy]
    forced = tuple(tok.encode("forced ids"))
    runner = make_runner(model, policy="off")
    try:
        before = runner.sampling_steps()
        jobs = {f"g{i}": (p, 8, Sampling(temperature=0.0)) for i, p in enumerate(greedy)}
        jobs["f"] = (prompt_ids(tok, "anything"), 40, Sampling(forced_tokens=forced))
        finals = await run_all(runner, jobs)
        processed, _ = (a - b for a, b in zip(runner.sampling_steps(), before, strict=True))
    finally:
        runner.stop()
    assert processed >= len(forced)
    assert finals["f"].generated_tokens == [*forced, EOS]
    for i, ref in enumerate(refs):
        assert finals[f"g{i}"].generated_tokens == ref


async def test_a_tapped_request_wakes_the_loop_once_and_its_tap_sees_every_step(tiny):
    """Tapped: intermediate outputs go to the tap on the generation thread, only the last one to
    the loop; the tokens equal an untapped run of the same request."""
    model, tok = tiny
    ids = prompt_ids(tok, "Tap me, please")
    n = 12
    sampling = Sampling(temperature=0.0, ignore_eos=True)
    runner = make_runner(model, policy="off")
    try:
        plain = await run_all(runner, {"plain": (ids, n, sampling)})
        loop0, tapped0 = runner.routing_counts()
        seen: list[tuple[int, bool]] = []
        finals: list = []
        done = asyncio.Event()

        def on_output(out):
            finals.append(out)
            done.set()

        def on_progress(out):
            seen.append((len(out.generated_tokens), threading.current_thread() is threading.main_thread()))

        runner.submit("tapped", ids, max_new_tokens=n, sampling=sampling, on_output=on_output,
                      on_progress=on_progress)
        await wait_until(done.is_set, "the tapped request to finish", timeout=60)
        loop1, tapped1 = runner.routing_counts()
    finally:
        runner.stop()
    assert [len_ for len_, _ in seen] == list(range(1, n))
    assert not any(on_main for _, on_main in seen)  # the taps ran on the generation thread
    assert len(finals) == 1 and finals[0].is_finished()
    assert (loop1 - loop0, tapped1 - tapped0) == (1, n - 1)
    assert finals[0].generated_tokens == plain["plain"].generated_tokens


async def test_no_tap_runs_once_cancel_returns(tiny):
    """Cancel unregisters the tap under the router's lock: a step finishing after it taps nothing
    (the engine has already counted the request's tokens into its totals by then)."""
    model, tok = tiny
    runner = make_runner(model, policy="off", step_delay_s=0.02)
    seen: list[int] = []
    try:
        runner.submit(
            "c",
            prompt_ids(tok, "cancel me"),
            max_new_tokens=200,
            sampling=Sampling(temperature=0.0, ignore_eos=True),
            on_output=lambda out: None,
            on_progress=lambda out: seen.append(len(out.generated_tokens)),
        )
        await wait_until(lambda: len(seen) >= 3, "three tapped steps")
        runner.cancel("c")
        at_cancel = len(seen)
        await asyncio.sleep(0.2)  # several held steps: the cancelled request's last one included
        await wait_until(lambda: not runner.live_requests(), "the cancelled request to leave")
    finally:
        runner.stop()
    assert len(seen) == at_cancel
