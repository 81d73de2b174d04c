"""Decodes the Generation service's requests itself, so that bytes protobuf refuses (invalid
UTF-8 or an encoded lone surrogate in a string field) are answered INVALID_ARGUMENT naming
the field, not UNKNOWN "Unexpected DecodeError" from grpc's own deserializer.

`add_generation_servicer` registers a servicer as the generated
`add_GenerationServicer_to_server` does, with a deserializer that turns an undecodable request
into an `UndecodableRequest` which the handler answers before the servicer sees it.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError

from kvloom.cluster.frontend.errors import InvalidArgument
from kvloom.protos.kvloom.v1 import generation_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["Generation"]
_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5


class UndecodableRequest:
    """Stands in for a request protobuf could not decode; `error` says why."""

    def __init__(self, error: InvalidArgument) -> None:
        self.error = error


class _Malformed(Exception):
    pass


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise _Malformed
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


def find_bad_string(descriptor: Descriptor, data: bytes, prefix: str = "") -> str | None:
    """The path (`messages[1].content`) of the first string field whose bytes are not valid
    UTF-8, walking the wire format by the message's descriptor; None if there is none."""
    counts: dict[int, int] = {}
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == _VARINT:
            _, pos = _varint(data, pos)
            continue
        if wire_type in (_FIXED64, _FIXED32):
            pos += 8 if wire_type == _FIXED64 else 4
            continue
        if wire_type != _LENGTH:
            raise _Malformed
        size, pos = _varint(data, pos)
        payload, pos = data[pos : pos + size], pos + size
        if pos > len(data):
            raise _Malformed
        field = descriptor.fields_by_number.get(number)
        if field is None:
            continue
        path = prefix + field.name
        if field.is_repeated:
            index = counts.get(number, 0)
            counts[number] = index + 1
            path += f"[{index}]"
        if field.type == FieldDescriptor.TYPE_STRING:
            try:
                payload.decode("utf-8")
            except UnicodeDecodeError:
                return path
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            found = find_bad_string(field.message_type, payload, path + ".")
            if found is not None:
                return found
    return None


def _explain(descriptor: Descriptor, data: bytes) -> InvalidArgument:
    try:
        path = find_bad_string(descriptor, data)
    except _Malformed:
        path = None
    if path is not None:
        return InvalidArgument(
            path, "is not valid UTF-8 (protobuf strings must be; a lone surrogate is not)"
        )
    return InvalidArgument("request", f"is not a valid {descriptor.full_name} message")


def deserializer(message_class: type) -> Callable[[bytes], Any]:
    def decode(data: bytes) -> Any:
        try:
            return message_class.FromString(data)
        except DecodeError:
            return UndecodableRequest(_explain(message_class.DESCRIPTOR, data))

    return decode


def _answering_undecodable(behavior: Callable, streaming: bool) -> Callable:
    if streaming:

        @functools.wraps(behavior)
        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator:
            if isinstance(request, UndecodableRequest):
                await context.abort(request.error.code, str(request.error))
            async for message in behavior(request, context):
                yield message

        return stream

    @functools.wraps(behavior)
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, UndecodableRequest):
            await context.abort(request.error.code, str(request.error))
        return await behavior(request, context)

    return unary


def add_generation_servicer(servicer: Any, server: grpc.aio.Server) -> None:
    """Registers every Generation RPC of `servicer` on `server`."""
    handlers = {}
    for method in SERVICE.methods:
        request_class = getattr(pb, method.input_type.name)
        response_class = getattr(pb, method.output_type.name)
        assert not method.client_streaming, method.name  # none of its RPCs stream requests
        streaming = method.server_streaming
        make = (
            grpc.unary_stream_rpc_method_handler
            if streaming
            else grpc.unary_unary_rpc_method_handler
        )
        handlers[method.name] = make(
            _answering_undecodable(getattr(servicer, method.name), streaming),
            request_deserializer=deserializer(request_class),
            response_serializer=response_class.SerializeToString,
        )
    generic = grpc.method_handlers_generic_handler(SERVICE.full_name, handlers)
    server.add_generic_rpc_handlers((generic,))
