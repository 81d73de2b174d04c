"""The HTTP door on scripted model output (the gRPC chat tests' fake engine): tool calls
streamed in OpenAI's shape and assembled by the `openai` SDK's own stream helper, reasoning
content, a full queue (429), readiness (/health 503 while loading and draining), and the
bearer token and TLS on every route but /health."""

from __future__ import annotations

import json
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from kvloom.cluster.frontend import BackgroundServer, ServerOptions
from kvloom.contracts.config import EngineConfig
from tests.test_grpc_chat import REASONING_AND_CALLS, TOOLS, ScriptedEngine, one_piece, splits

ASK = [{"role": "user", "content": "Weather in Paris, and the time?"}]


def _engine(model: str, scripts: dict, hang: set, **config) -> ScriptedEngine:
    engine = ScriptedEngine(model, scripts, hang)
    if config:
        engine.config = EngineConfig.from_kwargs(model=model, max_model_len=512, **config)
    return engine


def _start(model: str, scripts: dict, hang: set, config=None, **options) -> BackgroundServer:
    options = ServerOptions(
        model=model,
        host="127.0.0.1",
        port=0,
        http_port=0,
        tool_call_parser="hermes",
        reasoning_parser="think",
        **options,
    )
    server = BackgroundServer(lambda: _engine(model, scripts, hang, **(config or {})), options)
    server.start()
    server.server.engine.coalesce = False  # every scripted chunk reaches the parsers as is
    return server


@pytest.fixture(scope="module")
def scripted(demo_tokenizer_dir):
    scripts: dict[str, list[str]] = {}
    hang: set[str] = set()
    server = _start(str(demo_tokenizer_dir), scripts, hang)
    yield server, scripts, hang
    server.stop()


def _client(server: BackgroundServer, **kwargs) -> openai.OpenAI:
    base_url = f"http://127.0.0.1:{server.server.http_port}/v1"
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, **kwargs)


def test_tool_calls_stream_in_openai_shape_and_the_sdk_assembles_them(scripted):
    server, scripts, _ = scripted
    expected = one_piece(REASONING_AND_CALLS)
    client = _client(server)
    ways = splits(REASONING_AND_CALLS)
    for name in ("w1", "w5", "r0", "whole"):
        rid = f"http-calls-{name}"
        scripts[rid] = ways[name]
        with client.chat.completions.stream(
            model=server.server.options.model,
            messages=ASK,
            tools=TOOLS,
            extra_headers={"X-Request-Id": rid},
        ) as stream:
            chunks = [event.chunk for event in stream if event.type == "chunk"]
            final = stream.get_final_completion()
        choice = final.choices[0]
        calls = choice.message.tool_calls
        assert [(c.function.name, c.function.arguments) for c in calls] == [
            (c.name, c.arguments) for c in expected.tool_calls
        ], name
        assert all(c.id.startswith("call_") and c.type == "function" for c in calls), name
        assert choice.finish_reason == "tool_calls", name
        assert final.id == f"chatcmpl-{rid}"
        reasoning = "".join(
            (c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
            for c in chunks
            if c.choices
        )
        assert reasoning == expected.reasoning, name
        assert not choice.message.content, name
        # The shape: a call's id, type and name once, first; then argument fragments.
        fragments = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
        starts = [t for t in fragments if t.id is not None]
        assert [(t.index, t.function.name, t.type) for t in starts] == [
            (0, "get_weather", "function"),
            (1, "get_time", "function"),
        ], name
        assert all(t.function.name is None for t in fragments if t.id is None), name
        if name == "w1":
            assert sum(1 for t in fragments if t.index == 0 and t.function.arguments) > 5


def test_tool_calls_and_reasoning_in_a_whole_response(scripted):
    server, scripts, _ = scripted
    expected = one_piece(REASONING_AND_CALLS)
    scripts["http-whole"] = splits(REASONING_AND_CALLS)["w3"]
    out = _client(server).chat.completions.create(
        model=server.server.options.model,
        messages=ASK,
        tools=TOOLS,
        extra_headers={"X-Request-Id": "http-whole"},
    )
    message = out.choices[0].message
    assert message.content is None
    assert message.model_extra["reasoning_content"] == expected.reasoning
    assert [json.loads(c.function.arguments) for c in message.tool_calls] == [
        {"city": "Paris", "note": "a </tool_call> inside a string"},
        {},
    ]
    assert out.choices[0].finish_reason == "tool_calls"
    assert out.usage.completion_tokens == len(scripts["http-whole"])


def test_a_partial_marker_is_flushed_as_content(scripted):
    server, scripts, _ = scripted
    text = 'fine\n\n<tool_call>\n{"na'
    scripts["http-tail"] = list(text)
    chunks = list(
        _client(server).chat.completions.create(
            model=server.server.options.model,
            messages=ASK,
            tools=TOOLS,
            stream=True,
            extra_headers={"X-Request-Id": "http-tail"},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "stop"


def _wait(predicate, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
    return value


def test_full_queue_is_429_and_draining_is_503(demo_tokenizer_dir):
    scripts: dict[str, list[str]] = {"busy": ["a", "b"]}
    hang = {"busy"}
    server = _start(
        str(demo_tokenizer_dir), scripts, hang, config=dict(max_num_seqs=1), max_waiting=0
    )
    try:
        client = _client(server)
        model = server.server.options.model
        busy = client.chat.completions.create(
            model=model, messages=ASK, stream=True, extra_headers={"X-Request-Id": "busy"}
        )
        next(iter(busy))
        with pytest.raises(openai.RateLimitError) as info:
            client.chat.completions.create(model=model, messages=ASK)
        assert info.value.code == "resource_exhausted"
        assert "at capacity" in info.value.message
        draining = server.drain(timeout_s=30)
        health = f"http://127.0.0.1:{server.server.http_port}/health"
        with pytest.raises(urllib.error.HTTPError) as status:
            _wait(lambda: server.server.draining) and urllib.request.urlopen(health, timeout=10)
        assert status.value.code == 503
        assert "draining" in json.loads(status.value.read())["error"]["message"]
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model=model, prompt="hi")
        assert info.value.status_code == 503 and "draining" in info.value.message
        busy.close()  # the client goes away: its request is aborted, and the drain ends
        draining.result(30)
    finally:
        server.stop()


def test_health_is_503_until_the_model_is_ready(demo_tokenizer_dir):
    model = str(demo_tokenizer_dir)
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    release = threading.Event()

    def slow_engine():
        release.wait(60)
        return ScriptedEngine(model, {}, set())

    options = ServerOptions(model=model, host="127.0.0.1", port=0, http_port=port)
    server = BackgroundServer(slow_engine, options)
    starter = threading.Thread(target=server.start, daemon=True)
    starter.start()
    try:

        def health() -> tuple[int, str] | None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    return r.status, ""
            except urllib.error.HTTPError as exc:
                return exc.code, json.loads(exc.read())["error"]["message"]
            except OSError:
                return None  # not listening yet

        code, message = _wait(health)
        assert code == 503 and "not ready" in message
        release.set()
        _wait(lambda: health() == (200, ""))
        starter.join(30)
    finally:
        release.set()
        server.stop()


TOKEN = "s3cret-http-token-0123"


def test_bearer_token_and_tls_guard_every_route_but_health(demo_tokenizer_dir, certificate):
    cert, key = certificate
    server = _start(
        str(demo_tokenizer_dir),
        {},
        set(),
        tls_cert=str(cert),
        tls_key=str(key),
        auth_token=TOKEN,
        max_message_bytes=4096,
    )
    base = f"https://127.0.0.1:{server.server.http_port}"
    context = ssl.create_default_context(cafile=str(cert))

    def get(path: str, token: str | None = None) -> int:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        request = urllib.request.Request(base + path, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=10, context=context) as response:
                return response.status
        except urllib.error.HTTPError as exc:
            return exc.code

    try:
        assert get("/health") == 200  # probes cannot send credentials
        assert get("/metrics") == 401 and get("/metrics", "wrong") == 401
        assert get("/metrics", TOKEN) == 200
        assert get("/v1/models") == 401 and get("/v1/models", TOKEN) == 200
        model = server.server.options.model

        def client(api_key: str) -> openai.OpenAI:
            http = openai.DefaultHttpxClient(verify=context)
            return openai.OpenAI(
                base_url=f"{base}/v1", api_key=api_key, max_retries=0, http_client=http
            )

        with pytest.raises(openai.AuthenticationError) as info:
            client("wrong").chat.completions.create(model=model, messages=ASK)
        assert "bearer token" in info.value.message
        good = client(TOKEN)
        assert good.chat.completions.create(model=model, messages=ASK).choices[0].message.content
        with pytest.raises(openai.APIStatusError) as info:
            good.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "x" * 5000}]
            )
        assert info.value.status_code == 413 and info.value.param == "body"
    finally:
        server.stop()


def test_a_client_gone_before_a_whole_response_aborts_its_request(scripted):
    """No stream to notice it: the door watches the connection while it waits."""
    server, scripts, hang = scripted
    scripts["http-gone"] = ["a", "b"]
    hang.add("http-gone")
    body = json.dumps({"messages": ASK}).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nX-Request-Id: http-gone\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", server.server.http_port), timeout=10) as conn:
        conn.sendall(head + body)
        _wait(lambda: server.server.engine.num_in_flight == 1)
    _wait(lambda: server.server.engine.num_in_flight == 0)
    assert server.stats()["num_running"] == 0


def test_a_request_id_in_flight_is_409(scripted):
    server, scripts, hang = scripted
    scripts["http-dup"] = ["a", "b"]
    hang.add("http-dup")
    client = _client(server)
    model = server.server.options.model
    first = client.chat.completions.create(
        model=model, messages=ASK, stream=True, extra_headers={"X-Request-Id": "http-dup"}
    )
    next(iter(first))
    with pytest.raises(openai.ConflictError) as info:
        client.chat.completions.create(
            model=model, messages=ASK, extra_headers={"X-Request-Id": "http-dup"}
        )
    assert info.value.code == "already_exists" and "already in use" in info.value.message
    first.close()
    _wait(lambda: server.server.engine.num_in_flight == 0)


class _FailingScriptedEngine(ScriptedEngine):
    """Fails its step once `fail` is set (a replica lost under a stream)."""

    fail = threading.Event()

    def step_deltas(self):
        if self.fail.is_set():
            self.fail.clear()
            raise RuntimeError("the device fell off the bus")
        return super().step_deltas()


def test_an_engine_failure_mid_stream_is_an_error_event(demo_tokenizer_dir):
    model = str(demo_tokenizer_dir)
    hang = {"doomed"}
    options = ServerOptions(model=model, host="127.0.0.1", port=0, http_port=0)
    server = BackgroundServer(
        lambda: _FailingScriptedEngine(model, {"doomed": ["a", "b"]}, hang), options
    ).start()
    try:
        stream = _client(server).chat.completions.create(
            model=model, messages=ASK, stream=True, extra_headers={"X-Request-Id": "doomed"}
        )
        with pytest.raises(openai.APIError) as info:
            for _ in stream:
                _FailingScriptedEngine.fail.set()
        assert "the device fell off the bus" in info.value.message
        assert info.value.code == "unavailable"
    finally:
        server.stop()
