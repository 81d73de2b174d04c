"""Forced tool choice (`tool_choice="required"` or a named tool), enforced by a grammar of
the tool-call parser's format: every sentence of each format's grammar parses, with that
format's parser, as calls to offered tools with schema-valid arguments (random walks through
the grammar); on a tiny random-weight model (its free output is noise, so any structure comes
from the grammar) offline `LLM.chat`, gRPC and HTTP always return such calls, the named one
when named, for several seeds; what cannot be enforced is INVALID_ARGUMENT naming tool_choice.
"""

from __future__ import annotations

import json
import random

import grpc
import jsonschema
import numpy as np
import openai
import pytest

from kvloom import LLM, SamplingParams, StructuredOutputsParams
from kvloom.client import Client, ServerError, collect
from kvloom.cluster.frontend import BackgroundServer, ServerOptions, engine_factory
from kvloom.cluster.frontend.chat_request import (
    ChatInputs,
    chat_inputs,
    constrain_to_tool_choice,
    reasoning_room,
)
from kvloom.cluster.frontend.errors import InvalidArgument
from kvloom.cluster.parsers import collect as collect_deltas
from kvloom.cluster.parsers import make_tool_call_parser
from kvloom.cluster.parsers.registry import TOOL_CALL_PARSER_ALIASES, TOOL_CALL_PARSERS
from kvloom.cluster.structured_outputs.compiler import GrammarCompilers
from kvloom.cluster.structured_outputs.tool_call_grammar import (
    CALL_FORMATS,
    ReasoningRoom,
    ToolChoiceError,
    forced_tool_choice,
    tool_call_structural_tag,
)

VOCAB, EOS = 512, 2
ENGINE = dict(dtype="float32", block_size=4, max_model_len=2048, num_kv_blocks=2048)
# Bounded values (enums, ranges, maxLength): a noise model's free strings and digits would
# otherwise run on to max_tokens.
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "alerts": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {
        "zone": {"type": "string", "enum": ["utc", "cet"]},
        "exact": {"type": "boolean"},
    },
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
    {"type": "function", "function": {"name": "ping", "description": "No arguments."}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME, "ping": {"type": "object", "maxProperties": 0}}
NAMED = {"type": "function", "function": {"name": "get_time"}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def check_calls(calls, named: str | None = None) -> None:
    """calls: (name, arguments JSON text) pairs, as a client reads them."""
    assert calls, "no tool call"
    if named is not None:
        assert [name for name, _ in calls] == [named]
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def parsed(parser: str, text: str):
    tool_parser = make_tool_call_parser(parser, tools=TOOLS)
    return collect_deltas(tool_parser.feed(text) + tool_parser.finish())


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return str(tiny_model("llama"))  # the demo tokenizer and its ChatML (hermes) template


# -- the grammars, walked at random ---------------------------------------------------
@pytest.fixture(scope="module")
def compiler(model_dir):
    compilers = GrammarCompilers(model_dir, VOCAB, [EOS])
    yield compilers.compiler()
    compilers.shutdown()


def random_sentence(compiled, tokenizer, seed: int, limit: int = 800) -> str:
    """A sentence of the grammar drawn token by token among the tokens it allows (the stop
    token, where allowed, with probability 0.3, so `required` also ends)."""
    import xgrammar

    rng = random.Random(seed)
    matcher = xgrammar.GrammarMatcher(compiled)
    bitmask = xgrammar.allocate_token_bitmask(1, VOCAB)
    tokens: list[int] = []
    for _ in range(limit):
        matcher.fill_next_token_bitmask(bitmask)
        bits = np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")
        allowed = np.flatnonzero(bits[:VOCAB]).tolist()
        token = EOS if EOS in allowed and rng.random() < 0.3 else rng.choice(allowed)
        assert matcher.accept_token(token)
        if matcher.is_terminated():
            return tokenizer.decode(tokens)
        tokens.append(token)
    raise AssertionError(f"no sentence in {limit} tokens: {tokenizer.decode(tokens)!r}")


def test_every_parser_of_kvloom_has_a_call_grammar():
    # Plus a variant's own where it writes another form (deepseek_v31).
    assert set(TOOL_CALL_PARSERS) <= set(CALL_FORMATS)
    assert set(CALL_FORMATS) <= set(TOOL_CALL_PARSERS) | set(TOOL_CALL_PARSER_ALIASES)


@pytest.mark.parametrize("named", [None, "get_time"], ids=["required", "named"])
@pytest.mark.parametrize("parser", sorted(CALL_FORMATS))
def test_every_sentence_of_the_grammar_parses_as_offered_calls(compiler, model_dir, parser, named):
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    compiled = compiler.compile_structural_tag(tool_call_structural_tag(parser, TOOLS, named))
    names = set()
    for seed in range(25):
        text = random_sentence(compiled, tokenizer, seed)
        message = parsed(parser, text)
        assert message.content.strip() == "", (text, message)
        check_calls([(c.name, c.arguments) for c in message.tool_calls], named)
        names.update(c.name for c in message.tool_calls)
    assert names == ({named} if named else set(SCHEMAS))  # every offered tool is reachable


def accepts(compiler, tag: str, text: str) -> bool:
    """Whether `text`, then the stop token, is a whole sentence of the grammar."""
    import xgrammar

    matcher = xgrammar.GrammarMatcher(compiler.compile_structural_tag(tag))
    return matcher.accept_string(text) and matcher.accept_token(EOS) and matcher.is_terminated()


CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>'


def test_reasoning_comes_first_where_the_request_parses_it(compiler):
    """With a reasoning parser, the grammar leaves the model a free reasoning block before
    the calls (vLLM constrains what follows the reasoning); the calls still must come."""
    fresh = tool_call_structural_tag(
        "hermes", TOOLS, reasoning=ReasoningRoom("<think>", "</think>")
    )
    assert accepts(compiler, fresh, CALL)
    assert accepts(compiler, fresh, "<think>plan: get_time.</think>\n\n" + CALL)
    assert not accepts(compiler, fresh, "<think>plan</think>\n\nno call")
    assert not accepts(compiler, fresh, "<think>plan</think>")
    assert not accepts(compiler, fresh, "<think>a <tool_call> inside</think>" + CALL)
    opened = ReasoningRoom("<think>", "</think>", opened=True)
    in_block = tool_call_structural_tag("hermes", TOOLS, reasoning=opened)
    assert accepts(compiler, in_block, "plan</think>\n" + CALL)
    assert accepts(compiler, in_block, CALL)  # the call marker ends the block
    assert not accepts(compiler, in_block, "<think>plan</think>" + CALL + "</think>")
    # No marker to end the block in llama3_json: the block must be closed first.
    llama = tool_call_structural_tag("llama3_json", TOOLS, reasoning=opened)
    llama_call = '{"name": "ping", "parameters": {}}'
    assert accepts(compiler, llama, "plan</think>" + llama_call)
    assert not accepts(compiler, llama, llama_call)
    # What the grammar lets through parses as reasoning then the call.
    from kvloom.cluster.parsers import ChatOutputParser, make_reasoning_parser

    chat = ChatOutputParser(
        reasoning=make_reasoning_parser("think", start_in_reasoning=True),
        tool_calls=make_tool_call_parser("hermes", tools=TOOLS),
    )
    message = collect_deltas(chat.feed("plan</think>\n" + CALL) + chat.finish())
    assert message.reasoning == "plan" and message.content.strip() == ""
    check_calls([(c.name, c.arguments) for c in message.tool_calls], "get_time")


def test_reasoning_room_follows_the_server_parser_and_the_request():
    from kvloom.protos.kvloom.v1 import generation_pb2 as pb

    request = pb.ChatRequest()
    assert reasoning_room(None, request, "<think>") is None
    assert reasoning_room("think", request, "hi") == ReasoningRoom("<think>", "</think>")
    assert reasoning_room("think", request, "<|im_start|>assistant\n<think>\n").opened
    request.parse_reasoning = False
    assert reasoning_room("think", request, "<think>") is None


def test_aliases_resolve_and_what_cannot_be_enforced_names_tool_choice():
    assert tool_call_structural_tag("qwen", TOOLS) == tool_call_structural_tag("hermes", TOOLS)
    with pytest.raises(
        ToolChoiceError, match="tool_choice: cannot be enforced with the 'pythonic'"
    ):
        tool_call_structural_tag("pythonic", TOOLS)
    with pytest.raises(ToolChoiceError, match="tool_choice: 'nope' is not one of the tools"):
        tool_call_structural_tag("hermes", TOOLS, "nope")
    bad = [
        {
            "type": "function",
            "function": {"name": "f", "parameters": {"properties": {"a": {"type": "nonsense"}}}},
        }
    ]
    with pytest.raises(ToolChoiceError, match="the parameters schema of tool 'f' does not compile"):
        tool_call_structural_tag("hermes", bad)
    scalar = [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]
    with pytest.raises(ToolChoiceError, match="parameters of tool 'f' must be an object schema"):
        tool_call_structural_tag("mistral", scalar)


def test_structural_tag_is_a_constraint_of_its_own():
    tag = tool_call_structural_tag("hermes", TOOLS)
    params = StructuredOutputsParams(structural_tag=tag)
    assert (params.kind, params.spec) == ("structural_tag", tag)
    with pytest.raises(ValueError, match="structured_outputs.structural_tag must be"):
        StructuredOutputsParams(structural_tag="")
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(structural_tag=tag, regex="a")


def test_offline_tool_choice_values():
    assert forced_tool_choice(TOOLS, None) == (TOOLS, None)
    assert forced_tool_choice(TOOLS, "auto") == (TOOLS, None)
    assert forced_tool_choice(TOOLS, "none") == (None, None)
    assert forced_tool_choice(TOOLS, "required") == (TOOLS, True)
    assert forced_tool_choice(TOOLS, NAMED) == ([TOOLS[1]], "get_time")
    for choice, message in (
        ("sometimes", '"auto", "none", "required"'),
        ({"type": "function", "function": {"name": "x"}}, "'x' is not one of the tools"),
    ):
        with pytest.raises(ToolChoiceError, match=message):
            forced_tool_choice(TOOLS, choice)
    with pytest.raises(ToolChoiceError, match="needs tools"):
        forced_tool_choice(None, "required")


def test_a_forced_choice_does_not_combine_with_structured_outputs():
    inputs = ChatInputs(messages=MESSAGES, tools=TOOLS, calls_forced=True)
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True))
    with pytest.raises(InvalidArgument) as err:
        constrain_to_tool_choice(params, inputs, "hermes")
    assert err.value.field == "tool_choice"
    with pytest.raises(InvalidArgument) as err:
        constrain_to_tool_choice(SamplingParams(), inputs, "pythonic")
    assert err.value.field == "tool_choice"
    free = SamplingParams()
    unforced = ChatInputs(messages=MESSAGES, tools=TOOLS)
    assert constrain_to_tool_choice(free, unforced, "hermes") is free


# -- offline --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model=model_dir, progress=False, **ENGINE)


@pytest.mark.parametrize("parser", ["hermes", "qwen3_coder"])
def test_llm_chat_forced_calls_for_random_seeds(llm, parser):
    seeds = range(6)
    for choice, named in (("required", None), (NAMED, "get_time")):
        params = [SamplingParams(max_tokens=600, seed=s) for s in seeds]
        outs = llm.chat(
            [MESSAGES] * len(params),
            params,
            use_tqdm=False,
            tools=TOOLS,
            tool_choice=choice,
            tool_call_parser=None if parser == "hermes" else parser,  # hermes: the template's
        )
        for out in outs:
            completion = out.outputs[0]
            assert completion.finish_reason == "stop", completion
            message = parsed(parser, completion.text)
            assert message.content.strip() == "", completion.text
            check_calls([(c.name, c.arguments) for c in message.tool_calls], named)


def test_llm_chat_tool_choice_none_renders_no_tools(llm):
    params = SamplingParams(max_tokens=1)
    none = llm.chat(MESSAGES, params, use_tqdm=False, tools=TOOLS, tool_choice="none")
    bare = llm.chat(MESSAGES, params, use_tqdm=False)
    offered = llm.chat(MESSAGES, params, use_tqdm=False, tools=TOOLS)
    assert none[0].prompt_token_ids == bare[0].prompt_token_ids
    assert offered[0].prompt_token_ids != bare[0].prompt_token_ids
    with pytest.raises(ValueError, match="tool_choice: a forced tool choice cannot be combined"):
        llm.chat(
            MESSAGES,
            SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True)),
            tools=TOOLS,
            tool_choice="required",
        )


# -- the doors ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(model_dir):
    options = ServerOptions(model=model_dir, host="127.0.0.1", port=0, http_port=0)
    with BackgroundServer(engine_factory(model=model_dir, progress=False, **ENGINE), options) as s:
        yield s


def test_grpc_forced_calls_for_random_seeds(server):
    with Client(server.address, timeout=300) as client:
        for choice, named in (("required", None), (NAMED, "get_time")):
            for seed in range(3):
                result = collect(
                    client.chat(MESSAGES, TOOLS, tool_choice=choice, max_tokens=600, seed=seed)
                )
                assert result.finish_reason in ("stop", "tool_calls"), result
                assert result.text.strip() == "", result.text
                check_calls([(c.name, c.arguments) for c in result.tool_calls], named)
        with pytest.raises(ServerError) as err:
            collect(
                client.chat(
                    MESSAGES,
                    TOOLS,
                    tool_choice="required",
                    structured_outputs={"json_object": True},
                )
            )
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "tool_choice" in err.value.details


def test_grpc_forced_calls_in_the_xml_format(model_dir):
    """A server whose parser is qwen3_coder forces its XML calls, which it parses back
    into JSON arguments typed by the schema."""
    options = ServerOptions(
        model=model_dir, host="127.0.0.1", port=0, tool_call_parser="qwen3_coder"
    )
    factory = engine_factory(model=model_dir, progress=False, **ENGINE)
    with BackgroundServer(factory, options) as xml_server:
        client = Client(xml_server.address, timeout=300)
        try:
            for choice, named in (("required", None), (NAMED, "get_time")):
                for seed in range(2):
                    result = collect(
                        client.chat(MESSAGES, TOOLS, tool_choice=choice, max_tokens=600, seed=seed)
                    )
                    assert result.text.strip() == "", result.text
                    check_calls([(c.name, c.arguments) for c in result.tool_calls], named)
        finally:
            client.close()


def test_http_forced_calls_for_random_seeds(server):
    base_url = f"http://127.0.0.1:{server.server.http_port}/v1"
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0) as oai:
        model = oai.models.list().data[0].id
        for choice, named in (("required", None), (NAMED, "get_time")):
            for seed in range(3):
                reply = oai.chat.completions.create(
                    model=model,
                    messages=MESSAGES,
                    tools=TOOLS,
                    tool_choice=choice,
                    max_tokens=600,
                    seed=seed,
                )
                message = reply.choices[0].message
                assert reply.choices[0].finish_reason in ("stop", "tool_calls"), reply
                assert not (message.content or "").strip(), message
                calls = [(c.function.name, c.function.arguments) for c in message.tool_calls]
                check_calls(calls, named)
        with pytest.raises(openai.BadRequestError) as err:
            oai.chat.completions.create(
                model=model,
                messages=MESSAGES,
                tools=TOOLS,
                tool_choice="required",
                response_format={"type": "json_object"},
            )
        assert "tool_choice" in str(err.value)


# -- parallel_tool_calls ----------------------------------------------------------------
@pytest.mark.parametrize("parser", ["hermes", "kimi_k2", "mistral"])
def test_parallel_tool_calls_false_makes_required_exactly_one_call(compiler, model_dir, parser):
    """OpenAI's parallel_tool_calls: false: every sentence of the "required" grammar is
    one call, where the same random walks through the parallel grammar reach several."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    counts = {}
    for parallel in (True, False):
        tag = tool_call_structural_tag(parser, TOOLS, parallel=parallel)
        compiled = compiler.compile_structural_tag(tag)
        counts[parallel] = []
        for seed in range(25):
            message = parsed(parser, random_sentence(compiled, tokenizer, seed))
            check_calls([(c.name, c.arguments) for c in message.tool_calls])
            counts[parallel].append(len(message.tool_calls))
    assert set(counts[False]) == {1}
    assert max(counts[True]) > 1  # the walks do write several calls when allowed


def test_parallel_tool_calls_reaches_the_constraint_from_every_door():
    """The flag travels from HTTP's field and gRPC's to the grammar, and from LLM.chat."""
    from kvloom.cluster.frontend.http.request_models import ChatCompletionRequest
    from kvloom.cluster.frontend.http.to_proto import chat_request as chat_request_to_proto

    base = {"model": "m", "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required"}
    for field, want in ((None, True), (True, True), (False, False)):
        body = base if field is None else {**base, "parallel_tool_calls": field}
        request, _ = chat_request_to_proto(ChatCompletionRequest(**body), "r")
        assert chat_inputs(request).parallel_tool_calls is want
    request, _ = chat_request_to_proto(ChatCompletionRequest(**base), "r")
    request.parallel_tool_calls = False
    inputs = chat_inputs(request)
    constrained = constrain_to_tool_choice(SamplingParams(), inputs, "hermes")
    single = tool_call_structural_tag("hermes", inputs.tools, parallel=False)
    assert constrained.structured_outputs.structural_tag == single


def test_llm_chat_parallel_tool_calls_false_gives_one_call(llm):
    params = [SamplingParams(max_tokens=600, seed=s) for s in range(4)]
    outs = llm.chat(
        [MESSAGES] * len(params),
        params,
        use_tqdm=False,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
    )
    for out in outs:
        message = parsed("hermes", out.outputs[0].text)
        assert len(message.tool_calls) == 1, out.outputs[0].text
        check_calls([(c.name, c.arguments) for c in message.tool_calls])
