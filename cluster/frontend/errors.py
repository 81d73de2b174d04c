"""Errors the front door raises on purpose, each tied to the gRPC status a client sees.

Anything not listed here is a bug and becomes INTERNAL; the server keeps serving.
"""

from __future__ import annotations

import grpc


class FrontendError(Exception):
    """Base: `code` is the gRPC status, the message is the status details."""

    code = grpc.StatusCode.INTERNAL


class InvalidArgument(FrontendError, ValueError):
    """Bad input; the message starts with the field it is about (`sampling.top_p must be ...`)."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field

    @classmethod
    def from_message(cls, message: str, default_field: str) -> InvalidArgument:
        """From a ValueError text that may already start with `field:` or `field must`."""
        head = message.split(" ", 1)[0]
        if head.endswith(":") and len(head) > 1:
            return cls(head[:-1], message[len(head) :].strip())
        if message.startswith(f"{head} must ") and head.replace("_", "").isalnum():
            return cls(head, message[len(head) :].strip())
        return cls(default_field, message)


class RenderTimeout(FrontendError):
    """Tokenizing or rendering the request took longer than the server's render limit (the
    worker doing it was stopped); the message starts with the field, as InvalidArgument's."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field


class RequestIdInUse(FrontendError, ValueError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(FrontendError):
    """The request is well formed but this server cannot serve it (no chat template)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class QueueFull(FrontendError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(FrontendError):
    """Not ready yet (loading, warming up), draining, or the engine has stopped."""

    code = grpc.StatusCode.UNAVAILABLE


class EngineDead(Unavailable):
    """The engine thread failed or was shut down; no request can run any more."""
