"""Clients for a kvloom gRPC server: `Client` (blocking) and `AsyncClient` (asyncio).

    import kvloom
    client = kvloom.Client("127.0.0.1:50051")
    for event in client.generate("Once upon a time", max_tokens=32, temperature=0):
        if isinstance(event, kvloom.client.GenerateDelta):
            print(event.text, end="", flush=True)
    result = kvloom.client.collect(client.chat([{"role": "user", "content": "Hi"}]))
    print(result.content, result.finish_reason, result.usage)

A stream yields deltas (`GenerateDelta` or `ChatDelta`), then one `Finish`, then one
`Usage`. Sampling options are keyword arguments named as in `kvloom.SamplingParams`.
Errors from the server raise `ServerError` (its `code` is the gRPC status). Stopping the
iteration early cancels the stream, which aborts the request on the server.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvloom.protos.kvloom.v1 import generation_pb2 as pb
from kvloom.protos.kvloom.v1 import generation_pb2_grpc as pb_grpc

SERVICE_NAME = "kvloom.v1.Generation"
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024

_SAMPLING_FIELDS = (
    "max_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "structured_outputs",
)
_FINISH_REASONS = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_TOOL_CALLS: "tool_calls",
    pb.FINISH_REASON_ABORT: "abort",
}
_TOOL_CHOICES = {
    "auto": pb.ToolChoice.TOOL_CHOICE_AUTO,
    "none": pb.ToolChoice.TOOL_CHOICE_NONE,
    "required": pb.ToolChoice.TOOL_CHOICE_REQUIRED,
}


# ----- what a stream yields


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    rank: int | None
    token: str


@dataclass
class PositionLogprobs:
    sampled: TokenLogprob | None
    top: list[TokenLogprob]


@dataclass
class GenerateDelta:
    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] = field(default_factory=list)


@dataclass
class ToolCallDelta:
    index: int
    id: str | None  # only in the first delta of a call
    name: str | None  # only in the first delta of a call
    arguments: str  # the next fragment of the call's JSON arguments


@dataclass
class ChatDelta:
    request_id: str
    role: str  # "assistant" in the first delta, "" afterwards
    content: str
    reasoning: str
    tool_calls: list[ToolCallDelta]
    token_ids: list[int]
    logprobs: list[PositionLogprobs] = field(default_factory=list)


@dataclass
class Finish:
    request_id: str
    reason: str  # "stop", "length", "tool_calls" or "abort"
    stop_str: str | None = None
    stop_token_id: int | None = None


@dataclass
class Usage:
    request_id: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


Event = GenerateDelta | ChatDelta | Finish | Usage


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text


@dataclass
class Result:
    """A whole stream summed up (see `collect`)."""

    request_id: str = ""
    text: str = ""  # Generate: the text; Chat: the content
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_str: str | None = None
    stop_token_id: int | None = None
    usage: Usage | None = None

    @property
    def content(self) -> str:
        return self.text


def collect(events: Iterator[Event] | Sequence[Event]) -> Result:
    """Sums a stream's events: text (or content), reasoning, tool calls, tokens, finish, usage."""
    result = Result()
    text: list[str] = []
    reasoning: list[str] = []
    arguments: dict[int, list[str]] = {}
    for event in events:
        result.request_id = event.request_id
        if isinstance(event, GenerateDelta | ChatDelta):
            result.token_ids += event.token_ids
            result.logprobs += event.logprobs
        if isinstance(event, GenerateDelta):
            text.append(event.text)
        elif isinstance(event, ChatDelta):
            text.append(event.content)
            reasoning.append(event.reasoning)
            for call in event.tool_calls:
                if call.name is not None:
                    result.tool_calls.append(ToolCall(call.id or "", call.name, ""))
                arguments.setdefault(call.index, []).append(call.arguments)
        elif isinstance(event, Finish):
            result.finish_reason = event.reason
            result.stop_str = event.stop_str
            result.stop_token_id = event.stop_token_id
        elif isinstance(event, Usage):
            result.usage = event
    result.text = "".join(text)
    result.reasoning = "".join(reasoning)
    for index, call in enumerate(result.tool_calls):
        call.arguments = "".join(arguments.get(index, []))
    return result


class ServerError(RuntimeError):
    """The server answered with a non-OK status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


def _server_error(error: grpc.RpcError) -> ServerError:
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    return ServerError(code, details or "")


# ----- requests


def structured_outputs_message(value: Any) -> pb.StructuredOutputs:
    """A StructuredOutputsParams, or a dict of its fields (`json` a schema object or its
    JSON text), as the proto message."""
    if isinstance(value, pb.StructuredOutputs):
        return value
    fields = value if isinstance(value, Mapping) else vars(value)
    msg = pb.StructuredOutputs()
    for key, item in fields.items():
        if item is None or item is False:
            continue
        if key == "json" and not isinstance(item, str):
            item = json.dumps(item, ensure_ascii=False)
        if key == "choice":
            msg.choice.extend(item)
        else:
            setattr(msg, key, item)
    return msg


def sampling_message(**sampling: Any) -> pb.SamplingParams:
    """SamplingParams from keyword arguments (None means unset: the server's default)."""
    msg = pb.SamplingParams()
    for name, value in sampling.items():
        if name not in _SAMPLING_FIELDS:
            raise TypeError(
                f"unknown sampling argument {name!r}; known: {', '.join(_SAMPLING_FIELDS)}"
            )
        if value is None:
            continue
        if name == "stop" and isinstance(value, str):
            value = [value]
        try:
            if name == "structured_outputs":
                msg.structured_outputs.CopyFrom(structured_outputs_message(value))
            elif name in ("stop", "stop_token_ids"):
                getattr(msg, name).extend(value)
            else:
                setattr(msg, name, value)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{name}: {exc}") from None
    return msg


def _content_text(content: Any, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: the text ones
        return "".join(
            p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"
        )
    raise ValueError(f"{where}.content must be a string or a list of content parts")


def _message(i: int, message: Mapping[str, Any] | pb.ChatMessage) -> pb.ChatMessage:
    if isinstance(message, pb.ChatMessage):
        return message
    if not isinstance(message, Mapping):
        raise ValueError(f"messages[{i}] must be a dict, got {type(message).__name__}")
    where = f"messages[{i}]"
    msg = pb.ChatMessage(role=str(message.get("role", "")))
    content = _content_text(message.get("content"), where)
    if content is not None:
        msg.content = content
    for j, call in enumerate(message.get("tool_calls") or []):
        function = call.get("function", call) if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping):
            raise ValueError(f"{where}.tool_calls[{j}] must be a dict")
        arguments = function.get("arguments", "")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        msg.tool_calls.add(
            id=str(call.get("id") or ""), name=str(function.get("name", "")), arguments=arguments
        )
    if message.get("tool_call_id"):
        msg.tool_call_id = str(message["tool_call_id"])
    if message.get("name"):
        msg.name = str(message["name"])
    reasoning = message.get("reasoning_content", message.get("reasoning"))
    if reasoning is not None:
        msg.reasoning_content = str(reasoning)
    return msg


def _tool(i: int, tool: Mapping[str, Any] | pb.Tool) -> pb.Tool:
    if isinstance(tool, pb.Tool):
        return tool
    if not isinstance(tool, Mapping):
        raise ValueError(f"tools[{i}] must be a dict, got {type(tool).__name__}")
    function = tool.get("function", tool)
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, str):
        parameters = json.dumps(parameters, ensure_ascii=False)
    return pb.Tool(
        name=str(function.get("name", "")),
        description=str(function.get("description") or ""),
        parameters=parameters or "",
    )


def _tool_choice(choice: Any) -> pb.ToolChoice:
    if choice is None:
        return pb.ToolChoice()
    if isinstance(choice, str) and choice in _TOOL_CHOICES:
        return pb.ToolChoice(mode=_TOOL_CHOICES[choice])
    if isinstance(choice, Mapping) and isinstance(choice.get("function"), Mapping):
        return pb.ToolChoice(
            mode=pb.ToolChoice.TOOL_CHOICE_NAMED,
            function_name=str(choice["function"].get("name", "")),
        )
    raise ValueError(
        'tool_choice must be "auto", "none", "required" or '
        '{"type": "function", "function": {"name": ...}}'
    )


def generate_request(
    prompt: str | Sequence[int],
    *,
    request_id: str | None = None,
    add_special_tokens: bool | None = None,
    cache_salt: str | None = None,
    **sampling: Any,
) -> pb.GenerateRequest:
    request = pb.GenerateRequest(
        request_id=request_id or "",
        sampling=sampling_message(**sampling),
        cache_salt=cache_salt or "",
    )
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(int(t) for t in prompt)
    if add_special_tokens is not None:
        request.add_special_tokens = add_special_tokens
    return request


def chat_request(
    messages: Sequence[Mapping[str, Any] | pb.ChatMessage],
    tools: Sequence[Mapping[str, Any] | pb.Tool] | None = None,
    *,
    tool_choice: Any = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    add_generation_prompt: bool | None = None,
    continue_final_message: bool = False,
    parse_reasoning: bool | None = None,
    request_id: str | None = None,
    cache_salt: str | None = None,
    parallel_tool_calls: bool | None = None,
    **sampling: Any,
) -> pb.ChatRequest:
    request = pb.ChatRequest(
        request_id=request_id or "",
        messages=[_message(i, m) for i, m in enumerate(messages)],
        tools=[_tool(i, t) for i, t in enumerate(tools or [])],
        tool_choice=_tool_choice(tool_choice),
        sampling=sampling_message(**sampling),
        chat_template_kwargs=json.dumps(dict(chat_template_kwargs)) if chat_template_kwargs else "",
        continue_final_message=continue_final_message,
        cache_salt=cache_salt or "",
    )
    if add_generation_prompt is not None:
        request.add_generation_prompt = add_generation_prompt
    if parse_reasoning is not None:
        request.parse_reasoning = parse_reasoning
    if parallel_tool_calls is not None:
        request.parallel_tool_calls = parallel_tool_calls
    return request


# ----- responses


def _logprob(msg: pb.Logprob) -> TokenLogprob:
    return TokenLogprob(
        msg.token_id, msg.logprob, msg.rank if msg.HasField("rank") else None, msg.token
    )


def _logprobs(items: Sequence[pb.PositionLogprobs]) -> list[PositionLogprobs]:
    return [
        PositionLogprobs(
            _logprob(p.sampled) if p.HasField("sampled") else None, [_logprob(t) for t in p.top]
        )
        for p in items
    ]


def event_of(response: pb.GenerateResponse | pb.ChatResponse) -> Event:
    rid = response.request_id
    kind = response.WhichOneof("kind")
    if kind == "finish":
        finish = response.finish
        which = finish.WhichOneof("matched_stop")
        return Finish(
            rid,
            _FINISH_REASONS.get(finish.reason, "unspecified"),
            stop_str=finish.stop_str if which == "stop_str" else None,
            stop_token_id=finish.stop_token_id if which == "stop_token_id" else None,
        )
    if kind == "usage":
        u = response.usage
        return Usage(rid, u.prompt_tokens, u.completion_tokens, u.cached_tokens)
    delta = response.delta
    if isinstance(response, pb.GenerateResponse):
        return GenerateDelta(rid, delta.text, list(delta.token_ids), _logprobs(delta.logprobs))
    return ChatDelta(
        rid,
        delta.role,
        delta.content,
        delta.reasoning_content,
        [
            ToolCallDelta(
                c.index,
                c.id if c.HasField("id") else None,
                c.name if c.HasField("name") else None,
                c.arguments,
            )
            for c in delta.tool_calls
        ],
        list(delta.token_ids),
        _logprobs(delta.logprobs),
    )


def _status_name(status: int) -> str:
    return health_pb2.HealthCheckResponse.ServingStatus.Name(status)


def _credentials(tls: bool | str | Path) -> grpc.ChannelCredentials | None:
    if tls is False or tls is None:
        return None
    roots = None if tls is True else Path(tls).read_bytes()
    return grpc.ssl_channel_credentials(root_certificates=roots)


def _channel_options(server_name: str | None, max_message_bytes: int) -> list[tuple[str, Any]]:
    options: list[tuple[str, Any]] = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    return options


class _Base:
    def __init__(self, target: str, token: str | None, timeout: float | None) -> None:
        self.target = target
        self.timeout = timeout
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout


class Client(_Base):
    """A blocking client. `tls`: False (plaintext), True (system roots) or a CA PEM path;
    `token`: the server's bearer token; `timeout`: default deadline in seconds per call."""

    def __init__(
        self,
        target: str,
        token: str | None = None,
        tls: bool | str | Path = False,
        *,
        server_name: str | None = None,
        timeout: float | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        super().__init__(target, token, timeout)
        options = _channel_options(server_name, max_message_bytes)
        credentials = _credentials(tls)
        if credentials is None:
            self._channel = grpc.insecure_channel(target, options=options)
        else:
            self._channel = grpc.secure_channel(target, credentials, options=options)
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def _unary(self, method, request, timeout: float | None):
        try:
            return method(request, timeout=self._timeout(timeout), metadata=self._metadata)
        except grpc.RpcError as exc:
            raise _server_error(exc) from None

    def _stream(self, method, request, timeout: float | None) -> Iterator[Event]:
        call = method(request, timeout=self._timeout(timeout), metadata=self._metadata)
        try:
            for response in call:
                yield event_of(response)
        except grpc.RpcError as exc:
            raise _server_error(exc) from None
        finally:
            call.cancel()  # no-op after the end; aborts the request if we stopped early

    def generate(
        self, prompt: str | Sequence[int], *, timeout: float | None = None, **kwargs: Any
    ) -> Iterator[Event]:
        """Streams a completion of `prompt` (text, or token ids)."""
        return self._stream(self._stub.Generate, generate_request(prompt, **kwargs), timeout)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any] | pb.ChatMessage],
        tools: Sequence[Mapping[str, Any] | pb.Tool] | None = None,
        *,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> Iterator[Event]:
        """Streams the assistant's reply to OpenAI-style `messages`, offering `tools`."""
        return self._stream(self._stub.Chat, chat_request(messages, tools, **kwargs), timeout)

    def abort(self, *request_ids: str, timeout: float | None = None) -> list[str]:
        """Aborts requests by id; returns those that were still running."""
        request = pb.AbortRequest(request_ids=list(request_ids))
        return list(self._unary(self._stub.Abort, request, timeout).aborted_request_ids)

    def tokenize(
        self, text: str, add_special_tokens: bool = True, *, timeout: float | None = None
    ) -> list[int]:
        request = pb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        return list(self._unary(self._stub.Tokenize, request, timeout).token_ids)

    def detokenize(
        self,
        token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        *,
        timeout: float | None = None,
    ) -> str:
        request = pb.DetokenizeRequest(
            token_ids=list(token_ids), skip_special_tokens=skip_special_tokens
        )
        return self._unary(self._stub.Detokenize, request, timeout).text

    def render_chat(
        self, messages: Sequence[Any], tools: Sequence[Any] | None = None, **kwargs: Any
    ) -> tuple[str, list[int]]:
        """The prompt text and token ids Chat would run for the same arguments."""
        timeout = kwargs.pop("timeout", None)
        response = self._unary(
            self._stub.RenderChat, chat_request(messages, tools, **kwargs), timeout
        )
        return response.prompt, list(response.token_ids)

    def model_info(self, *, timeout: float | None = None) -> pb.ModelInfo:
        return self._unary(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout)

    def server_info(self, *, timeout: float | None = None) -> pb.ServerInfo:
        return self._unary(self._stub.GetServerInfo, pb.GetServerInfoRequest(), timeout)

    def health(self, service: str = SERVICE_NAME, *, timeout: float | None = None) -> str:
        """ "SERVING", "NOT_SERVING" or "SERVICE_UNKNOWN"; `service=""` asks for liveness."""
        try:
            response = self._health.Check(
                health_pb2.HealthCheckRequest(service=service), timeout=self._timeout(timeout)
            )
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return "SERVICE_UNKNOWN"
            raise _server_error(exc) from None
        return _status_name(response.status)


class AsyncClient(_Base):
    """The asyncio twin of `Client`: the same arguments; streams are async iterators."""

    def __init__(
        self,
        target: str,
        token: str | None = None,
        tls: bool | str | Path = False,
        *,
        server_name: str | None = None,
        timeout: float | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        super().__init__(target, token, timeout)
        options = _channel_options(server_name, max_message_bytes)
        credentials = _credentials(tls)
        if credentials is None:
            self._channel = grpc.aio.insecure_channel(target, options=options)
        else:
            self._channel = grpc.aio.secure_channel(target, credentials, options=options)
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()

    async def _unary(self, method, request, timeout: float | None):
        try:
            return await method(request, timeout=self._timeout(timeout), metadata=self._metadata)
        except grpc.RpcError as exc:
            raise _server_error(exc) from None

    async def _stream(self, method, request, timeout: float | None) -> AsyncIterator[Event]:
        call = method(request, timeout=self._timeout(timeout), metadata=self._metadata)
        try:
            async for response in call:
                yield event_of(response)
        except grpc.RpcError as exc:
            raise _server_error(exc) from None
        finally:
            call.cancel()

    def generate(
        self, prompt: str | Sequence[int], *, timeout: float | None = None, **kwargs: Any
    ) -> AsyncIterator[Event]:
        return self._stream(self._stub.Generate, generate_request(prompt, **kwargs), timeout)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any] | pb.ChatMessage],
        tools: Sequence[Mapping[str, Any] | pb.Tool] | None = None,
        *,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[Event]:
        return self._stream(self._stub.Chat, chat_request(messages, tools, **kwargs), timeout)

    async def abort(self, *request_ids: str, timeout: float | None = None) -> list[str]:
        request = pb.AbortRequest(request_ids=list(request_ids))
        return list((await self._unary(self._stub.Abort, request, timeout)).aborted_request_ids)

    async def tokenize(
        self, text: str, add_special_tokens: bool = True, *, timeout: float | None = None
    ) -> list[int]:
        request = pb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        return list((await self._unary(self._stub.Tokenize, request, timeout)).token_ids)

    async def detokenize(
        self,
        token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        *,
        timeout: float | None = None,
    ) -> str:
        request = pb.DetokenizeRequest(
            token_ids=list(token_ids), skip_special_tokens=skip_special_tokens
        )
        return (await self._unary(self._stub.Detokenize, request, timeout)).text

    async def render_chat(
        self, messages: Sequence[Any], tools: Sequence[Any] | None = None, **kwargs: Any
    ) -> tuple[str, list[int]]:
        timeout = kwargs.pop("timeout", None)
        response = await self._unary(
            self._stub.RenderChat, chat_request(messages, tools, **kwargs), timeout
        )
        return response.prompt, list(response.token_ids)

    async def model_info(self, *, timeout: float | None = None) -> pb.ModelInfo:
        return await self._unary(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout)

    async def server_info(self, *, timeout: float | None = None) -> pb.ServerInfo:
        return await self._unary(self._stub.GetServerInfo, pb.GetServerInfoRequest(), timeout)

    async def health(self, service: str = SERVICE_NAME, *, timeout: float | None = None) -> str:
        try:
            response = await self._health.Check(
                health_pb2.HealthCheckRequest(service=service), timeout=self._timeout(timeout)
            )
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return "SERVICE_UNKNOWN"
            raise _server_error(exc) from None
        return _status_name(response.status)
