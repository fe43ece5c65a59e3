"""The coordinator's own errors, and OpenAI's error shape built on the runtime's one status mapping.

    {"error": {"message": str, "type": str, "param": str | null, "code": str | null}}

The status always comes from common.runtime (status_for / error_response); this module only
re-dresses the body for the /v1 endpoints. /generate keeps the runtime's own shape.
"""
from __future__ import annotations

from typing import Any

from common.runtime import BadRequest, HttpError, Response, Unauthorized, error_response


class InvalidParam(BadRequest):
    """A 400 naming the offending request field (OpenAI's `param`) and, for some, a machine code."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


class InvalidAPIKey(Unauthorized):
    """401: KNOT_API_KEY is set and the request's bearer token is missing or wrong."""

    code = "invalid_api_key"

    def __init__(self, message: str):
        super().__init__(message, headers={"WWW-Authenticate": "Bearer"})


class TooManyRequests(HttpError):
    """The bounded queue is full: come back after Retry-After seconds."""

    status = 429


def openai_error_type(status: int) -> str:
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def openai_error_body(exc: BaseException, status: int) -> dict[str, Any]:
    code = getattr(exc, "code", None)
    if code is None and status == 429:
        code = "rate_limit_exceeded"
    return {"error": {"message": str(exc) or type(exc).__name__, "type": openai_error_type(status),
                      "param": getattr(exc, "param", None), "code": code}}


def openai_error_response(exc: BaseException, request_id: str | None = None) -> Response:
    """error_response()'s status and headers (Retry-After, ...), with OpenAI's body."""
    plain = error_response(exc, request_id)
    headers = {k: v for k, v in plain.headers.items() if k.lower() != "content-type"}
    return Response.from_json(openai_error_body(exc, plain.status), plain.status, headers)
