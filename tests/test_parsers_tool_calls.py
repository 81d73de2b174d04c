"""Streaming tool-call parsers: every way of splitting the text gives the same message.

Bug classes covered (from the field): lost tail / last brace at end of stream (vllm#32152,
sglang#31915), one delta closing a call and opening the next (vllm#41967), split and partial
markers leaking into content (vllm#28543), marker text inside arguments (vllm#45310, #34919),
ids or names sent twice (vllm#44098), empty arguments for parameterless tools (vllm#28806).
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvloom.cluster.parsers import (
    Delta,
    ParsedMessage,
    ToolCallDelta,
    collect,
    make_tool_call_parser,
    parsers_for_model,
    tool_call_parser_class,
)
from kvloom.cluster.parsers.json_object_stream import JsonObjectStreamer
from kvloom.cluster.parsers.json_scan import JsonValueScanner
from kvloom.cluster.parsers.tool_calls.parameter_values import parameter_json


@dataclass
class Case:
    name: str
    parser: str
    text: str
    content: str
    calls: list[tuple[str, Any]]  # (name, arguments as a dict, or the exact arguments text)
    ids: list[str] | None = None  # expected ids when the text carries them
    tools: list[dict] | None = None
    joint: str = ""  # a piece that closes one call and opens the next
    markers: list[str] = field(default_factory=list)  # start markers of the format


WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                    "hours": {"type": "array"},
                },
            },
        },
    }
]

SHORT_CASES = [
    Case(
        "hermes",
        "hermes",
        'Hi 😀\n<tool_call>\n{"name": "f", "arguments": {"q": "a</tool_call>中"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>',
        "Hi 😀",
        [("f", {"q": "a</tool_call>中"}), ("g", {})],
        joint='}}\n</tool_call>\n<tool_call>\n{"name": "g"',
        markers=["<tool_call>"],
    ),
    Case(
        "qwen3_coder",
        "qwen3_coder",
        "Ok 中\n<tool_call>\n<function=get_weather>\n<parameter=city>\nP</parameter>😀\n"
        "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
        "<tool_call>\n<function=t>\n</function>\n</tool_call>",
        "Ok 中",
        [("get_weather", {"city": "P</parameter>😀", "days": 3}), ("t", {})],
        tools=[*WEATHER_TOOLS, {"name": "t"}],
        joint="</function>\n</tool_call><tool_call>\n<function=t>",
        markers=["<tool_call>", "<function="],
    ),
    Case(
        "kimi_k2",
        "kimi_k2",
        "好<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>"
        '{"a": "<|tool_call_end|>😀"}<|tool_call_end|><|tool_call_begin|>functions.g:1'
        "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>",
        "好",
        [("f", {"a": "<|tool_call_end|>😀"}), ("g", {})],
        ids=["functions.f:0", "functions.g:1"],
        joint='"}<|tool_call_end|><|tool_call_begin|>functions.g',
        markers=["<|tool_calls_section_begin|>", "<|tool_call_begin|>"],
    ),
    Case(
        "llama3_json",
        "llama3_json",
        '<|python_tag|>{"name": "f", "parameters": {"q": "}; {\\"name\\": 中"}}; '
        '{"name": "g", "parameters": {"n": "😀", "m": 1}}',
        "",
        [("f", {"q": '}; {"name": 中'}), ("g", '{"n": "😀", "m": 1}')],
        joint='"}}; {"name": "g"',
        markers=["<|python_tag|>"],
    ),
    Case(
        "mistral_v11",
        "mistral",
        'Hm 😀[TOOL_CALLS]f[ARGS]{"q": "[TOOL_CALLS]中"}[TOOL_CALLS]g[CALL_ID]abcdefghi[ARGS]{}',
        "Hm 😀",
        [("f", {"q": "[TOOL_CALLS]中"}), ("g", {})],
        joint='"}[TOOL_CALLS]g[CALL_ID]',
        markers=["[TOOL_CALLS]"],
    ),
    Case(
        "mistral_array",
        "mistral",
        '[TOOL_CALLS] [{"name": "f", "arguments": {"q": "]中"}}, {"name": "g", "arguments": {}}]',
        "",
        [("f", {"q": "]中"}), ("g", {})],
        joint='"}}, {"name": "g"',
        markers=["[TOOL_CALLS]"],
    ),
    Case(
        "deepseek_v3",
        "deepseek_v3",
        "嗯<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n"
        '{"q": "<｜tool▁call▁end｜>😀"}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function'
        "<｜tool▁sep｜>g\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "嗯",
        [("f", {"q": "<｜tool▁call▁end｜>😀"}), ("g", {})],
        joint="```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>g",
        markers=["<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>"],
    ),
    Case(
        "deepseek_v31",
        "deepseek_v31",
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{"q": "中"}<｜tool▁call▁end｜>'
        "<｜tool▁call▁begin｜>g<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜> 😀",
        " 😀",
        [("f", {"q": "中"}), ("g", {})],
        joint='"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>g',
        markers=["<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>"],
    ),
]


SHORT_CASES.append(
    Case(
        "minimax",
        "minimax",
        'Ok 😀\n<tool_calls>\n{"name": "f", "arguments": {"q": "</tool_calls>中"}}\n'
        '{"name": "g", "arguments": {}}\n</tool_calls>',
        "Ok 😀",
        [("f", {"q": "</tool_calls>中"}), ("g", {})],
        joint='"}}\n{"name": "g"',
        markers=["<tool_calls>"],
    )
)


def _long_json_arguments(rng: random.Random, markers: list[str]) -> dict:
    words = ["天气", "😀🎉", 'q"uote', "back\\slash", "new\nline", "}]{[", *markers]
    return {
        f"k{i}": [rng.choice(words) * rng.randint(1, 4), {"n": rng.randint(-9, 99)}, None, True]
        for i in range(12)
    }


def _long_case(parser: str) -> Case:
    """Long outputs (3 calls with ~1 KB of arguments each) for random multi-piece splits."""
    rng = random.Random(parser)
    if parser == "qwen3_coder":
        values = [
            {"city": "P" * 300 + "</parameter>中", "days": 7, "hours": [1, 2]} for _ in range(3)
        ]
        blocks = [
            "<tool_call>\n<function=get_weather>\n"
            + "".join(
                f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
                for k, v in args.items()
            )
            + "</function>\n</tool_call>"
            for args in values
        ]
        return Case(
            "long_qwen3_coder",
            parser,
            "前言 " * 40 + "\n" + "\n".join(blocks),
            ("前言 " * 40).rstrip(),
            [("get_weather", args) for args in values],
            tools=WEATHER_TOOLS,
        )
    markers = {
        "hermes": ["</tool_call>", "<tool_call>"],
        "kimi_k2": ["<|tool_call_end|>", "<|tool_calls_section_end|>"],
        "llama3_json": ["; {", "<|python_tag|>"],
        "mistral": ["[TOOL_CALLS]", "[ARGS]"],
        "deepseek_v3": ["<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>"],
        "minimax": ["</tool_calls>", "<tool_calls>"],
    }[parser]
    args = [_long_json_arguments(rng, markers) for _ in range(3)]
    raw = [json.dumps(a, ensure_ascii=False) for a in args]
    names = ["alpha", "beta", "gamma"]
    prose = "Let me look that up — 稍等 😀. " * 20
    if parser == "hermes":
        body = "".join(
            f'<tool_call>\n{{"name": "{n}", "arguments": {r}}}\n</tool_call>\n'
            for n, r in zip(names, raw)
        )
        text, content = prose + "\n" + body, prose.rstrip()
    elif parser == "kimi_k2":
        body = "".join(
            f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>{r}<|tool_call_end|>"
            for i, (n, r) in enumerate(zip(names, raw))
        )
        text = prose + "<|tool_calls_section_begin|>" + body + "<|tool_calls_section_end|>"
        content = prose.rstrip()
    elif parser == "llama3_json":
        text = "; ".join(f'{{"name": "{n}", "parameters": {r}}}' for n, r in zip(names, raw))
        content = ""
    elif parser == "mistral":
        text = prose + "".join(f"[TOOL_CALLS]{n}[ARGS]{r}" for n, r in zip(names, raw))
        content = prose.rstrip()
    elif parser == "minimax":
        body = "".join(f'{{"name": "{n}", "arguments": {r}}}\n' for n, r in zip(names, raw))
        text, content = prose + "\n<tool_calls>\n" + body + "</tool_calls>", prose.rstrip()
    else:
        body = "".join(
            f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{n}\n```json\n{r}\n```<｜tool▁call▁end｜>"
            for n, r in zip(names, raw)
        )
        text = prose + "<｜tool▁calls▁begin｜>" + body + "<｜tool▁calls▁end｜>"
        content = prose.rstrip()
    return Case(f"long_{parser}", parser, text, content, list(zip(names, raw)))


LONG_CASES = [
    _long_case(p)
    for p in (
        "hermes", "qwen3_coder", "kimi_k2", "llama3_json", "mistral", "deepseek_v3", "minimax"
    )
]  # fmt: skip


def parse(case: Case, pieces: list[str]) -> ParsedMessage:
    parser = make_tool_call_parser(
        case.parser, tools=case.tools, call_id_factory=lambda i: f"id{i}"
    )
    deltas = []
    for piece in pieces:
        deltas += parser.feed(piece)
    deltas += parser.finish()
    assert parser.finish() == []  # idempotent
    return collect(deltas)  # also checks: id and name once, first, in order


def check_expected(case: Case, message: ParsedMessage) -> None:
    assert message.content == case.content
    assert [c.name for c in message.tool_calls] == [name for name, _ in case.calls]
    for call, (_, expected) in zip(message.tool_calls, case.calls):
        if isinstance(expected, str):
            assert call.arguments == expected
        else:
            assert json.loads(call.arguments) == expected
    if case.ids is not None:
        assert [c.id for c in message.tool_calls] == case.ids


def random_pieces(text: str, rng: random.Random, max_piece: int) -> list[str]:
    pieces, pos = [], 0
    while pos < len(text):
        size = rng.randint(0, max_piece)  # 0: empty deltas must be harmless too
        pieces.append(text[pos : pos + size])
        pos += size
    return pieces


@pytest.mark.parametrize("case", SHORT_CASES + LONG_CASES, ids=lambda c: c.name)
def test_whole_text_gives_the_expected_message(case: Case) -> None:
    check_expected(case, parse(case, [case.text]))


@pytest.mark.parametrize("case", SHORT_CASES, ids=lambda c: c.name)
def test_every_two_and_three_way_split_gives_the_same_message(case: Case) -> None:
    reference = parse(case, [case.text])
    text = case.text
    for i in range(len(text) + 1):
        assert parse(case, [text[:i], text[i:]]) == reference, (text[:i], text[i:])
        for j in range(i, len(text) + 1):
            pieces = [text[:i], text[i:j], text[j:]]
            assert parse(case, pieces) == reference, pieces


@pytest.mark.parametrize("case", SHORT_CASES + LONG_CASES, ids=lambda c: c.name)
def test_one_character_at_a_time_gives_the_same_message(case: Case) -> None:
    assert parse(case, list(case.text)) == parse(case, [case.text])


@pytest.mark.parametrize("case", LONG_CASES, ids=lambda c: c.name)
def test_random_multi_piece_splits_give_the_same_message(case: Case) -> None:
    reference = parse(case, [case.text])
    check_expected(case, reference)
    rng = random.Random(case.name)
    for trial in range(60):
        pieces = random_pieces(case.text, rng, max_piece=rng.choice([3, 9, 40, 200]))
        assert parse(case, pieces) == reference, f"trial {trial}"


@pytest.mark.parametrize("case", [c for c in SHORT_CASES if c.joint], ids=lambda c: c.name)
def test_a_delta_that_closes_one_call_and_opens_the_next(case: Case) -> None:
    start = case.text.index(case.joint)
    end = start + len(case.joint)
    text = case.text
    reference = parse(case, [text])
    for pieces in (
        [text[:start], text[start:end], text[end:]],
        [text[:end], text[end:]],  # the whole first call and the next call's start together
        [text[: start + 1], text[start + 1 : end - 1], text[end - 1 :]],
    ):
        assert parse(case, pieces) == reference, pieces
    assert len(reference.tool_calls) == 2


@pytest.mark.parametrize("case", SHORT_CASES, ids=lambda c: c.name)
def test_text_ending_in_a_partial_marker_is_flushed_as_content(case: Case) -> None:
    prefix = "" if case.parser == "llama3_json" else "Answer: 42 "
    partials = {m[:k] for m in case.markers for k in range(1, len(m))} | {"<", "<|", "["}
    for partial in sorted(partials):
        text = prefix + partial
        for pieces in ([text], list(text), [prefix, partial]):
            message = parse(case, pieces)
            assert message.content == text, pieces
            assert message.tool_calls == []


@pytest.mark.parametrize("case", SHORT_CASES, ids=lambda c: c.name)
def test_streamed_fragments_equal_final_arguments_and_name_comes_once(case: Case) -> None:
    parser = make_tool_call_parser(case.parser, tools=case.tools, call_id_factory=str)
    seen_names: dict[int, int] = {}
    fragments: dict[int, list[str]] = {}
    for char in case.text:
        for delta in parser.feed(char):
            for call in delta.tool_calls:
                if call.name is not None:
                    seen_names[call.index] = seen_names.get(call.index, 0) + 1
                    assert call.id is not None
                else:
                    assert call.id is None
                    assert call.index in seen_names  # arguments never before the name
                fragments.setdefault(call.index, []).append(call.arguments)
    # finish() may still start a call: a llama3 call is certain only once the output ends.
    for delta in parser.finish():
        for call in delta.tool_calls:
            if call.name is not None:
                seen_names[call.index] = seen_names.get(call.index, 0) + 1
            fragments.setdefault(call.index, []).append(call.arguments)
    assert all(count == 1 for count in seen_names.values())
    final = parse(case, [case.text])
    assert ["".join(fragments[i]) for i in range(len(final.tool_calls))] == [
        c.arguments for c in final.tool_calls
    ]


def test_arguments_stream_before_the_call_ends() -> None:
    """Fragments arrive while the model writes them, not only when the call closes."""
    parser = make_tool_call_parser("hermes", call_id_factory=str)
    parser.feed('<tool_call>{"name": "f", "arguments": {"text": "')
    deltas = parser.feed("hello wor")
    assert [c.arguments for d in deltas for c in d.tool_calls] == ["hello wor"]
    parser = make_tool_call_parser("kimi_k2", call_id_factory=str)
    deltas = parser.feed(
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"
        '<|tool_call_argument_begin|>{"text": "hel'
    )
    assert "".join(c.arguments for d in deltas for c in d.tool_calls) == '{"text": "hel'


def test_content_is_not_held_back_beyond_a_possible_marker() -> None:
    parser = make_tool_call_parser("hermes")
    assert [d.content for d in parser.feed("Hello wor")] == ["Hello wor"]
    # The trailing space waits (it is dropped if a call follows), as does the partial marker.
    assert [d.content for d in parser.feed("ld <tool_")] == ["ld"]
    assert [d.content for d in parser.feed("x")] == [" <tool_x"]
    assert [d.content for d in parser.feed(" <tool_call>")] == []
    assert parser.feed('{"name": "f"}</tool_call>')[0].tool_calls[0].name == "f"


def test_truncated_call_is_closed_into_a_json_object() -> None:
    """A stream cut by max_tokens inside the arguments: what was streamed stands (it was
    sent), and the open containers and string are closed; a half-written key is dropped."""
    for text, arguments in [
        ('<tool_call>{"name": "f", "arguments": {"a": [1, 2', '{"a": [1, 2]}'),
        ('<tool_call>{"name": "f", "arguments": {"a": "hel', '{"a": "hel"}'),
        ('<tool_call>{"name": "f", "arguments": {"a": 1, "b', '{"a": 1}'),
        ('<tool_call>{"name": "f", "arguments": {"a": tru', "{}"),
    ]:
        case = Case("cut", "hermes", text, "", [("f", json.loads(arguments))])
        for pieces in ([text], list(text)):
            message = parse(case, pieces)
            check_expected(case, message)
            assert message.tool_calls[0].arguments == arguments


@pytest.mark.parametrize(
    "parser,text",
    [
        ("hermes", '<tool_call>{"name": "noargs"}</tool_call>'),
        ("kimi_k2", "<|tool_call_begin|>functions.noargs:0<|tool_call_end|>"),
        ("qwen3_coder", "<tool_call><function=noargs></function></tool_call>"),
        ("mistral", '[TOOL_CALLS][{"name": "noargs"}]'),
        ("llama3_json", '{"name": "noargs"}'),
    ],
)
def test_a_call_without_arguments_gets_an_empty_object(parser: str, text: str) -> None:
    message = parse(Case("noargs", parser, text, "", []), [text])
    assert [(c.name, c.arguments) for c in message.tool_calls] == [("noargs", "{}")]


@pytest.mark.parametrize(
    "parser,text",
    [
        ("hermes", "a <tool_call>not json</tool_call> b"),
        ("hermes", 'a <tool_call>{"city": "Paris"}</tool_call> b'),
        ("llama3_json", '{"answer": 42, "name": "x"} is the JSON you asked for'),
        ("llama3_json", "Plain answer {with braces}"),
        ("mistral", "see [TOOL_CALLS] above, then [ARGS]"),
        ("mistral", '[TOOL_CALLS] [ {"foo": 1}] tail'),
        ("qwen3_coder", "write <function=f x> in HTML"),
    ],
)
def test_text_that_only_looks_like_a_call_stays_content(parser: str, text: str) -> None:
    case = Case("look-alike", parser, text, text, [])
    reference = parse(case, [text])
    assert reference.tool_calls == []
    assert reference.content == text
    for i in range(len(text) + 1):
        assert parse(case, [text[:i], text[i:]]) == reference


def test_string_encoded_arguments_are_decoded() -> None:
    text = '<tool_call>{"name": "f", "arguments": "{\\"a\\": \\"é\\"}"}</tool_call>'
    message = parse(Case("s", "hermes", text, "", []), [text])
    assert message.tool_calls[0].arguments == '{"a": "é"}'


def test_unicode_escapes_are_kept_verbatim() -> None:
    """Fragments are the model's text; re-serialising (ensure_ascii) would break equality."""
    text = '<tool_call>{"name": "f", "arguments": {"a": "\\u00e9 é"}}</tool_call>'
    for pieces in ([text], list(text)):
        message = parse(Case("u", "hermes", text, "", []), pieces)
        assert message.tool_calls[0].arguments == '{"a": "\\u00e9 é"}'


def test_kimi_section_left_open_still_yields_calls() -> None:
    """dynamo#8208: a missing section end must not drop the calls."""
    text = (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"
        '<|tool_call_argument_begin|>{"a": 1}<|tool_call_end|>'
    )
    message = parse(Case("k", "kimi_k2", text, "", []), [text])
    assert [(c.id, c.name, c.arguments) for c in message.tool_calls] == [
        ("functions.f:0", "f", '{"a": 1}')
    ]


def test_kimi_malformed_json_is_closed_at_the_call_end_marker() -> None:
    text = (
        '<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"a": [1'
        "<|tool_call_end|><|tool_call_begin|>functions.g:1<|tool_call_argument_begin|>{}"
        "<|tool_call_end|>"
    )
    message = parse(Case("k", "kimi_k2", text, "", []), list(text))
    assert [(c.name, c.arguments) for c in message.tool_calls] == [("f", '{"a": [1]}'), ("g", "{}")]


def test_qwen3_coder_types_values_by_schema() -> None:
    tools = [
        {
            "name": "f",
            "parameters": {
                "properties": {
                    "i": {"type": "integer"},
                    "x": {"type": "number"},
                    "b": {"type": "boolean"},
                    "o": {"type": "object"},
                    "a": {"type": "array"},
                    "n": {"type": ["integer", "null"]},
                    "s": {"type": "string"},
                    "bad": {"type": "integer"},
                }
            },
        }
    ]
    params = {
        "i": "42",
        "x": "2.5",
        "b": "True",
        "o": "{'k': True}",
        "a": '[1, "two"]',
        "n": "null",
        "s": "007",
        "bad": "many",
        "unknown": "3",
    }
    text = (
        "<tool_call>\n<function=f>\n"
        + "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
        + "</function>\n</tool_call>"
    )
    message = parse(Case("t", "qwen3_coder", text, "", [], tools=tools), [text])
    assert json.loads(message.tool_calls[0].arguments) == {
        "i": 42,
        "x": 2.5,
        "b": True,
        "o": {"k": True},
        "a": [1, "two"],
        "n": None,
        "s": "007",
        "bad": "many",
        "unknown": "3",
    }


def test_parameter_json_rejects_non_finite_numbers() -> None:
    assert parameter_json("nan", {"type": "number"}) == '"nan"'
    assert parameter_json("1e999", {"type": "number"}) == '"1e999"'
    assert parameter_json(" 3 ", {"type": ["string", "integer"]}) == '" 3 "'


def test_default_call_ids_have_the_expected_shape() -> None:
    hermes = make_tool_call_parser("hermes")
    deltas = hermes.feed('<tool_call>{"name": "f"}</tool_call>') + hermes.finish()
    assert re.fullmatch(r"call_[0-9a-f]{24}", deltas[0].tool_calls[0].id)
    mistral = make_tool_call_parser("mistral")
    deltas = mistral.feed("[TOOL_CALLS]f[ARGS]{}") + mistral.finish()
    assert re.fullmatch(r"[A-Za-z0-9]{9}", deltas[0].tool_calls[0].id)


def test_feed_after_finish_is_an_error() -> None:
    parser = make_tool_call_parser("hermes")
    parser.finish()
    with pytest.raises(RuntimeError):
        parser.feed("x")


def test_registry_by_name_alias_and_model_type() -> None:
    assert tool_call_parser_class("qwen3_xml") is tool_call_parser_class("qwen3_coder")
    assert tool_call_parser_class("deepseek_v31") is tool_call_parser_class("deepseek_v3")
    with pytest.raises(ValueError, match="tool_call_parser"):
        tool_call_parser_class("nope")
    assert parsers_for_model("qwen3") == ("hermes", "think")
    assert parsers_for_model("qwen3_moe", "Qwen/Qwen3-Coder-30B-A3B-Instruct")[0] == "qwen3_coder"
    assert parsers_for_model("deepseek_v3", "moonshotai/Kimi-K2-Instruct") == ("kimi_k2", "kimi")
    assert parsers_for_model("llama") == ("llama3_json", None)
    assert parsers_for_model("gpt2") == (None, None)


def test_bad_tools_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"tools\[1\]"):
        make_tool_call_parser("qwen3_coder", tools=[{"name": "ok"}, "{not json"])


def test_json_scanner_ignores_structure_inside_strings() -> None:
    text = '{"a": "}{\\"]", "b": [1, {"c": "\\\\"}]} tail'
    for pieces in ([text], list(text)):
        scanner, consumed = JsonValueScanner(), 0
        for piece in pieces:
            consumed += scanner.scan(piece)
            if scanner.done:
                break
        assert scanner.done
        assert consumed == text.index(" tail")


@pytest.mark.parametrize(
    "text,sent,rest,done",
    [
        (' {"a": [1, 2.5e3, true, null, {"b": "x\\"y\\u00e9"}]} x', None, " x", True),
        ('{"a": "x\ny"}', '{"a": "x\\ny"}', "", True),  # raw control characters escaped
        ('{"a": 1 2}', '{"a": 1}', "2}", False),  # a syntax error ends (and closes) it
        ('{"a": 1.}', '{"a": 1}', "}", False),  # an invalid number is dropped
        ('{"a":1<|tool_call_end|>', '{"a":1}', "<|tool_call_end|>", False),
        ('{"a": "\\u00', '{"a": ""}', "", False),  # a partial escape is dropped
        ('{"a": [], "b": {"c": -0.5}', '{"a": [], "b": {"c": -0.5}}', "", False),
        ('"hello"', "", '"hello"', False),  # not an object: nothing is sent
    ],
)
def test_json_object_streamer_sends_only_valid_object_prefixes(
    text: str, sent: str | None, rest: str, done: bool
) -> None:
    for pieces in ([text], list(text)):
        streamer, out, left = JsonObjectStreamer(), [], ""
        for i, piece in enumerate(pieces):
            out.append(streamer.feed(piece))
            if streamer.ended:
                left = streamer.rest + "".join(pieces[i + 1 :])
                break
            # Every prefix sent so far is closable into a valid object.
            if "".join(out):
                json.loads("".join(out) + streamer.closing_if_cut())
        if not streamer.ended:
            out.append(streamer.feed("", eof=True))
            left = streamer.rest
        expected = text.strip()[: len(text.strip()) - len(rest.strip())] if sent is None else sent
        assert "".join(out) == expected.strip(), pieces
        assert left == rest
        assert streamer.done == done
        if "".join(out):
            assert isinstance(json.loads("".join(out)), dict)


@pytest.mark.parametrize(
    "text,content,arguments",
    [
        # A model that forgets the end tag: the text after the object is content, not lost.
        (
            '<tool_call>{"name": "f", "arguments": {"a": 1}}\nLet me know! 😀',
            "Let me know! 😀",
            '{"a": 1}',
        ),
        # One closing brace too many is a common slip; it is dropped.
        ('<tool_call>{"name": "f", "arguments": {}}}\n</tool_call>\nok', "\nok", "{}"),
    ],
)
def test_hermes_tolerates_sloppy_block_ends(text: str, content: str, arguments: str) -> None:
    case = Case("sloppy", "hermes", text, content, [("f", arguments)])
    reference = parse(case, [text])
    check_expected(case, reference)
    for i in range(len(text) + 1):
        assert parse(case, [text[:i], text[i:]]) == reference


def test_collect_rejects_broken_streams() -> None:
    with pytest.raises(ValueError, match="before its id and name"):
        collect([Delta(tool_calls=[ToolCallDelta(index=0, arguments="{}")])])
    with pytest.raises(ValueError, match="out of order"):
        collect([Delta(tool_calls=[ToolCallDelta(index=1, id="a", name="f")])])
    with pytest.raises(ValueError, match="both id and name"):
        collect([Delta(tool_calls=[ToolCallDelta(index=0, name="f")])])


# Pieces of each format's syntax; random concatenations are mostly malformed output.
FUZZ_ATOMS = {
    "hermes": ["<tool_call>", "</tool_call>", "</tool", '{"name": "f"', '"arguments"', ": ", "{",
               "}", '"', "\\", ",", "[", "]", "x 中", "😀", "\n", " ", '"parameters"'],
    "qwen3_coder": ["<tool_call>", "</tool_call>", "<function=", "f>", "</function>",
                    "<parameter=", "a>", "</parameter>", "\n", " ", "x 中", "😀", "<", ">", "1"],
    "kimi_k2": ["<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>",
                "functions.f:0", "<|", "{", "}", '"', "\\", "x 中", "😀", " ", "[", "]"],
    "llama3_json": ["<|python_tag|>", '{"name": "f"', '"parameters"', '"arguments"', ": ", "{",
                    "}", '"', "\\", ";", " ", "x 中", "😀", ",", '"type"', "[", "]", "<|"],
    "mistral": ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "f", "abc123xyz", "{", "}", "[", "]", '"',
                "\\", ",", '{"name": "g"', '"arguments"', ": ", " ", "x 中", "😀"],
    "deepseek_v3": ["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                    "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "function", "f\n", "```json\n",
                    "\n```", "{", "}", '"', "\\", " ", "x 中", "😀", "<｜", "["],
    "minimax": ["<tool_calls>", "</tool_calls>", "</tool", '{"name": "f"', '"arguments"', ": ",
                "{", "}", '"', "\\", ",", "[", "]", "x 中", "😀", "\n", " ", "null", "1"],
}  # fmt: skip
# Offered tools exercise name resolution: `f` resolves, `functions.f:0` too, `g` does not.
FUZZ_TOOLS = [{"name": "f", "parameters": {"properties": {"a": {"type": "integer"}}}}]


@pytest.mark.parametrize("tools", [None, FUZZ_TOOLS], ids=["no_tools", "tools"])
@pytest.mark.parametrize("parser", sorted(FUZZ_ATOMS))
def test_random_malformed_output_is_split_invariant(parser: str, tools: list | None) -> None:
    """Whatever the model writes, the message must not depend on how it was chunked (and the
    parser must neither crash nor loop), and every call's arguments are a JSON object."""
    rng = random.Random(parser)
    atoms = FUZZ_ATOMS[parser]
    for _ in range(300):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(1, 25)))
        case = Case("fuzz", parser, text, "", [], tools=tools)
        reference = parse(case, [text])
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 6))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert parse(case, pieces) == reference, pieces
        assert parse(case, list(text)) == reference, text
        for call in reference.tool_calls:
            assert isinstance(json.loads(call.arguments), dict), (text, call.arguments)
            assert tools is None or call.name == "f", text
