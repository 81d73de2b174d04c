"""Streaming reasoning parsers, alone and combined with tool-call parsing.

Bug classes covered: split `</think>` (lmdeploy#4754), reasoning truncated when `</think>` and
`<tool_call>` share a delta (vllm#43221), Kimi markers leaking into reasoning (vllm#28543),
the start tag placed in the prompt by the template (DeepSeek-R1, Qwen3), and
`enable_thinking=False` closing the block in the prompt (vllm#40816).
"""

from __future__ import annotations

import random

import pytest

from kvloom.cluster.parsers import (
    ChatOutputParser,
    collect,
    make_reasoning_parser,
    make_tool_call_parser,
    reasoning_parser_class,
)
from kvloom.cluster.parsers.reasoning.tag_reasoning import KimiReasoningParser


def run(name: str, pieces: list[str], start_in_reasoning: bool = False) -> tuple[str, str]:
    parser = make_reasoning_parser(name, start_in_reasoning=start_in_reasoning)
    reasoning, content = [], []
    for piece in pieces:
        r, c = parser.feed(piece)
        reasoning.append(r)
        content.append(c)
    r, c = parser.finish()
    assert parser.finish() == ("", "")
    return "".join(reasoning + [r]), "".join(content + [c])


# (parser, text, start_in_reasoning, expected reasoning, expected content)
CASES = [
    ("think", "<think>\nLet me 想 🤔 </thin</think>\n\nAnswer 😀", False,
     "\nLet me 想 🤔 </thin", "\n\nAnswer 😀"),
    ("think", "\n<think>a</think>b <think>c</think>", False, "a", "b <think>c</think>"),
    ("think", "No reasoning here <", False, "", "No reasoning here <"),
    ("think", "  <thi", False, "", "  <thi"),
    ("think", "Reasoning 中 with no start tag</think>Answer", True,
     "Reasoning 中 with no start tag", "Answer"),
    ("think", "\n<think>Repeated start tag</think>Answer", True, "Repeated start tag", "Answer"),
    ("think", "cut off inside reasoning </th", True, "cut off inside reasoning </th", ""),
    ("think", "<think>never closed <", False, "never closed <", ""),
    ("kimi", "◁think▷推理 😀◁/think▷回答", False, "推理 😀", "回答"),
    ("kimi", "<think>plan</think>done", False, "plan", "done"),
    ("kimi", "plan<|tool_calls_section_begin|><|tool_call_begin|>", True,
     "plan", "<|tool_calls_section_begin|><|tool_call_begin|>"),
]  # fmt: skip


@pytest.mark.parametrize("name,text,opened,reasoning,content", CASES)
def test_every_split_gives_the_same_reasoning_and_content(
    name: str, text: str, opened: bool, reasoning: str, content: str
) -> None:
    assert run(name, [text], opened) == (reasoning, content)
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            pieces = [text[:i], text[i:j], text[j:]]
            assert run(name, pieces, opened) == (reasoning, content), pieces
    assert run(name, list(text), opened) == (reasoning, content)


def test_long_reasoning_under_random_splits() -> None:
    rng = random.Random(0)
    # Near-misses of the end tag, never the tag itself.
    body = "".join(
        rng.choice(["思考", "😀", "<", "</", "</thi", "k>", " ", "x"]) for _ in range(3000)
    )
    text = "<think>" + body + "</think>" + "答案 " * 200
    expected = run("think", [text])
    assert expected[0] == body
    for _ in range(40):
        pieces, pos = [], 0
        while pos < len(text):
            size = rng.randint(0, 30)
            pieces.append(text[pos : pos + size])
            pos += size
        assert run("think", pieces) == expected


def test_reasoning_streams_without_waiting_for_the_end_tag() -> None:
    parser = make_reasoning_parser("think")
    assert parser.feed("<think>step one") == ("step one", "")
    assert parser.feed(", step two </") == (", step two ", "")
    assert parser.feed("think>Answer") == ("", "Answer")


def test_prompt_opens_reasoning() -> None:
    think = reasoning_parser_class("think")
    assert think.prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not think.prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not think.prompt_opens_reasoning("<|im_start|>user\nhi<|im_end|>\n")
    assert KimiReasoningParser.prompt_opens_reasoning("<|im_assistant|>assistant◁think▷")


def test_unknown_reasoning_parser_names_the_field() -> None:
    with pytest.raises(ValueError, match="reasoning_parser"):
        make_reasoning_parser("nope")


def chat(pieces: list[str], tools: str = "hermes", reasoning: str = "think") -> tuple:
    parser = ChatOutputParser(
        make_reasoning_parser(reasoning),
        make_tool_call_parser(tools, call_id_factory=lambda i: f"id{i}"),
    )
    deltas = []
    for piece in pieces:
        deltas += parser.feed(piece)
    deltas += parser.finish()
    message = collect(deltas)
    calls = [(c.id, c.name, c.arguments) for c in message.tool_calls]
    return message.reasoning, message.content, calls, parser.num_tool_calls


def test_reasoning_then_tool_call_in_one_delta_under_every_split() -> None:
    text = (
        '<think>Need weather 🌧</think>\n\n<tool_call>\n{"name": "w", "arguments": '
        '{"c": "巴黎"}}\n</tool_call>'
    )
    expected = ("Need weather 🌧", "", [("id0", "w", '{"c": "巴黎"}')], 1)
    assert chat([text]) == expected
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            assert chat([text[:i], text[i:j], text[j:]]) == expected


def test_kimi_reasoning_ends_at_the_tool_section() -> None:
    text = (
        "◁think▷plan◁/think▷Sure.<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"
        '<|tool_call_argument_begin|>{"a": 1}<|tool_call_end|><|tool_calls_section_end|>'
    )
    implicit = text.replace("◁/think▷Sure.", "")
    assert chat([text], "kimi_k2", "kimi") == (
        "plan",
        "Sure.",
        [("functions.f:0", "f", '{"a": 1}')],
        1,
    )
    for pieces in ([implicit], list(implicit)):
        assert chat(pieces, "kimi_k2", "kimi") == (
            "plan",
            "",
            [("functions.f:0", "f", '{"a": 1}')],
            1,
        )


def test_chat_output_without_parsers_passes_text_through() -> None:
    parser = ChatOutputParser()
    assert collect(parser.feed("<think>x</think><tool_call>") + parser.finish()).content == (
        "<think>x</think><tool_call>"
    )


def test_a_tool_call_marker_ends_open_reasoning_under_every_split() -> None:
    """Issue 20: `plan<tool_call>…` with the block opened by the prompt and never closed."""
    text = 'plan 🤔<tool_call>{"name": "w", "arguments": {"c": "</think>"}}</tool_call>'
    expected = ("plan 🤔", "", [("id0", "w", '{"c": "</think>"}')], 1)
    parser_pieces = [[text], list(text)] + [[text[:i], text[i:]] for i in range(len(text) + 1)]
    for pieces in parser_pieces:
        parser = ChatOutputParser(
            make_reasoning_parser("think", start_in_reasoning=True),
            make_tool_call_parser("hermes", call_id_factory=lambda i: f"id{i}"),
        )
        deltas = [d for piece in pieces for d in parser.feed(piece)] + parser.finish()
        message = collect(deltas)
        calls = [(c.id, c.name, c.arguments) for c in message.tool_calls]
        assert (message.reasoning, message.content, calls, parser.num_tool_calls) == expected


CHAT_FUZZ_ATOMS = ["<think>", "</think>", "</thi", "<tool_call>", "</tool_call>", '{"name": "w"',
                   ', "arguments": ', "{", "}", '"', "x 中", "😀", "\n", " ", "<"]  # fmt: skip


@pytest.mark.parametrize("opened", [False, True])
def test_reasoning_and_calls_are_split_invariant_on_random_output(opened: bool) -> None:
    rng = random.Random(int(opened))
    for _ in range(300):
        text = "".join(rng.choice(CHAT_FUZZ_ATOMS) for _ in range(rng.randint(1, 20)))
        results = []
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, 4)))
        for pieces in ([text], list(text), [text[a:b] for a, b in zip([0, *cuts], [*cuts, None])]):
            parser = ChatOutputParser(
                make_reasoning_parser("think", start_in_reasoning=opened),
                make_tool_call_parser("hermes", call_id_factory=lambda i: f"id{i}"),
            )
            deltas = [d for piece in pieces for d in parser.feed(piece)] + parser.finish()
            results.append(collect(deltas))
        assert results[0] == results[1] == results[2], text
