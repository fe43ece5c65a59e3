"""JS Request/Response <-> common.runtime.Request/Response, and response streams as ReadableStreams.

Pyodide pitfalls handled here (each measured against workers-runtime-sdk 1.9.5 and JS objects
shaped like workerd's; tests/cloudflare holds one test per pitfall):
- to_js(dict) makes a JS Map, which Request/Response inits ignore or reject: plain objects need
  dict_converter=Object.fromEntries (js_object below);
- a Python bytes object passed to JS is a borrowed proxy, not bytes: to_js(data) copies it into a
  Uint8Array that JS owns;
- bodies come back as an ArrayBuffer proxy (or a memoryview through the SDK's wrappers):
  as_bytes() takes either;
- a streamed body is a ReadableStream whose pull awaits the handler's __anext__, highWaterMark 0
  (no read-ahead: a chunk is produced only when the client asks); on cancel the pull in flight is
  cancelled first, then the stream is closed (aclose), so the producer's `finally` runs;
- workerd calls no cancel on a response body whose client went away: it stops pulling and ends
  the invocation with "Network connection lost.", and the producer's cleanup (the station
  releases, subrequests) would never run. So a response's stream is piped through an
  IdentityTransformStream, whose readable side is the body, the pipe's promise in waitUntil:
  when the client goes, workerd errors the transform, and the pipe cancels the stream (pipeTo
  propagates a destination's error back as the source's cancel) while waitUntil keeps the
  invocation alive for the cleanup.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Awaitable, Callable

import js
from pyodide.ffi import create_proxy, to_js

from common.runtime import Headers, Request, Response, aclose_stream

log = logging.getLogger(__name__)

INTERNAL_ORIGIN = "https://knot.internal"  # for path-only URLs: a JS Request needs an absolute URL
NULL_BODY_STATUSES = (101, 103, 204, 205, 304)  # a Response with one of these must have a null body
NO_BODY_METHODS = ("GET", "HEAD")


def js_object(mapping: dict) -> Any:
    """A Python dict as a plain JS object (nested dicts too); to_js alone would make a Map."""
    return to_js(mapping, dict_converter=js.Object.fromEntries)


def as_bytes(data: Any) -> bytes:
    """An ArrayBuffer / typed array proxy, a memoryview or bytes -> bytes (a copy JS cannot change)."""
    if data is None:
        return b""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    return data.to_bytes()


def absolute(url: str) -> str:
    return url if "://" in url else INTERNAL_ORIGIN + (url if url.startswith("/") else "/" + url)


def _header_pairs(js_headers: Any) -> list[tuple[str, str]]:
    return [(str(k), str(v)) for k, v in js_headers]


async def request_from_js(js_request: Any) -> Request:
    """A JS Request (or the SDK's workers.Request around one) -> Request with its body read."""
    js_request = getattr(js_request, "js_object", js_request)
    method = str(js_request.method)
    body = b"" if method in NO_BODY_METHODS else as_bytes(await js_request.arrayBuffer())
    return Request(method, str(js_request.url), Headers(_header_pairs(js_request.headers)), body)


def request_to_js(request: Request) -> Any:
    """Request -> a new JS Request, for a service binding's or a Durable Object stub's fetch."""
    init: dict[str, Any] = {"method": request.method, "headers": dict(request.headers.items())}
    if request.body and request.method not in NO_BODY_METHODS:
        init["body"] = to_js(request.body)
    return js.Request.new(absolute(request.url), js_object(init))


async def response_from_js(js_response: Any) -> Response:
    """A JS Response -> Response, its body read whole (peers' streams are buffered, as over HTTP)."""
    js_response = getattr(js_response, "js_object", js_response)
    body = as_bytes(await js_response.arrayBuffer())
    return Response(int(js_response.status), Headers(_header_pairs(js_response.headers)), body)


def response_to_js(response: Response, wait_until: Callable[[Awaitable[Any]], None] | None = None) -> Any:
    """Response -> the SDK's workers.Response (the runtime sends its js_object); streams stay streams
    (with the invocation's wait_until, cancelled when the client goes away: readable_stream)."""
    from workers import Response as WorkersResponse  # the SDK: only under the Workers runtime or its doubles

    headers = list(response.headers.items())
    if response.stream is not None:
        body: Any = readable_stream(response.stream, wait_until)
    elif response.status in NULL_BODY_STATUSES:
        body = None
    else:
        # an ArrayBuffer: the runtime's workers.Response of Pyodide 0.27's era refuses bytes (newer SDKs take both)
        body = to_js(response.body).buffer
    return WorkersResponse(body, status=response.status, headers=headers)


def readable_stream(chunks: AsyncIterator[bytes], wait_until: Callable[[Awaitable[Any]], None] | None = None) -> Any:
    """An async iterator of bytes -> a JS ReadableStream (pull-based, highWaterMark 0). With the
    invocation's wait_until: the readable side of an IdentityTransformStream the stream is piped
    into, the pipe in wait_until, so a client that goes away cancels the stream (module docstring)."""
    pump = _Pump(chunks)
    source = js_object({"pull": pump.pull_proxy, "cancel": pump.cancel_proxy})
    stream = js.ReadableStream.new(source, js_object({"highWaterMark": 0}))
    if wait_until is None:
        return stream
    pipe = js.IdentityTransformStream.new()
    wait_until(_piped(stream.pipeTo(pipe.writable)))
    return pipe.readable


async def _piped(done: Any) -> None:
    """The pipe's end. It fails when the client went away (the stream was cancelled then): not an error."""
    try:
        await done
    except Exception as e:  # noqa: BLE001 - a JsException ("Network connection lost.") under workerd
        log.info("response stream ended early: %s", e)


class _Pump:
    """The ReadableStream's underlying source. Its proxies live until the stream ends."""

    def __init__(self, chunks: AsyncIterator[bytes]):
        self.chunks = chunks
        self.pending: asyncio.Future | None = None
        self.done = False
        self.pull_proxy = create_proxy(self.pull)
        self.cancel_proxy = create_proxy(self.cancel)

    async def pull(self, controller: Any) -> None:
        if self.done:
            return
        self.pending = asyncio.ensure_future(self.chunks.__anext__())
        try:
            chunk = await self.pending
        except StopAsyncIteration:
            controller.close()
            await self._finish()
            return
        except asyncio.CancelledError:
            return  # cancel() took over: it closes the stream
        except Exception as e:  # noqa: BLE001 - the status is gone already: end the stream with the error
            log.warning("response stream failed: %s: %s", type(e).__name__, e)
            controller.error(js.Error.new(f"{type(e).__name__}: {e}"))
            await self._finish()
            return
        finally:
            self.pending = None
        controller.enqueue(to_js(bytes(chunk)))

    async def cancel(self, reason: Any = None) -> None:
        """The client went away: stop the pull in flight, then run the producer's cleanup."""
        if self.done:
            return
        pending = self.pending
        if pending is not None and not pending.done():
            pending.cancel()
            await asyncio.wait([pending])
        await self._finish()

    async def _finish(self) -> None:
        if self.done:
            return
        self.done = True
        try:
            await aclose_stream(self.chunks)
        finally:
            self.pull_proxy.destroy()
            self.cancel_proxy.destroy()
