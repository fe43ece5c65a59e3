"""Calls to a peer over its binding (a service binding or a Durable Object stub): one request shape,
one timeout, one error mapping. The typed clients next to each server use these.

A peer's failure is never the caller's client's fault: a non-2xx reply becomes PeerError, a 502
that keeps the peer's status and error kind (so a station's UnknownSession can be told apart).
An unreachable peer raises what its binding raises (ServiceUnavailable) or TimeoutError.

An envelope hop may name the knot version the request works on (X-Knot-Etag): the reply must then
name the same one, and a peer that answered from another version, or refused over the knot's
integrity (services/knot_source.py INTEGRITY_ERRORS), raises IntegrityFailure (503).
"""
from __future__ import annotations

import asyncio
from typing import Any

from common import wire
from common.runtime import BadGateway, HttpError, Request, Response
from services.knot_source import INTEGRITY_ERRORS, KNOT_ETAG_HEADER

PEER_URL = "https://peer"  # a binding routes by itself: only the path is read


class PeerError(BadGateway):
    def __init__(self, path: str, status: int, error: str, message: str):
        # status is the class's (502): the peer's own reply is kept beside it
        self.path, self.peer_status, self.peer_error, self.peer_message = path, status, error, message
        super().__init__(f"{path}: HTTP {status}: {message}")

    @classmethod
    def of(cls, path: str, resp: Response) -> "PeerError":
        try:
            body = resp.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            body = {"message": bytes(resp.body[:200]).decode("utf-8", "replace")}  # a memoryview if large
        return cls(path, resp.status, str(body.get("error", "")), str(body.get("message", "")))


async def call(binding: Any, request: Request, timeout_s: float | None) -> Response:
    """The peer's 2xx reply; PeerError for any other status. timeout_s None: no timeout."""
    # asyncio.timeout, not wait_for: in Python 3.11 wait_for runs the call as a task of its own,
    # a task and two turns of the loop more per call, and a coordinator makes ten calls a token.
    if timeout_s is not None and timeout_s <= 0:
        # wait_for never started such a call; under asyncio.timeout its request would go out
        # (the first send does not suspend) before the timeout lands: refuse it here instead.
        raise TimeoutError(f"{request.path}: no time left for the call (timeout {timeout_s:g} s)")
    async with asyncio.timeout(timeout_s):
        resp = await binding.fetch(request)
    # A cancellation that lands just as the call completes must not be lost (Python 3.11's wait_for
    # dropped it: a request whose client hung up then generated to the end with its slot taken,
    # tests/unit/test_pipeline.py, a client that hangs up). A task with one pending stops here.
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError(f"{request.path}: cancelled as the call completed")
    if not resp.ok:
        raise PeerError.of(request.path, resp)
    return resp


class IntegrityFailure(HttpError):
    """A hop answered from another knot version, or refused over the knot's integrity: the request
    fails (never degraded), and the coordinator checks the bucket's version before the next one."""

    status = 503


async def post_envelope(binding: Any, path: str, frame: wire.Envelope, timeout_s: float,
                        knot_etag: str | None = None) -> wire.Envelope:
    """With knot_etag, the request names that version and the reply must come from it."""
    resp = await post_pinned(binding, path, wire.encode_envelope(frame), wire.ENVELOPE_CONTENT_TYPE, timeout_s,
                             knot_etag)
    try:
        return wire.decode_envelope(resp.body)
    except wire.WireError as e:
        raise BadGateway(f"{path}: malformed reply: {e}") from None


async def post_pinned(binding: Any, path: str, body: bytes, content_type: str, timeout_s: float,
                      knot_etag: str | None = None) -> Response:
    """POST a binary body -> the 2xx reply; with knot_etag, the request names that version and the
    reply must come from it (else IntegrityFailure)."""
    headers = {"Content-Type": content_type} | ({KNOT_ETAG_HEADER: knot_etag} if knot_etag else {})
    req = Request("POST", PEER_URL + path, headers, body)
    try:
        resp = await call(binding, req, timeout_s)
    except PeerError as e:
        if e.peer_error in INTEGRITY_ERRORS:
            raise IntegrityFailure(f"{path}: {e.peer_error}: {e.peer_message}") from None
        raise
    if knot_etag and resp.headers.get(KNOT_ETAG_HEADER) != knot_etag:
        raise IntegrityFailure(f"{path}: answered from knot version {resp.headers.get(KNOT_ETAG_HEADER)!r}, the "
                               f"request works on {knot_etag!r}; refused rather than mixing versions")
    return resp


async def get_json(binding: Any, path: str, timeout_s: float | None) -> Any:
    """GET path -> its JSON body (ValueError if it is not JSON)."""
    return (await call(binding, Request("GET", PEER_URL + path), timeout_s)).json()
