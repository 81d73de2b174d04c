"""Bearer-token check for every RPC except health (probes cannot send credentials)."""

from __future__ import annotations

import hmac

import grpc

HEALTH_PREFIX = "/grpc.health.v1.Health/"


def bearer_matches(value: str | bytes | None, token: str) -> bool:
    """Whether an `authorization` value is `Bearer TOKEN` (compared in constant time); the
    gRPC interceptor and the HTTP door both check with this."""
    if value is None:
        return False
    given = value.encode() if isinstance(value, str) else value
    return hmac.compare_digest(given, f"Bearer {token}".encode())


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str, exempt_prefixes: tuple[str, ...] = (HEALTH_PREFIX,)) -> None:
        self._token = token
        self._exempt = exempt_prefixes

    def _authorized(self, metadata) -> bool:
        for key, value in metadata or ():
            if key == "authorization":
                return bearer_matches(value, self._token)
        return False

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(self._exempt):
            return handler
        if self._authorized(handler_call_details.invocation_metadata):
            return handler
        return _denying(handler)


_DENIED = "missing or wrong bearer token (send metadata `authorization: Bearer TOKEN`)"


def _denying(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that fails with UNAUTHENTICATED."""

    async def deny(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _DENIED)

    serializers = dict(
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny, **serializers)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny, **serializers)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny, **serializers)
    return grpc.unary_unary_rpc_method_handler(deny, **serializers)
