"""The OpenAI-compatible routes, on the KvloomServer the gRPC door runs on:

    POST /v1/chat/completions   POST /v1/completions   (streaming as server-sent events, or not)
    GET  /v1/models             GET  /health           GET  /metrics

Each generation request is checked and converted to the gRPC door's request message, then
started by the server's GenerationServicer exactly as a gRPC call is (same checks, template,
tokenizer pool, engine, parsers); its stream messages come back as OpenAI objects. A client
that goes away (or a stream cancelled by a stop) aborts its request in the engine.
`Authorization: Bearer TOKEN` guards every route but /health when the server has a token.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvloom.cluster.frontend.async_engine import EngineFailed, RequestRejected
from kvloom.cluster.frontend.auth import bearer_matches
from kvloom.cluster.frontend.errors import FrontendError, InvalidArgument, Unavailable
from kvloom.cluster.frontend.http.body import decode_json_object
from kvloom.cluster.frontend.http.errors import HttpError, from_frontend, from_validation
from kvloom.cluster.frontend.http.openai_output import ChatOutput, CompletionOutput, sse
from kvloom.cluster.frontend.http.request_models import ChatCompletionRequest, CompletionRequest
from kvloom.cluster.frontend.http.to_proto import FieldNames, chat_request, generate_request

if TYPE_CHECKING:
    from kvloom.cluster.frontend.server import KvloomServer

logger = logging.getLogger(__name__)

_DENIED = "missing or wrong bearer token (send the header `Authorization: Bearer TOKEN`)"
REQUEST_ID_HEADER = "X-Request-Id"
_CLIENT_GONE = 499  # nobody reads it: the client has closed the connection


def _request_id(request: Request) -> str:
    """The client's X-Request-Id (the engine's id for the request, so gRPC's Abort and the
    logs name it), else a fresh one."""
    return request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex


def _error_response(error: HttpError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


class _Relay:
    """One started request: its stream messages, mapped errors, and an abort unless it
    finished (`close`, called whatever ended the response)."""

    def __init__(self, server: KvloomServer, request_id: str, started: tuple) -> None:
        self.engine = server.engine  # the engine it was added to, even after a restart
        self.request_id = request_id
        self.stream, self.responder = started

    async def messages(self) -> AsyncIterator[Any]:
        try:
            async for out in self.stream:
                for message in self.responder.update(out):
                    yield message
        except RequestRejected as exc:
            raise InvalidArgument.from_message(str(exc), "prompt") from None
        except EngineFailed as exc:
            raise Unavailable(str(exc)) from None

    def close(self) -> None:
        if not self.responder.finished:
            self.engine.abort([self.request_id])


class _EventStream(StreamingResponse):
    """Server-sent events that close their request however the response ends (finished,
    client gone, server stopping), even if the body was never started."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: asyncio.Future) -> bool:
    """Awaits `work`; True if the client went away first (then `work` is cancelled)."""
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
    if work.cancelled():
        return True
    work.result()  # raises what the work raised
    return False


class OpenAIRoutes:
    def __init__(self, server: KvloomServer) -> None:
        self.server = server
        options = server.options
        self.model_name = options.served_model_name or options.model
        self._known_models = {self.model_name, options.model}

    @property
    def generation(self):
        return self.server.generation

    # ----- shared steps

    def authorize(self, request: Request) -> None:
        token = self.server.options.auth_token
        if token is not None and not bearer_matches(request.headers.get("authorization"), token):
            raise HttpError(401, _DENIED, code="unauthenticated")

    async def _json(self, request: Request) -> dict[str, Any]:
        limit = self.server.options.max_message_bytes
        too_large = HttpError(
            413, f"body: larger than the limit of {limit} bytes", param="body", code="too_large"
        )
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > limit:
                raise too_large
            parts.append(part)
        return decode_json_object(b"".join(parts), self.server.options.limits.max_json_depth)

    def _parse(self, model: type[BaseModel], body: dict[str, Any]):
        try:
            parsed = model.model_validate(body)
        except ValidationError as exc:
            raise from_validation(exc) from None
        if parsed.model is not None and parsed.model not in self._known_models:
            raise HttpError(
                404,
                f"model: {parsed.model!r} is not served here (GET /v1/models lists what is)",
                param="model",
                code="not_found",
            )
        return parsed

    async def _respond(
        self,
        request: Request,
        relay: _Relay,
        output: ChatOutput | CompletionOutput,
        names: FieldNames,
        stream: bool,
        include_usage: bool,
    ) -> Response:
        if stream:
            return _EventStream(self._events(relay, output, names, include_usage), relay.close)

        async def collect() -> None:
            async for message in relay.messages():
                output.add(message)

        try:
            gone = await _unless_disconnected(request, asyncio.ensure_future(collect()))
        except FrontendError as exc:
            raise from_frontend(exc, names.openai) from None
        finally:
            relay.close()
        if gone:
            return Response(status_code=_CLIENT_GONE)
        return JSONResponse(output.response())

    async def _events(
        self,
        relay: _Relay,
        output: ChatOutput | CompletionOutput,
        names: FieldNames,
        include_usage: bool,
    ) -> AsyncIterator[bytes]:
        try:
            async for message in relay.messages():
                chunk = output.chunk(message)
                if chunk is not None:
                    yield sse(chunk)
            if include_usage:
                yield sse(output.usage_chunk())
        except FrontendError as exc:  # after the 200: the error is an event (the SDKs raise it)
            yield sse(from_frontend(exc, names.openai).body())
        except Exception as exc:
            logger.exception("request %s failed", relay.request_id)
            yield sse(HttpError(500, f"internal error: {type(exc).__name__}: {exc}").body())
        yield sse("[DONE]")

    # ----- routes

    async def chat_completions(self, request: Request) -> Response:
        return await self._complete(
            request,
            ChatCompletionRequest,
            chat_request,
            self.generation.start_chat,
            lambda req, rid: ChatOutput(f"chatcmpl-{rid}", self.model_name, logprobs=req.logprobs),
        )

    async def completions(self, request: Request) -> Response:
        return await self._complete(
            request,
            CompletionRequest,
            generate_request,
            self.generation.start_generate,
            lambda req, rid: CompletionOutput(
                f"cmpl-{rid}", self.model_name, logprobs=req.logprobs is not None
            ),
        )

    async def _complete(self, request, model, to_message, start, make_output) -> Response:
        """One OpenAI request: parse, turn into the gRPC door's message, start it through
        the servicer, answer whole or as server-sent events."""
        names = FieldNames()
        try:
            req = self._parse(model, await self._json(request))
            request_id = _request_id(request)
            message, names = to_message(req, request_id)
            names.set("request_id", REQUEST_ID_HEADER)
            started = await start(message, request_id)
        except FrontendError as exc:
            raise from_frontend(exc, names.openai) from None
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        relay = _Relay(self.server, request_id, started)
        output = make_output(req, request_id)
        return await self._respond(request, relay, output, names, req.stream, include_usage)

    async def models(self) -> dict[str, Any]:
        config = self.server.engine.config
        card = {
            "id": self.model_name,
            "object": "model",
            "created": int(self.server.start_time),
            "owned_by": "kvloom",
            "root": self.server.options.model,
            "parent": None,
            "max_model_len": None if config is None else config.scheduler.max_model_len,
        }
        return {"object": "list", "data": [card]}

    async def health(self) -> Response:
        """200 while serving; 503 while loading, warming up, restarting or draining."""
        try:
            self.generation.check_serving()
        except FrontendError as exc:
            return _error_response(from_frontend(exc))
        return Response(status_code=200)

    async def metrics(self) -> Response:
        text = await self.server.metrics_text()
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")


def _answer_errors_as_openai_objects(app: FastAPI) -> None:
    @app.exception_handler(HttpError)
    async def _http_error(request: Request, exc: HttpError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:  # logged by uvicorn
        return _error_response(HttpError(500, f"internal error: {type(exc).__name__}: {exc}"))

    @app.exception_handler(StarletteHTTPException)
    async def _framework_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"{request.method} {request.url.path}: no such route"
        else:
            message = f"{request.method} {request.url.path}: {exc.detail}"
        return _error_response(HttpError(exc.status_code, message))


def _bare_app() -> FastAPI:
    app = FastAPI(title="kvloom", docs_url=None, redoc_url=None, openapi_url=None)
    _answer_errors_as_openai_objects(app)
    return app


def build_app(server: KvloomServer) -> FastAPI:
    """The HTTP door (--http-port)."""
    routes = OpenAIRoutes(server)
    app = _bare_app()
    guarded = [Depends(routes.authorize)]
    app.add_api_route("/health", routes.health, methods=["GET"])
    app.add_api_route("/metrics", routes.metrics, methods=["GET"], dependencies=guarded)
    app.add_api_route("/v1/models", routes.models, methods=["GET"], dependencies=guarded)
    app.add_api_route(
        "/v1/chat/completions", routes.chat_completions, methods=["POST"], dependencies=guarded
    )
    app.add_api_route("/v1/completions", routes.completions, methods=["POST"], dependencies=guarded)
    return app


def build_metrics_app(server: KvloomServer) -> FastAPI:
    """The metrics port (--metrics-port): GET /metrics only, plain HTTP with no token, for
    a scraper that reaches that port alone."""
    app = _bare_app()
    app.add_api_route("/metrics", OpenAIRoutes(server).metrics, methods=["GET"])
    return app
