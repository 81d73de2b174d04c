"""The gRPC front door: `kvloom.v1.Generation`, health and reflection on one grpc.aio server.

Life cycle: the port is bound first, so probes see liveness SERVING and readiness
NOT_SERVING while the model loads; then the engine starts, one short generation warms it
up, and readiness turns SERVING. SIGTERM drains: readiness NOT_SERVING, new requests get
UNAVAILABLE, requests in flight may finish for `drain_timeout_s`, then the rest are
cancelled (which aborts them in the engine) and the server stops. With `http_port`, the
OpenAI-compatible HTTP door (http/) runs beside gRPC on the same loop, starting requests
through the same GenerationServicer; /health follows readiness, and both doors drain and
stop together.

Errors: bad input INVALID_ARGUMENT naming the field, prompt too long INVALID_ARGUMENT,
queue full RESOURCE_EXHAUSTED, not ready or draining UNAVAILABLE, tokenizing or rendering
past the render pool's time limit DEADLINE_EXCEEDED, anything else INTERNAL (logged; the
server keeps serving). A cancelled or timed-out stream aborts its request.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from kvloom.cluster.chat_template import add_special_tokens_for
from kvloom.cluster.frontend.async_engine import AsyncEngine, EngineFailed, RequestRejected
from kvloom.cluster.frontend.auth import BearerTokenInterceptor
from kvloom.cluster.frontend.chat_request import (
    ChatInputs,
    chat_inputs,
    constrain_to_tool_choice,
    reasoning_room,
)
from kvloom.cluster.frontend.errors import (
    FailedPrecondition,
    FrontendError,
    InvalidArgument,
    Unavailable,
)
from kvloom.cluster.frontend.limits import check_text
from kvloom.cluster.frontend.metrics import render_metrics
from kvloom.cluster.frontend.model_files import ModelFiles, load_model_files
from kvloom.cluster.frontend.options import ServerOptions
from kvloom.cluster.frontend.ports import check_port_free
from kvloom.cluster.frontend.render_pool import RenderPool
from kvloom.cluster.frontend.request_decoding import add_generation_servicer
from kvloom.cluster.frontend.request_validation import (
    check_abort_ids,
    check_cache_salt,
    check_detokenize_ids,
    check_prompt_length,
    check_request_id,
    fill_max_tokens,
    prompt_of,
    sampling_params,
)
from kvloom.cluster.frontend.responses import ChatResponder, GenerateResponder, TokenTexts
from kvloom.cluster.parsers import ChatOutputParser, make_tool_call_parser, reasoning_parser_class
from kvloom.cluster.ray_local import call_when_connected
from kvloom.cluster.spec_decode.server_info import spec_decode_fields
from kvloom.contracts.sampling_params import SamplingParams
from kvloom.protos.kvloom.v1 import generation_pb2 as pb
from kvloom.protos.kvloom.v1 import generation_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # readiness
LIVENESS = ""
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
WARMUP_PROMPT = "Hello"
# A server stopping because its engine failed: the streams already ended with the failure
# get this long to send their status before the RPCs are cancelled.
FAILED_STREAMS_GRACE_S = 5.0


def _version() -> str:
    try:
        return metadata.version("kvloom")
    except metadata.PackageNotFoundError:
        return "unknown"


def _internal(exc: BaseException) -> FrontendError:
    return FrontendError(f"internal error: {type(exc).__name__}: {exc}")


def _unary(method: Callable) -> Callable:
    """Maps a unary RPC's exceptions to statuses (see the module docstring)."""

    @functools.wraps(method)
    async def wrapper(self: GenerationServicer, request: Any, context: grpc.aio.ServicerContext):
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except FrontendError as exc:
            await context.abort(exc.code, str(exc))
        except Exception as exc:
            logger.exception("%s failed", method.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, str(_internal(exc)))

    return wrapper


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, server: KvloomServer) -> None:
        self.server = server
        self.files: ModelFiles = server.files
        tokenizer = self.files.tokenizer
        self.token_texts = TokenTexts(lambda ids: tokenizer.decode(ids, skip_special_tokens=False))

    @property
    def engine(self) -> AsyncEngine:
        return self.server.engine  # a new one after a restart

    # ----- shared steps

    @property
    def _limits(self) -> tuple[int, int]:
        """(vocab size, max_model_len) of the running engine."""
        config = self.engine.config
        if config is None:
            raise Unavailable("the server is not ready yet (the model is loading)")
        return int(config.model.text_config["vocab_size"]), int(config.scheduler.max_model_len)

    def _check_serving(self) -> None:
        if self.server.draining:
            raise Unavailable("the server is draining (shutting down); retry on another replica")
        if self.server.restarting:
            raise Unavailable(
                f"the model replica failed ({self.server.last_failure}) and is restarting; "
                "retry shortly"
            )
        if not self.server.ready:
            raise Unavailable("the server is not ready yet (loading or warming up)")
        if not self.engine.running:
            raise Unavailable("the engine is not running")

    @property
    def render_pool(self) -> RenderPool:
        """Tokenizing and chat rendering run in worker processes, with a time limit each."""
        return self.server.render_pool

    def _request_limits(self):
        """The size limits, resolved for the engine's max_model_len once it is known."""
        config = self.engine.config
        max_model_len = None if config is None else int(config.scheduler.max_model_len)
        return self.server.options.limits.for_model_len(max_model_len)

    async def _run_stream(
        self,
        request_id: str,
        context: grpc.aio.ServicerContext,
        start: Callable[[], Any],
    ) -> AsyncIterator[Any]:
        """Starts a request and relays its messages. Whatever ends the RPC early (client
        cancel, deadline, an error, server stop) aborts the engine request."""
        state = {"added": False, "finished": False}

        def abort_if_unfinished(_: Any = None) -> None:
            if state["added"] and not state["finished"]:
                state["finished"] = True
                self.engine.abort([request_id])

        context.add_done_callback(abort_if_unfinished)
        error: FrontendError | None = None
        try:
            stream, responder = await start()
            state["added"] = True
            async for out in stream:
                messages = responder.update(out)
                state["finished"] = responder.finished
                for message in messages:
                    yield message
        except FrontendError as exc:
            error = exc
        except RequestRejected as exc:
            error = InvalidArgument.from_message(str(exc), "prompt")
        except EngineFailed as exc:
            error = Unavailable(str(exc))
        except Exception as exc:
            logger.exception("request %s failed", request_id)
            error = _internal(exc)
        finally:
            abort_if_unfinished()
        if error is not None:
            await context.abort(error.code, str(error))

    # ----- Generate

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        request_id = request.request_id or uuid.uuid4().hex
        start = functools.partial(self._start_generate, request, request_id)
        async for message in self._run_stream(request_id, context, start):
            yield message

    async def _start_generate(self, request: pb.GenerateRequest, request_id: str):
        self._check_serving()
        check_request_id(request.request_id)
        vocab_size, max_model_len = self._limits
        limits = self._request_limits()
        prompt = prompt_of(request, vocab_size, max_model_len, limits)
        params = sampling_params(request.sampling, vocab_size, limits=limits)
        cache_salt = check_cache_salt(request.cache_salt)
        if isinstance(prompt, str):
            if request.HasField("add_special_tokens"):
                add_special = request.add_special_tokens
            else:
                add_special = add_special_tokens_for(prompt, self.files.tokenizer.bos_token)
            prompt = await self.render_pool.encode(prompt, add_special)
            if not prompt:
                raise InvalidArgument("text", "encodes to no tokens")
        return self._add(request_id, prompt, params, cache_salt, GenerateResponder)

    def _add(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None,
        responder_class: type,
        **responder_kwargs: Any,
    ):
        _, max_model_len = self._limits
        check_prompt_length(len(prompt_ids), max_model_len)
        params = fill_max_tokens(params, len(prompt_ids), max_model_len)
        responder = responder_class(
            request_id, params.logprobs, self.token_texts, **responder_kwargs
        )
        self._check_serving()  # draining may have begun while tokenizing
        stream = self.engine.add(
            request_id, {"prompt_token_ids": prompt_ids}, params, cache_salt=cache_salt
        )
        return stream, responder

    # ----- Chat

    async def Chat(self, request: pb.ChatRequest, context: grpc.aio.ServicerContext):
        request_id = request.request_id or uuid.uuid4().hex
        start = functools.partial(self._start_chat, request, request_id)
        async for message in self._run_stream(request_id, context, start):
            yield message

    def _chat_template(self):
        if self.files.chat_template is None:
            raise FailedPrecondition(
                f"messages: the model {self.files.model} has no chat template "
                "(tokenizer_config.json chat_template or chat_template.jinja)"
            )
        return self.files.chat_template

    async def _render(self, inputs: ChatInputs) -> tuple[str, list[int]]:
        """The prompt text and ids, from the render pool (the template's errors become
        INVALID_ARGUMENT; past the render time limit, DEADLINE_EXCEEDED)."""
        self._chat_template()
        return await self.render_pool.render(
            inputs.messages,
            inputs.tools,
            inputs.template_kwargs,
            inputs.add_generation_prompt,
            inputs.continue_final_message,
        )

    def _check_parsers(self, request: pb.ChatRequest, inputs: ChatInputs) -> None:
        wants_reasoning = request.HasField("parse_reasoning") and request.parse_reasoning
        if wants_reasoning and self.files.reasoning_parser is None:
            raise InvalidArgument(
                "parse_reasoning",
                "this server has no reasoning parser (start it with --reasoning-parser)",
            )
        if inputs.tools and self.files.tool_call_parser is None:
            raise InvalidArgument(
                "tools",
                "this server has no tool-call parser for the model (start it with "
                "--tool-call-parser), so tool calls could not be returned",
            )

    def _chat_parser(
        self, request: pb.ChatRequest, inputs: ChatInputs, prompt: str
    ) -> ChatOutputParser | None:
        reasoning = None
        wanted = request.parse_reasoning if request.HasField("parse_reasoning") else True
        if wanted and self.files.reasoning_parser is not None:
            cls = reasoning_parser_class(self.files.reasoning_parser)
            reasoning = cls(start_in_reasoning=cls.prompt_opens_reasoning(prompt))
        tools = None
        if inputs.tools and self.files.tool_call_parser is not None:
            tools = make_tool_call_parser(self.files.tool_call_parser, tools=inputs.tools)
        if reasoning is None and tools is None:
            return None
        return ChatOutputParser(reasoning=reasoning, tool_calls=tools)

    async def _start_chat(self, request: pb.ChatRequest, request_id: str):
        self._check_serving()
        check_request_id(request.request_id)
        self._chat_template()
        vocab_size, _ = self._limits
        limits = self._request_limits()
        inputs = chat_inputs(request, limits)
        params = sampling_params(request.sampling, vocab_size, limits=limits)
        cache_salt = check_cache_salt(request.cache_salt)
        self._check_parsers(request, inputs)
        prompt, prompt_ids = await self._render(inputs)
        room = reasoning_room(self.files.reasoning_parser, request, prompt)
        params = constrain_to_tool_choice(params, inputs, self.files.tool_call_parser, room)
        parser = self._chat_parser(request, inputs, prompt)
        return self._add(request_id, prompt_ids, params, cache_salt, ChatResponder, parser=parser)

    # The HTTP door (http/routes.py) checks readiness and starts its requests through these,
    # exactly as Generate and Chat do: each returns (stream of RequestOutputs, responder).
    check_serving = _check_serving
    start_generate = _start_generate
    start_chat = _start_chat

    # ----- unary RPCs

    @_unary
    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        check_abort_ids(request.request_ids, self.server.options.limits)
        aborted = self.engine.abort(list(request.request_ids))
        return pb.AbortResponse(aborted_request_ids=aborted)

    @_unary
    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        text = request.text
        check_text("text", text, self._request_limits().max_prompt_bytes)
        ids = await self.render_pool.encode(text, add_special)
        return pb.TokenizeResponse(token_ids=ids)

    @_unary
    async def Detokenize(self, request: pb.DetokenizeRequest, context) -> pb.DetokenizeResponse:
        limits = self.server.options.limits
        check_detokenize_ids(request.token_ids, self.files.tokenizer.vocab_size, limits)
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        text = await self.render_pool.decode(list(request.token_ids), skip)
        return pb.DetokenizeResponse(text=text)

    @_unary
    async def RenderChat(self, request: pb.ChatRequest, context) -> pb.RenderChatResponse:
        check_request_id(request.request_id)
        self._chat_template()
        inputs = chat_inputs(request, self._request_limits())
        prompt, prompt_ids = await self._render(inputs)
        return pb.RenderChatResponse(prompt=prompt, token_ids=prompt_ids)

    @_unary
    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context) -> pb.ModelInfo:
        vocab_size, max_model_len = self._limits
        tokenizer = self.files.tokenizer
        return pb.ModelInfo(
            model=self.files.model,
            model_type=self.files.model_type,
            architectures=self.files.architectures,
            max_model_len=max_model_len,
            vocab_size=vocab_size,
            eos_token_ids=list(tokenizer.eos_token_ids),
            bos_token_id=tokenizer.bos_token_id,
            has_chat_template=self.files.chat_template is not None,
            tool_call_parser=self.files.tool_call_parser or "",
            reasoning_parser=self.files.reasoning_parser or "",
        )

    @_unary
    async def GetServerInfo(self, request: pb.GetServerInfoRequest, context) -> pb.ServerInfo:
        info = pb.ServerInfo(
            version=_version(),
            ready=self.server.ready,
            draining=self.server.draining,
            start_time=self.server.start_time,
        )
        config = self.engine.config
        if config is not None:
            info.tensor_parallel_size = config.parallel.tensor_parallel_size
            info.decode_context_parallel_size = config.parallel.decode_context_parallel_size
            info.block_size = config.cache.block_size or 0  # 0: chosen when the model loads
            info.max_num_seqs = config.scheduler.max_num_seqs
            info.max_num_batched_tokens = config.scheduler.max_num_batched_tokens
            info.enable_prefix_caching = config.cache.enable_prefix_caching
        if self.engine.running:
            stats = await self.engine.stats()
            info.num_kv_blocks = stats["num_blocks"]
            info.num_running_requests = stats["num_running"]
            info.num_waiting_requests = stats["num_waiting"]
            info.kv_cache_usage = stats["kv_cache_usage"]
            info.routing = stats.get("routing", "")
            for index, replica in enumerate(stats.get("replicas") or []):
                info.replicas.append(_replica_info(index, replica))
            spec = spec_decode_fields(config.speculative, stats) if config is not None else None
            if spec is not None:
                info.spec_decode.CopyFrom(pb.SpecDecodeInfo(**spec))
        return info


def _replica_info(index: int, replica: dict[str, Any]) -> pb.ReplicaInfo:
    """A replica's entry of GetServerInfo (a down replica has its routing figures only)."""
    return pb.ReplicaInfo(
        index=index,
        up=bool(replica.get("up")),
        num_in_flight_requests=int(replica.get("in_flight", 0)),
        num_running_requests=int(replica.get("num_running", 0)),
        num_waiting_requests=int(replica.get("num_waiting", 0)),
        kv_cache_usage=float(replica.get("kv_cache_usage", 0.0)),
        prefix_cache_hit_rate=float(replica.get("prefix_cache_hit_rate", 0.0)),
        num_routed=int(replica.get("routed", 0)),
        num_routed_by_prefix=int(replica.get("routed_by_prefix", 0)),
    )


class KvloomServer:
    """One model replica's gRPC server. `engine_factory` builds the engine (in the engine
    thread); `start()` binds, loads, warms up and turns ready."""

    def __init__(self, engine_factory: Callable[[], Any], options: ServerOptions) -> None:
        self.options = options
        self._engine_factory = engine_factory
        self.engine = self._make_engine()
        self.restarting = False
        self.num_restarts = 0
        self.last_failure: str | None = None
        # Set when the server stopped because its engine failed (policy "exit", or a
        # restart that failed): `kvloom serve` then exits non-zero.
        self.failure: str | None = None
        self.files: ModelFiles | None = None
        self.executor: ThreadPoolExecutor | None = None
        self.render_pool: RenderPool | None = None
        self.ready = False
        self.summary = ""  # the start-up summary line, once ready
        self.draining = False
        self.start_time = time.time()
        self.port: int | None = None
        self.metrics_port: int | None = None
        self.http_port: int | None = None  # the OpenAI-compatible HTTP door, when on
        self.generation: GenerationServicer | None = None  # serves both doors
        self._grpc: grpc.aio.Server | None = None
        self._http = None  # an http.HttpListener
        self._health = health_aio.HealthServicer()
        self._metrics = None  # an http.HttpListener serving GET /metrics only
        self._stopping = False
        self._stopped: asyncio.Event | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        self._stopped = asyncio.Event()
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise
        self.ready = True
        await self._health.set(SERVICE_NAME, SERVING)
        self.summary = await self._summary()
        logger.info("kvloom: %s", self.summary)

    async def _summary(self) -> str:
        """One line for the operator: model, dtype, grid, KV pool, concurrency, parsers,
        addresses (printed by `kvloom serve` once ready)."""
        config = self.engine.config
        stats = await self.engine.stats()
        grid = f"tp {config.parallel.tensor_parallel_size} x dcp "
        grid += str(config.parallel.decode_context_parallel_size)
        if stats.get("data_parallel_size", 1) > 1:
            grid += f" x {stats['data_parallel_size']} replicas ({stats['routing']} routing)"
        blocks, block_size = stats["num_blocks"], stats.get("block_size") or 0
        files = self.files
        parsers = [
            f"tool calls {getattr(files, 'tool_call_parser', None) or 'none'}",
            f"reasoning {getattr(files, 'reasoning_parser', None) or 'none'}",
        ]
        addresses = [f"grpc {self.options.host}:{self.port}"]
        if self.http_port is not None:
            addresses.append(f"http {self.options.host}:{self.http_port}")
        if self.metrics_port is not None:
            addresses.append(f"metrics {self.options.host}:{self.metrics_port}")
        dtype = config.model.dtype
        if dtype == "auto":  # the checkpoint's own
            hf = config.model.text_config
            dtype = f"auto ({hf.get('torch_dtype') or hf.get('dtype') or 'float32'})"
        return (
            f"{self.options.model}: dtype {dtype}, {grid}; KV cache {blocks} "
            f"blocks of {block_size} tokens ({blocks * block_size} tokens); up to "
            f"{config.scheduler.max_num_seqs} running and {self.options.max_waiting} waiting "
            f"requests, max_model_len {config.scheduler.max_model_len}; parsers: "
            f"{', '.join(parsers)}; {', '.join(addresses)}"
        )

    async def _start(self) -> None:
        options = self.options
        self.executor = ThreadPoolExecutor(
            max_workers=options.tokenizer_threads, thread_name_prefix="kvloom-tokenizer"
        )
        loop = asyncio.get_running_loop()
        self.files = await loop.run_in_executor(
            self.executor,
            load_model_files,
            options.model,
            options.tool_call_parser,
            options.reasoning_parser,
        )
        self.render_pool = RenderPool(
            options.model, options.tokenizer_threads, options.limits.render_timeout_s
        )
        await self.render_pool.start()
        await self._health.set(LIVENESS, SERVING)
        await self._health.set(SERVICE_NAME, NOT_SERVING)
        interceptors = [BearerTokenInterceptor(options.auth_token)] if options.auth_token else []
        self._grpc = grpc.aio.server(interceptors=interceptors, options=options.grpc_options())
        self.generation = GenerationServicer(self)
        add_generation_servicer(self.generation, self._grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._grpc)
        reflection.enable_server_reflection(
            (
                SERVICE_NAME,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            self._grpc,
        )
        self.port = self._bind(self._grpc)
        await self._grpc.start()
        if options.http_port is not None:
            from kvloom.cluster.frontend.http import HttpListener, build_app

            self._http = HttpListener(build_app(self), options.tls_cert, options.tls_key)
            self.http_port = await self._http.start(options.host, options.http_port)
        if options.metrics_port is not None:
            from kvloom.cluster.frontend.http import HttpListener, build_metrics_app

            self._metrics = HttpListener(build_metrics_app(self), what="metrics port")
            self.metrics_port = await self._metrics.start(options.host, options.metrics_port)
        await self.engine.start()
        if options.warmup:
            await self._warm_up()

    def _bind(self, server: grpc.aio.Server) -> int:
        options = self.options
        address = f"{options.host}:{options.port}"
        # gRPC logs its own bind failure at ERROR level; look first, so that a port in use
        # is said once, plainly (gRPC's check stays: the port may be taken meanwhile).
        check_port_free(options.host, options.port)
        try:
            if options.tls_cert is not None:
                credentials = grpc.ssl_server_credentials(
                    [(Path(options.tls_key).read_bytes(), Path(options.tls_cert).read_bytes())]
                )
                port = server.add_secure_port(address, credentials)
            else:
                port = server.add_insecure_port(address)
        except RuntimeError as exc:  # grpcio: "Failed to bind to address ..."
            check_port_free(options.host, options.port)
            raise OSError(f"cannot listen on {address}: {exc}") from None
        if port == 0:
            raise OSError(f"cannot listen on {address}")
        return port

    async def _warm_up(self) -> None:
        """One short greedy generation, so the first client does not pay for lazy setup."""
        max_model_len = self.engine.config.scheduler.max_model_len
        ids = (self.files.tokenizer.encode(WARMUP_PROMPT) or [0])[: max_model_len - 1]
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        request_id = f"kvloom-warmup-{uuid.uuid4().hex}"
        stream = self.engine.add(request_id, {"prompt_token_ids": ids}, params)
        async for _ in stream:
            pass

    async def _render_metrics(self) -> str:
        stats = await self.engine.stats() if self.engine.running else {}
        model_name = self.options.served_model_name or self.options.model
        return render_metrics(stats, self.ready, model_name, self.engine.request_metrics)

    metrics_text = _render_metrics  # GET /metrics on the HTTP door

    def _make_engine(self) -> AsyncEngine:
        return AsyncEngine(
            self._engine_factory, max_waiting=self.options.max_waiting, on_fatal=self._on_fatal
        )

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_fatal(self, error: BaseException) -> None:
        """The engine failed (every stream in flight has already ended with the error)."""
        policy = self.options.on_worker_failure
        logger.error("the engine failed; NOT_SERVING, then %s: %s", policy, error)
        self.ready = False
        self.last_failure = str(error)
        self.restarting = policy == "restart" and not (self.draining or self._stopping)
        self._spawn(self._recover(error))

    async def _recover(self, error: BaseException) -> None:
        await self._health.set(SERVICE_NAME, NOT_SERVING)
        if self.draining or self._stopping:
            return
        if not self.restarting:
            self.failure = f"the engine failed: {error}"
            await self.stop(grace_s=FAILED_STREAMS_GRACE_S)
            return
        try:
            await self.engine.shutdown()  # frees the old replica's actors and devices
            self.engine = self._make_engine()
            await self.engine.start()
            if self.options.warmup:
                await self._warm_up()
        except Exception as exc:
            logger.exception("restarting the engine failed")
            self.restarting = False
            self.failure = f"the engine failed ({error}) and restarting it failed: {exc}"
            await self.stop(grace_s=FAILED_STREAMS_GRACE_S)
            return
        self.restarting = False
        if self.draining or self._stopping:
            await self.engine.shutdown()
            return
        self.num_restarts += 1
        self.ready = True
        await self._health.set(SERVICE_NAME, SERVING)
        logger.info("the engine is restarted (%d so far); SERVING", self.num_restarts)

    async def drain(self, timeout_s: float | None = None) -> None:
        """Stops taking requests, lets those in flight finish (up to the timeout), stops."""
        if self.draining or self._stopping:
            await self.wait_stopped()
            return
        self.draining = True
        self.ready = False
        await self._health.set(SERVICE_NAME, NOT_SERVING)
        timeout_s = self.options.drain_timeout_s if timeout_s is None else timeout_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.engine.num_in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.engine.num_in_flight:
            # Out of time: abort what is left, so each stream still ends properly (its
            # held-back text flushed, Finish ABORT, Usage) before the RPCs are closed.
            logger.warning("drain timed out; aborting %d requests", self.engine.num_in_flight)
            self.engine.abort_all()
            deadline = loop.time() + 2.0
            while self.engine.num_in_flight and loop.time() < deadline:
                await asyncio.sleep(0.02)
        await self.stop(grace_s=1.0)

    async def stop(self, grace_s: float = 0.0) -> None:
        """Stops at once: RPCs still running after `grace_s` are cancelled (and aborted)."""
        if self._stopping:
            await self.wait_stopped()
            return
        self._stopping = True
        self.ready = False
        await self._health.enter_graceful_shutdown()
        doors = [self._grpc.stop(grace_s)] if self._grpc is not None else []
        if self._http is not None:
            doors.append(self._http.stop(grace_s))
        await asyncio.gather(*doors)
        await self.engine.shutdown()
        if self._metrics is not None:
            await self._metrics.stop(grace_s=0.0)
        if self.render_pool is not None:
            await self.render_pool.close()
        if self.executor is not None:
            self.executor.shutdown(wait=False, cancel_futures=True)
        assert self._stopped is not None
        self._stopped.set()

    @property
    def stopping(self) -> bool:
        return self._stopping

    async def wait_stopped(self) -> None:
        assert self._stopped is not None, "start() first"
        await self._stopped.wait()


async def serve_until_signal(
    engine_factory: Callable[[], Any],
    options: ServerOptions,
    on_ready: Callable[[KvloomServer], None] | None = None,
    on_signal: Callable[[signal.Signals, int], None] | None = None,
) -> KvloomServer:
    """Runs a server until SIGTERM or SIGINT: the first drains, a second stops at once.

    Returns the stopped server (its `failure` says whether its engine failed). A start-up
    failure raises, unless a signal arrived meanwhile (then stopping was asked for, and the
    failure is the stop). `on_signal(signal, count)` is called on each signal first."""
    server = KvloomServer(engine_factory, options)
    loop = asyncio.get_running_loop()
    signals = 0

    def handle(sig: signal.Signals) -> None:
        nonlocal signals
        signals += 1
        if on_signal is not None:
            on_signal(sig, signals)
        coro = server.drain() if signals == 1 else server.stop()
        task = loop.create_task(coro)
        server._tasks.add(task)
        task.add_done_callback(server._tasks.discard)

    def take_signals() -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
            loop.add_signal_handler(sig, handle, sig)

    def take_signals_soon() -> None:  # called in the thread that connected to Ray
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody to drain
            loop.call_soon_threadsafe(take_signals)

    take_signals()
    # Connecting to Ray installs its core worker's (aborting) SIGTERM handler: take the
    # signals back as soon as it has, not only once the model is loaded.
    forget_hook = call_when_connected(take_signals_soon)
    try:
        try:
            await server.start()
        except Exception:
            if signals:  # a signal arrived while loading: the stop it asked for, not an error
                logger.debug("start-up ended by a signal", exc_info=True)
                return server
            raise
        take_signals()  # again, in case Ray was joined some other way meanwhile
        if on_ready is not None:
            on_ready(server)
        await server.wait_stopped()
        return server
    finally:
        forget_hook()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
