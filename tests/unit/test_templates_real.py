"""The effort and turn probes against real checkpoints' chat templates (tests/data/templates, see SOURCES.md).

A probe validated only against templates its own tests wrote is validated against
nothing. The expected values below were read off the rendered prompts of these
templates and are checked in: a change to a probe that moves any of them must be
deliberate.
"""

from __future__ import annotations

import pytest
from chat_templates import TEMPLATES_DIR, real, renderer

from moetray.policy.effort import (
    Effort,
    ThinkingProfile,
    ThinkingState,
    probe_effort,
    probe_thinking,
    quantize_effort,
    template_kwargs_for_request,
)
from moetray.policy.turn import end_of_turn_stops, probe_end_of_turn

E = Effort
ON, OFF = ThinkingState.ON, ThinkingState.OFF
DEEPSEEK = {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"}

# name: (special tokens, end of turn, effort vocabulary, effort default, thinking profile)
EXPECTED = {
    "HuggingFaceTB-SmolLM2-135M-Instruct": (
        {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"},
        "<|im_end|>",
        (),
        None,
        ThinkingProfile(),
    ),
    "meta-llama-Llama-3.1-8B-Instruct": (
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
        "<|eot_id|>",
        (),
        None,
        ThinkingProfile(),
    ),
    "google-gemma-2-2b-it": (
        {"bos_token": "<bos>", "eos_token": "<eos>"},
        "<end_of_turn>",
        (),
        None,
        ThinkingProfile(),
    ),
    "google-gemma-4-31B-it": (
        {"bos_token": "<bos>", "eos_token": "<eos>"},
        "<turn|>",
        (),
        None,
        ThinkingProfile(True, False, OFF),
    ),
    "mistralai-Mistral-Nemo-Instruct-2407": (
        {"bos_token": "<s>", "eos_token": "</s>"},
        "</s>",
        (),
        None,
        ThinkingProfile(),
    ),
    "microsoft-Phi-3.5-mini-instruct": (
        {"bos_token": "<s>", "eos_token": "<|endoftext|>"},
        "<|end|>",
        (),
        None,
        ThinkingProfile(),
    ),
    "Qwen-Qwen3-0.6B": ({}, "<|im_end|>", (), None, ThinkingProfile(True, False, ON)),
    "HuggingFaceTB-SmolLM3-3B": ({}, "<|im_end|>", (), None, ThinkingProfile(True, False, ON)),
    "ibm-granite-granite-3.3-2B-Instruct": (
        {"bos_token": "<|end_of_text|>", "eos_token": "<|end_of_text|>"},
        "<|end_of_text|>",
        (),
        None,
        ThinkingProfile(True, False, OFF),
    ),
    "deepseek-ai-DeepSeek-V3.1": (
        DEEPSEEK,
        "<｜end▁of▁sentence｜>",
        (),
        None,
        ThinkingProfile(True, False, OFF),
    ),
    # Only "max" changes the prompt (and only when thinking): a selective template.
    "deepseek-ai-DeepSeek-V4": (
        DEEPSEEK,
        "<｜end▁of▁sentence｜>",
        (E.XHIGH, E.MAX),
        E.XHIGH,
        ThinkingProfile(True, False, OFF),
    ),
    # Prints any effort string ("Reasoning: banana"), default medium: capped to the OpenAI triple.
    # History turns end with <|end|>, which also closes reasoning; the generated turn ends with <|return|>.
    "openai-gpt-oss-120b": (
        {"bos_token": "<|startoftext|>", "eos_token": "<|return|>"},
        "<|return|>",
        (E.LOW, E.MEDIUM, E.HIGH),
        E.MEDIUM,
        ThinkingProfile(),
    ),
    # Raises on anything but high/low/no_think: a validating template.
    "tencent-Hy3": (
        {"bos_token": "<｜hy_begin_of_sentence:opensource｜>", "eos_token": "<｜hy_eos:opensource｜>"},
        "<｜hy_eos:opensource｜>",
        (E.LOW, E.HIGH),
        None,
        ThinkingProfile(),
    ),
    # Reacts to low/minimal only; the rest render as its default ("high" in its source, "xhigh" to the probe).
    "upstage-Solar-Open-100B": ({}, "<|end|>", (E.MINIMAL, E.LOW, E.XHIGH), E.XHIGH, ThinkingProfile()),
    # Reads reasoning_strength (default high) and prints any value: capped to the graded ladder.
    "muse-glimmer": ({}, "<|eot|>", (E.LOW, E.MEDIUM, E.HIGH, E.XHIGH), E.HIGH, ThinkingProfile()),
}


def test_every_checked_in_template_has_expectations():
    """A template added without expected values would be tested against nothing."""
    assert sorted(p.stem for p in TEMPLATES_DIR.glob("*.jinja")) == sorted(EXPECTED)
    assert len(EXPECTED) >= 3


def render_of(name: str):
    special = EXPECTED[name][0]
    return renderer(real(name), **special)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_end_of_turn_on_real_templates(name):
    """Issue 3: each real template yields its real terminator, so a non-EOS marker reaches the stop set."""
    special, expected = EXPECTED[name][0], EXPECTED[name][1]
    assert (
        probe_end_of_turn(render_of(name), bos=special.get("bos_token"), eos=special.get("eos_token"))
        == expected
    )


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_effort_vocabulary_on_real_templates(name):
    """Issue 3: the vocabulary is learned by rendering; a wrong one sends values a template rejects."""
    profile = probe_effort(render_of(name))
    assert profile.supported == EXPECTED[name][2]
    assert profile.default == EXPECTED[name][3]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_thinking_toggle_on_real_templates(name):
    """The thinking switch and its default are learned by rendering, never from the family name."""
    assert probe_thinking(render_of(name)) == EXPECTED[name][4]


def test_markers_equal_to_eos_add_no_stop_string():
    """Granite ends turns with its EOS: decoding stops there already; Gemma-2's marker is not its EOS."""
    granite = EXPECTED["ibm-granite-granite-3.3-2B-Instruct"]
    assert end_of_turn_stops(granite[1], granite[0]["eos_token"]) == ()
    gemma = EXPECTED["google-gemma-2-2b-it"]
    assert end_of_turn_stops(gemma[1], gemma[0]["eos_token"]) == ("<end_of_turn>",)


def test_raw_effort_breaks_a_validating_template_and_the_fold_does_not():
    """Hy3 raises on "medium"; passing a client's effort through unquantized turns the request into a 500."""
    render = render_of("tencent-Hy3")
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(Exception, match="reasoning_effort"):
        render(messages, add_generation_prompt=True, reasoning_effort="medium")
    profile, thinking = probe_effort(render), probe_thinking(render)
    decided = template_kwargs_for_request("medium", None, profile, thinking)
    assert decided.effort is None
    render(messages, add_generation_prompt=True, **decided.kwargs)  # renders: the template default applies
    high = template_kwargs_for_request("xhigh", None, profile, thinking)
    assert "reasoning_effort:high" in render(messages, add_generation_prompt=True, **high.kwargs)


def test_gpt_oss_prompt_carries_the_quantized_effort():
    """gpt-oss prints any string; an unquantized "xhigh" would put an untrained level in the prompt."""
    render = render_of("openai-gpt-oss-120b")
    profile = probe_effort(render)
    decided = template_kwargs_for_request("xhigh", None, profile, probe_thinking(render))
    text = render([{"role": "user", "content": "hi"}], add_generation_prompt=True, **decided.kwargs)
    assert "Reasoning: high" in text


def test_qwen3_none_switches_thinking_off_in_the_prompt():
    """OpenAI's "none" must reach Qwen3 as enable_thinking=False: an empty think block in the prompt."""
    render = render_of("Qwen-Qwen3-0.6B")
    decided = template_kwargs_for_request("none", None, probe_effort(render), probe_thinking(render))
    assert decided.thinking is OFF
    text = render([{"role": "user", "content": "hi"}], add_generation_prompt=True, **decided.kwargs)
    assert text.endswith("<think>\n\n</think>\n\n")


def test_deepseek_v4_max_reaches_the_prompt_only_by_name():
    """A max-only template: "max" must pass, and "high" must never be rounded up into it."""
    render = render_of("deepseek-ai-DeepSeek-V4")
    profile = probe_effort(render)
    assert quantize_effort("max", profile.supported) is E.MAX
    assert quantize_effort("high", profile.supported) is E.XHIGH
    decided = template_kwargs_for_request("max", None, profile, probe_thinking(render))
    text = render([{"role": "user", "content": "hi"}], add_generation_prompt=True, **decided.kwargs)
    assert "Reasoning Effort: Absolute maximum" in text
