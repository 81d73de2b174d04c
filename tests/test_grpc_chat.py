"""Chat over gRPC: a Qwen-style chat template with tools (rendered, tokenized without a
second BOS, and generated from), and reasoning and tool-call deltas from scripted model
output played back by a fake engine, split every way, through the real server and client.
Hold-backs (a partial marker, a possible stop string) are flushed at finish and at abort."""

from __future__ import annotations

import itertools
import json
import random
import shutil
import threading
import time

import grpc
import pytest

from kvloom import LLM, SamplingParams
from kvloom.client import ChatDelta, Client, GenerateDelta, ServerError, collect
from kvloom.cluster.engine import OutputEngine
from kvloom.cluster.frontend import BackgroundServer, ServerOptions, engine_factory
from kvloom.cluster.outputs import EngineCoreOutput
from kvloom.cluster.parsers import ChatOutputParser, make_reasoning_parser, make_tool_call_parser
from kvloom.cluster.parsers import collect as collect_parsed
from kvloom.cluster.tokenizer import Tokenizer
from kvloom.contracts.config import EngineConfig

# A Qwen2.5-style template, written for this test: tools listed in the system turn, calls as
# <tool_call> JSON, tool results in a user turn. It prints arguments with `tojson`, so
# arguments given as JSON text must reach it as a dict (or they would be encoded twice).
QWEN_STYLE_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call functions. Their signatures are in <tools></tools>:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nCall one as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for call in message.tool_calls or [] %}
{%- set fn = call.function if call.function is defined else call %}
{{- '\\n<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' + (fn.arguments | tojson) + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "get_time", "description": "The time now."}},
]
HISTORY = [
    {"role": "system", "content": "You are a weather bot."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
    {"role": "user", "content": "Thanks! And in 東京?"},
]
EXPECTED_PROMPT = (
    "<|im_start|>system\nYou are a weather bot.\n\n# Tools\n\nYou may call functions. "
    "Their signatures are in <tools></tools>:\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Current weather '
    'in a city.", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, '
    '"required": ["city"]}}}\n'
    '{"type": "function", "function": {"name": "get_time", "description": "The time now.", '
    '"parameters": {"type": "object", "properties": {}}}}\n'
    '</tools>\n\nCall one as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n'
    "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
    '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
    "\n</tool_call><|im_end|>\n"
    '<|im_start|>user\n<tool_response>\n{"temp_c": 21}\n</tool_response><|im_end|>\n'
    "<|im_start|>user\nThanks! And in 東京?<|im_end|>\n"
    "<|im_start|>assistant\n"
)
ENGINE = dict(dtype="float64", block_size=4, max_model_len=512, num_kv_blocks=512)


# ----- the Qwen-style template on a real model


@pytest.fixture(scope="module")
def qwen_style_model(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen-style") / "model"
    shutil.copytree(tiny_model("llama"), out)
    (out / "chat_template.jinja").write_text(QWEN_STYLE_TEMPLATE, encoding="utf-8")
    return str(out)


@pytest.fixture(scope="module")
def qwen_server(qwen_style_model):
    options = ServerOptions(
        model=qwen_style_model, host="127.0.0.1", port=0, tool_call_parser="hermes"
    )
    factory = engine_factory(model=qwen_style_model, progress=False, **ENGINE)
    with BackgroundServer(factory, options) as server:
        yield server


def test_qwen_style_template_renders_tools_and_history(qwen_server, qwen_style_model):
    with Client(qwen_server.address, timeout=60) as client:
        prompt, ids = client.render_chat(HISTORY, TOOLS)
        info = client.model_info()
    assert prompt == EXPECTED_PROMPT
    # Templates write their own special tokens: encoded as is, never a second BOS.
    assert ids == Tokenizer(qwen_style_model).encode(EXPECTED_PROMPT, add_special_tokens=False)
    assert info.has_chat_template and info.tool_call_parser == "hermes"


def test_chat_with_tools_generates_from_the_rendered_prompt(qwen_server, qwen_style_model):
    llm = LLM(model=qwen_style_model, progress=False, **ENGINE)
    ids = Tokenizer(qwen_style_model).encode(EXPECTED_PROMPT, add_special_tokens=False)
    sampling = dict(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = llm.generate({"prompt_token_ids": ids}, SamplingParams(**sampling))[0]
    with Client(qwen_server.address, timeout=60) as client:
        result = collect(client.chat(HISTORY, TOOLS, **sampling))
    assert result.token_ids == expected.outputs[0].token_ids
    assert result.usage.prompt_tokens == len(ids)
    assert result.finish_reason == "length"


def test_tool_choice_none_offers_no_tools(qwen_server):
    with Client(qwen_server.address, timeout=60) as client:
        prompt, _ = client.render_chat(HISTORY, TOOLS, tool_choice="none")
        named, _ = client.render_chat(
            HISTORY, TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}
        )
    assert "<tools>" not in prompt and prompt.startswith(
        "<|im_start|>system\nYou are a weather bot.<|im_end|>"
    )
    assert '"get_time"' in named and '"get_weather", "description"' not in named


# ----- scripted output through the real server


class ScriptedTokenizer:
    """Decodes the scripted core's token ids to their chunks (any other id to nothing), so
    the front door's output processor turns each step's ids into that step's chunk."""

    def __init__(self) -> None:
        self.pieces: dict[int, str] = {}

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(self.pieces.get(i, "") for i in ids)


class ScriptedCore:
    """Plays back scripted text: a request whose id is in `scripts` gets one chunk per step
    (one token id each, decoded to it by `ScriptedTokenizer`), then finishes with "stop";
    ids in `hang` never finish."""

    _ids = itertools.count(1000)

    def __init__(self, model_dir: str, scripts: dict[str, list[str]], hang: set[str]) -> None:
        self.config = EngineConfig.from_kwargs(model=model_dir, max_model_len=512)
        self.scripts = scripts
        self.hang = hang
        self.tokenizer = ScriptedTokenizer()
        self.active: dict[str, list[str]] = {}

    def add_request(self, request_id, prompt_token_ids, params, *_) -> None:
        self.active[request_id] = list(self.scripts.get(request_id, ["ok"]))

    def step(self) -> list[EngineCoreOutput]:
        outputs = []
        for request_id, chunks in list(self.active.items()):
            if not chunks:
                continue
            token_id = next(self._ids)
            self.tokenizer.pieces[token_id] = chunks.pop(0)
            done = not chunks and request_id not in self.hang
            outputs.append(EngineCoreOutput(request_id, [token_id], None, "stop" if done else None))
            if done:
                del self.active[request_id]
        if not outputs:
            time.sleep(0.002)  # only hanging requests: do not spin
        return outputs

    def abort_requests(self, request_ids, stopped=False) -> None:
        for request_id in request_ids:
            self.active.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.active)

    def stats(self) -> dict:
        return dict(
            num_blocks=1,
            num_free_blocks=1,
            kv_cache_usage=0.0,
            num_running=len(self.active),
            num_waiting=0,
        )

    def shutdown(self) -> None:
        pass


class ScriptedEngine(OutputEngine):
    """The engine interface (and the front door's real output processor) over ScriptedCore."""

    def __init__(self, model_dir: str, scripts: dict[str, list[str]], hang: set[str]) -> None:
        core = ScriptedCore(model_dir, scripts, hang)
        super().__init__(core, core.tokenizer)


@pytest.fixture(scope="module")
def scripted(demo_tokenizer_dir):
    """(server, scripts, hang): the demo model's files, think + hermes parsers."""
    scripts: dict[str, list[str]] = {}
    hang: set[str] = set()
    model = str(demo_tokenizer_dir)
    options = ServerOptions(
        model=model, host="127.0.0.1", port=0, tool_call_parser="hermes", reasoning_parser="think"
    )
    with BackgroundServer(lambda: ScriptedEngine(model, scripts, hang), options) as server:
        # Every step's output is delivered (no skipping to the newest when the stream falls
        # behind the instant fake engine), so each split below reaches the parsers as is.
        server.server.engine.coalesce = False
        yield server, scripts, hang


REASONING_AND_CALLS = (
    "<think>\nThe user wants the weather in Paris and the time: two calls. ünïcødé ✓\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
    '"note": "a </tool_call> inside a string"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


def splits(text: str) -> dict[str, list[str]]:
    """Fixed-width chunks (1 character up to the whole text) and random multi-size ones."""
    ways = {f"w{k}": [text[i : i + k] for i in range(0, len(text), k)] for k in (1, 2, 3, 5, 8, 13)}
    ways["whole"] = [text]
    for seed in range(4):
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(1, len(text)), min(12, len(text) - 1)))
        ways[f"r{seed}"] = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    return ways


def one_piece(text: str, tools: bool = True):
    parser = ChatOutputParser(
        make_reasoning_parser("think"), make_tool_call_parser("hermes") if tools else None
    )
    return collect_parsed(parser.feed(text) + parser.finish())


def run_chat(server, scripts, request_id: str, chunks: list[str], tools=TOOLS, **kwargs):
    scripts[request_id] = chunks
    with Client(server.address, timeout=60) as client:
        messages = [{"role": "user", "content": "Weather in Paris, and the time?"}]
        return list(client.chat(messages, tools, request_id=request_id, **kwargs))


def test_reasoning_and_tool_calls_stream_the_same_for_every_split(scripted):
    server, scripts, _ = scripted
    expected = one_piece(REASONING_AND_CALLS)
    assert expected.reasoning.strip().startswith("The user wants the weather in Paris")
    assert expected.content == ""
    assert [c.name for c in expected.tool_calls] == ["get_weather", "get_time"]
    assert json.loads(expected.tool_calls[0].arguments) == {
        "city": "Paris",
        "note": "a </tool_call> inside a string",
    }
    assert json.loads(expected.tool_calls[1].arguments) == {}
    for name, chunks in splits(REASONING_AND_CALLS).items():
        events = run_chat(server, scripts, f"calls-{name}", chunks)
        result = collect(events)
        assert result.reasoning == expected.reasoning, name
        assert result.content == expected.content, name
        assert [(c.name, c.arguments) for c in result.tool_calls] == [
            (c.name, c.arguments) for c in expected.tool_calls
        ], name
        assert result.finish_reason == "tool_calls", name
        assert len(result.token_ids) == len(chunks), name  # one per step
        # The streaming contract: a call's id and name once, first; then argument fragments.
        deltas = [e for e in events if isinstance(e, ChatDelta)]
        starts = [c for d in deltas for c in d.tool_calls if c.name is not None]
        assert [(c.index, c.name) for c in starts] == [(0, "get_weather"), (1, "get_time")]
        assert all(c.id and c.id.startswith("call_") for c in starts)
        assert len({c.id for c in starts}) == 2
        if name == "w1":
            fragments = [c for d in deltas for c in d.tool_calls if c.index == 0 and c.arguments]
            assert len(fragments) > 5, "arguments should stream, not arrive at the end"
            assert sum(bool(d.reasoning) for d in deltas) > 5


@pytest.mark.parametrize(
    "text", ["The answer is 42 <", "see <tool_c", "<thi", "<|", 'fine\n\n<tool_call>\n{"na']
)
def test_partial_marker_at_the_end_is_flushed(scripted, text):
    """Text ending in what could start a marker is held back while streaming, and comes
    out as content when the stream ends (none of these is a complete call)."""
    server, scripts, _ = scripted
    for i, (name, chunks) in enumerate(splits(text).items()):
        result = collect(run_chat(server, scripts, f"tail-{i}-{name}", chunks))
        assert (result.content, result.reasoning, result.tool_calls) == (text, "", []), name
        assert result.finish_reason == "stop"


def test_reasoning_parsing_off_gives_content(scripted):
    server, scripts, _ = scripted
    text = "<think>hmm</think>Paris is sunny."
    result = collect(
        run_chat(server, scripts, "no-reasoning", list(text), tools=None, parse_reasoning=False)
    )
    assert result.content == text and result.reasoning == ""
    result = collect(run_chat(server, scripts, "reasoning", list(text), tools=None))
    assert result.content == "Paris is sunny." and result.reasoning == "hmm"
    assert result.finish_reason == "stop"


def _wait_tokens(events: list, num_tokens: int) -> None:
    deadline = time.monotonic() + 30
    while sum(len(getattr(e, "token_ids", [])) for e in list(events)) < num_tokens:
        assert time.monotonic() < deadline, events
        time.sleep(0.01)


def test_abort_flushes_a_held_back_partial_marker(scripted):
    server, scripts, hang = scripted
    rid = "hang-chat"
    scripts[rid] = ["Hello wor", "ld <tool_c"]
    hang.add(rid)
    events: list = []
    with Client(server.address, timeout=60) as client:
        messages = [{"role": "user", "content": "hi"}]
        stream = client.chat(messages, TOOLS, request_id=rid)
        thread = threading.Thread(target=lambda: events.extend(stream), daemon=True)
        thread.start()
        _wait_tokens(events, 2)
        assert "<" not in collect(list(events)).content  # held back: it may open a call
        assert client.abort(rid) == [rid]
        thread.join(30)
    result = collect(events)
    assert result.content == "Hello world <tool_c"
    assert result.finish_reason == "abort"
    assert result.usage.completion_tokens == 2


def test_abort_flushes_a_held_back_stop_string_prefix(scripted):
    server, scripts, hang = scripted
    rid = "hang-generate"
    scripts[rid] = ["abc S", "T"]
    hang.add(rid)
    events: list = []
    with Client(server.address, timeout=60) as client:
        stream = client.generate([5, 6, 7], request_id=rid, stop=["STOP"])
        thread = threading.Thread(target=lambda: events.extend(stream), daemon=True)
        thread.start()
        _wait_tokens(events, 2)
        assert "".join(e.text for e in list(events) if isinstance(e, GenerateDelta)) == "abc "
        assert client.abort(rid) == [rid]
        thread.join(30)
    result = collect(events)
    assert result.text == "abc ST" and result.finish_reason == "abort"


def test_chat_needs_a_template_and_tools_need_a_parser(demo_tokenizer_dir, tmp_path):
    plain = tmp_path / "no-template"
    shutil.copytree(demo_tokenizer_dir, plain)
    config_file = plain / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    del config["chat_template"]
    config_file.write_text(json.dumps(config), encoding="utf-8")
    messages = [{"role": "user", "content": "hi"}]
    for model, has_template in ((plain, False), (demo_tokenizer_dir, True)):
        options = ServerOptions(
            model=str(model),
            host="127.0.0.1",
            port=0,
            tool_call_parser="none",
            reasoning_parser="none",
        )
        factory = lambda m=str(model): ScriptedEngine(m, {}, set())  # noqa: E731
        with (
            BackgroundServer(factory, options) as server,
            Client(server.address, timeout=30) as client,
        ):
            assert client.model_info().has_chat_template is has_template
            if not has_template:
                for call in (
                    lambda: collect(client.chat(messages)),
                    lambda: client.render_chat(messages),
                ):
                    with pytest.raises(ServerError) as info:
                        call()
                    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
                    assert info.value.details.startswith("messages:")
                assert collect(client.generate("hi")).text == "ok"  # raw generation still works
            else:
                with pytest.raises(ServerError) as info:
                    collect(client.chat(messages, TOOLS))
                assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
                assert info.value.details.startswith("tools:")
                assert collect(client.chat(messages)).content == "ok"
