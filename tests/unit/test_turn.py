"""Rules of the end-of-turn probe: the terminator is measured by rendering, never guessed from source."""

from __future__ import annotations

import pytest
from chat_templates import renderer
from hypothesis import given
from hypothesis import strategies as st

from moetray.policy.turn import MAX_MARKER, end_of_turn_stops, probe_end_of_turn

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GEMMA = (
    "{{ bos_token }}{% for m in messages %}"
    "<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n{{ m.content | trim }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
# Llama-3 shape: the default system block carries an <|eot_id|> inside the first opener.
LLAMA3 = (
    "{{ bos_token }}<|start_header_id|>system<|end_header_id|>\n\nToday.<|eot_id|>{% for m in messages %}"
    "<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
# The same, prefill style (a trailing assistant is left open): only the user turn's own
# terminator tells the marker apart from the next opener.
LLAMA3_PREFILL = (
    "{{ bos_token }}<|start_header_id|>system<|end_header_id|>\n\nToday.<|eot_id|>{% for m in messages %}"
    "<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content | trim }}"
    "{% if not (loop.last and m.role == 'assistant') %}<|eot_id|>{% endif %}{% endfor %}"
)
INVENTED = (
    "{% for m in messages %}[[{{ m.role }}]] {{ m.content }} [[/turn]]\n{% endfor %}"
    "{% if add_generation_prompt %}[[assistant]] {% endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}[INST]{{ m.content }}[/INST]"
    "{% else %}{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}"
)
ZEPHYR = (
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# transformers renders with trim_blocks, so the newline must be an expression, not template text.
ROLE_LINES = (
    "{% for m in messages %}{% if not loop.first %}{{ '\\n' }}{% endif %}"
    "{{ m.role }}: {{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '\\nassistant:' }}{% endif %}"
)
# Prefill style: a trailing assistant message is left open so generation can continue it.
PREFILL = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% if not (loop.last and m.role == 'assistant') %}<|im_end|>\n{% endif %}{% endfor %}"
)
# Harmony shape: history turns end with <|end|>, the turn being generated with <|return|>.
HARMONY = (
    "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}"
    "{% if loop.last and m.role == 'assistant' %}<|return|>{% else %}<|end|>{% endif %}{% endfor %}"
)
# Hy3 shape: BOS-prefixed first opener, EOS closing history turns, a trailing assistant left open.
MISTRAL_PREFILL = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}[INST]{{ m.content }}[/INST]"
    "{% else %}{{ m.content }}{% if not loop.last %}{{ eos_token }}{% endif %}{% endif %}{% endfor %}"
)
ECHOES_LENGTH = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.content | length }}>{% endfor %}"
RAISES = "{{ raise_exception('this template refuses every conversation') }}"


def long_gap(n: int) -> str:
    """A template whose user and assistant turns end with an n-character terminator."""
    return "{% for m in messages %}<u>{{ m.content }}" + "#" * (n - 4) + "</u>{% endfor %}"


@pytest.mark.parametrize(
    ("template", "special", "expected"),
    [
        (CHATML, {}, "<|im_end|>"),
        (GEMMA, {"bos_token": "<bos>"}, "<end_of_turn>"),
        (LLAMA3, {"bos_token": "<|begin_of_text|>"}, "<|eot_id|>"),
        (LLAMA3_PREFILL, {"bos_token": "<|begin_of_text|>"}, "<|eot_id|>"),
        (INVENTED, {}, "[[/turn]]"),
        (ZEPHYR, {"eos_token": "</s>"}, "</s>"),
        (ROLE_LINES, {}, "\nuser:"),
        (PREFILL, {}, "<|im_end|>"),
    ],
    ids=[
        "chatml",
        "gemma-bos",
        "llama3-system-eot",
        "llama3-prefill",
        "invented-family",
        "zephyr",
        "role-lines",
        "prefill",
    ],
)
def test_terminator_is_learned_by_rendering(template, special, expected):
    """A terminator missing from the stop set makes the model print it as text and keep talking."""
    bos = special.get("bos_token")
    assert probe_end_of_turn(renderer(template, **special), bos=bos) == expected


def test_mistral_terminator_is_not_truncated():
    """A longest-common-suffix cut gives "</" for "</s>[INST]" vs "<s>[INST]": a marker that never matches."""
    render = renderer(MISTRAL_PREFILL, bos_token="<s>", eos_token="</s>")
    assert probe_end_of_turn(render, bos="<s>") == "</s>"
    assert probe_end_of_turn(renderer(MISTRAL, bos_token="<s>", eos_token="</s>"), bos="<s>") == "</s>"


def test_eos_ends_a_turn_even_when_the_opener_differs():
    """Without the BOS the first opener is no suffix of the gap; a gap starting with EOS still ends there."""
    render = renderer(MISTRAL_PREFILL, bos_token="<s>", eos_token="</s>")
    assert probe_end_of_turn(render, eos="</s>") == "</s>"
    assert probe_end_of_turn(render) == "</s>[INST]"  # the documented step-3 boundary without bos or eos


def test_generation_form_wins_over_the_history_form():
    """Stopping at harmony's <|end|> would cut every answer off after its reasoning."""
    assert probe_end_of_turn(renderer(HARMONY)) == "<|return|>"


def test_content_dependent_gap_is_refused():
    """A gap that varies with the answer is content, not a delimiter; stopping on it would cut answers."""
    assert probe_end_of_turn(renderer(ECHOES_LENGTH)) is None


def test_template_error_means_no_terminator():
    """A probe that raised would take the engine's start-up down over an optional stop string."""
    assert probe_end_of_turn(renderer(RAISES)) is None


def test_marker_length_limit():
    """A 65-character "terminator" is prose; stopping on it would never match or cut mid-answer."""
    assert probe_end_of_turn(renderer(long_gap(MAX_MARKER))) == "#" * (MAX_MARKER - 4) + "</u>"
    assert probe_end_of_turn(renderer(long_gap(MAX_MARKER + 1))) is None


def test_result_containing_probe_text_is_refused():
    """A template quoting the conversation in its terminator would make user text a stop string."""
    echo = "{% for m in messages %}<m>{{ m.content }}</m re='{{ messages[0].content }}'>{% endfor %}"
    assert probe_end_of_turn(renderer(echo)) is None


def test_stops_drop_a_terminator_equal_to_eos():
    """Decoding already stops at EOS; the same text as a stop string only delays streaming."""
    assert end_of_turn_stops("<|im_end|>", "<|im_end|>") == ()
    assert end_of_turn_stops("<|im_end|>", "<|endoftext|>") == ("<|im_end|>",)
    assert end_of_turn_stops(None, "</s>") == ()
    assert end_of_turn_stops("<end_of_turn>", None) == ("<end_of_turn>",)


marker_text = st.text(alphabet="<>|/[]_-=abcdefxyz", min_size=1, max_size=20)


@given(terminator=marker_text, opener=marker_text)
def test_any_chatml_like_family_yields_its_terminator(terminator, opener):
    """Property: for any template "OPENER role \\n content TERMINATOR \\n", the probe returns TERMINATOR."""
    template = (
        "{% for m in messages %}{{ opener }}{{ m.role }}\n{{ m.content }}{{ terminator }}\n{% endfor %}"
        "{% if add_generation_prompt %}{{ opener }}assistant\n{% endif %}"
    )
    render = renderer(template, opener=opener, terminator=terminator)
    assert probe_end_of_turn(render) == terminator
