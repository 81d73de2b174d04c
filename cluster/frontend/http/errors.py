"""HTTP errors as OpenAI error objects: `{"error": {"message", "type", "param", "code"}}`.

The status follows the gRPC door's status for the same failure (so the OpenAI SDKs raise
BadRequestError, AuthenticationError, NotFoundError, RateLimitError, ...); `code` is that
gRPC status in lower case, `param` the OpenAI field an error is about.
"""

from __future__ import annotations

from typing import Any

import grpc
from pydantic import ValidationError

from kvloom.cluster.frontend.errors import FrontendError, InvalidArgument

# A render or tokenization over its time limit is the request's doing: 400, not a 5xx
# that the SDKs would retry.
STATUS_OF_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.DEADLINE_EXCEEDED: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
}
_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    429: "rate_limit_error",
}


def error_type(status: int) -> str:
    if status in _TYPES:
        return _TYPES[status]
    return "server_error" if status >= 500 else "invalid_request_error"


class HttpError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": str(self),
                "type": error_type(self.status),
                "param": self.param,
                "code": self.code,
            }
        }


def from_frontend(exc: FrontendError, rename=lambda field: field) -> HttpError:
    """A front-door error as the HTTP door reports it; `rename` maps a proto field name to
    the OpenAI one the client wrote."""
    status = STATUS_OF_CODE.get(exc.code, 500)
    message = str(exc)
    field = exc.field if isinstance(exc, InvalidArgument) else None
    if field is None:
        head = message.split(" ", 1)[0]
        if head.endswith(":") and len(head) > 1:  # "messages: the model has no template"
            field = head[:-1]
    if field is not None:
        openai = rename(field)
        if message.startswith(field):
            message = openai + message[len(field) :]
        field = openai
    return HttpError(status, message, param=field, code=exc.code.name.lower())


def _location(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def from_validation(exc: ValidationError) -> HttpError:
    """The first problem pydantic found, with the field's path (`messages[0].role`)."""
    first = exc.errors(include_url=False)[0]
    field = _location(first["loc"]) or "body"
    return HttpError(400, f"{field}: {first['msg']}", param=field, code="invalid_argument")
