"""The string that ends an assistant turn, learned by rendering the chat template.

A missing turn terminator is a severe bug: when a checkpoint ends turns with a marker
that is not its EOS token (Yi-1.5's ``<|im_end|>``, Gemma-2's ``<end_of_turn>``), the
model prints the marker as text and keeps talking. Searching the template source for
marker-like strings guesses; rendering two conversations and taking their difference
measures. The engine hands in ``render(messages, **kwargs) -> str`` (raising on a
template error) and adds the result to its stop strings unless it equals the EOS text.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["MAX_MARKER", "end_of_turn_stops", "probe_end_of_turn"]

MAX_MARKER = 64
"""Longest terminator accepted: anything longer is content, not a delimiter."""

Render = Callable[..., str]

# Probe texts: distinctive, so they cannot occur inside a template's own markup.
_USER_1 = "Probe user one qz7"
_USER_2 = "Probe user two qz8"
_ANSWERS = ("Probe answer qz9", "Probe answer qz9 with a much longer body of text")


def _strip_bos(text: str, bos: str | None) -> str:
    if bos and text.startswith(bos):
        return text[len(bos) :]
    return text


def _probe_once(render: Render, answer: str, bos: str | None, eos: str | None) -> str | None:
    closed = render(
        [
            {"role": "user", "content": _USER_1},
            {"role": "assistant", "content": answer},
            {"role": "user", "content": _USER_2},
        ],
        add_generation_prompt=False,
    )
    single = render([{"role": "user", "content": _USER_1}], add_generation_prompt=False)
    answer_at = closed.find(answer)
    if answer_at < 0:
        return None
    answer_end = answer_at + len(answer)
    user_2_at = closed.find(_USER_2, answer_end)
    user_1_at = single.find(_USER_1)
    if user_2_at < 0 or user_1_at < 0:
        return None
    gap = closed[answer_end:user_2_at]

    # Step 1: the user turn's own terminator, when the assistant's gap starts with it (this
    # is how a template whose opener itself contains a terminator, like Llama-3's system
    # block, still yields the right marker).
    user_terminator = single[user_1_at + len(_USER_1) :].strip()
    if user_terminator and gap.startswith(user_terminator):
        return user_terminator

    # Step 1b: a turn closed by the EOS text ends there, whatever opener follows.
    if eos and gap.startswith(eos):
        return eos

    # Step 2: remove the next turn's opener, exactly, from the end of the gap. The opener
    # is what precedes the first user text in a one-turn render, less the BOS that only
    # the first turn carries. Never a longest-common-suffix: that truncates markers.
    opener = _strip_bos(single[:user_1_at], bos)
    if opener and gap.endswith(opener):
        remainder = gap[: len(gap) - len(opener)].strip()
        if remainder:
            return remainder

    # Step 3: no terminator at all; the next turn's opener is the boundary, its leading
    # whitespace kept (e.g. "\nuser:") and its trailing whitespace trimmed.
    boundary = gap.rstrip()
    return boundary or None


def _generation_form(render: Render, answer: str, marker: str) -> str:
    """The terminator a turn ends with when the model writes it, where that differs from history.

    Some templates close earlier turns with one marker and the turn being generated with
    another (harmony: ``<|end|>`` in history, ``<|return|>`` when the answer ends the
    conversation; ``<|end|>`` also closes the reasoning inside a turn). A trailing
    assistant message shows the generation form; templates that print nothing after it
    (prefill style) or the same marker keep the history form.
    """
    trailing = render(
        [{"role": "user", "content": _USER_1}, {"role": "assistant", "content": answer}],
        add_generation_prompt=False,
    )
    at = trailing.rfind(answer)
    if at < 0:
        return marker
    after = trailing[at + len(answer) :].strip()
    if not after or after.startswith(marker):
        return marker
    return after


def probe_end_of_turn(render: Render, bos: str | None = None, *, eos: str | None = None) -> str | None:
    """Decides the string that ends an assistant turn, or ``None`` when the template has none that is stable.

    Renders ``[user, assistant, user]`` and ``[user]`` without a generation prompt (the
    assistant message is never last: templates that prefill print no terminator after a
    trailing assistant message) and takes the text between the answer and the next user
    message. Runs with two answers of different lengths; the results must agree (a gap
    that depends on content is not a delimiter). Refuses (``None``): any render error,
    results that differ, an empty result, one longer than ``MAX_MARKER``, or one that
    contains probe text. ``bos`` is the BOS text, stripped from the first turn's opener;
    ``eos`` the EOS text, which ends a turn whose gap starts with it. Where a trailing
    assistant message shows a different terminator than history does, that generation
    form wins (harmony's ``<|return|>`` over ``<|end|>``, which also ends reasoning).
    Calls ``render`` only; mutates nothing.
    """
    results = []
    for answer in _ANSWERS:
        try:
            marker = _probe_once(render, answer, bos, eos)
            if marker is not None:
                marker = _generation_form(render, answer, marker)
        except Exception:  # a template error means "no stable terminator", whatever its type
            return None
        results.append(marker)
    marker = results[0]
    if marker is None or any(r != marker for r in results):
        return None
    if len(marker) > MAX_MARKER or "qz" in marker or "Probe" in marker:
        return None
    return marker


def end_of_turn_stops(marker: str | None, eos_text: str | None) -> tuple[str, ...]:
    """The stop strings a turn terminator adds: none when unknown or equal to the EOS text.

    Decoding already stops at EOS; adding it again as a string would only make the stop
    matcher hold text back for nothing.
    """
    if not marker or (eos_text is not None and marker == eos_text):
        return ()
    return (marker,)
