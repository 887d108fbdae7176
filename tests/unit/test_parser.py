"""Rules of incremental reasoning and tool-call parsing.

The central invariant: a server-sent stream cannot retract, so for EVERY chunking the
concatenated stream must equal ``parse_complete`` of the whole text, and for well-formed
outputs that result must be exactly the text and calls the model wrote, with no markup
in the content. Outputs are written by small renderers in this file (one per wire
format, independent of the parser's tables) and cut at arbitrary points by hypothesis.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import pkgutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moetray.policy import parser as parser_module
from moetray.policy.parser import (
    HARMONY,
    REASONING_MARKERS,
    TOOL_CALL_MARKERS,
    TOOL_HOLD_MAX,
    CallArguments,
    CallEnd,
    CallStart,
    Delta,
    ParserRefused,
    ReasoningFormat,
    ReasoningParser,
    Text,
    ToolCall,
    ToolCallFormat,
    ToolCallParser,
    fold_events,
    infer_reasoning_format,
    infer_tool_call_format,
    prompt_opens_reasoning,
)

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

TOOLS = [
    {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {
        "zip": {"type": "string"}, "n": {"type": "integer"}, "exact": {"type": "boolean"}}}}},
    {"type": "function", "function": {"name": "note", "parameters": {"type": "object", "properties": {
        "body": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}},
]

# Text that never spells a whole marker but is full of their beginnings, so every
# partial-marker hold is exercised and must release the text unchanged.
PARTIAL_MARKERS = ["<tool_", "<thi", "</thi", "<|pyth", "[TOOL_", "<func", "<|chan", "<|sta", "<chan",
                   "<|channel>th", "<arg_", "<|", "[", "<"]
TEXT = st.lists(st.one_of(st.text(alphabet="abcdefghij XYZ.,!?>0123\n", max_size=6),
                          st.sampled_from(PARTIAL_MARKERS)), max_size=6).map("".join)
cuts_st = st.lists(st.integers(min_value=0, max_value=400), max_size=30)


def chunks(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(points, points[1:], strict=False)]


def stream_reasoning(make, text: str, cuts: list[int]) -> Delta:
    p, reasoning, content = make(), [], []
    for piece in chunks(text, cuts):
        d = p.push(piece)
        reasoning.append(d.reasoning)
        content.append(d.content)
    d = p.flush()
    return Delta("".join(reasoning) + d.reasoning, "".join(content) + d.content)


def stream_tools(make, text: str, cuts: list[int]) -> list:
    p, events = make(), []
    for piece in chunks(text, cuts):
        events += p.push(piece)
    return events + p.flush()


def assert_well_formed(events: list) -> None:
    """Empty events, unclosed calls, out-of-order indices and unstable fragments break clients."""
    open_calls: dict[int, str] = {}
    seen = []
    for ev in events:
        if isinstance(ev, Text):
            assert ev.text, "empty text event"
        elif isinstance(ev, CallStart):
            assert ev.index == len(seen) and ev.index not in open_calls
            seen.append(ev.index)
            open_calls[ev.index] = ""
        elif isinstance(ev, CallArguments):
            assert ev.fragment, "empty argument fragment"
            open_calls[ev.index] += ev.fragment
        elif isinstance(ev, CallEnd):
            assert open_calls.pop(ev.index) == ev.arguments  # fragments are prefix-stable
            assert isinstance(json.loads(ev.arguments), dict)
    assert not open_calls, "a started call was never closed"


# --- names and tables ---------------------------------------------------------------------


def test_wire_names_round_trip_and_aliases_parse():
    # `--reasoning-format` / request overrides must name exactly one format.
    for fmt in ReasoningFormat:
        assert ReasoningFormat.parse(fmt.value) is fmt
    for fmt in ToolCallFormat:
        assert ToolCallFormat.parse(fmt.value) is fmt
    assert ReasoningFormat.parse("GPT-OSS") is ReasoningFormat.GPT_OSS
    assert ToolCallFormat.parse("qwen3-coder") is ToolCallFormat.QWEN3_CODER


def test_an_unknown_format_name_is_refused_by_name():
    # Guessing a format for a typo would silently mangle every response.
    with pytest.raises(ParserRefused) as err:
        ToolCallFormat.parse("hermes2000")
    assert (err.value.kind, err.value.name) == ("unknown_format", "hermes2000")
    with pytest.raises(ParserRefused):
        ReasoningFormat.parse("")


def test_required_wire_formats_exist():
    assert {f.value for f in ReasoningFormat} >= {"qwen3", "gpt_oss", "deepseek_r1", "gemma4"}
    assert {f.value for f in ToolCallFormat} >= {"hermes", "llama3", "mistral", "qwen3_coder",
                                                 "gpt_oss", "glm45"}


def test_openers_come_from_the_table_and_gpt_oss_has_none():
    # The anchor module pins the KV prefix at the opener token; a wrong opener pins nothing.
    assert ToolCallFormat.HERMES.opener() == "<tool_call>"
    assert ToolCallFormat.LLAMA3.opener() == "<|python_tag|>"
    assert ToolCallFormat.MISTRAL.opener() == "[TOOL_CALLS]"
    assert ToolCallFormat.GPT_OSS.opener() is None
    assert all(f.opener() == TOOL_CALL_MARKERS[f].opener for f in ToolCallFormat)


def test_every_marker_string_is_written_once_in_the_parser():
    # Two copies of a marker drift apart: the dominant bug shape of wire-format code.
    markers = {HARMONY.start, HARMONY.channel, HARMONY.message, HARMONY.end, HARMONY.ret,
               HARMONY.call, HARMONY.constrain}
    for m in REASONING_MARKERS.values():
        markers |= {m.start, m.end} - {None}
    for m in TOOL_CALL_MARKERS.values():
        markers |= {v for k, v in vars(m).items() if isinstance(v, str) and k not in ("grammar", "trim")}
    markers -= {"\n", ">", ";"}  # one-character separators are not markers worth naming
    modules = [importlib.import_module(f"{parser_module.__name__}.{info.name}")
               for info in pkgutil.iter_modules(parser_module.__path__)]
    literals = [node.value for module in (parser_module, *modules)
                for node in ast.walk(ast.parse(inspect.getsource(module)))
                if isinstance(node, ast.Constant) and isinstance(node.value, str)]
    for marker in markers:
        assert literals.count(marker) == 1, marker


# --- choosing a format --------------------------------------------------------------------


@pytest.mark.parametrize(("identity", "reasoning", "tools"), [
    ("openai/gpt-oss-20b", "gpt_oss", "gpt_oss"),
    ("deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", "deepseek_r1", None),  # named after its student
    ("Qwen/Qwen3-30B-A3B", "qwen3", "hermes"),
    ("Qwen/Qwen3-Coder-30B-A3B-Instruct", "qwen3", "qwen3_coder"),  # coder before qwen
    ("Qwen/Qwen2.5-7B-Instruct", None, "hermes"),
    ("zai-org/GLM-4.5-Air", "qwen3", "glm45"),
    ("google/gemma-4-E2B-it", "gemma4", None),
    ("mistralai/Mixtral-8x7B-Instruct-v0.1", None, "mistral"),
    ("meta-llama/Llama-3.1-8B-Instruct", None, "llama3"),
    ("allenai/OLMoE-1B-7B-0924", None, None),
    ("qwen3_moe", "qwen3", "hermes"),
])
def test_inference_tries_specific_families_before_general_ones(identity, reasoning, tools):
    # "DeepSeek-R1-Distill-Qwen" caught by a generic qwen rule gets the wrong grammar.
    got_r = infer_reasoning_format(identity)
    got_t = infer_tool_call_format(identity)
    assert (got_r and got_r.value, got_t and got_t.value) == (reasoning, tools)


@pytest.mark.parametrize(("fmt", "prompt", "opens"), [
    ("qwen3", "<|im_start|>assistant\n<think>\n", True),
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", False),  # thinking disabled
    ("qwen3", "<|im_start|>assistant\n", False),
    ("qwen3", "<think>old</think><|im_start|>assistant\n<think>\n", True),
    ("deepseek_r1", "<｜Assistant｜>", True),  # always open
    ("gemma4", "<start_of_turn>model\n<|channel>thought\n", True),
    ("gpt_oss", "<|start|>assistant", False),
    ("gpt_oss", "<|start|>assistant<|channel|>analysis<|message|>", True),
    ("gpt_oss", "<|start|>assistant<|channel|>final<|message|>", False),
    ("gpt_oss", "<|channel|>analysis<|message|>x<|end|><|start|>assistant", False),
])
def test_the_rendered_prompt_decides_whether_reasoning_is_already_open(fmt, prompt, opens):
    # Missing a pre-opened <think> puts the whole chain of thought into the answer.
    assert prompt_opens_reasoning(ReasoningFormat(fmt), prompt) is opens


# --- reasoning ----------------------------------------------------------------------------


def test_a_marker_split_across_chunks_still_splits_cleanly():
    p = ReasoningParser(ReasoningFormat.QWEN3)
    parts = [p.push(x) for x in ["<thi", "nk>plan", " it</thi", "nk>\n\nAnswer"]] + [p.flush()]
    assert "".join(d.reasoning for d in parts) == "plan it"
    assert "".join(d.content for d in parts) == "Answer"
    assert parts[2] == Delta(" it", "")  # "</thi" is held until it resolves


def test_flush_releases_a_tail_that_looked_like_a_marker():
    # A truncated stream ending in "</th" must not lose those characters.
    p = ReasoningParser(ReasoningFormat.QWEN3, force_reasoning=True)
    assert p.push("so </th") == Delta("so", "")
    assert p.flush() == Delta(" </th", "")


def test_flush_never_drops_a_possible_start_marker_that_was_text():
    p = ReasoningParser(ReasoningFormat.QWEN3)
    assert p.push("<thi") == Delta("", "")
    assert p.flush() == Delta("", "<thi")


def test_a_forced_block_may_still_print_its_start_marker_once():
    # The template opened <think>; a model that echoes it must not show "<think>" as reasoning.
    p = ReasoningParser(ReasoningFormat.QWEN3, force_reasoning=True)
    assert p.parse_complete("<think>\nidea\n</think>\nok") == Delta("idea", "ok")
    assert p.parse_complete("idea</think>ok") == Delta("idea", "ok")


def test_without_markers_everything_is_content():
    got = ReasoningParser(ReasoningFormat.QWEN3).parse_complete("  plain answer ")
    assert got == Delta("", "  plain answer ")


def test_a_quoted_tool_opener_inside_a_closed_block_stays_reasoning():
    # The model discussing "<tool_call>" while thinking is not calling a tool.
    p = ReasoningParser(ReasoningFormat.QWEN3, tool_format=ToolCallFormat.HERMES)
    text = "<think>I could emit <tool_call> here but</think>No call."
    assert p.parse_complete(text) == Delta("I could emit <tool_call> here but", "No call.")


def test_a_tool_call_inside_unclosed_reasoning_goes_to_content_after_the_hold():
    # A model that skips </think> and calls a tool would otherwise hide the call in reasoning.
    p = ReasoningParser(ReasoningFormat.QWEN3, force_reasoning=True, tool_format=ToolCallFormat.HERMES)
    call = '<tool_call>{"name": "ping", "arguments": {}}</tool_call>'
    filler = "x" * TOOL_HOLD_MAX
    assert p.parse_complete("need data " + call + filler) == Delta("need data", call + filler)
    # ... and while the hold lasts, nothing after the opener is shown as reasoning.
    q = ReasoningParser(ReasoningFormat.QWEN3, force_reasoning=True, tool_format=ToolCallFormat.HERMES)
    assert q.push("need data " + call) == Delta("need data", "")
    assert q.flush() == Delta("", call)


def test_an_end_marker_inside_the_hold_window_reclaims_the_block_as_reasoning():
    p = ReasoningParser(ReasoningFormat.QWEN3, force_reasoning=True, tool_format=ToolCallFormat.HERMES)
    assert p.parse_complete("a <tool_call> b</think>c") == Delta("a <tool_call> b", "c")


def test_gemma4_thought_channel():
    p = ReasoningParser(ReasoningFormat.GEMMA4)
    assert p.parse_complete("<|channel>thought\nplan<channel|>Answer") == Delta("plan", "Answer")


def test_deepseek_r1_starts_inside_reasoning_without_an_opener():
    got = ReasoningParser(ReasoningFormat.DEEPSEEK_R1).parse_complete("hmm\n</think>\n\nok")
    assert got == Delta("hmm", "ok")


HARMONY_TEXT = ("<|channel|>analysis<|message|>think a<|end|>"
                "<|start|>assistant<|channel|>final<|message|>Answer.<|return|>")


def test_harmony_markers_split_across_six_chunks():
    p = ReasoningParser(ReasoningFormat.GPT_OSS)
    step = -(-len(HARMONY_TEXT) // 6)
    parts = [p.push(HARMONY_TEXT[i:i + step]) for i in range(0, len(HARMONY_TEXT), step)] + [p.flush()]
    assert Delta("".join(d.reasoning for d in parts), "".join(d.content for d in parts)) == \
        Delta("think a", "Answer.")


def test_harmony_tool_message_reaches_content_verbatim_for_the_tool_parser():
    text = ("<|channel|>analysis<|message|>need weather<|end|>"
            '<|start|>assistant<|channel|>commentary to=functions.lookup <|constrain|>json<|message|>'
            '{"zip": "018956"}')  # <|call|> is an EOS token the detokenizer may hide
    d = ReasoningParser(ReasoningFormat.GPT_OSS).parse_complete(text)
    assert d.reasoning == "need weather"
    assert d.content.endswith(HARMONY.call)
    assert ToolCallParser(ToolCallFormat.GPT_OSS, TOOLS).parse_complete(d.content) == \
        ("", [ToolCall(0, "lookup", '{"zip": "018956"}')])


def test_harmony_without_channels_passes_through():
    assert ReasoningParser(ReasoningFormat.GPT_OSS).parse_complete("just text") == Delta("", "just text")


def test_harmony_forced_reasoning_starts_in_the_analysis_body():
    p = ReasoningParser(ReasoningFormat.GPT_OSS, force_reasoning=True)
    got = p.parse_complete("deep<|end|><|start|>assistant<|channel|>final<|message|>ok")
    assert got == Delta("deep", "ok")


def test_push_after_flush_is_refused():
    p = ReasoningParser(ReasoningFormat.QWEN3)
    p.flush()
    with pytest.raises(ParserRefused) as err:
        p.push("x")
    assert err.value.kind == "stream_finished"


def test_parse_complete_leaves_a_streaming_parser_untouched():
    p = ReasoningParser(ReasoningFormat.QWEN3)
    assert p.push("<think>a") == Delta("a", "")
    p.parse_complete("zzz")
    assert p.push("b</think>c") == Delta("b", "c")


@st.composite
def think_outputs(draw, fmt: ReasoningFormat):
    m = REASONING_MARKERS[fmt]
    forced = draw(st.booleans()) or m.always_open
    reasoning, content = draw(TEXT), draw(TEXT)
    closed = draw(st.booleans())
    quoted = draw(st.sampled_from(["", "<tool_call>", "<tool_"]))
    reasoning = reasoning[: len(reasoning) // 2] + quoted + reasoning[len(reasoning) // 2:]
    ws = draw(st.sampled_from(["", "\n", "\n\n", " "]))
    head = "" if forced else ws + m.start
    if not closed:  # truncated: all reasoning, unless a real opener ends it (the model went to a call)
        cut = reasoning.find("<tool_call>")
        if cut == -1:
            return forced, head + ws + reasoning, Delta(reasoning.lstrip(), "")
        return forced, head + ws + reasoning, Delta(reasoning[:cut].strip(), reasoning[cut:])
    text = head + ws + reasoning + ws + m.end + ws + content
    return forced, text, Delta(reasoning.strip(), content.lstrip())


@pytest.mark.parametrize("fmt", [ReasoningFormat.QWEN3, ReasoningFormat.DEEPSEEK_R1, ReasoningFormat.GEMMA4])
@SETTINGS
@given(data=st.data(), cuts=cuts_st)
def test_think_formats_stream_exactly_what_parse_complete_returns(fmt, data, cuts):
    forced, text, expected = data.draw(think_outputs(fmt))
    make = lambda: ReasoningParser(fmt, forced, tool_format=ToolCallFormat.HERMES)  # noqa: E731
    whole = make().parse_complete(text)
    assert stream_reasoning(make, text, cuts) == whole
    assert whole == expected
    markers = REASONING_MARKERS[fmt]
    assert markers.start not in whole.content and markers.end not in whole.content


@st.composite
def harmony_outputs(draw):
    parts, reasoning, content = [], [], []
    for i in range(draw(st.integers(min_value=1, max_value=4))):
        kind = draw(st.sampled_from(["analysis", "final", "commentary", "tool"]))
        body = draw(TEXT)
        start = "<|channel|>" if i == 0 else "<|start|>assistant<|channel|>"
        if kind == "tool":
            header = f"{start}commentary to=functions.ping <|constrain|>json<|message|>"
            parts.append(header + "{}" + "<|call|>")
            content.append(header + "{}" + "<|call|>")
            continue
        parts.append(f"{start}{kind}<|message|>{body}" + draw(st.sampled_from(["<|end|>", "<|return|>"])))
        if kind == "analysis":
            reasoning.append(body.strip())
        else:
            content.append(body.lstrip())
    return "".join(parts), Delta("".join(reasoning), "".join(content))


@SETTINGS
@given(out=harmony_outputs(), cuts=cuts_st)
def test_harmony_streams_exactly_what_parse_complete_returns(out, cuts):
    text, expected = out
    make = lambda: ReasoningParser(ReasoningFormat.GPT_OSS)  # noqa: E731
    whole = make().parse_complete(text)
    assert stream_reasoning(make, text, cuts) == whole == expected


@SETTINGS
@given(before=TEXT, quoted=st.integers(min_value=0, max_value=TOOL_HOLD_MAX + 40), cuts=cuts_st)
def test_the_tool_hold_decision_does_not_depend_on_chunking(before, quoted, cuts):
    # The 512-character window must be measured in text, not in how many pushes it took.
    text = before + "<tool_call>" + "y" * quoted + "</think>after"
    make = lambda: ReasoningParser(ReasoningFormat.QWEN3, True, tool_format=ToolCallFormat.HERMES)  # noqa: E731
    whole = make().parse_complete(text)
    assert stream_reasoning(make, text, cuts) == whole
    if quoted + len("<tool_call>") < TOOL_HOLD_MAX:
        assert whole.content == "after"
    else:
        assert whole.content.startswith("<tool_call>")


# --- tool calls: rules --------------------------------------------------------------------


def test_a_declared_string_keeps_its_leading_zeros():
    # Typing "018956" as a number would change a postal code into 18956.
    p = ToolCallParser(ToolCallFormat.QWEN3_CODER, TOOLS)
    text = "<tool_call>\n<function=lookup>\n<parameter=zip>\n018956\n</parameter>\n" \
           "<parameter=n>\n7\n</parameter>\n<parameter=exact>\ntrue\n</parameter>\n</function>\n</tool_call>"
    assert p.parse_complete(text)[1] == [ToolCall(0, "lookup", '{"zip": "018956", "n": 7, "exact": true}')]


def test_a_declared_string_that_looks_like_a_number_stays_a_string():
    # Guessing without the schema turns a note saying "42" into the integer 42.
    p = ToolCallParser(ToolCallFormat.GLM45, TOOLS)
    text = "<tool_call>note\n<arg_key>body</arg_key><arg_value>42</arg_value></tool_call>"
    assert p.parse_complete(text)[1] == [ToolCall(0, "note", '{"body": "42"}')]


def test_an_undeclared_parameter_gets_a_loose_guess():
    p = ToolCallParser(ToolCallFormat.GLM45, TOOLS)
    text = ("<tool_call>other\n<arg_key>a</arg_key><arg_value>3</arg_value>"
            "<arg_key>b</arg_key><arg_value>018956</arg_value>"
            "<arg_key>c</arg_key><arg_value>x y</arg_value></tool_call>")
    assert p.parse_complete(text)[1] == [ToolCall(0, "other", '{"a": 3, "b": "018956", "c": "x y"}')]


def test_a_value_that_does_not_fit_its_declared_type_stays_text():
    p = ToolCallParser(ToolCallFormat.GLM45, TOOLS)
    text = "<tool_call>lookup\n<arg_key>n</arg_key><arg_value>seven</arg_value></tool_call>"
    assert p.parse_complete(text)[1] == [ToolCall(0, "lookup", '{"n": "seven"}')]


def test_a_call_without_arguments_has_an_empty_object():
    p = ToolCallParser(ToolCallFormat.QWEN3_CODER, TOOLS)
    events = p.push("<tool_call>\n<function=ping>\n</function>\n</tool_call>") + p.flush()
    assert [e for e in events if not isinstance(e, Text)] == [
        CallStart(0, "ping"), CallArguments(0, "{}"), CallEnd(0, "{}")]


def test_parameters_stream_as_prefix_stable_fragments():
    # Clients append fragments; a fragment that rewrote an earlier one would corrupt the JSON.
    p = ToolCallParser(ToolCallFormat.QWEN3_CODER, TOOLS)
    first = p.push("<tool_call>\n<function=note>\n<parameter=body>\nhello\n</parameter>\n")
    assert first == [CallStart(0, "note"), CallArguments(0, '{"body": "hello"')]
    assert p.push("</function>\n</tool_call>") == [CallArguments(0, "}"), CallEnd(0, '{"body": "hello"}')]


def test_a_repeated_parameter_keeps_its_first_value():
    # A second "zip" fragment would make the streamed JSON disagree with the final arguments.
    p = ToolCallParser(ToolCallFormat.QWEN3_CODER, TOOLS)
    events = p.push("<tool_call>\n<function=lookup>\n<parameter=zip>\n1\n</parameter>\n"
                    "<parameter=zip>\n2\n</parameter>\n</function>\n</tool_call>") + p.flush()
    assert_well_formed(events)
    assert fold_events(events)[1] == [ToolCall(0, "lookup", '{"zip": "1"}')]


def test_an_invalid_json_block_is_text_not_a_call():
    # Inventing a call from broken JSON would run a tool the model never asked for.
    p = ToolCallParser(ToolCallFormat.HERMES, TOOLS)
    text = "x <tool_call>{not json}</tool_call> y"
    assert p.parse_complete(text) == (text, [])


def test_a_truncated_json_call_is_recovered_at_flush():
    p = ToolCallParser(ToolCallFormat.HERMES, TOOLS)
    got = p.parse_complete('<tool_call>\n{"name": "ping", "arguments": {}}')
    assert got == ("", [ToolCall(0, "ping", "{}")])


def test_a_truncated_parameter_call_is_closed_with_what_arrived():
    p = ToolCallParser(ToolCallFormat.QWEN3_CODER, TOOLS)
    got = p.parse_complete("<tool_call>\n<function=lookup>\n<parameter=zip>\n0189")
    assert got == ("", [ToolCall(0, "lookup", '{"zip": "0189"}')])


def test_unknown_tools_are_forwarded():
    p = ToolCallParser(ToolCallFormat.HERMES, TOOLS)
    got = p.parse_complete('<tool_call>{"name": "shell", "arguments": {"cmd": "ls"}}</tool_call>')
    assert got == ("", [ToolCall(0, "shell", '{"cmd": "ls"}')])


def test_two_calls_get_indices_in_order_and_trailing_text_keeps_its_place():
    p = ToolCallParser(ToolCallFormat.MISTRAL, TOOLS)
    events = p.push('A[TOOL_CALLS]ping[ARGS]{}[TOOL_CALLS]note[ARGS]{"body": "b"} tail') + p.flush()
    assert_well_formed(events)
    kinds = [type(e).__name__ for e in events]
    assert kinds == ["Text"] + ["CallStart", "CallArguments", "CallEnd"] * 2 + ["Text"]
    assert fold_events(events) == ("Atail", [ToolCall(0, "ping", "{}"), ToolCall(1, "note", '{"body": "b"}')])


def test_llama3_text_before_the_tag_in_one_chunk():
    p = ToolCallParser(ToolCallFormat.LLAMA3, TOOLS)
    events = p.push('Sure. <|python_tag|>{"name": "ping", "parameters": {}}') + p.flush()
    assert events[0] == Text("Sure. ")
    assert fold_events(events)[1] == [ToolCall(0, "ping", "{}")]


def test_llama3_bare_json_answer_that_is_not_a_call_stays_text():
    # Llama 3 may answer with a bare call object; an ordinary JSON answer must survive intact.
    p = ToolCallParser(ToolCallFormat.LLAMA3, TOOLS)
    assert p.parse_complete('{"a": [1, 2]} and more') == ('{"a": [1, 2]} and more', [])
    assert p.parse_complete('  {"name": "ping", "parameters": {}}') == ("", [ToolCall(0, "ping", "{}")])


def test_harmony_messages_that_are_not_calls_are_text():
    p = ToolCallParser(ToolCallFormat.GPT_OSS, TOOLS)
    assert p.parse_complete("<|channel|>final<|message|>Hi<|return|>") == ("Hi", [])


def test_pure_text_streams_unchanged():
    for fmt in ToolCallFormat:
        text = "Plain answer, no calls. <b> [x] {y}"
        if fmt is ToolCallFormat.LLAMA3:
            text = "Plain " + text
        assert ToolCallParser(fmt).parse_complete(text) == (text, []), fmt


def test_push_after_tool_flush_is_refused():
    p = ToolCallParser(ToolCallFormat.HERMES)
    p.flush()
    with pytest.raises(ParserRefused):
        p.flush()


# --- tool calls: the streaming invariant per format ----------------------------------------

names_st = st.sampled_from(["lookup", "note", "ping"])
strings_st = st.text(alphabet="abc xyz0123456789-.", max_size=10)


@st.composite
def calls_st(draw):
    calls = []
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        name = draw(names_st)
        if name == "lookup":
            args = {"zip": draw(strings_st), "n": draw(st.integers(-50, 10**6)), "exact": draw(st.booleans())}
            for key in draw(st.sets(st.sampled_from(list(args)))):
                del args[key]
        elif name == "note":
            args = {"body": draw(strings_st)}
        else:
            args = {}
        calls.append((name, args))
    return calls


def xml_value(v) -> str:
    return json.dumps(v) if isinstance(v, bool) else str(v)


def render(fmt: ToolCallFormat, calls, variant: bool) -> str:
    """The calls as each family's model writes them (an independent writer, not the parser's tables)."""
    if fmt is ToolCallFormat.HERMES:
        return "\n".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>"
                         for n, a in calls)
    if fmt is ToolCallFormat.LLAMA3:
        return "<|python_tag|>" + "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)
    if fmt is ToolCallFormat.MISTRAL:
        if variant:
            return "[TOOL_CALLS] " + json.dumps([{"name": n, "arguments": a} for n, a in calls])
        return "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}" for n, a in calls)
    if fmt is ToolCallFormat.QWEN3_CODER:
        return "\n".join(
            f"<tool_call>\n<function={n}>\n"
            + "".join(f"<parameter={k}>\n{xml_value(v)}\n</parameter>\n" for k, v in a.items())
            + "</function>\n</tool_call>" for n, a in calls)
    if fmt is ToolCallFormat.GLM45:
        return "".join(
            f"<tool_call>{n}\n"
            + "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{xml_value(v)}</arg_value>\n"
                      for k, v in a.items())
            + "</tool_call>\n" for n, a in calls)
    assert fmt is ToolCallFormat.GPT_OSS
    return "".join(f"<|start|>assistant<|channel|>commentary to=functions.{n} <|constrain|>json<|message|>"
                   f"{json.dumps(a)}<|call|>" for n, a in calls)


@pytest.mark.parametrize("fmt", list(ToolCallFormat))
@SETTINGS
@given(before=TEXT, after=TEXT, calls=calls_st(), variant=st.booleans(), cuts=cuts_st)
def test_every_format_streams_exactly_what_parse_complete_returns(fmt, before, after, calls, variant, cuts):
    # SSE cannot retract: any chunking must give the same text and calls as the whole answer.
    if fmt is ToolCallFormat.LLAMA3 and variant:
        before = ""  # the bare-JSON variant: the answer opens with the call object itself
    text = before + (render(fmt, calls, variant)[len("<|python_tag|>"):]
                     if fmt is ToolCallFormat.LLAMA3 and variant else render(fmt, calls, variant)) + after
    make = lambda: ToolCallParser(fmt, TOOLS)  # noqa: E731
    events = stream_tools(make, text, cuts)
    assert_well_formed(events)
    whole = make().parse_complete(text)
    assert fold_events(events) == whole
    expected_calls = [ToolCall(i, n, json.dumps(a)) for i, (n, a) in enumerate(calls)]
    assert whole == (before + after.lstrip(), expected_calls)
