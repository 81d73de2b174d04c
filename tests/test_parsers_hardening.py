"""Tool-call and reasoning parsers on the malformed output real models write (issue 20), each
case checked on the whole text, at every split point, and one character at a time.

The cases follow the formats' public descriptions (the models' chat templates and tool-call
guides) and the rules in docs/parsers.md: arguments are a JSON object or there is no call;
names resolve against the offered tools; text outside call markers is content; XML values
convert by the tool's schema; a tool-call marker ends an open reasoning block.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

import pytest

from kvloom.cluster.parsers import (
    ChatOutputParser,
    ParsedMessage,
    collect,
    make_reasoning_parser,
    make_tool_call_parser,
    parsers_for_model,
    tool_call_parser_class,
)
from kvloom.cluster.parsers.json_object_stream import JsonObjectStreamer
from kvloom.cluster.parsers.tool_calls.tool_names import resolve_tool_name


def tool(name: str, **properties: dict) -> dict:
    return {
        "type": "function",
        "function": {"name": name, "parameters": {"type": "object", "properties": properties}},
    }


WEATHER = [tool("get_weather", city={"type": "string"}, days={"type": "integer"})]


@dataclass
class Case:
    id: str
    parser: str
    text: str
    content: str
    calls: list[tuple[str, Any]]  # (name, arguments as a dict)
    tools: list[dict] | None = None
    reasoning: str | None = None  # a reasoning parser name: parse through ChatOutputParser
    opened: bool = False  # the prompt opened the reasoning block
    expected_reasoning: str = ""
    ids: list[str] | None = None


def run(case: Case, pieces: list[str]) -> ParsedMessage:
    tools = make_tool_call_parser(case.parser, tools=case.tools, call_id_factory=lambda i: f"id{i}")
    if case.reasoning is None:
        parser: Any = tools
    else:
        reasoning = make_reasoning_parser(case.reasoning, start_in_reasoning=case.opened)
        parser = ChatOutputParser(reasoning, tools)
    deltas = []
    for piece in pieces:
        deltas += parser.feed(piece)
    deltas += parser.finish()
    return collect(deltas)


def check(case: Case, message: ParsedMessage) -> None:
    assert message.content == case.content
    assert message.reasoning == case.expected_reasoning
    assert [c.name for c in message.tool_calls] == [name for name, _ in case.calls]
    for call, (_, arguments) in zip(message.tool_calls, case.calls):
        assert isinstance(json.loads(call.arguments), dict), call.arguments
        assert json.loads(call.arguments) == arguments
    if case.ids is not None:
        assert [c.id for c in message.tool_calls] == case.ids


def check_every_split(case: Case) -> None:
    reference = run(case, [case.text])
    check(case, reference)
    text = case.text
    for i in range(len(text) + 1):
        assert run(case, [text[:i], text[i:]]) == reference, (text[:i], text[i:])
    assert run(case, list(text)) == reference


def as_content(id: str, parser: str, text: str, tools: list[dict] | None = WEATHER) -> Case:
    """Output that is no call: all of it is content."""
    return Case(id, parser, text, text, [], tools=tools)


# ----- arguments are always a JSON object, or there is no call

ARGUMENT_CASES = [
    as_content("hermes_string", "hermes", '<tool_call>{"name": "get_weather", "arguments": "hello"}</tool_call>'),
    as_content("hermes_number", "hermes", '<tool_call>{"name": "get_weather", "arguments": 42}</tool_call>'),
    as_content("hermes_list", "hermes", '<tool_call>{"name": "get_weather", "arguments": [1, 2]}</tool_call>'),
    as_content("hermes_string_list", "hermes", '<tool_call>{"name": "get_weather", "arguments": "[1]"}</tool_call>'),
    as_content("hermes_true", "hermes", '<tool_call>{"name": "get_weather", "arguments": true}</tool_call>'),
    Case("hermes_null", "hermes", '<tool_call>{"name": "get_weather", "arguments": null}</tool_call>',
         "", [("get_weather", {})], tools=WEATHER),
    Case("hermes_string_object", "hermes",
         '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>',
         "", [("get_weather", {"city": "Paris"})], tools=WEATHER),
    # The call object's own closing brace is missing (a common slip): the arguments are whole.
    Case("hermes_outer_unclosed", "hermes",
         '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}</tool_call>\nDone.',
         "\nDone.", [("get_weather", {"city": "Paris"})], tools=WEATHER),
    # Arguments that break off mid-object are closed at the last complete value.
    Case("hermes_syntax_error", "hermes",
         '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris" "days": 3}}</tool_call>ok',
         "ok", [("get_weather", {"city": "Paris"})], tools=WEATHER),
    Case("hermes_cut", "hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Par',
         "", [("get_weather", {"city": "Par"})], tools=WEATHER),
    as_content("llama3_string", "llama3_json", '{"name": "get_weather", "parameters": "hello"}'),
    as_content("llama3_list", "llama3_json", '{"name": "get_weather", "parameters": [1]}'),
    # No marker, so an unclosed object is never a call.
    as_content("llama3_unclosed", "llama3_json", '{"name": "get_weather", "parameters": {"city": "Pa"}'),
    as_content("mistral_string", "mistral", '[TOOL_CALLS]get_weather[ARGS]"hello"'),
    as_content("mistral_array_number", "mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": 5}]'),
    as_content("kimi_list", "kimi_k2",
               "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
               "<|tool_call_argument_begin|>[1, 2]<|tool_call_end|><|tool_calls_section_end|>"),
    as_content("deepseek_v31_string", "deepseek_v3",
               '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"hi"'
               "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
    as_content("minimax_number", "minimax", '<tool_calls>\n{"name": "get_weather", "arguments": 5}\n</tool_calls>'),
    # Kimi: the model closed the call inside the JSON; the object is closed for it.
    Case("kimi_unclosed", "kimi_k2",
         '<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
         '{"city": "Paris", "days": [1<|tool_call_end|><|tool_calls_section_end|>',
         "", [("get_weather", {"city": "Paris", "days": [1]})], tools=WEATHER),
]  # fmt: skip

# ----- names resolve against the offered tools, or there is no call

NAME_CASES = [
    as_content("kimi_bare_index", "kimi_k2",
               "<|tool_calls_section_begin|><|tool_call_begin|>0<|tool_call_argument_begin|>"
               '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>'),
    as_content("kimi_invalid", "kimi_k2",
               "<|tool_calls_section_begin|><|tool_call_begin|>functions.invalid.0"
               '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>'),
    # Ids sanitised by clients and echoed back by the model: the canonical id is returned.
    Case("kimi_sanitised_id", "kimi_k2",
         "<|tool_calls_section_begin|><|tool_call_begin|>functions_get_weather_3"
         '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>',
         "", [("get_weather", {"city": "Paris"})], tools=WEATHER, ids=["functions.get_weather:3"]),
    # One bad call among good ones: only its text is content.
    Case("kimi_one_bad_call", "kimi_k2",
         "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
         '{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>functions.nope:1<|tool_call_argument_begin|>'
         "{}<|tool_call_end|><|tool_calls_section_end|>",
         "<|tool_call_begin|>functions.nope:1<|tool_call_argument_begin|>{}<|tool_call_end|>",
         [("get_weather", {"city": "Paris"})], tools=WEATHER, ids=["functions.get_weather:0"]),
    Case("hermes_spaces", "hermes", '<tool_call>{"name": "get weather", "arguments": {}}</tool_call>',
         "", [("get_weather", {})], tools=WEATHER),
    Case("hermes_case", "hermes", '<tool_call>{"name": "Get-Weather", "arguments": {}}</tool_call>',
         "", [("get_weather", {})], tools=WEATHER),
    as_content("hermes_unknown", "hermes", '<tool_call>{"name": "search", "arguments": {}}</tool_call>'),
    as_content("hermes_bare_index", "hermes", '<tool_call>{"name": "0", "arguments": {}}</tool_call>'),
    as_content("hermes_ambiguous", "hermes", '<tool_call>{"name": "get weather", "arguments": {}}</tool_call>',
               tools=[tool("get-weather"), tool("get_weather")]),
    Case("mistral_spaces", "mistral", '[TOOL_CALLS]get weather[ARGS]{"city": "Paris"}', "",
         [("get_weather", {"city": "Paris"})], tools=WEATHER),
    as_content("mistral_unknown", "mistral", '[TOOL_CALLS]search[ARGS]{"q": 1}'),
    as_content("qwen3_coder_unknown", "qwen3_coder",
               "<tool_call>\n<function=search>\n<parameter=q>\nx\n</parameter>\n</function>\n</tool_call>"),
    Case("deepseek_prefixed", "deepseek_v3",
         "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>functions.get_weather\n"
         '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
         "", [("get_weather", {"city": "Paris"})], tools=WEATHER),
    as_content("llama3_unknown", "llama3_json", '{"name": "search", "parameters": {}}'),
    as_content("minimax_unknown", "minimax", '<tool_calls>\n{"name": "search", "arguments": {}}\n</tool_calls>'),
]  # fmt: skip

# ----- text outside call markers is content

CONTENT_CASES = [
    as_content("deepseek_malformed_section", "deepseek_v3",
               "<｜tool▁calls▁begin｜>I cannot call tools here.<｜tool▁calls▁end｜> Sorry."),
    as_content("deepseek_no_separator", "deepseek_v3",
               "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
    as_content("deepseek_cut_in_head", "deepseek_v3", "Let me see<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>func"),
    Case("deepseek_text_after_section", "deepseek_v3",
         '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}'
         "<｜tool▁call▁end｜><｜tool▁calls▁end｜>\n\nI asked for the weather.",
         "\n\nI asked for the weather.", [("get_weather", {"city": "Paris"})], tools=WEATHER),
    as_content("mistral_no_json", "mistral", "[TOOL_CALLS] Sorry, I cannot do that."),
    as_content("mistral_marker_at_end", "mistral", "The answer is 4.[TOOL_CALLS]"),
    as_content("mistral_name_without_args", "mistral", "[TOOL_CALLS]get_weather"),
    Case("mistral_bare_object", "mistral", '[TOOL_CALLS]{"name": "get_weather", "arguments": {"city": "Paris"}}',
         "", [("get_weather", {"city": "Paris"})], tools=WEATHER),
    Case("llama3_prose_before", "llama3_json",
         'Let me check the weather. {"name": "get_weather", "parameters": {"city": "Paris"}}',
         "Let me check the weather.", [("get_weather", {"city": "Paris"})], tools=WEATHER),
    Case("llama3_python_tag_in_prose", "llama3_json",
         'Sure: <|python_tag|>{"name": "get_weather", "parameters": {}}; {"name": "get_weather", "parameters": {"days": 2}}',
         "Sure:", [("get_weather", {}), ("get_weather", {"days": 2})], tools=WEATHER),
    as_content("llama3_key_is_not_a_call", "llama3_json", '{"name": "x"} is the key', tools=[tool("x")]),
    as_content("llama3_key_no_tools", "llama3_json", '{"name": "x"} is the key', tools=None),
    as_content("llama3_prose_after", "llama3_json",
               'Use {"name": "get_weather", "parameters": {"city": "Paris"}} to ask.'),
    as_content("kimi_malformed_section", "kimi_k2",
               "<|tool_calls_section_begin|>no calls today<|tool_calls_section_end|>"),
    Case("kimi_text_after_section", "kimi_k2",
         "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
         '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>Checking now.',
         "Checking now.", [("get_weather", {"city": "Paris"})], tools=WEATHER),
    as_content("minimax_prose_block", "minimax", "<tool_calls>\nI will not call anything.\n</tool_calls>"),
    as_content("qwen3_coder_no_function", "qwen3_coder", "<tool_call>\nnothing here\n</tool_call>"),
]  # fmt: skip

# ----- qwen3_coder values by the tool's schema

TYPED = [
    tool(
        "f",
        x={"type": "float"},
        i={"type": "int"},
        n={"type": ["integer", "null"]},
        m={"anyOf": [{"type": "integer"}, {"type": "null"}]},
        o={"type": "integer", "nullable": True},
        b={"type": "bool"},
        s={"type": "string"},
        s2={"type": "string"},
        code={"type": "string"},
    )
]


def qwen_call(*params: tuple[str, str], end: str = "</parameter>\n") -> str:
    body = "".join(f"<parameter={k}>\n{v}\n{end}" for k, v in params)
    return f"<tool_call>\n<function=f>\n{body}</function>\n</tool_call>"


VALUE_CASES = [
    Case("qwen_types", "qwen3_coder",
         qwen_call(("x", "2.5"), ("i", "7"), ("n", "None"), ("m", "null"), ("o", "None"),
                   ("b", "False"), ("s", "None")),
         "", [("f", {"x": 2.5, "i": 7, "n": None, "m": None, "o": None, "b": False, "s": "None"})],
         tools=TYPED),
    # A parameter written twice: the first value stands (it was already sent).
    Case("qwen_repeated", "qwen3_coder", qwen_call(("i", "1"), ("s", "a"), ("i", "2")),
         "", [("f", {"i": 1, "s": "a"})], tools=TYPED),
    # `</parameter>` missing: the value ends at the next parameter or the function's end.
    Case("qwen_missing_end", "qwen3_coder",
         "<tool_call>\n<function=f>\n<parameter=i>\n5\n<parameter=s>\nhi\n</function>\n</tool_call>",
         "", [("f", {"i": 5, "s": "hi"})], tools=TYPED),
    # A literal `</parameter>` inside a value (code that writes this very format).
    Case("qwen_literal_end_tag", "qwen3_coder",
         qwen_call(("code", 'print("</parameter>")\nx = 1'), ("s2", "ok")),
         "", [("f", {"code": 'print("</parameter>")\nx = 1', "s2": "ok"})], tools=TYPED),
]  # fmt: skip

# ----- a tool-call marker ends an open reasoning block

CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
REASONING_CASES = [
    Case("think_unclosed_then_call", "hermes", "plan" + CALL, "", [("get_weather", {"city": "Paris"})],
         tools=WEATHER, reasoning="think", opened=True, expected_reasoning="plan"),
    # A call written inside <think>: it is a call; the block's end tag after it is dropped.
    Case("think_call_inside_block", "hermes", "<think>I need the weather. " + CALL + "</think>It is sunny.",
         "It is sunny.", [("get_weather", {"city": "Paris"})], tools=WEATHER, reasoning="think",
         expected_reasoning="I need the weather. "),
    # ... but an end tag inside the call's arguments is argument text.
    Case("think_end_tag_in_arguments", "hermes",
         '<think>x<tool_call>{"name": "get_weather", "arguments": {"city": "</think>"}}</tool_call>',
         "", [("get_weather", {"city": "</think>"})], tools=WEATHER, reasoning="think",
         expected_reasoning="x"),
    Case("think_qwen3_coder", "qwen3_coder",
         "plan<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
         "", [("get_weather", {"days": 2})], tools=WEATHER, reasoning="think", opened=True,
         expected_reasoning="plan"),
    Case("think_deepseek", "deepseek_v3",
         "plan<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{}<｜tool▁call▁end｜>"
         "<｜tool▁calls▁end｜>",
         "", [("get_weather", {})], tools=WEATHER, reasoning="think", opened=True,
         expected_reasoning="plan"),
    Case("think_minimax", "minimax",
         '<think>plan</think>\n<tool_calls>\n{"name": "get_weather", "arguments": {}}\n</tool_calls>',
         "", [("get_weather", {})], tools=WEATHER, reasoning="think", expected_reasoning="plan"),
]  # fmt: skip

# ----- MiniMax-M1 (the format added for hybrid lightning-attention models)

MINIMAX_CASES = [
    Case("minimax_two_calls", "minimax",
         'Searching 😀\n<tool_calls>\n{"name": "search_web", "arguments": {"query_tag": ["tech"], '
         '"query_list": ["\\"OpenAI\\" </tool_calls>"]}}\n{"name": "get_weather", "arguments": '
         '{"city": "巴黎"}}\n</tool_calls>\nDone.',
         "Searching 😀\nDone.",
         [("search_web", {"query_tag": ["tech"], "query_list": ['"OpenAI" </tool_calls>']}),
          ("get_weather", {"city": "巴黎"})],
         tools=[*WEATHER, tool("search_web")]),
    Case("minimax_block_left_open", "minimax",
         '<tool_calls>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n',
         "", [("get_weather", {"city": "Paris"})], tools=WEATHER),
]  # fmt: skip

ALL_CASES = ARGUMENT_CASES + NAME_CASES + CONTENT_CASES + VALUE_CASES + REASONING_CASES
ALL_CASES += MINIMAX_CASES


@pytest.mark.parametrize("case", ALL_CASES, ids=lambda c: c.id)
def test_whole_text_and_every_split(case: Case) -> None:
    check_every_split(case)


def test_every_three_way_split_of_a_reasoning_case() -> None:
    case = REASONING_CASES[1]
    reference = run(case, [case.text])
    check(case, reference)
    text = case.text
    for i in range(0, len(text) + 1, 3):
        for j in range(i, len(text) + 1, 2):
            assert run(case, [text[:i], text[i:j], text[j:]]) == reference


@pytest.mark.parametrize(
    "written,offered,resolved",
    [
        ("get_weather", ["get_weather"], "get_weather"),
        ("functions.get_weather:0", ["get_weather"], "get_weather"),
        ("functions_get_weather_12", ["get_weather"], "get_weather"),
        ("functionsget_weather5", ["get_weather"], "get_weather"),
        ("functions.invalid.0", ["get_weather"], None),
        ("functions.invalid.0", ["invalid"], "invalid"),
        ("0", ["get_weather"], None),
        (" Get Weather ", ["get_weather"], "get_weather"),
        ("get weather", ["get-weather", "get_weather"], None),  # ambiguous
        ("get_v2", ["get_v2", "get_v"], "get_v2"),  # the exact name first
        ("x", [], "x"),  # no offered tools: as written
        ("get weather", [], None),  # ... unless it holds whitespace
        ("", ["f"], None),
    ],
)
def test_tool_name_resolution(written: str, offered: list[str], resolved: str | None) -> None:
    assert resolve_tool_name(written, frozenset(offered)) == resolved


def test_minimax_is_registered_for_its_hybrid_models() -> None:
    assert tool_call_parser_class("minimax_m1") is tool_call_parser_class("minimax")
    assert parsers_for_model("minimax_m1") == ("minimax", "think")
    assert parsers_for_model("minimax_text_01") == ("minimax", None)


def test_arguments_still_stream_while_written() -> None:
    """Committing a call at its arguments' opening brace keeps argument streaming."""
    parser = make_tool_call_parser("hermes", tools=WEATHER, call_id_factory=str)
    first = parser.feed('<tool_call>{"name": "get_weather", "arguments": {"city": "Pa')
    assert [(c.name, c.arguments) for d in first for c in d.tool_calls] == [
        ("get_weather", '{"city": "Pa')
    ]
    # The next key waits until its value has begun (so a cut there still closes cleanly).
    assert [c.arguments for d in parser.feed('ris", "da') for c in d.tool_calls] == ['ris"']


def _stream_object(pieces: list[str]) -> tuple[str, str]:
    streamer, out = JsonObjectStreamer(), []
    for i, piece in enumerate(pieces):
        out.append(streamer.feed(piece))
        if streamer.ended:
            return "".join(out), streamer.rest + "".join(pieces[i + 1 :])
    out.append(streamer.feed("", eof=True))
    return "".join(out), streamer.rest


def _random_value(rng: random.Random, depth: int) -> Any:
    kind = rng.choice(["obj", "list", "str", "num", "lit"] if depth < 3 else ["str", "num", "lit"])
    if kind == "obj":
        return {rng.choice(["k", "中", 'q"'] ) + str(i): _random_value(rng, depth + 1)
                for i in range(rng.randint(0, 3))}  # fmt: skip
    if kind == "list":
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if kind == "str":
        return rng.choice(["", "a b", "😀\\", "<|tool_call_end|>", "line\nbreak", "}]"])
    if kind == "num":
        return rng.choice([0, -7, 12.5, -0.25, 3e-5, 10**20])
    return rng.choice([True, False, None])


def test_json_object_streamer_on_random_objects() -> None:
    """A valid object passes through verbatim; one cut anywhere, or broken by a stray
    character, comes out closed into an object; the same under every chunking."""
    rng = random.Random(20)
    for _ in range(400):
        value = {"a": _random_value(rng, 0), "b": _random_value(rng, 1)}
        text = json.dumps(value, ensure_ascii=False, indent=rng.choice([None, 1]))
        for pieces in ([text + " tail"], list(text + " tail")):
            assert _stream_object(pieces) == (text, " tail")
        cut = rng.randint(1, len(text) - 1)
        damaged = rng.choice([text[:cut], text[:cut] + rng.choice(["<|x|>", "]", "'", "\\q"])])
        reference = _stream_object([damaged])
        assert isinstance(json.loads(reference[0]), dict), damaged
        assert _stream_object(list(damaged)) == reference, damaged
        splits = sorted(rng.sample(range(len(damaged) + 1), min(3, len(damaged) + 1)))
        pieces = [damaged[a:b] for a, b in zip([0, *splits], [*splits, len(damaged)])]
        assert _stream_object(pieces) == reference, pieces
    # A raw newline inside a string (strict JSON rejects it) is sent escaped.
    assert _stream_object(['{"a": "x', '\ny"}']) == ('{"a": "x\\ny"}', "")
