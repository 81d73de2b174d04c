"""The OpenAI-compatible HTTP door with the real `openai` client, against a real model: chat
and completions, streaming and not, give exactly the tokens the gRPC door and the offline
`LLM.generate` give for the same request (float64); usage, logprobs, stop strings, models,
health, metrics; bad requests raise the SDK's errors naming the field."""

from __future__ import annotations

import json
import math
import socket
import time
import urllib.error
import urllib.request

import openai
import pytest

from kvloom import LLM, SamplingParams
from kvloom.client import Client, collect
from kvloom.cluster.frontend import BackgroundServer, ServerOptions, engine_factory

ENGINE = dict(dtype="float64", block_size=4, max_model_len=256, num_kv_blocks=1024)
MODEL_NAME = "tiny-llama"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three colours."},
]


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return str(tiny_model("llama"))


@pytest.fixture(scope="module")
def server(model_dir):
    options = ServerOptions(
        model=model_dir,
        host="127.0.0.1",
        port=0,
        http_port=0,
        served_model_name=MODEL_NAME,
        tool_call_parser="hermes",
        reasoning_parser="think",
    )
    with BackgroundServer(engine_factory(model=model_dir, progress=False, **ENGINE), options) as s:
        yield s


@pytest.fixture(scope="module")
def base_url(server):
    return f"http://127.0.0.1:{server.server.http_port}"


@pytest.fixture(scope="module")
def oai(base_url):
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def grpc_client(server):
    with Client(server.address, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model=model_dir, progress=False, **ENGINE)


def offline(llm, prompt, **sampling):
    if isinstance(prompt, list):
        prompt = {"prompt_token_ids": prompt}
    return llm.generate(prompt, SamplingParams(**sampling))[0].outputs[0]


def assert_pool_full(server):
    stats = server.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"], stats
    assert stats["num_running"] == stats["num_waiting"] == 0, stats
    assert stats["num_in_flight"] == 0, stats


def test_chat_matches_grpc_and_offline_streaming_or_not(oai, grpc_client, llm, server):
    _, ids = grpc_client.render_chat(MESSAGES)
    expected = offline(llm, ids, max_tokens=20, temperature=0.0, ignore_eos=True)
    by_grpc = collect(grpc_client.chat(MESSAGES, max_tokens=20, temperature=0.0, ignore_eos=True))
    sampling = dict(max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    whole = oai.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, **sampling)
    choice = whole.choices[0]
    assert by_grpc.token_ids == expected.token_ids
    assert by_grpc.reasoning == "" and by_grpc.content == expected.text  # no markers here
    assert choice.message.content == expected.text
    assert choice.message.role == "assistant" and not choice.message.tool_calls
    assert choice.finish_reason == "length"
    assert whole.model == MODEL_NAME and whole.object == "chat.completion"
    assert whole.usage.prompt_tokens == len(ids)
    assert whole.usage.completion_tokens == 20
    assert whole.usage.total_tokens == len(ids) + 20

    chunks = list(
        oai.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            stream=True,
            stream_options={"include_usage": True},
            **sampling,
        )
    )
    deltas = [c for c in chunks if c.choices]
    assert deltas[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in deltas[1:])
    assert "".join(c.choices[0].delta.content or "" for c in deltas) == expected.text
    assert len(deltas) > 3  # it streams
    assert [c.choices[0].finish_reason for c in deltas][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")

    no_usage = list(
        oai.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, stream=True, **sampling)
    )
    assert all(c.usage is None and c.choices for c in no_usage)
    assert_pool_full(server)


@pytest.mark.parametrize("prompt_kind", ["text", "token_ids"])
def test_completions_match_grpc_and_offline(oai, grpc_client, llm, prompt_kind):
    prompt = "The quick brown fox" if prompt_kind == "text" else [5, 17, 230, 41, 9, 77]
    sampling = dict(max_tokens=16, temperature=0.0, ignore_eos=True)
    expected = offline(llm, prompt, **sampling)
    by_grpc = collect(grpc_client.generate(prompt, **sampling))
    assert by_grpc.token_ids == expected.token_ids and by_grpc.text == expected.text
    kwargs = dict(model=MODEL_NAME, prompt=prompt, max_tokens=16, temperature=0)
    kwargs["extra_body"] = {"ignore_eos": True}
    whole = oai.completions.create(**kwargs)
    assert whole.choices[0].text == expected.text
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 16
    chunks = list(oai.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_seeded_sampling_matches_offline(oai, llm):
    prompt = [7, 8, 9, 10, 11]
    sampling = dict(max_tokens=12, temperature=0.8, top_p=0.9, top_k=50, seed=11)
    expected = offline(llm, prompt, ignore_eos=True, **sampling)
    out = oai.completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=12,
        temperature=0.8,
        top_p=0.9,
        seed=11,
        extra_body={"top_k": 50, "ignore_eos": True},
    )
    assert out.choices[0].text == expected.text


def test_completions_default_to_16_tokens(oai):
    out = oai.completions.create(
        model=MODEL_NAME, prompt=[5, 6, 7], temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.usage.completion_tokens == 16


def test_logprobs_match_offline(oai, llm):
    prompt = [5, 6, 7, 8]
    expected = offline(llm, prompt, max_tokens=5, temperature=0.0, logprobs=3, ignore_eos=True)
    out = oai.completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=5,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == 5
    for got, token_id, entry in zip(lp.token_logprobs, expected.token_ids, expected.logprobs):
        assert math.isclose(got, entry[token_id].logprob, rel_tol=1e-6)
    assert all(len(top) <= 3 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0

    chat = oai.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.top_logprobs[0].logprob == entry.logprob  # greedy: the best is sampled
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token


def test_stop_string_cuts_the_text(oai, llm):
    prompt = [9, 10, 11, 12, 13]
    text = offline(llm, prompt, max_tokens=24, temperature=0.0, ignore_eos=True).text
    start = next(
        k
        for k in range(2, len(text) - 3)
        if text[k : k + 3].isascii()
        and text[k : k + 3].isprintable()
        and text.find(text[k : k + 3]) == k
    )
    stop = text[start : start + 3]
    kwargs = dict(model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0, stop=stop)
    kwargs["extra_body"] = {"ignore_eos": True}
    whole = oai.completions.create(**kwargs)
    assert whole.choices[0].text == text[:start]
    assert whole.choices[0].finish_reason == "stop"
    assert whole.choices[0].model_extra["stop_reason"] == stop
    streamed = "".join(c.choices[0].text for c in oai.completions.create(stream=True, **kwargs))
    assert streamed == text[:start]


def test_prefix_cache_hits_in_usage(oai):
    prompt = [5 + (j * 13) % 400 for j in range(21)]
    kwargs = dict(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0)
    assert oai.completions.create(**kwargs).usage.prompt_tokens_details.cached_tokens == 0
    assert oai.completions.create(**kwargs).usage.prompt_tokens_details.cached_tokens == 20


def test_models_health_and_metrics(oai, base_url, model_dir, server):
    models = oai.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert models[0].owned_by == "kvloom" and models[0].model_extra["max_model_len"] == 256
    assert models[0].model_extra["root"] == model_dir
    with urllib.request.urlopen(f"{base_url}/health", timeout=10) as response:
        assert response.status == 200
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        body = response.read().decode()
    samples = dict(line.rsplit(" ", 1) for line in body.splitlines() if not line.startswith("#"))
    assert samples["kvloom_ready"] == "1"
    assert samples["kvloom_kv_blocks"] == str(server.stats()["num_blocks"])
    # vLLM's names too, labelled with the served model name.
    label = f'{{model_name="{MODEL_NAME}"}}'
    assert samples[f"vllm:num_requests_running{label}"] == "0"
    hits = server.stats()["prefix_cache_hit_tokens"]
    assert samples[f"vllm:prefix_cache_hits_total{label}"] == str(hits)
    assert "# TYPE vllm:prefix_cache_queries_total counter" in body
    # The model may be named by its path as well as by its served name.
    out = oai.completions.create(model=model_dir, prompt=[5, 6], max_tokens=1)
    assert out.usage.completion_tokens == 1


def _post(base_url: str, path: str, body: bytes, headers=None) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"{base_url}{path}",
        data=body,
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


HI = [{"role": "user", "content": "hi"}]
# (what, create kwargs, SDK error, param); each names the OpenAI field the client wrote.
BAD_REQUESTS = [
    ("top_p", dict(messages=HI, top_p=5), openai.BadRequestError, "top_p"),
    ("temperature", dict(messages=HI, temperature=-1), openai.BadRequestError, "temperature"),
    ("max_tokens", dict(messages=HI, max_tokens=0), openai.BadRequestError, "max_tokens"),
    (
        "max_completion_tokens",
        dict(messages=HI, max_completion_tokens=-3),
        openai.BadRequestError,
        "max_completion_tokens",
    ),
    ("n", dict(messages=HI, n=2), openai.BadRequestError, "n"),
    ("no messages", dict(messages=[]), openai.BadRequestError, "messages"),
    ("role", dict(messages=[{"content": "hi"}]), openai.BadRequestError, "messages[0].role"),
    (
        "content part",
        dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        openai.BadRequestError,
        "messages[0].content[0]",
    ),
    (
        "tool name",
        dict(messages=HI, tools=[{"type": "function", "function": {"name": "no spaces"}}]),
        openai.BadRequestError,
        "tools[0].function.name",
    ),
    (
        "tool choice",
        dict(
            messages=HI,
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        ),
        openai.BadRequestError,
        "tool_choice.function.name",
    ),
    (
        "call arguments",
        dict(
            messages=[
                *HI,
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{"},
                        }
                    ],
                },
            ]
        ),
        openai.BadRequestError,
        "messages[1].tool_calls[0].function.arguments",
    ),
    ("top_logprobs", dict(messages=HI, top_logprobs=2), openai.BadRequestError, "top_logprobs"),
    ("logit_bias", dict(messages=HI, logit_bias={"5": 1.0}), openai.BadRequestError, "logit_bias"),
    (
        "response_format",
        dict(messages=HI, response_format={"type": "xml"}),
        openai.BadRequestError,
        "response_format.type",
    ),
    (
        "response_format schema",
        dict(messages=HI, response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
        openai.BadRequestError,
        "response_format.json_schema.schema",
    ),
    ("stop", dict(messages=HI, stop=[""]), openai.BadRequestError, "stop[0]"),
    ("seed", dict(messages=HI, seed=-1), openai.BadRequestError, "seed"),
    (
        "template kwargs",
        dict(messages=HI, extra_body={"chat_template_kwargs": {"messages": 1}}),
        openai.BadRequestError,
        "chat_template_kwargs.messages",
    ),
    (
        "request id",
        dict(messages=HI, extra_headers={"X-Request-Id": "r" * 300}),
        openai.BadRequestError,
        "X-Request-Id",
    ),
    ("model", dict(messages=HI, model="gpt-4o"), openai.NotFoundError, "model"),
    (
        "prompt too long",
        dict(messages=[{"role": "user", "content": "a " * 300}]),
        openai.BadRequestError,
        "prompt",
    ),
]


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_chat_requests_raise_the_sdk_error_naming_the_field(oai, server, case):
    _, kwargs, error, param = case
    kwargs = {"model": MODEL_NAME, **kwargs}
    with pytest.raises(error) as info:
        oai.chat.completions.create(**kwargs)
    assert info.value.param == param, info.value.body
    assert info.value.body["message"].startswith(param), info.value.body
    with pytest.raises(error) as info:  # the same before a stream starts
        oai.chat.completions.create(stream=True, **kwargs)
    assert info.value.param == param


def test_bad_completions_and_bodies(oai, base_url, server):
    for kwargs, param in (
        (dict(prompt=[]), "prompt"),
        (dict(prompt=[5, 100000]), "prompt"),
        (dict(prompt=["a", "b"]), "prompt"),
        (dict(prompt="hi", logprobs=100000), "logprobs"),
        (dict(prompt="hi", echo=True), "echo"),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            oai.completions.create(model=MODEL_NAME, **kwargs)
        assert info.value.param == param, info.value.body
    deep = b'{"model": "x", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for body, param, words in (
        (b"{not json", "body", "not valid JSON"),
        (b"[1, 2]", "body", "must be a JSON object"),
        (b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', "body", "UTF-8"),
        (deep, "body", "nested deeper"),
        (
            b'{"messages": [{"role": "user", "content": "a \\ud800 b"}]}',
            "messages[0].content",
            "lone surrogate",
        ),
        (b'{"messages": "hi"}', "messages", "valid list"),
    ):
        status, error = _post(base_url, "/v1/chat/completions", body)
        assert status == 400, (body[:60], error)
        assert error["error"]["param"] == param, error
        assert words in error["error"]["message"], error
        assert error["error"]["type"] == "invalid_request_error"
        assert error["error"]["code"] == "invalid_argument"
    status, error = _post(base_url, "/v1/nowhere", b"{}")
    assert status == 404 and error["error"]["type"] == "not_found_error"
    with pytest.raises(openai.NotFoundError):
        oai.embeddings.create(model=MODEL_NAME, input="hi")
    # Afterwards a normal request is served and nothing leaked.
    out = oai.chat.completions.create(model=MODEL_NAME, messages=HI, max_tokens=3)
    assert out.usage.completion_tokens == 3
    assert_pool_full(server)


def test_a_closed_stream_aborts_its_request(oai, server):
    stream = oai.completions.create(
        model=MODEL_NAME,
        prompt=[5, 6, 7],
        max_tokens=200,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    next(iter(stream))
    stream.close()
    begun = time.monotonic()
    while server.stats()["num_in_flight"] and time.monotonic() - begun < 30:
        time.sleep(0.05)
    stats = server.stats()
    assert stats["num_in_flight"] == 0 and stats["num_aborted"] >= 1
    assert_pool_full(server)


def test_port_in_use_is_an_error(model_dir):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        options = ServerOptions(model=model_dir, host="127.0.0.1", port=0, http_port=port)
        server = BackgroundServer(
            engine_factory(model=model_dir, progress=False, **ENGINE), options
        )
        with pytest.raises(OSError, match=f"HTTP port {port} is in use"):
            server.start()
    finally:
        holder.close()


def test_the_listening_socket_is_tcp_so_responses_are_not_delayed():
    """asyncio sets TCP_NODELAY only on sockets whose proto is TCP; without it every
    response's second write waited for the client's delayed ACK (40 ms a request)."""
    from kvloom.cluster.frontend.http.listener import _bind

    sock = _bind("127.0.0.1", 0, "HTTP port")
    try:
        assert sock.proto == socket.IPPROTO_TCP
    finally:
        sock.close()
