"""Rules of the effort policy: vocabulary learned by rendering, quantized without escalation, thinking."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moetray.policy.effort import (
    EFFORT_SCALE,
    GRADED_EFFORTS,
    KNOWN_EFFORTS,
    OPENAI_EFFORTS,
    QUANTIZE_MAX_DISTANCE,
    THINKING_OFF,
    THINKING_ON,
    Effort,
    EffortProfile,
    EffortRefused,
    ThinkingProfile,
    ThinkingState,
    broadcast_effort_spellings,
    effective_efforts,
    explicit_thinking,
    parse_effort,
    probe_effort,
    probe_thinking,
    quantize_effort,
    template_kwargs_for_request,
)

E = Effort


class TemplateError(Exception):
    """What a template's raise_exception turns into."""


def prompt(messages, **kw) -> str:
    return "|".join(m["content"] for m in messages) + (
        "<assistant>" if kw.get("add_generation_prompt") else ""
    )


# Fake renders in the style of FreeToken's probe tests: each is one template behaviour.


def ignoring(messages, **kw):
    return prompt(messages, **kw)


def always_errors(messages, **kw):
    raise TemplateError("broken template")


def interpolating(messages, **kw):
    """gpt-oss shape: prints any effort string, defaulting to medium."""
    return f"Reasoning: {kw.get('reasoning_effort', 'medium')}\n" + prompt(messages, **kw)


def validating_triple(messages, **kw):
    """Accepts low/medium/high only and raises on anything else; no effort prints nothing."""
    effort = kw.get("reasoning_effort")
    if effort is not None and effort not in ("low", "medium", "high"):
        raise TemplateError(f"reasoning_effort {effort} not supported")
    return (f"[effort={effort}]" if effort else "") + prompt(messages, **kw)


def strength_dialect(messages, **kw):
    """muse shape: reads reasoning_strength, not reasoning_effort, and prints any value."""
    return f"strength={kw.get('reasoning_strength', 'high')}|" + prompt(messages, **kw)


def graded_only_with_tools(messages, **kw):
    """Grades effort only when tools force thinking, defaulting to low."""
    effort = kw.get("reasoning_effort", "low")
    if kw.get("tools") and effort in ("low", "high", "max"):
        return f"tools,effort={effort}|" + prompt(messages, **kw)
    if kw.get("tools"):
        raise TemplateError("effort must be low, high or max")
    return prompt(messages, **kw)


def selective_max(messages, **kw):
    """DeepSeek-V4 shape: only 'max' changes the prompt, and only when thinking."""
    if kw.get("thinking") and kw.get("reasoning_effort") == "max":
        return "THINK HARDER|" + prompt(messages, **kw)
    return prompt(messages, **kw)


def needs_tools_free_round(messages, **kw):
    """Rejects the thinking round's shape entirely; effort interpolated in the others."""
    if kw.get("enable_thinking"):
        raise TemplateError("enable_thinking not supported")
    return f"effort={kw.get('reasoning_effort', 'medium')}|" + prompt(messages, **kw)


def low_and_medium_are_baseline(messages, **kw):
    effort = kw.get("reasoning_effort", "medium")
    return ("[short]" if effort in ("none", "minimal", "low", "medium") else f"[{effort}]") + prompt(
        messages, **kw
    )


def validating_with_quiet_gears(messages, **kw):
    """Hy3 shape: accepts none/low/high only; none and low render as the bare prompt."""
    effort = kw.get("reasoning_effort")
    if effort is not None and effort not in ("none", "low", "high"):
        raise TemplateError(f"reasoning_effort {effort} not supported")
    return ("[deep]" if effort == "high" else "") + prompt(messages, **kw)


def reacts_to_low_only(messages, **kw):
    """Solar shape: only "low" changes the prompt; every other value renders as the default."""
    return ("[brief]" if kw.get("reasoning_effort") == "low" else "") + prompt(messages, **kw)


def clamps_unknown_to_high(messages, **kw):
    """Prints low/medium/high, maps anything else to high, and defaults to medium."""
    effort = kw.get("reasoning_effort", "medium")
    return f"level={effort if effort in ('low', 'medium', 'high') else 'high'}|" + prompt(messages, **kw)


def thinking_three_way(messages, **kw):
    """Off by default; on and adaptive each change the prompt."""
    mode = kw.get("thinking_mode")
    if mode == "adaptive":
        return "<adaptive>" + prompt(messages, **kw)
    if kw.get("enable_thinking"):
        return "<think>" + prompt(messages, **kw)
    return "<no_think>" + prompt(messages, **kw)


def thinking_default_on(messages, **kw):
    """Qwen3 shape: thinks unless enable_thinking is false."""
    suffix = "<think></think>" if kw.get("enable_thinking") is False else ""
    return prompt(messages, **kw) + suffix


# --- parse and quantize -------------------------------------------------------------------


def test_parse_effort_is_lenient_about_case_and_strict_about_names():
    """A client's "High " must work; "turbo" must not be mistaken for a gear."""
    assert parse_effort(" High ") is E.HIGH
    assert parse_effort("turbo") is None
    assert parse_effort(3) is None
    assert parse_effort("") is None


def test_supported_effort_passes_through():
    """Rewriting a value the template accepts would change behaviour the client chose explicitly."""
    assert quantize_effort("medium", OPENAI_EFFORTS) is E.MEDIUM


@pytest.mark.parametrize(
    ("requested", "supported", "expected"),
    [
        ("high", {"xhigh", "medium", "low"}, E.XHIGH),  # 0.09 away: close enough
        ("medium", {"low", "high", "max"}, None),  # 0.2 away: refused, never escalated
        ("xhigh", {"low", "medium", "high", "max"}, E.HIGH),  # never rounded into max
        ("max", {"xhigh", "medium", "low"}, E.XHIGH),
        ("minimal", {"low", "xhigh"}, E.LOW),
        ("medium", {"low", "xhigh"}, None),
        ("high", {"low", "max"}, None),
        ("max", {"low", "max"}, E.MAX),  # max only by its own name
    ],
)
def test_quantize_snaps_to_a_near_gear_or_drops(requested, supported, expected):
    """FreeToken's table: a far gear would silently change the model's behaviour, escalating cost."""
    assert quantize_effort(requested, supported) is expected


def test_quantize_ties_go_to_the_higher_gear():
    """Determinism across processes needs a tie rule; the higher gear is the documented one."""
    assert quantize_effort("minimal", {E.NONE, E.LOW}) is E.LOW


@pytest.mark.parametrize("value", ["banana", 3, None, ""])
def test_quantize_unknown_values_send_nothing(value):
    """Guessing a gear for garbage would render a prompt the client never asked for."""
    assert quantize_effort(value, KNOWN_EFFORTS) is None


def test_quantize_against_an_empty_vocabulary_sends_nothing():
    """A template without effort must receive no reasoning_effort at all."""
    assert quantize_effort("high", ()) is None


@given(st.sampled_from(KNOWN_EFFORTS), st.sets(st.sampled_from(KNOWN_EFFORTS)))
def test_quantize_never_escalates_beyond_the_distance_nor_into_max(requested, supported):
    """Property: the result is supported, within the distance, and max only when asked for by name."""
    result = quantize_effort(requested, supported)
    if result is None:
        return
    assert result in supported
    assert abs(EFFORT_SCALE[result] - EFFORT_SCALE[requested]) <= QUANTIZE_MAX_DISTANCE
    if result is E.MAX:
        assert requested is E.MAX


# --- probe_effort ---------------------------------------------------------------------------


def test_ignoring_template_consumes_nothing():
    """Sending reasoning_effort to a template that ignores it is harmless but advertising it is a lie."""
    profile = probe_effort(ignoring)
    assert not profile.consumes
    assert profile.supported == ()
    assert profile.default is None


def test_always_erroring_template_is_inert():
    """A template that cannot render the probe tells nothing; it must not be read as "rejects all"."""
    assert probe_effort(always_errors) == EffortProfile.inert()


def test_interpolating_template_is_capped_to_the_openai_triple():
    """A template that prints any string accepts "banana" too; offering all seven gears would be noise."""
    profile = probe_effort(interpolating)
    assert profile.consumes and profile.interpolates and not profile.validates
    assert profile.default is E.MEDIUM
    assert profile.supported == (E.LOW, E.MEDIUM, E.HIGH)
    assert quantize_effort("minimal", profile.supported) is E.LOW


def test_validating_template_is_authoritative():
    """Sending a value the template rejects would turn every such request into a render error."""
    profile = probe_effort(validating_triple)
    assert profile.validates
    assert profile.supported == (E.LOW, E.MEDIUM, E.HIGH)
    assert profile.default is None  # no effort renders differently from every effort


def test_validating_template_keeps_gears_that_render_as_baseline():
    """Dropping an accepted gear because it looks like the default would refuse a value the template takes."""
    profile = probe_effort(validating_with_quiet_gears)
    assert profile.supported == (E.NONE, E.LOW, E.HIGH)
    assert profile.default is E.LOW


def test_template_clamping_any_value_is_treated_as_taking_anything():
    """A template mapping unknown values to a level accepts "banana"; all seven gears would be offered."""
    profile = probe_effort(clamps_unknown_to_high)
    assert profile.interpolates
    assert profile.supported == OPENAI_EFFORTS


def test_default_is_never_max():
    """Max is reachable only by its own name; calling it the default would advertise it as the usual gear."""
    profile = probe_effort(reacts_to_low_only)
    assert profile.default is E.XHIGH
    assert profile.supported == (E.LOW, E.XHIGH)


def test_strength_dialect_is_capped_to_the_graded_ladder():
    """The strength spelling grades four levels; max must land on xhigh, not be passed through."""
    profile = probe_effort(strength_dialect)
    assert profile.strength_dialect and profile.interpolates
    assert profile.supported == GRADED_EFFORTS
    assert quantize_effort("max", profile.supported) is E.XHIGH
    assert not probe_effort(interpolating).strength_dialect


def test_effort_learned_through_the_tools_round():
    """Templates grading effort only under tool-forced thinking would look effort-blind without that round."""
    profile = probe_effort(graded_only_with_tools)
    assert profile.validates
    assert set(profile.supported) == {E.LOW, E.HIGH, E.MAX}
    assert quantize_effort("medium", profile.supported) is None


def test_selective_template_offers_what_changes_the_prompt():
    """Capping a max-only template to the OpenAI triple would make "max" unreachable."""
    profile = probe_effort(selective_max)
    assert profile.consumes and not profile.interpolates and not profile.validates
    assert E.MAX in profile.supported
    assert quantize_effort("max", profile.supported) is E.MAX


def test_rounds_whose_baseline_fails_are_skipped():
    """Counting a round that rejects the probe's shape would mark every effort as rejected."""
    profile = probe_effort(needs_tools_free_round)
    assert not profile.validates
    assert profile.interpolates


def test_default_is_the_highest_gear_rendering_as_baseline():
    """The default tells the UI which gear a bare request gets; the lowest match would understate it."""
    assert probe_effort(low_and_medium_are_baseline).default is E.MEDIUM


def test_effective_efforts_of_a_non_consuming_profile_is_empty():
    """A profile that consumes nothing must never advertise gears, whatever else it says."""
    assert effective_efforts(EffortProfile(accepted=frozenset(KNOWN_EFFORTS), default=E.HIGH)) == ()


# --- thinking -------------------------------------------------------------------------------


def test_thinking_probe_finds_toggle_adaptive_and_default():
    """The UI offers off/adaptive/on only where the template changes the prompt for them."""
    assert probe_thinking(thinking_three_way) == ThinkingProfile(True, True, ThinkingState.OFF)


def test_thinking_default_on_when_bare_matches_on():
    """Qwen3 thinks unless told not to; calling its default off would mislabel every bare request."""
    assert probe_thinking(thinking_default_on) == ThinkingProfile(True, False, ThinkingState.ON)


def test_no_toggle_means_no_default():
    """A template with no switch has no thinking state to default; inventing one misleads the UI."""
    assert probe_thinking(ignoring) == ThinkingProfile()
    assert probe_thinking(always_errors) == ThinkingProfile()


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        (None, None),
        ({}, None),
        ({"enable_thinking": False}, ThinkingState.OFF),
        ({"enable_thinking": "false"}, ThinkingState.OFF),
        ({"thinking": 1}, ThinkingState.ON),
        ({"thinking_mode": "adaptive", "enable_thinking": False}, ThinkingState.ADAPTIVE),
        ({"thinking_mode": "disabled"}, ThinkingState.OFF),
        ({"enable_thinking": None}, None),
    ],
)
def test_explicit_thinking_reads_every_spelling(kwargs, expected):
    """Missing one spelling would override a client's explicit choice with our broadcast."""
    assert explicit_thinking(kwargs) == expected


def test_broadcast_copies_effort_and_lets_an_explicit_strength_win():
    """Templates read one spelling each; a client's explicit strength must not be overwritten."""
    original = {"reasoning_effort": "high"}
    assert broadcast_effort_spellings(original) == {"reasoning_effort": "high", "reasoning_strength": "high"}
    assert original == {"reasoning_effort": "high"}  # not mutated
    both = {"reasoning_effort": "high", "reasoning_strength": "low"}
    assert broadcast_effort_spellings(both) == both


# --- the request fold -----------------------------------------------------------------------

TOGGLE = ThinkingProfile(True, False, ThinkingState.ON)
TRIPLE = probe_effort(validating_triple)


def test_unknown_effort_is_refused_before_rendering():
    """An unknown value passed through would surface as a template error after the stream started."""
    with pytest.raises(EffortRefused) as refusal:
        template_kwargs_for_request("turbo", None, TRIPLE, TOGGLE)
    assert refusal.value.kind == "invalid_request_error"


def test_empty_effort_counts_as_absent():
    """Some clients send "" for unset; refusing it would break them."""
    decided = template_kwargs_for_request("", None, TRIPLE, TOGGLE)
    assert decided.kwargs == {}
    assert decided.thinking is ThinkingState.ON  # the probed default


@pytest.mark.parametrize("value", ["none", "OFF"])
def test_none_or_off_switches_thinking_off(value):
    """OpenAI clients say "none" to mean no reasoning; a toggleable template must get the off switch."""
    decided = template_kwargs_for_request(value, None, TRIPLE, TOGGLE)
    assert decided.kwargs == THINKING_OFF
    assert decided.thinking is ThinkingState.OFF
    assert decided.effort is None


def test_effort_switches_thinking_on_and_is_sent_in_both_spellings():
    """An effort on a template whose thinking is off would be ignored by the model."""
    decided = template_kwargs_for_request("high", None, TRIPLE, TOGGLE)
    assert decided.kwargs == {**THINKING_ON, "reasoning_effort": "high", "reasoning_strength": "high"}
    assert decided.effort is E.HIGH


def test_far_effort_is_dropped_not_escalated():
    """Sending a gear the template rejects would fail the render; escalating would cost the client."""
    low_high_max = probe_effort(graded_only_with_tools)
    decided = template_kwargs_for_request("medium", None, low_high_max, ThinkingProfile())
    assert "reasoning_effort" not in decided.kwargs
    assert decided.effort is None
    # "none" on a template without a thinking switch is not rounded up to "low" either.
    assert (
        "reasoning_effort" not in template_kwargs_for_request("none", None, TRIPLE, ThinkingProfile()).kwargs
    )


def test_near_effort_is_sent_as_the_supported_gear():
    """Sending the client's raw "xhigh" to a validating template would fail the render."""
    decided = template_kwargs_for_request("xhigh", None, TRIPLE, ThinkingProfile())
    assert decided.kwargs["reasoning_effort"] == "high"
    assert decided.effort is E.HIGH


def test_explicit_template_kwargs_win_wholesale():
    """A client that set enable_thinking=False must not be switched on by its own effort field."""
    client = {"enable_thinking": False, "reasoning_effort": "low"}
    decided = template_kwargs_for_request("high", client, TRIPLE, TOGGLE)
    assert decided.kwargs["enable_thinking"] is False
    assert decided.kwargs["reasoning_effort"] == "low"
    assert decided.thinking is ThinkingState.OFF
    assert client == {"enable_thinking": False, "reasoning_effort": "low"}  # not mutated
