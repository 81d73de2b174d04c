"""End to end over gRPC: a real server on 127.0.0.1 and the real client stream exactly what
the offline API (`kvloom.LLM`) generates for the same request (float64, so exactly)."""

from __future__ import annotations

import asyncio
import math

import pytest

from kvloom import LLM, SamplingParams
from kvloom.client import AsyncClient, ChatDelta, Client, GenerateDelta, collect
from kvloom.cluster.frontend import BackgroundServer, ServerOptions, engine_factory

ENGINE = dict(dtype="float64", block_size=4, max_model_len=256, num_kv_blocks=2048)


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return str(tiny_model("llama"))


@pytest.fixture(scope="module")
def server(model_dir):
    options = ServerOptions(
        model=model_dir,
        host="127.0.0.1",
        port=0,
        tool_call_parser="hermes",
        reasoning_parser="think",
    )
    with BackgroundServer(engine_factory(model=model_dir, progress=False, **ENGINE), options) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with Client(server.address, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model=model_dir, progress=False, **ENGINE)


def offline(llm, prompt, **sampling):
    if isinstance(prompt, list):
        prompt = {"prompt_token_ids": prompt}
    return llm.generate(prompt, SamplingParams(**sampling))[0].outputs[0]


def prompt_ids(i: int, length: int) -> list[int]:
    return [5 + (i * 37 + j * 11) % 500 for j in range(length)]


def assert_pool_full(server):
    stats = server.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"], stats
    assert stats["num_running"] == stats["num_waiting"] == 0, stats


@pytest.mark.parametrize(
    "sampling",
    [
        dict(max_tokens=24, temperature=0.0, ignore_eos=True),
        dict(max_tokens=20, temperature=0.8, top_p=0.9, top_k=50, seed=7, ignore_eos=True),
        dict(max_tokens=12, temperature=1.0, min_p=0.05, seed=3, repetition_penalty=1.2),
    ],
)
def test_generate_token_ids_match_offline(client, llm, server, sampling):
    prompt = prompt_ids(1, 13)
    expected = offline(llm, prompt, **sampling)
    events = list(client.generate(prompt, **sampling))
    deltas = [e for e in events if isinstance(e, GenerateDelta)]
    result = collect(events)
    assert result.token_ids == expected.token_ids
    assert result.text == expected.text
    assert result.finish_reason == expected.finish_reason
    assert result.usage.prompt_tokens == len(prompt)
    assert result.usage.completion_tokens == len(expected.token_ids)
    # The stream really streams (one delta per step here) and ends Finish, Usage.
    assert len(deltas) > 1
    assert [type(e).__name__ for e in events[-2:]] == ["Finish", "Usage"]
    assert_pool_full(server)


def test_generate_text_prompt_matches_offline(client, llm):
    sampling = dict(max_tokens=16, temperature=0.0, ignore_eos=True)
    expected = offline(llm, "The quick brown fox", **sampling)
    result = collect(client.generate("The quick brown fox", **sampling))
    assert result.token_ids == expected.token_ids
    assert result.text == expected.text


def test_logprobs_match_offline(client, llm):
    sampling = dict(max_tokens=6, temperature=0.0, logprobs=3, ignore_eos=True)
    prompt = prompt_ids(2, 9)
    expected = offline(llm, prompt, **sampling)
    result = collect(client.generate(prompt, **sampling))
    assert result.token_ids == expected.token_ids
    assert len(result.logprobs) == len(expected.token_ids)
    for token_id, position, entry in zip(expected.token_ids, result.logprobs, expected.logprobs):
        assert position.sampled.token_id == token_id
        assert math.isclose(position.sampled.logprob, entry[token_id].logprob, rel_tol=1e-6)
        assert [t.rank for t in position.top] == [1, 2, 3]
        top = sorted((lp.rank, tid) for tid, lp in entry.items() if lp.rank <= 3)
        assert [t.token_id for t in position.top] == [tid for _, tid in top]
        assert position.top[0].logprob >= position.top[1].logprob >= position.top[2].logprob


def test_stop_string_is_held_back_and_cut(client, llm):
    """A stop string spanning tokens: the stream never sends its first characters, and its
    text equals the offline text cut before the stop string."""
    prompt = prompt_ids(3, 11)
    free_run = offline(llm, prompt, max_tokens=32, temperature=0.0, ignore_eos=True)
    text = free_run.text
    # A 3-character printable stop string starting after the first token's text.
    start = next(
        k
        for k in range(2, len(text) - 3)
        if text[k : k + 3].isascii()
        and text[k : k + 3].isprintable()
        and text.find(text[k : k + 3]) == k
    )
    stop = text[start : start + 3]
    sampling = dict(max_tokens=32, temperature=0.0, ignore_eos=True, stop=[stop])
    expected = offline(llm, prompt, **sampling)
    assert expected.text == text[:start] and expected.stop_reason == stop
    events = list(client.generate(prompt, **sampling))
    result = collect(events)
    assert result.text == expected.text
    assert result.finish_reason == "stop" and result.stop_str == stop
    assert result.token_ids == expected.token_ids
    streamed = ""
    for event in events:
        if isinstance(event, GenerateDelta):
            streamed += event.text
            assert streamed == text[: len(streamed)] and len(streamed) <= start


def test_stop_token_id_reported(client, llm):
    prompt = prompt_ids(4, 7)
    free_run = offline(llm, prompt, max_tokens=12, temperature=0.0, ignore_eos=True)
    stop_id = free_run.token_ids[5]
    first = free_run.token_ids.index(stop_id)
    result = collect(
        client.generate(
            prompt, max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_id]
        )
    )
    assert result.token_ids == free_run.token_ids[: first + 1]
    assert result.finish_reason == "stop" and result.stop_token_id == stop_id


def test_prefix_cache_hits_reported_in_usage(client):
    prompt = prompt_ids(5, 21)
    first = collect(client.generate(prompt, max_tokens=2, temperature=0.0))
    again = collect(client.generate(prompt, max_tokens=2, temperature=0.0))
    assert first.usage.cached_tokens == 0
    assert again.usage.cached_tokens == 20  # five full blocks of 4; the last token recomputed
    salted = collect(client.generate(prompt, max_tokens=2, temperature=0.0, cache_salt="tenant-b"))
    assert salted.usage.cached_tokens == 0


def test_chat_streams_the_offline_tokens_of_its_rendered_prompt(client, llm, server):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name three colours."},
    ]
    prompt, ids = client.render_chat(messages)
    assert prompt.endswith("<|im_start|>assistant\n")
    expected = offline(llm, ids, max_tokens=20, temperature=0.0, ignore_eos=True)
    sampling = dict(max_tokens=20, temperature=0.0, ignore_eos=True)
    # Reasoning parsing off and no tools: all generated text is content, unparsed.
    events = list(client.chat(messages, parse_reasoning=False, **sampling))
    result = collect(events)
    deltas = [e for e in events if isinstance(e, ChatDelta)]
    assert result.token_ids == expected.token_ids
    assert result.content == expected.text
    assert result.reasoning == "" and result.tool_calls == []
    assert result.usage.prompt_tokens == len(ids)
    assert deltas[0].role == "assistant" and all(d.role == "" for d in deltas[1:])
    assert_pool_full(server)


def test_64_concurrent_streams_lose_and_duplicate_nothing(server, llm):
    """64 streams at once (greedy and seeded, different lengths): each stream's deltas
    concatenate to exactly the offline tokens and text of its request."""
    requests = []
    for i in range(64):
        sampling = dict(max_tokens=6 + i % 11, ignore_eos=True)
        if i % 2:
            sampling.update(temperature=0.9, seed=1000 + i)
        else:
            sampling.update(temperature=0.0)
        requests.append((prompt_ids(i, 3 + (i * 7) % 29), sampling))
    outs = llm.generate(
        [{"prompt_token_ids": p} for p, _ in requests], [SamplingParams(**s) for _, s in requests]
    )

    async def run_all():
        async with AsyncClient(server.address, timeout=120) as client:

            async def one(i, prompt, sampling):
                return [e async for e in client.generate(prompt, request_id=f"c{i}", **sampling)]

            return await asyncio.gather(*(one(i, p, s) for i, (p, s) in enumerate(requests)))

    streams = asyncio.run(run_all())
    assert len(streams) == 64
    for i, (events, out) in enumerate(zip(streams, outs)):
        result = collect(events)
        expected = out.outputs[0]
        assert result.request_id == f"c{i}"
        assert result.token_ids == expected.token_ids, i
        assert result.text == expected.text, i
        assert (
            result.usage.completion_tokens
            == len(expected.token_ids)
            == requests[i][1]["max_tokens"]
        )
        assert [type(e).__name__ for e in events].count("Finish") == 1
    assert_pool_full(server)
