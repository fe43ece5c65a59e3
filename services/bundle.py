"""Several single calls in one request (common/wire.py's bundle): continuous batching's hops.

The coordinator steps its generations' decode trips together (services/coordinator/pipeline.py):
one POST /forward_many to each station and one POST /sample_many to each shard carry every
generation's frame, where one call each would cost every hop's fixed price per generation. A
server runs the parts as it runs its single calls, at once, so its Batcher stacks them into one
forward; each part's answer is what that single call would have answered, error statuses too.

    body = await serve_bundle(request.body, one)          # a server: one(part body) -> reply body
    parts = await post_bundle(binding, path, bodies, t)   # a client: [(status, body)] per part
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

from common import wire
from common.runtime import BadGateway, BadRequest, Response, error_response
from services.peer import post_pinned

log = logging.getLogger(__name__)


async def serve_bundle(body: bytes | memoryview, one: Callable[[memoryview], Awaitable[bytes]]) -> Response:
    """A bundle request -> the bundle of one(part)'s replies, each part's error as its own status."""
    try:
        parts = wire.decode_bundle(body)
    except wire.WireError as e:
        raise BadRequest(f"malformed bundle: {e}") from None
    if any(status for status, _ in parts):
        raise BadRequest("bundle request: every part's status must be 0")
    results = await asyncio.gather(*(one(p) for _, p in parts), return_exceptions=True)
    out = []
    for i, r in enumerate(results):
        if isinstance(r, BaseException):
            if not isinstance(r, Exception):  # cancelled: the whole request is
                raise r
            resp = error_response(r)
            if resp.status >= 500:
                log.warning("bundle part %d of %d: %s: %s", i, len(parts), type(r).__name__, r)
            out.append((resp.status, bytes(resp.body)))
        else:
            out.append((200, r))
    return Response.from_bytes(wire.encode_bundle(out), wire.BUNDLE_CONTENT_TYPE)


async def post_bundle(binding: Any, path: str, bodies: list[bytes], timeout_s: float,
                      knot_etag: str | None = None) -> list[tuple[int, memoryview]]:
    """POST the bodies as one bundle -> (status, body) per part, in order; BadGateway when the reply
    is not a bundle of as many parts."""
    resp = await post_pinned(binding, path, wire.encode_bundle((0, b) for b in bodies), wire.BUNDLE_CONTENT_TYPE,
                             timeout_s, knot_etag)
    try:
        parts = wire.decode_bundle(resp.body)
    except wire.WireError as e:
        raise BadGateway(f"{path}: malformed reply: {e}") from None
    if len(parts) != len(bodies):
        raise BadGateway(f"{path}: {len(parts)} parts in the reply to {len(bodies)}")
    return parts
